"""The benchmark still runs end to end (tiny sizes) and reports the figures it promises.

Speed is not asserted here (benchmarks measure, tests check); only that every figure is present
and positive, that the ratios are what their definitions say (recomputed from the raw figures the
JSON also holds, so a wrong formula fails), and that the run cleans up after itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_run import DEADLINE_S, TEST_TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = [
    "raw_grpc_gbps", "raw_tcp_gbps", "dense_pushpull_gbps", "dense_ratio", "sparse_rows_per_s", "sparse_gbps",
    "dense_sgd_gbps", "dense_sgd_ratio", "adam_limit_ratio", "raw_grpc_roundtrip_ms", "torch_fused_adam_ms", "dense_adam_ms",
    "sparse_ratio", "sparse_pullpush_gbps", "sparse_step_gbps", "raw_grpc_sparse_size_gbps", "sparse_vs_raw_same_size",
    "sparse_bytes_per_row_ratio", "raw_bytes_per_row_ratio", "populate_rows_per_s", "populate_rows_per_s_median", "raw_fill_rows_per_s",
]


def close(a: float, b: float, rel: float = 0.02) -> bool:
    """Equal up to the JSON's rounding (figures are rounded to 3-5 digits)."""
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-4


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ps_throughput_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "ps_throughput.py"), "--quick", "--repeats", "2", "--json-out", str(out)],
        capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON figures
    assert last == json.loads(out.read_text())
    for k in KEYS:
        assert last[k] > 0, k
    mib = last["dense_mib"] * (1 << 20)
    # each ratio, recomputed from its parts
    assert close(last["dense_sgd_ratio"], last["dense_sgd_gbps"] / last["raw_grpc_gbps"])
    assert close(last["dense_ratio"], last["dense_pushpull_gbps"] / last["raw_grpc_gbps"])
    assert close(last["sparse_ratio"], last["sparse_gbps"] / last["raw_grpc_gbps"])
    assert close(last["sparse_vs_raw_same_size"], last["sparse_gbps"] / last["raw_grpc_sparse_size_gbps"])
    assert close(last["adam_limit_ratio"], (last["raw_grpc_roundtrip_ms"] + last["torch_fused_adam_ms"]) / last["dense_adam_ms"])
    # the shards' CPU per sparse Step, on the default transport (the bulk port) and each
    assert last["sparse_step_shard_cpu_ms"] == last["sparse_step_shard_cpu_ms_bulk"] > 0 < last["sparse_step_shard_cpu_ms_grpc"]
    # (f) bench/ps_kernel.py --served: one served shard against the table in process, and FBGEMM (or why not)
    if "row_kernel_min_ms" in last:
        assert close(last["served_vs_kernel"], last["row_served_min_ms"] / last["row_kernel_min_ms"])
    if "row_fbgemm_min_ms" in last:
        assert close(last["served_vs_fbgemm"], last["row_served_min_ms"] / last["row_fbgemm_min_ms"])
        assert close(last["kernel_vs_fbgemm"], last["row_kernel_min_ms"] / last["row_fbgemm_min_ms"])
    else:
        assert last["fbgemm"].startswith("skipped: "), last.get("fbgemm")
    # the times behind them are the same bytes: the dense payload moved at the stated rates
    assert close(last["raw_grpc_roundtrip_ms"], mib / last["raw_grpc_gbps"] / 1e6)
    assert close(last["dense_adam_ms"], mib / last["dense_pushpull_gbps"] / 1e6)
    assert close(last["torch_fused_adam_ms"], mib / last["torch_fused_adam_gbps"] / 1e6)
    # the best of the ways, and rows/s from the same time as GB/s (4096 rows of 64 float32)
    # (both transports measured: gRPC's keys unsuffixed, the bulk port's with _bulk)
    assert last["transports"] == ["grpc", "bulk"]
    ways = [f"sparse_{w}_gbps{t}" for w in ("pullpush", "step") for t in ("", "_bulk")]
    assert close(last["sparse_gbps"], max(last[k] for k in ways))
    for t in ("grpc", "bulk"):
        sfx = "" if t == "grpc" else "_bulk"
        assert close(last[f"sparse_ratio_{t}"], max(last[f"sparse_pullpush_gbps{sfx}"], last[f"sparse_step_gbps{sfx}"]) / last["raw_grpc_gbps"])
        assert close(last[f"dense_sgd_ratio_{t}"],
                     max(last[f"sgd_2shard_{w}{sfx}_gbps"] for w in ("separate", "fused", "step")) / last["raw_grpc_gbps"])
    assert close(last["sparse_rows_per_s"], last["sparse_gbps"] * 1e9 / (64 * 4))
    assert close(last["dense_sgd_ratio"], max(last["dense_sgd_ratio_grpc"], last["dense_sgd_ratio_bulk"]))
    assert close(last["adam_limit_ratio"], max(last["adam_limit_ratio_grpc"], last["adam_limit_ratio_bulk"]))
    assert last["dense_sgd_gbps"] >= max(last[f"sgd_2shard_{w}_gbps"] for w in ("separate", "fused", "step")) - 1e-4
