"""bench/worker_step.py still runs end to end (--quick) and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check): only that the run succeeds, that the
last stdout line is the JSON also written to --json-out, that every promised figure is there
and positive, and that the run left none of its processes behind.
"""
from __future__ import annotations

from bench_run import run_quick

KEYS = [
    "sync_eps", "ssp_eps", "async_eps", "local_eps", "sync_noov_eps", "ssp_noov_eps", "async_noov_eps",
    "overlap_speedup", "async_wait_fraction", "sync_step_ms", "ddp_step_ms", "sync_vs_ddp", "gloo_allreduce_gbps",
]


def test_worker_step_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    last, stdout = run_quick("worker_step.py", str(out), timeout=110)
    for k in KEYS:
        assert k in last, k
        assert last[k] > 0, (k, last[k])
    assert last["quick"] is True
    # the split of async step time is a share: in [0, 1], and the parts sum to the whole
    parts = [last[f"async_{p}_frac"] for p in ("compute", "pull", "push", "other")]
    assert all(0 <= p <= 1 for p in parts) and abs(sum(parts) - 1) < 0.02, parts
    assert 0 < last["async_wait_fraction"] <= 1
