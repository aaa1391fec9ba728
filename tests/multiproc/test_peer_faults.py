"""A peer rank SIGKILLed mid-run: the others stop with an error naming it, within the collective
timeout, never a hang; under `tessera peer` (torchrun's agent) the run reports the dead rank."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

GPT = ["--task", "gpt", "--task-opt", "dim=32", "--task-opt", "seq=16", "--task-opt", "layers=1", "--no-progress",
       "--torch-threads", "1", "--global-batch", "8", "--steps", "100000", "--max-seconds", "90", "--log-every", "1",
       "--no-eval"]
TIMEOUT = 20  # --timeout: every collective's bound


def _wait_for_steps(path: str, deadline: float) -> None:
    while not (os.path.exists(path) and '"kind": "step"' in open(path).read()):
        assert time.monotonic() < deadline, f"no step record in {path}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_killed_rank_is_named_by_the_others_within_the_timeout(tmp_path) -> None:
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "worker.peer", *GPT, "--backend", "gloo", "--device", "cpu", "--timeout", str(TIMEOUT),
               "--metrics-out", str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _wait_for_steps(str(tmp_path / "rank1.jsonl"), time.monotonic() + 60)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=TIMEOUT + 15)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 1, err[-3000:]
    assert "tessera peer: rank 0: a collective failed: rank 1 stopped responding" in err, err[-3000:]
    assert waited < TIMEOUT + 10, waited


@pytest.mark.timeout(120)
def test_tessera_peer_reports_the_killed_rank(tmp_path) -> None:
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", *GPT, "--timeout", str(TIMEOUT),
           "--metrics-out", str(tmp_path)]
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_steps(str(tmp_path / "rank1.jsonl"), time.monotonic() + 60)
        pid = _rank_pid(p.pid, 1)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=TIMEOUT + 15)
        waited = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode != 0
    assert "tessera peer: rank 1 failed first (exit code -9)" in err, err[-3000:]
    assert waited < TIMEOUT + 10, waited


def _rank_pid(agent: int, rank: int) -> int:
    """The pid of ``rank`` among the agent's children (its environment says RANK)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if env.get(b"RANK") == str(rank).encode():
                return int(d)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no rank {rank} under process {agent}")


@pytest.mark.timeout(150)
def test_max_restarts_resumes_from_the_last_checkpoint_and_finishes(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", "--max-restarts", "1",
           *[a for a in GPT if a not in ("100000", "--steps")], "--steps", "400", "--timeout", str(TIMEOUT),
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5", "--metrics-out", str(tmp_path)]
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # any complete checkpoint (only the newest 2 are kept: on a quiet machine step-5 can be gone
        # by the time a poll looks; 400 steps leave time to kill a rank mid-run)
        deadline = time.monotonic() + 60
        while not list(ckpt.glob("step-*/manifest.json")):
            assert time.monotonic() < deadline and p.poll() is None, "no checkpoint written"
            time.sleep(0.05)
        os.kill(_rank_pid(p.pid, 1), signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err[-3000:]
    with open(tmp_path / "rank0.jsonl") as f:
        records = [json.loads(line) for line in f]
    starts = [r["step"] for r in records if r["kind"] == "start"]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 5 and starts[1] % 5 == 0, starts  # resumed, not restarted
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["final_clock"] == 400, summary


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["debug-mismatch", "debug-stall"])
def test_debug_collectives_names_the_rank_and_the_op(fault: str) -> None:
    """Rank 1 issues an extra collective, or stalls 6 s (the checker waits 2 s): rank 0 stops with
    the collective's number and each rank's op, or naming rank 1 and the last collective it reached."""
    from test_peer_equivalence import run_ranks  # type: ignore[import-not-found]

    (rc0, _, err0), _ = run_ranks(2, [fault], timeout=100, only_rank0=True)
    assert rc0 != 0
    if fault == "debug-mismatch":
        assert re.search(r"CollectiveMismatchError: collective #\d+ differs between ranks: rank 0: all_reduce float(32|64)\[\d+\]; "
                         r"rank 1: all_reduce float32\[1\]", err0), err0[-3000:]
    else:
        assert re.search(r"CollectiveMismatchError: collective #\d+ \(all_reduce float32\[\d+\]\): rank 1 did not reach it "
                         r"within 2 s; last collective reached: rank 1: #\d+ all_reduce", err0), err0[-3000:]
