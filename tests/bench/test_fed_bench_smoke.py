"""bench/fed.py --quick runs end to end and reports every figure it promises, computed by the
formulas its docstring states: each check below recomputes a figure from the raw numbers the
benchmark also reports, so a wrong formula (a mean where a median is promised, one seed where three
are, a ratio upside down, an RSS of the wrong process, a 1,000-client figure labelled 10k) fails.
Speed and accuracy themselves are not asserted (benchmarks measure, tests check)."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from bench_run import DEADLINE_S, TEST_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ["s_per_round", "startup_s", "agg_mbps", "fedavg_acc", "fedprox_acc", "secagg_overhead", "secagg_bytes_ratio",
        "int8_bytes_ratio", "int8_acc_delta", "server_rss_mb_1k", "server_rss_mb_100", "fedbuff_speedup",
        "client_import_s", "client_import_mb", "round_overhead_ratio", "inproc_s_per_round"]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_fed_bench_quick(tmp_path) -> None:
    out = tmp_path / "fed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fed.py"), "--quick", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=DEADLINE_S, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    for k in KEYS:
        assert k in last and math.isfinite(last[k]), k
    for k in ("s_per_round", "startup_s", "agg_mbps", "secagg_overhead", "secagg_bytes_ratio", "int8_bytes_ratio",
              "server_rss_mb_1k", "client_import_s", "client_import_mb", "inproc_s_per_round"):
        assert last[k] > 0, k
    assert 0 < last["fedavg_acc"] <= 1 and 0 < last["fedprox_acc"] <= 1
    assert last["int8_bytes_ratio"] < 0.5  # int8 really went out as a quarter of fp32 (+ headers)
    # quick mode measures 1,000 clients and says so; it does not relabel the figure as 10k
    assert last["big_clients"] == 1000 and "server_rss_mb_10k" not in last
    # s_per_round: the median of rounds 2..R (not the mean, not round 1)
    rounds_s = last["fedavg_rounds_s"]
    assert len(rounds_s) == last["rounds"] == 3
    assert last["s_per_round"] == pytest.approx(statistics.median(rounds_s[1:]), abs=2e-4)
    # round_overhead_ratio: seconds per round over the in-process FedAvg's, the right way up
    assert last["round_overhead_ratio"] == pytest.approx(last["s_per_round"] / last["inproc_s_per_round"], rel=0.01)
    # int8_acc_delta: the mean over 3 seeds of int8 - fp32 with the same seed
    int8, fp32 = last["int8_accs"], last["fp32_accs"]
    assert len(int8) == len(fp32) == 3
    assert last["int8_acc_deltas"] == pytest.approx([a - b for a, b in zip(int8, fp32)], abs=2e-4)
    assert last["int8_acc_delta"] == pytest.approx(statistics.mean(last["int8_acc_deltas"]), abs=2e-4)
    assert len(set(fp32)) > 1  # the seeds differ (the same run three times would not)
    # the server's RSS is its own process's: less than this process running server and clients together
    assert last["server_rss_mb_100"] < last["inproc_peak_rss_mb"]
    # client import: min and median of the samples; the torch client (its baseline) is the heavier one
    samples = last["client_import_samples_s"]
    assert last["client_import_s"] == pytest.approx(min(samples), abs=2e-4)
    assert last["client_import_s_median"] == pytest.approx(statistics.median(samples), abs=2e-4)
    if not last["client_imports_torch"]:
        assert last["client_import_mb"] < last["torch_client_import_mb"]
