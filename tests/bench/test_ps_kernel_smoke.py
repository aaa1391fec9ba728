"""bench/ps_kernel.py still runs end to end (--quick) and reports what it promises: min and median
of every variant (the table's kernel and numpy paths, plain torch, FBGEMM or why it was skipped),
and ratios that are what their definitions say (recomputed from the figures beside them). Speed is
not asserted. ``check()`` inside the bench fails the run if the kernel's rows differ from numpy's."""
from __future__ import annotations

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick

from ps import rowkernel


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ps_kernel_quick(tmp_path) -> None:
    last, stdout = run_quick("ps_kernel.py", str(tmp_path / "r.json"))
    for v in ("numpy", "torch"):
        assert 0 < last[v]["min_ms"] <= last[v]["median_ms"], (v, last[v])
    assert "fbgemm" in last  # its figures, or "skipped: <why>"
    if rowkernel.KERNEL is None:  # the numpy path only: the bench says why
        assert "kernel" in last and "kernel_vs_numpy" not in last, last
        return
    assert 0 < last["kernel"]["min_ms"] <= last["kernel"]["median_ms"]
    close = lambda a, b: abs(a - b) <= 1e-3 * max(abs(a), abs(b)) + 1e-3  # noqa: E731  the JSON's rounding
    assert close(last["kernel_vs_numpy"], last["kernel"]["min_ms"] / last["numpy"]["min_ms"])
    assert close(last["kernel_vs_torch"], last["kernel"]["min_ms"] / last["torch"]["min_ms"])
    if isinstance(last["fbgemm"], dict):
        assert close(last["kernel_vs_fbgemm"], last["kernel"]["min_ms"] / last["fbgemm"]["min_ms"])
    assert "variant" in stdout and "min ms" in stdout  # the table before the JSON


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ps_kernel_quick_adam(tmp_path) -> None:
    """``--optimizer adam``: the same workload on a lazy-Adam table; the kernel and numpy variants are
    that table (checked bit-identical inside the bench), ``torch`` plain torch's lazy Adam, and FBGEMM
    (row-wise Adagrad only) skipped with the reason."""
    last, _ = run_quick("ps_kernel.py", str(tmp_path / "r.json"), ("--optimizer", "adam"))
    assert last["optimizer"] == "adam"
    assert last["fbgemm"].startswith("skipped: ") and "row-wise Adagrad" in last["fbgemm"]
    for v in ("numpy", "torch"):
        assert 0 < last[v]["min_ms"] <= last[v]["median_ms"], (v, last[v])
    if rowkernel.KERNEL is None:
        assert "kernel" in last and "kernel_vs_numpy" not in last, last
        return
    assert 0 < last["kernel"]["min_ms"] <= last["kernel"]["median_ms"]
    assert abs(last["kernel_vs_numpy"] - last["kernel"]["min_ms"] / last["numpy"]["min_ms"]) <= 2e-3
