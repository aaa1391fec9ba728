"""Pipeline parallelism against one process with the same global batch, on CPU with Gloo.

Each test starts P x D rank processes (P = 2 pipeline stages) running
tests/multiproc/pipeline_child.py: the gpt task (4 blocks, dim 16) trained 3 SGD steps (lr 0.5) with
4 micro-batches; the loss at every step and every rank's parameters after the last step equal a
deep copy of the same model trained by ``torch.optim.SGD`` on the global batch in the same process
(fp32 rtol 1e-5, atol 1e-6; one run in float64 with SGD lr=1, rtol 1e-12). GPipe, 1F1B and interleaved
(V=2) end with bit-identical parameters, and per-layer recompute equals no recompute.
"""
from __future__ import annotations

import os

import pytest

from tests.multiproc.test_peer_equivalence import _check
from tests.multiproc.test_peer_equivalence import run_ranks as peer_run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(world: int, args: list[str], timeout: float, child: str = "pipeline_child.py") -> list[tuple[int, str, str]]:
    """``world`` processes of ``child`` (in tests/multiproc) with torchrun's environment; [(rc, stdout, stderr)]."""
    return peer_run_ranks(world, args, timeout=timeout, child=os.path.join(ROOT, "tests", "multiproc", child))


CHECKS_PP2 = ["gpipe", "1f1b", "interleaved-v2", "1f1b-recompute", "interleaved-v2-recompute", "same", "gpipe-fp64"]
CHECKS_DP2_PP2 = ["gpipe", "1f1b", "interleaved-v2", "same"]


@pytest.mark.timeout(300)
def test_pipeline_pp2_equals_one_process() -> None:
    """(D, T, P) = (1, 1, 2)."""
    res = run_ranks(2, CHECKS_PP2, timeout=240)
    _check(res, CHECKS_PP2)


@pytest.mark.timeout(300)
def test_pipeline_dp2_pp2_equals_one_process() -> None:
    """(D, T, P) = (2, 1, 2): two pipelines, gradients all-reduced over the DP pairs."""
    res = run_ranks(4, CHECKS_DP2_PP2, timeout=240)
    _check(res, CHECKS_DP2_PP2)
