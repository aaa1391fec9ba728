"""bench/faults.py --quick still runs end to end and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check). What must hold even in a tiny run is
asserted: no acknowledged update is lost when a primary is SIGKILLed (and none is applied twice,
in the fault-free runs either: that is what makes the accounting trustworthy), the backup took
over and training resumed, and the load test saw no errors. Also: the last stdout line is the
JSON also written to --json-out, and the run left none of its processes behind.
"""
from __future__ import annotations

import math

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick

KEYS = ["failover_s", "lost_updates", "metric_delta", "replication_throughput_ratio", "load_errors", "rss_growth_mb"]
FIGURES = ["promote_s", "write_resume_s", "auc_fault_free", "auc_fault", "eps_replicated", "eps_unreplicated",
           "rss_start_mb", "rss_end_mb", "load_pull_sparse_p50_ms", "load_push_sparse_p99_ms", "load_push_dense_p50_ms"]


@pytest.mark.timeout(TEST_TIMEOUT_S)  # ~45 s on a quiet 2-core machine; over 4 min at load average 13
def test_faults_quick(tmp_path) -> None:
    out = tmp_path / "faults.json"
    last, stdout = run_quick("faults.py", str(out))
    for k in KEYS + FIGURES:
        assert k in last, k
        assert isinstance(last[k], (int, float)) and math.isfinite(last[k]), (k, last[k])
    assert last["quick"] is True
    # the goals that must hold even tiny
    assert last["lost_updates"] == 0, stdout[-3000:]
    assert last["double_applied"] == 0 and last["fault_free_lost"] == 0 and last["fault_free_double"] == 0, stdout[-3000:]
    assert last["acked_updates"] > 0
    assert last["load_errors"] == 0, stdout[-3000:]
    assert 0 < last["promote_s"] <= last["failover_s"]  # the backup took over, then training went on
    assert last["replication_throughput_ratio"] > 0 and last["rss_start_mb"] > 0
    assert set(last["goals"]) == {"lost_updates", "failover_s", "metric_delta", "replication_throughput_ratio", "load_errors"}
