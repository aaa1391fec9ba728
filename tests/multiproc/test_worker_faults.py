"""Membership under faults, with real processes: a SIGKILLed sync worker does not hang the others,
a new worker joins mid-run from the current parameters, and the run finishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ps.client import PSClient

STEPS = 1500
LEASE = "2"


def _worker(addresses: list[str], index: int, metrics: str, name: str = "", steps: int = STEPS) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", "digits",
        "--mode", "sync", "--steps", str(steps), "--batch-size", "16", "--worker-index", str(index),
        "--num-workers", "2", "--device", "cpu", "--lease", LEASE, "--metrics-out", metrics, "--no-progress",
        "--torch-threads", "1",
    ]
    if name:
        cmd += ["--name", name]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _clock(path: str) -> int:
    steps = [r["step"] for r in _records(path) if r["kind"] == "step"]
    return max(steps, default=0)


def test_sigkilled_sync_worker_is_dropped_and_a_new_worker_joins(proc_cluster, tmp_path) -> None:
    addresses = proc_cluster(2, "--lease", LEASE)
    m0, m1, m2 = (str(tmp_path / f"w{i}.jsonl") for i in range(3))
    procs = [_worker(addresses, 0, m0), _worker(addresses, 1, m1)]
    try:
        _wait_for(lambda: _clock(m1) >= 50, 90, "both workers to train 50 steps")
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        killed_at = _clock(m0)
        # worker 0 stalls in the round its peer never finishes, then goes on alone once the lease expires
        _wait_for(lambda: _clock(m0) >= killed_at + 50, 60, "worker 0 to continue after the lease expired")
        with PSClient(addresses, timeout=10) as c:
            stats = c.stats()
        assert all(s.leases_expired >= 1 for s in stats), [s.leases_expired for s in stats]
        assert all(not w.live for s in stats for w in s.workers if w.name == "w1")
        # a replacement joins mid-run: it starts from the cluster's clock, not from 0
        procs.append(_worker(addresses, 1, m2, name="w1-replacement"))
        for p in (procs[0], procs[2]):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    s0 = [r for r in _records(m0) if r["kind"] == "summary"][-1]
    s2 = [r for r in _records(m2) if r["kind"] == "summary"][-1]
    assert s0["final_clock"] == STEPS and s2["final_clock"] == STEPS
    assert s2["start_clock"] > killed_at, s2  # joined mid-run
    assert 0 < s2["steps"] < STEPS - killed_at
    final = [r for r in _records(m0) if r["kind"] == "eval" and r.get("final")][-1]
    assert final["accuracy"] > 0.85, final  # the run still trained to a useful model


def test_sigterm_finishes_the_push_in_flight_leaves_and_exits_0(proc_cluster, tmp_path) -> None:
    addresses = proc_cluster(2)
    m = str(tmp_path / "w.jsonl")
    cmd = [
        sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", "digits",
        "--mode", "async", "--steps", "1000000", "--batch-size", "16", "--device", "cpu",
        "--metrics-out", m, "--no-progress", "--torch-threads", "1",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _clock(m) >= 30, 90, "the worker to train 30 steps")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    summary = [r for r in _records(m) if r["kind"] == "summary"][-1]
    assert summary["stopped_early"] and summary["steps"] >= 30
    with PSClient(addresses, timeout=10) as c:
        stats = c.stats()
    # every step it trained was pushed before it left: the dense table's version counts them all
    versions = {t.version for s in stats for t in s.tables if t.name == "digits/dense"}
    assert versions == {summary["steps"]}, (versions, summary["steps"])
    assert all(not w.live for s in stats for w in s.workers), "the worker left the shards"
