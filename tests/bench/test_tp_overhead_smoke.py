"""bench/tp_overhead.py still runs (--quick, CPU, a Gloo group of one) and reports what it promises.

Speed is not asserted. What is: the three paths (plain torch, the TP layers at T=1, the pipeline
executor at P=1) trained the same model from the same weights on the same batches, so their last
losses agree (the reference is plain torch's; fp32, the TP path's vocab-parallel cross-entropy sums
in another order: rtol 1e-5); and ``tp_overhead`` / ``pp_overhead`` are the medians' ratios minus 1,
recomputed from the JSON's own step times."""
from __future__ import annotations

import math

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_tp_overhead_quick(tmp_path) -> None:
    last, stdout = run_quick("tp_overhead.py", str(tmp_path / "r.json"))
    assert last["device"] == "cpu"
    for path in ("tp", "pp"):
        assert math.isclose(last[f"loss_{path}"], last["loss_plain"], rel_tol=1e-5), (path, last)
        ratio = last[f"ms_med_{path}"] / last["ms_med_plain"] - 1
        assert abs(last[f"{path}_overhead"] - ratio) < 1e-3 + 1e-3 * abs(ratio), (path, last)
        tokens = last["batch"] * last["seq"]
        assert math.isclose(last[f"tokens_per_s_{path}"], tokens / (last[f"ms_med_{path}"] / 1e3), rel_tol=1e-3)
    assert "plain" in stdout and "pp" in stdout
