"""worker/experiment.py's pure parts: the mode grid, time/updates to a target."""
from __future__ import annotations

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
