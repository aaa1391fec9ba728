"""bench/recommender.py still runs end to end (--quick) and keeps its numerical claim.

The claim: the mf task trained by 2 async workers against 2 shard processes (``tessera ps serve`` /
``tessera worker --task mf``) reaches the test RMSE of the same model trained in one torch process
(``nn.Embedding(sparse=True)`` + Adagrad, Adam on the MLP; ``worker.tasks.mf.torch_reference``) on
the same examples, within 0.01 in the default run (bench/RESULTS.md). The --quick run trains a quarter
as long, and how stale async reads get depends on how the machine's load schedules the two workers
(CI saw a gap of 0.011 at full suite load, 0.0005-0.003 on a quieter machine): here both must have
learned, and the gap must be within 0.03. Exactness is test_mf_task's (sync workers equal the
reference step for step). Speed is not asserted (benchmarks measure, tests check): only that
the wall ratio is what its definition says, from the raw figures beside it, and that the run left
none of its processes behind. Also the one-process run with the cluster's staleness (every gradient
computed on parameters ``stale_delay`` updates old): with a delay of 0 it is the reference exactly.
"""
from __future__ import annotations

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick

KEYS = [
    "rmse_ps", "rmse_local", "rmse_gap", "wall_ratio", "wall_ratio_min", "wall_ps_s", "wall_local_s", "best_rmse",
    "worker_cpu_ms_per_step", "shard_cpu_ms_per_step", "local_cpu_ms_per_step", "compute_frac", "push_wait_frac",
]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_recommender_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    last, stdout = run_quick("recommender.py", str(out))
    for k in KEYS:
        assert k in last, k
    assert last["quick"] is True and last["workers"] == 2 and last["shards"] == 2
    for k in ("rmse_ps", "rmse_local", "wall_ps_s", "wall_local_s", "wall_ratio", "worker_cpu_ms_per_step", "shard_cpu_ms_per_step"):
        assert last[k] > 0, (k, last[k])
    # both learned: from the ratings' spread (~1.2 before training) to near the noise floor
    assert last["best_rmse"] < last["rmse_local"] < 0.7 and last["rmse_ps"] < 0.7, last
    # the cluster's RMSE is the one process's, within 0.03 in a quick run (0.01: the default run's claim)
    assert abs(last["rmse_gap"]) <= 0.03, last
    assert abs(last["rmse_ps"] - last["rmse_local"] - last["rmse_gap_median_repeat"]) < 1e-4
    # the ratio is the two walls' (the JSON rounds each)
    assert abs(last["wall_ratio"] - last["wall_ps_s"] / last["wall_local_s"]) <= 0.01 * last["wall_ratio"] + 1e-3
    assert last["wall_ratio_min"] <= last["wall_ratio"] + 1e-9
    assert 0 <= last["compute_frac"] <= 1 and 0 <= last["push_wait_frac"] <= 1
    assert "rmse_ps" in stdout and "wall_ratio" in stdout
    # staleness alone, in one process: the cluster's mean staleness as the delay; with no delay the same
    # training is the reference itself (same final RMSE), so the delayed run differs by the delay only
    assert last["stale_delay"] == max(1, round(last["mean_staleness"])), last
    assert last["rmse_fresh"] == last["rmse_local"], last
    assert abs(last["rmse_stale_gap"] - (last["rmse_local_stale"] - last["rmse_local"])) < 2e-5, last
    assert last["rmse_local_stale"] != last["rmse_local"] and last["rmse_local_stale"] < 0.7, last
    assert last["rmse_stale_jitter"] > 0 and last["rmse_fresh_jitter"] > 0, last
