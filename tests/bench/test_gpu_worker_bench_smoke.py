"""bench/gpu_worker.py still runs end to end (--quick, on the CPU device) and reports what it promises.

Speed is not asserted: only that the run succeeds, the last stdout line is the JSON written to
--json-out, every promised figure is there, and the ratios are what their definitions say
(recomputed from the examples/s the JSON holds beside them)."""
from __future__ import annotations

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gpu_worker_quick(tmp_path) -> None:
    last, stdout = run_quick("gpu_worker.py", str(tmp_path / "r.json"))
    R = last["rows"][0]
    assert last["quick"] is True and last["device"] in ("cpu", "cuda")
    for way in ("ceiling", "ps", "ps+cache"):
        assert last[f"{way}_eps_{R}"] > 0, way
        ms = last[f"{way}_ms_{R}"]
        assert set(ms) == {"step", "pull", "h2d", "compute", "push"}, ms
        assert sum(v for k, v in ms.items() if k != "step") <= ms["step"] * 1.05 + 0.05, (way, ms)
    assert abs(last["gpu_ratio"] - last[f"ps+cache_eps_{R}"] / last[f"ceiling_eps_{R}"]) < 0.01 * last["gpu_ratio"] + 1e-3
    assert abs(last["gpu_ratio_nocache"] - last[f"ps_eps_{R}"] / last[f"ceiling_eps_{R}"]) < 0.01 * last["gpu_ratio_nocache"] + 1e-3
    assert 0 < last["cache_hit_rate"] <= 1
    assert "| ps+cache |" in stdout
    # sync mode (conditional pulls): with every field trained nothing a worker cached stays current (its own
    # push changed it), so the same rows cross the wire; with half the fields frozen, fewer do
    half = f"frozen{last['fields'] // 2}"
    assert last["sync_hit_rate"] == 0 and last["sync_rows_ratio"] == 1.0, (last["sync_hit_rate"], last["sync_rows_ratio"])
    assert 0 < last[f"sync_hit_rate_{half}"] <= 1 and 0 < last[f"sync_rows_ratio_{half}"] < 1
    assert f"| {last['fields'] // 2} of {last['fields']} |" in stdout
