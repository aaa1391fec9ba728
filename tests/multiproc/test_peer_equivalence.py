"""Peer mode against one process with the same global batch, on CPU with Gloo, several processes.

Each test starts D rank processes (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as torchrun sets
them) running tests/multiproc/peer_child.py, which runs several checks in one process group and
compares, at every step, the global loss and the parameters with a reference computed in the
same process: a deep copy of the same initial model trained with ``torch.optim`` on the global
batch (fp32: rtol 1e-5; fp64 SGD lr=1: rtol 1e-12; bf16 transport: rtol 2e-2).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "multiproc", "peer_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, args: list[str] | list[list[str]], module: bool = False, timeout: float = 150.0) -> list[tuple[int, str, str]]:
    """Start ``world`` rank processes; returns [(returncode, stdout, stderr)] per rank. Every rank is
    killed at the deadline. ``args``: one command line for all ranks, or one per rank."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
        )
        a = args[r] if args and isinstance(args[0], list) else args
        cmd = [sys.executable, "-m", "worker.peer", *a] if module else [sys.executable, CHILD, *a]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
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


@pytest.mark.timeout(200)
def test_d2_dp_zero_accumulation_compression_match_one_process() -> None:
    checks = ["dp", "dp64", "zero1", "zero2", "zero3", "accum-dp", "accum-zero2", "accum-zero3", "bf16", "gpt-zero3"]
    _check(run_ranks(2, checks), checks)


@pytest.mark.timeout(200)
def test_d4_dp_matches_one_process_fp32_and_fp64() -> None:
    checks = ["dp", "dp64", "zero3"]
    _check(run_ranks(4, checks), checks)
