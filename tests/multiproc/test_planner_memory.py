"""The planner's memory estimate per rank against torch's allocator, on CPU with Gloo.

For each layout, tests/multiproc/plan_child.py trains the gpt task (4 blocks, dim 64, vocab 256,
seq 64, batch 16, Adam, fp32) with ``PipelineEngine`` and measures each rank's peak allocated
bytes (its parameters plus the peak of the profiler's CPU allocator count over two steps); the
estimate is ``worker.peer.planner.rank_memory`` for the same layout. Layouts (D, T, P): (2, 1, 1)
data parallel; (1, 1, 2) with GPipe, and with 1F1B and per-layer recompute (m = 4).
Each must be within 15% on every rank.
"""
from __future__ import annotations

import json

import pytest

from tests.multiproc.test_pipeline_equivalence import run_ranks

LAYOUTS = [(2, ["1", "1f1b", "1"]), (2, ["2", "gpipe", "4"]), (2, ["2", "1f1b", "4", "recompute"])]


@pytest.mark.timeout(300)
def test_memory_estimate_within_15_percent() -> None:
    rows = []
    for world, args in LAYOUTS:
        res = run_ranks(world, args, timeout=120, child="plan_child.py")
        for r, (rc, so, se) in enumerate(res):
            assert rc == 0, f"{args} rank {r} failed (rc {rc}):\n{se[-3000:]}"
            rec = json.loads(next(line for line in so.splitlines() if line.startswith("MEM "))[4:])
            rows.append((args, r, rec["measured"], rec["estimate"]))
    bad = [(a, r, m, e) for a, r, m, e in rows if abs(e / m - 1) > 0.15]
    table = "\n".join(f"{' '.join(a):<22} rank {r}: measured {m:,} estimate {e:,.0f} ({e / m - 1:+.1%})" for a, r, m, e in rows)
    assert not bad, f"estimates off by more than 15%:\n{table}"
    print(table)
