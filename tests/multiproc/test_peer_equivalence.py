"""Peer mode against one process with the same global batch, on CPU with Gloo, several processes.

Each test starts D rank processes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as torchrun sets
them) running tests/multiproc/peer_child.py, which runs several checks in one process group and
compares, at every step, the global loss and the parameters with a reference computed in the
same process: a deep copy of the same initial model trained with ``torch.optim`` on the global
batch (fp32: rtol 1e-5; fp64 SGD lr=1: rtol 1e-12; bf16 transport, DP and ZeRO-2: rtol 2e-2). A ZeRO-3
checkpoint saved at D=4 is resumed at D=2 (in ZeRO-1 and in DP) with the same next step.
Two process groups in all (one D=4, one D=2), to keep the suite fast on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "multiproc", "peer_child.py")



def run_ranks(
    world: int, args: list[str] | list[list[str]], module: bool = False, timeout: float = 150.0, only_rank0: bool = False,
    child: str | None = None,
) -> list[tuple[int, str, str]]:
    """Start ``world`` rank processes of ``child`` (default ``CHILD``, peer_child.py; ``module``:
    ``python -m worker.peer``); returns [(returncode, stdout, stderr)] per rank. Every rank is
    killed at the deadline (``only_rank0``: as soon as rank 0 has exited). ``args``: one command line
    for all ranks, or one per rank."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
        )
        a = args[r] if args and isinstance(args[0], list) else args
        cmd = [sys.executable, "-m", "worker.peer", *a] if module else [sys.executable, child or CHILD, *a]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    out = []
    try:
        for i, p in enumerate(procs):
            if only_rank0 and i > 0 and p.poll() is None:
                p.kill()
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _check(results: list[tuple[int, str, str]], checks: list[str]) -> None:
    for r, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {r} failed (rc {rc}):\n{se[-4000:]}"
        for c in checks:
            assert f"OK {c}" in so, f"rank {r}: check {c} did not report OK:\n{so}\n{se[-2000:]}"


D2_CHECKS = ["dp", "dp64", "zero1", "zero2", "zero3", "accum-dp", "accum-zero2", "accum-zero3", "bf16", "bf16-zero2", "gpt-zero3"]
D4_CHECKS = ["dp", "dp64", "zero3"]


def _ckpt(out: str, kind: str, mode: str) -> tuple[float, list[float]]:
    line = next(line for line in out.splitlines() if line.startswith(f"CKPT {kind} {mode} "))
    rec = json.loads(line.split(" ", 3)[3])
    return rec["loss"], rec["params"]


@pytest.fixture(scope="module")
def d4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, str, str]]]:
    """One D=4 process group: the D=4 checks, then 4 ZeRO-3 steps with a checkpoint after step 3."""
    d = str(tmp_path_factory.mktemp("peer") / "ckpt")
    return d, run_ranks(4, [*D4_CHECKS, f"ckpt-save:{d}:zero3"])


@pytest.mark.timeout(200)
def test_d4_dp_fp32_fp64_and_zero3_match_one_process(d4) -> None:
    d, results = d4
    _check(results, [*D4_CHECKS, f"ckpt-save:{d}:zero3"])
    assert sorted(os.listdir(d)) == ["step-3"] and len(os.listdir(os.path.join(d, "step-3"))) == 5  # 4 ranks + manifest


@pytest.mark.timeout(200)
def test_d2_dp_zero_accumulation_compression_hybrid_and_resuming_the_d4_checkpoint(d4, proc_cluster) -> None:
    """D=2 checks; the hybrid (ctr on 2 PS shard processes: rows BSP on the PS, the MLP all-reduced;
    the MLP at every step and the rows at the end equal one process with the global batch, as PS
    sync mode does in tests/integration/test_worker_sync_exact.py); and the ZeRO-3 checkpoint saved
    at D=4 resumed at D=2 in ZeRO-1 and in DP: reference for the resumed step is the D=4 run itself,
    which went on past its checkpoint (step 3's global loss and the parameters after it, rtol 1e-5)."""
    d, saved = d4
    _check(saved, [f"ckpt-save:{d}:zero3"])
    want_loss, want_params = _ckpt(saved[0][1], "ckpt-save", "zero3")
    hybrid = "hybrid-sync:" + ",".join(proc_cluster(2))
    checks = [*D2_CHECKS, f"ckpt-load:{d}:zero1", f"ckpt-load:{d}:dp", hybrid]
    loaded = run_ranks(2, checks)
    _check(loaded, [*checks[:-1], "hybrid-sync"])
    for mode in ("zero1", "dp"):
        loss, params = _ckpt(loaded[0][1], "ckpt-load", mode)
        assert loss == pytest.approx(want_loss, rel=1e-5), mode
        torch.testing.assert_close(torch.tensor(params), torch.tensor(want_params), rtol=1e-5, atol=1e-6)

