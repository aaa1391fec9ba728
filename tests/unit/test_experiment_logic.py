"""worker/experiment.py's pure parts: the mode grid, time/updates to a target."""
from __future__ import annotations

import dataclasses

import pytest

from worker.experiment import ExperimentConfig, ModeSpec, parse_modes, time_to_target


def test_mode_grid_with_staleness_aware_lr_as_a_factor() -> None:
    got = [m.label for m in parse_modes("sync,async,ssp:4,dense-sync", "both")]
    assert got == ["sync", "async", "async+salr", "ssp:4", "ssp:4+salr", "dense-sync"]
    assert parse_modes("ssp:16")[0] == ModeSpec("ssp", 16, False)


def test_the_old_name_hybrid_points_to_dense_sync() -> None:
    with pytest.raises(ValueError, match="renamed 'dense-sync'"):
        parse_modes("sync,hybrid")


@pytest.mark.parametrize("bad", ["ssp", "ssp:x", "sync:2", "bsp", ""])
def test_bad_modes_are_refused_with_a_message(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_modes(bad)


def test_bad_straggler_is_refused() -> None:
    with pytest.raises(ValueError, match="WORKERxFACTOR"):
        ExperimentConfig(straggler="one-x-4")
    with pytest.raises(ValueError, match="worker in"):
        ExperimentConfig(workers=2, straggler="5x4")


def test_time_to_target_is_the_first_crossing() -> None:
    series = [
        {"time_s": 1.0, "updates": 10, "metric": 0.6},
        {"time_s": 2.0, "updates": 20, "metric": 0.72},
        {"time_s": 3.0, "updates": 30, "metric": 0.70},
    ]
    assert time_to_target(series, 0.7) == (2.0, 20)
    assert time_to_target(series, 0.9) == (None, None)
    assert time_to_target(series, 0.65, higher_is_better=False) == (1.0, 10)


def _results(tmp_path, metric: str, hib: bool, bests: dict[str, list[float]]) -> tuple[dict, ExperimentConfig]:
    cfg = ExperimentConfig(out=str(tmp_path))
    modes = {}
    for label, values in bests.items():
        series = [{"time_s": float(i + 1), "updates": 10 * (i + 1), "metric": v} for i, v in enumerate(values)]
        modes[label] = {"spec": {}, "series": series, "complete": True,
                        "summary": {"final_metric": values[-1], "mean_staleness": 0.0, "max_staleness": 0,
                                    "examples_per_s": 1.0, "blocked_fraction": 0.0}}
    return {"settings": {**dataclasses.asdict(cfg), "modes": list(bests)}, "metric": metric, "higher_is_better": hib,
            "task_info": {}, "modes": modes, "complete": True}, cfg


def test_default_target_is_99_percent_of_the_worst_modes_best(tmp_path) -> None:
    """README (Experiments): "The target is `--target`, or 99% of the worst mode's best metric (for a
    metric where lower is better, such as a loss, 101% of the worst mode's best)."
    A run's results (three modes' metric series, AUC: higher is better; each series peaks before its
    end, so its best is not its last point) go through ``finish`` (what `tessera experiment` calls
    at the end, also after Ctrl-C). Reference: 0.99 x the smallest of the per-mode maxima, computed
    here by hand; it lands in results.json and summary.md and the times to target are measured
    against it. With --target given, that value is the target."""
    import json

    from worker.experiment import finish

    bests = {"sync": [0.60, 0.80, 0.79], "async": [0.62, 0.76, 0.74], "ssp:4": [0.70, 0.78, 0.77]}
    results, cfg = _results(tmp_path, "auc", True, bests)
    finish(results, cfg, str(tmp_path))
    want = 0.99 * 0.76  # the worst mode (async)'s best
    assert results["target"] == pytest.approx(want, rel=1e-12)
    assert json.loads((tmp_path / "results.json").read_text())["target"] == pytest.approx(want, rel=1e-12)
    assert f"target auc: {want:.4f}" in (tmp_path / "summary.md").read_text()
    # every mode crosses 0.7524 at its second point (0.80, 0.76, 0.78), none at its first
    assert {lb: m["summary"]["time_to_target_s"] for lb, m in results["modes"].items()} == {lb: 2.0 for lb in bests}

    results, cfg = _results(tmp_path, "auc", True, bests)
    finish(results, dataclasses.replace(cfg, target=0.79), str(tmp_path))
    assert results["target"] == 0.79 and results["modes"]["async"]["summary"]["time_to_target_s"] is None

    # a metric where lower is better (a loss): 101% of the worst mode's best, the highest of the per-mode minima
    losses = {"sync": [0.90, 0.50, 0.55], "async": [0.95, 0.60, 0.62], "ssp:4": [0.80, 0.52, 0.60]}
    results, cfg = _results(tmp_path, "loss", False, losses)
    finish(results, cfg, str(tmp_path))
    assert results["target"] == pytest.approx(1.01 * 0.60, rel=1e-12)
