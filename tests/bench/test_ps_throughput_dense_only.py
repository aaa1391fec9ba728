"""``bench/ps_throughput.py --only dense`` runs the transports and the dense push+pull only, and its
ratios are what their definitions say (recomputed from the raw figures in the same JSON)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_run import DEADLINE_S, TEST_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ps_throughput_only_dense(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "ps_throughput.py"), "--quick", "--only", "dense", "--repeats", "1",
         "--dense-mib", "2", "--shards", "1", "--json-out", str(out)],
        check=False, capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text()) and last["only"] == "dense"
    assert not any(k.startswith("sparse_") and k != "sparse_table_rows" for k in last), "no sparse figures in a dense-only run"
    assert "populate_rows_per_s" not in last
    for k in ("raw_grpc_gbps", "dense_sgd_ratio", "adam_limit_ratio", "dense_adam_ms", "torch_fused_adam_ms"):
        assert last[k] > 0, k
    assert abs(last["adam_limit_ratio"] - (last["raw_grpc_roundtrip_ms"] + last["torch_fused_adam_ms"]) / last["dense_adam_ms"]) < 0.01
    assert abs(last["dense_sgd_ratio"] - last["dense_sgd_gbps"] / last["raw_grpc_gbps"]) < 0.01
