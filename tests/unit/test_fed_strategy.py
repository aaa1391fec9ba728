"""Strategies against their papers' formulas, computed independently here in float64."""
from __future__ import annotations

import numpy as np
import pytest

from federated.strategy import (
    STRATEGIES,
    ClientUpdate,
    FedAvg,
    Strategy,
    StrategyError,
    make_strategy,
    weighted_mean_delta,
)

SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _weights(rng: np.random.Generator, scale: float = 1.0, dtype: type = np.float64) -> list[np.ndarray]:
    return [(scale * rng.standard_normal(s)).astype(dtype) for s in SHAPES]


def _updates(rng: np.random.Generator, n: int = 4, dtype: type = np.float64) -> list[ClientUpdate]:
    return [ClientUpdate(f"c{k}", _weights(rng, dtype=dtype), int(rng.integers(1, 100))) for k in range(n)]


# --------------------------------------------------------------------------- FedAvg

def test_fedavg_is_example_weighted_mean_exactly() -> None:
    rng = np.random.default_rng(0)
    g = _weights(rng)
    ups = _updates(rng)
    out = make_strategy("fedavg").aggregate(0, g, ups)
    ns = np.array([u.num_examples for u in ups], dtype=np.float64)
    for i in range(len(SHAPES)):
        stacked = np.stack([u.weights[i] for u in ups])
        expected = np.average(stacked, axis=0, weights=ns)
        np.testing.assert_array_equal(out[i], expected)  # float64: bit for bit
        assert out[i].dtype == np.float64


def test_fedavg_keeps_float32_and_mean_delta_path_agrees() -> None:
    rng = np.random.default_rng(1)
    g = _weights(rng, dtype=np.float32)
    ups = _updates(rng, dtype=np.float32)
    s = FedAvg()
    direct = s.aggregate(0, g, ups)
    via_delta = s.aggregate_mean_delta(0, g, weighted_mean_delta(g, ups))
    for a, b in zip(direct, via_delta):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda w: w[:-1], r"client 'c1': weights has 2 arrays"),
        (lambda w: [w[0], w[1].reshape(2, 2), w[2]], r"client 'c1': weights\[1\] has shape \(2, 2\)"),
        (lambda w: [w[0], w[1].astype(np.float32), w[2]], r"client 'c1': weights\[1\] has dtype float32"),
        (lambda w: [w[0], w[1], np.where(w[2] > 0, np.nan, w[2])], r"client 'c1': weights\[2\] holds non-finite"),
        (lambda w: [w[0], np.full(4, np.inf), w[2]], r"client 'c1': weights\[1\] holds non-finite"),
    ],
)
def test_bad_update_is_rejected_naming_client_and_index(mutate, match) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    g = _weights(rng)
    ups = _updates(rng, n=3)
    bad = ClientUpdate("c1", mutate(ups[1].weights), 5)
    with pytest.raises(StrategyError, match=match):
        FedAvg().aggregate(0, g, [ups[0], bad, ups[2]])


def test_bad_num_examples_and_empty_and_duplicate() -> None:
    rng = np.random.default_rng(3)
    g = _weights(rng)
    u = _updates(rng, n=2)
    with pytest.raises(StrategyError, match="num_examples"):
        FedAvg().aggregate(0, g, [ClientUpdate("x", u[0].weights, 0)])
    with pytest.raises(StrategyError, match="no client updates"):
        FedAvg().aggregate(0, g, [])
    with pytest.raises(StrategyError, match="two updates"):
        FedAvg().aggregate(0, g, [u[0], u[0]])


def test_registry_and_user_class_by_path() -> None:
    assert STRATEGIES["fedavg"] is FedAvg
    s = make_strategy("federated.strategy:FedAvg")
    assert isinstance(s, FedAvg)
    with pytest.raises(StrategyError, match="unknown strategy"):
        make_strategy("nope")
    with pytest.raises(StrategyError, match="not a Strategy"):
        make_strategy("numpy:ndarray")
    with pytest.raises(StrategyError, match="cannot load"):
        make_strategy("no_such_module_xyz:Thing")
    with pytest.raises(StrategyError, match="fedavg"):
        make_strategy("fedavg", bogus=1)
    assert issubclass(FedAvg, Strategy)
