"""Pipeline x tensor x data parallelism (worker/peer/pipeline.py with tensor-parallel stages), on CPU with Gloo.

Each launch starts D*T*P rank processes of tests/multiproc/pp3d_child.py in one ParallelMesh; its
checks train the gpt task (4 blocks, dim 16) 3 steps with 4 micro-batches and compare, at every
step (loss) and after the last (every parameter, gathered whole from the TP shards), with one
process training a deep copy of the same model with torch SGD (momentum 0.9) on the global batch:
fp32 rtol 1e-5. Schedules end bit-identical; recompute equals no recompute; ZeRO-1 on the DP
dimension equals it with 1/D of the momentum state per rank; bf16 compute stays within 2e-3 (loss) and 1e-2
(parameters) of the fp32 reference with fp32 master weights and gradients (see the child's docstring for why 2e-2).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import pytest
from test_peer_equivalence import ROOT, _free_port  # type: ignore[import-not-found]
from test_tensor_parallel import _check  # type: ignore[import-not-found]

CHILD = os.path.join(ROOT, "tests", "multiproc", "pp3d_child.py")


def run_mesh(dp: int, tp: int, pp: int, checks: list[str], timeout: float = 240.0) -> list[tuple[int, str, str]]:
    """The D*T*P ranks of pp3d_child.py, output to files (not pipes); [(returncode, stdout, stderr)]."""
    world, port = dp * tp * pp, _free_port()
    procs: list[subprocess.Popen[str]] = []
    files = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        try:
            for r in range(world):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                           PYTHONWARNINGS="ignore::FutureWarning")
                out = stack.enter_context(open(os.path.join(tmp, f"{r}.out"), "w+"))
                err = stack.enter_context(open(os.path.join(tmp, f"{r}.err"), "w+"))
                files.append((out, err))
                procs.append(subprocess.Popen([sys.executable, CHILD, str(dp), str(tp), str(pp), *checks], env=env,
                                              cwd=ROOT, stdout=out, stderr=err, text=True))
            deadline = time.monotonic() + timeout
            results = []
            for p, (out, err) in zip(procs, files):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                out.seek(0)
                err.seek(0)
                results.append((p.returncode, out.read(), err.read()))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


CHECKS_TP2_PP2 = ["1f1b", "gpipe", "interleaved-v2", "1f1b-recompute", "same", "1f1b-bf16"]
CHECKS_DP2_PP2 = ["1f1b-zero1", "gpipe-recompute-zero1", "1f1b", "same"]


@pytest.mark.timeout(300)
def test_tp2_pp2_equals_one_process() -> None:
    """(D, T, P) = (1, 2, 2): tensor-parallel stages; schedules, recompute, and bf16 compute."""
    _check(run_mesh(1, 2, 2, CHECKS_TP2_PP2), CHECKS_TP2_PP2)


@pytest.mark.timeout(300)
def test_dp2_pp2_zero1_equals_one_process() -> None:
    """(D, T, P) = (2, 1, 2): ZeRO-1 over the DP pairs of each stage, with and without recompute."""
    _check(run_mesh(2, 1, 2, CHECKS_DP2_PP2), CHECKS_DP2_PP2)
