"""Mixture-of-experts and expert parallelism on CPU with Gloo, against one process.

One process group of 4 ranks (tests/multiproc/moe_child.py) runs every check. Reference: one
process training a deep copy of the same initial MoE ``gpt`` (E=4 experts in each of its 2 blocks)
with SGD on the global batch, compared at every step (fp32, rtol 1e-5): the global loss, all the
parameters (experts gathered from their ranks), and the token assignments the capacity dropped.

- EP=1, 2, 4, top-2, capacity factor 2 (no drops): the same losses and parameters.
- Capacity factor 0.5 (top-2 at EP=2 and 4, top-1 at EP=4): drops happen, and they are the
  reference's drops, rank by rank.
- Metrics: all-to-all bytes over the ranks equal 4 exchanges of every routed token's row per layer.
- A checkpoint saved at EP=4 after 3 steps resumes at EP=2 with the same step 3.
- Load balance: routers start skewed to expert 0 (top-1, 40 Adam steps): the metrics report the
  skew (CV of tokens per expert > 1, expert 0 holding most tokens); with the balance loss on (0.1)
  the CV falls below a quarter of its start and below the run without it.
"""
from __future__ import annotations

import os

import pytest
import test_peer_equivalence as tpe  # type: ignore[import-not-found]

CHILD = os.path.join(tpe.ROOT, "tests", "multiproc", "moe_child.py")

CHECKS = ["ep1", "ep2", "ep4", "drop-2-2", "drop-2-4", "drop-1-4", "metrics", "ckpt", "balance"]


@pytest.mark.timeout(300)
def test_moe_expert_parallel_equals_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpe, "CHILD", CHILD)  # the rank launcher of the peer tests, with this file's child
    tpe._check(tpe.run_ranks(4, CHECKS, timeout=280), CHECKS)
