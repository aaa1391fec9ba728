"""``bench/dense_push_ab.py`` runs end to end at a tiny size (2 shards per side, the echo and fused
Adam timed alongside) and its ratios are what their definitions say, recomputed from the raw times
in the same JSON (speed is not asserted: benchmarks measure, tests check)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_run import DEADLINE_S, TEST_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_dense_push_ab_reports_the_fused_ratios_per_side() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "dense_push_ab.py"), "--before", ROOT, "--mib", "2", "--repeats", "2",
         "--shards", "2", "--ways", "fused,pull", "--echo"],
        capture_output=True, text=True, timeout=DEADLINE_S, cwd=ROOT, check=False, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["shards"] == 2 and r["max_abs_diff"] == 0.0  # the same tree on both sides: the same values
    close = lambda a, b: abs(a - b) <= 0.01 * max(abs(a), abs(b)) + 1e-3  # rounding in the JSON
    for side in ("before", "after"):
        assert 0 < r[f"sgd_fused_{side}_wall_ms_min"] <= r[f"sgd_fused_{side}_wall_ms_median"]
        assert r[f"adam_pull_{side}_shard_cpu_ms_median"] >= 0
        assert close(r[f"{side}_dense_sgd_ratio"], r["echo_wall_ms_min"] / r[f"sgd_fused_{side}_wall_ms_min"])
        assert close(r[f"{side}_dense_sgd_ratio_median"], r["echo_wall_ms_median"] / r[f"sgd_fused_{side}_wall_ms_median"])
        assert close(r[f"{side}_adam_limit_ratio"],
                     (r["echo_wall_ms_min"] + r["torch_fused_adam_ms"]) / r[f"adam_fused_{side}_wall_ms_min"])
    assert "sgd_push_before_wall_ms_min" not in r  # only the ways asked for
