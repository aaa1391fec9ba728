"""The benchmark still runs end to end (tiny sizes) and reports the figures it promises.

Speed is not asserted here (benchmarks measure, tests check); only that every
figure is present and positive and that the run cleans up after itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ["raw_grpc_gbps", "raw_tcp_gbps", "dense_pushpull_gbps", "dense_ratio", "sparse_rows_per_s", "sparse_gbps"]


def test_ps_throughput_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "ps_throughput.py"), "--quick", "--repeats", "2", "--json-out", str(out)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON figures
    assert last == json.loads(out.read_text())
    for k in KEYS:
        assert last[k] > 0, k
