"""bench/worker_step.py still runs end to end (--quick) and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check): only that the run succeeds, that the
last stdout line is the JSON also written to --json-out, that every promised figure is there
and positive, that the ratios are what their definitions say (recomputed from the raw figures
the JSON holds beside them, so a wrong formula fails), and that the run left none of its
processes behind.
"""
from __future__ import annotations

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick

KEYS = [
    "sync_eps", "ssp_eps", "async_eps", "local_eps", "sync_noov_eps", "ssp_noov_eps", "async_noov_eps",
    "overlap_speedup", "async_wait_fraction", "sync_step_ms", "ddp_step_ms", "sync_vs_ddp", "gloo_allreduce_gbps",
    "async_vs_local", "cpu_per_example_ratio", "async_eps_span", "async_span_s", "async_steady_examples", "local_eps_span",
    "local_span_s", "local_steady_examples", "async_cpu_s", "async_examples", "local_cpu_s", "local_examples",
]


def close(a: float, b: float, rel: float = 0.02) -> bool:
    """Equal up to the JSON's rounding."""
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-3


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_worker_step_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    last, stdout = run_quick("worker_step.py", str(out), extra=("--emb-cache-rows", "2000"))
    for k in KEYS:
        assert k in last, k
        assert last[k] > 0, (k, last[k])
    assert last["quick"] is True
    # the split of async step time is a share: in [0, 1], and the parts sum to the whole
    parts = [last[f"async_{p}_frac"] for p in ("compute", "pull", "push", "other")]
    assert all(0 <= p <= 1 for p in parts) and abs(sum(parts) - 1) < 0.02, parts
    assert 0 < last["async_wait_fraction"] <= 1
    # examples/s: every steady example of every worker over the one shared wall-clock span
    for run in ("async", "local", "sync", "ssp"):
        assert close(last[f"{run}_eps_span"], last[f"{run}_steady_examples"] / last[f"{run}_span_s"]), run
    # a span shared by both workers is at least each worker's own: never more than the per-worker rates summed
    assert last["async_eps_span"] <= last["async_eps_mean"] * 1.05
    assert close(last["async_vs_local"], last["async_eps_span"] / last["local_eps_span"])
    # the workers ran over the shards' bulk port; async also once over gRPC, for the comparison
    assert last["transport"] == "bulk"
    assert close(last["async_vs_local_grpc"], last["async_grpc_eps_span"] / last["local_eps_span"])
    assert last["cpu_per_example_ratio_grpc"] > 0
    # against the one-process run of least CPU per example: never lower than against the chosen baseline
    assert last["cpu_per_example_ratio_cheapest"] >= last["cpu_per_example_ratio"] - 1e-3
    # CPU per example: workers + shards (OS process times) over the baseline's, whole runs
    per = lambda run: last[f"{run}_cpu_s"] / last[f"{run}_examples"]  # noqa: E731
    assert close(last["cpu_per_example_ratio"], per("async") / per("local"), rel=0.05)
    assert last["async_examples"] == last["steps"] * 2 * last["batch_size"]  # both workers, every step
    # the baseline is the faster of 1 thread and 2 (the cores the cluster used); DDP ran after the shards exited
    assert close(last["local_eps_span"], max(v for k, v in last.items() if k.startswith("local_") and k.endswith("t_eps_span")))
    assert last["ddp_after_shards_exit"] is True
    # --emb-cache-rows: async again with each worker's hot-row cache; its figures by the same formulas
    assert last["cache_rows"] == 2000 and 0 <= last["cache_row_hit_rate"] <= 1 and 0 <= last["cache_hit_rate"] <= 1
    assert close(last["async_vs_local_cache"], last["async_cache_eps_span"] / last["local_eps_span"])
    assert last["cpu_per_example_ratio_cache"] > 0
