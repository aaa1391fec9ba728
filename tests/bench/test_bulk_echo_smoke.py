"""``bench/bulk_echo.py`` runs end to end at small sizes and its figures are what they say: the
speedup is the ratio of the two medians in the same JSON (speed is not asserted: benchmarks
measure, tests check)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_run import DEADLINE_S, TEST_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_bulk_echo_bench_reports_both_transports() -> None:
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bulk_echo.py"), "--sizes", "16B,1MiB", "--repeats", "0.05"],
        capture_output=True, text=True, timeout=DEADLINE_S, cwd=ROOT, check=False, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in ("16B", "1MiB"):
        for way in ("grpc", "bulk"):
            assert 0 < r[f"{way}_{label}_ms_min"] <= r[f"{way}_{label}_ms_median"]
            assert r[f"{way}_{label}_server_cpu_ms"] >= 0
        want = r[f"grpc_{label}_ms_median"] / r[f"bulk_{label}_ms_median"]
        assert abs(r[f"speedup_{label}_median"] - want) <= 0.01 * want + 1e-3
    assert "grpc_64MiB_ms_min" not in r
