"""bench/fed.py --quick still runs end to end and reports every figure it promises.

Speed and accuracy are not asserted here (benchmarks measure, tests check); only
that each figure is present and sane, and the last line is the JSON."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ["s_per_round", "startup_s", "agg_mbps", "fedavg_acc", "fedprox_acc", "secagg_overhead", "secagg_bytes_ratio",
        "int8_bytes_ratio", "int8_acc_delta", "server_rss_mb_10k", "fedbuff_speedup"]


def test_fed_bench_quick(tmp_path) -> None:
    out = tmp_path / "fed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fed.py"), "--quick", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    for k in KEYS:
        assert k in last and math.isfinite(last[k]), k
    for k in ("s_per_round", "startup_s", "agg_mbps", "secagg_overhead", "secagg_bytes_ratio", "int8_bytes_ratio",
              "server_rss_mb_10k"):
        assert last[k] > 0, k
    assert 0 < last["fedavg_acc"] <= 1 and 0 < last["fedprox_acc"] <= 1
    assert last["int8_bytes_ratio"] < 0.5  # int8 really went out as a quarter of fp32 (+ headers)
