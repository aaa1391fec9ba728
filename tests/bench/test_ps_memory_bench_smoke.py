"""bench/ps_memory.py still runs end to end (--quick) and reports the figures it promises.

Speed and memory are not asserted here (the benchmark measures; tests/multiproc/test_ps_memory.py
checks the bounds): only that every figure is present and positive and that each ratio is what
its definition says (recomputed from the raw figures the JSON also holds)."""
from __future__ import annotations

import pytest

from bench_run import TEST_TIMEOUT_S, run_quick

KEYS = [
    "sparse_bytes_per_row_ratio", "sparse_bytes_per_row", "raw_bytes_per_row_ratio", "sparse_vs_raw_ratio",
    "bf16_rowwise_bytes_per_row_ratio", "fp32_peak_over_final", "bf16_peak_over_final", "populate_rows_per_s",
    "populate_rows_per_s_median", "populate_rows_per_cpu_s", "populate_uniform_rows_per_s", "raw_fill_rows_per_s", "populate_vs_raw_fill",
    "tier_resident_pull_ratio", "tier_resident_pull_ratio_median", "tier_ram_pull_rows_per_s",
    "tier_resident_pull_rows_per_s", "tier_cold_pull_rows_per_s", "held_bytes_per_row", "index_bytes_per_row",
]


def close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-3


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ps_memory_quick(tmp_path) -> None:
    last, stdout = run_quick("ps_memory.py", str(tmp_path / "m.json"))
    for k in KEYS:
        assert last[k] > 0, k
    assert last["payload_bytes_per_row"] == 64 * 4 * 2
    assert close(last["sparse_bytes_per_row_ratio"], last["sparse_bytes_per_row"] / last["payload_bytes_per_row"])
    assert close(last["sparse_vs_raw_ratio"], last["sparse_bytes_per_row_ratio"] / last["raw_bytes_per_row_ratio"])
    assert close(last["populate_vs_raw_fill"], last["populate_rows_per_s"] / last["raw_fill_rows_per_s"])
    assert close(last["tier_resident_pull_ratio"], last["tier_resident_pull_rows_per_s"] / last["tier_ram_pull_rows_per_s"], 0.02)
    assert last["populate_rows_per_s"] >= last["populate_rows_per_s_median"]  # best is the min time
    assert last["tier_cold_rows"] > last["tier_resident_rows"]  # the tiered table really is mostly on disk
    assert "sparse_bytes_per_row_ratio" in stdout and "tier_resident_pull_ratio" in stdout  # the table
