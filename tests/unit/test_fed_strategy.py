"""Strategies against their papers' formulas, computed independently here in float64."""
from __future__ import annotations

import numpy as np
import pytest

from federated.strategy import (
    Krum,
    proximal_term,
    scaffold_client_update,
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
    # numeric strings (from a command line) are accepted; others are named in the error
    s2 = make_strategy("fedavgm", momentum="0.5", server_lr="2")
    assert s2.params() == {"server_lr": 2.0, "momentum": 0.5}
    assert make_strategy("multikrum", f="2", m="3").params() == {"f": 2, "m": 3}
    with pytest.raises(StrategyError, match="parameter momentum must be a number, got 'fast'"):
        make_strategy("fedavgm", momentum="fast")
    with pytest.raises(StrategyError, match="parameter buffer_size must be an integer"):
        make_strategy("fedbuff", buffer_size="2.5")


def _mean_delta(g: list[np.ndarray], ups: list[ClientUpdate]) -> list[np.ndarray]:
    """Example-weighted mean of w_k - w, written out independently of the library."""
    ns = np.array([u.num_examples for u in ups], dtype=np.float64)
    return [np.tensordot(ns, np.stack([u.weights[i] - g[i] for u in ups]), axes=1) / ns.sum()
            for i in range(len(g))]


def _close(a: list[np.ndarray], b: list[np.ndarray], rtol: float = 1e-12) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-14)


# --------------------------------------------------------------------------- FedAvgM

def test_fedavgm_server_momentum_two_rounds() -> None:
    """Hsu et al. 2019: v <- beta v + (w - avg); w <- w - eta v."""
    rng = np.random.default_rng(10)
    beta, eta = 0.7, 0.5
    s = make_strategy("fedavgm", momentum=beta, server_lr=eta)
    g0 = _weights(rng)
    ups0 = _updates(rng)
    avg0 = [g + d for g, d in zip(g0, _mean_delta(g0, ups0))]
    v1 = [g - a for g, a in zip(g0, avg0)]
    g1_expected = [g - eta * v for g, v in zip(g0, v1)]
    g1 = s.aggregate(0, g0, ups0)
    _close(g1, g1_expected)
    ups1 = _updates(rng)
    avg1 = [g + d for g, d in zip(g1, _mean_delta(g1, ups1))]
    v2 = [beta * v + (g - a) for v, g, a in zip(v1, g1, avg1)]
    g2_expected = [g - eta * v for g, v in zip(g1, v2)]
    _close(s.aggregate(1, g1, ups1), g2_expected)


def test_fedavgm_without_momentum_is_fedavg() -> None:
    rng = np.random.default_rng(11)
    g, ups = _weights(rng), _updates(rng)
    _close(make_strategy("fedavgm", momentum=0.0, server_lr=1.0).aggregate(0, g, ups),
           FedAvg().aggregate(0, g, ups))


# --------------------------------------------------------------------------- FedProx

def test_fedprox_aggregates_like_fedavg_and_sends_mu() -> None:
    rng = np.random.default_rng(12)
    g, ups = _weights(rng), _updates(rng)
    s = make_strategy("fedprox", proximal_mu=0.05)
    assert s.client_config(3) == {"proximal_mu": 0.05}
    _close(s.aggregate(0, g, ups), FedAvg().aggregate(0, g, ups), rtol=0)
    with pytest.raises(StrategyError, match="proximal_mu"):
        make_strategy("fedprox", proximal_mu=-1.0)


def test_proximal_term_value_and_gradient() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    g = _weights(rng)
    params = [torch.tensor(a + rng.standard_normal(a.shape), requires_grad=True) for a in g]
    mu = 0.3
    term = proximal_term(params, g, mu)
    expected = mu / 2 * sum(float(((p.detach().numpy() - a) ** 2).sum()) for p, a in zip(params, g))
    assert abs(float(term.detach()) - expected) <= 1e-12 * abs(expected)
    term.backward()
    for p, a in zip(params, g):
        np.testing.assert_allclose(p.grad.numpy(), mu * (p.detach().numpy() - a), rtol=1e-12)
    with pytest.raises(StrategyError, match="shape"):
        proximal_term(params, [g[1], g[0], g[2]], mu)


# --------------------------------------------------------------------------- SCAFFOLD

def _scaffold_updates(rng: np.random.Generator, n: int) -> list[ClientUpdate]:
    return [ClientUpdate(f"c{k}", _weights(rng), int(rng.integers(1, 50)),
                         extras={"delta_c": _weights(rng, 0.1)}) for k in range(n)]


def test_scaffold_server_update_two_rounds() -> None:
    """Karimireddy et al. 2020, Alg. 1: x += eta_g mean(dy); c += |S|/N mean(dc)."""
    rng = np.random.default_rng(14)
    n_total, eta_g = 10, 0.5
    s = make_strategy("scaffold", num_clients=n_total, server_lr=eta_g)
    x0 = _weights(rng)
    assert s.client_payload(0) == {}
    s.setup(x0)
    _close(s.client_payload(0)["c"], [np.zeros_like(a) for a in x0], rtol=0)
    c = [np.zeros_like(a) for a in x0]
    x = x0
    for rnd in range(2):
        ups = _scaffold_updates(rng, 3)
        exp_x = [x[i] + eta_g * np.mean([u.weights[i] - x[i] for u in ups], axis=0) for i in range(len(x))]
        c = [c[i] + (3 / n_total) * np.mean([u.extras["delta_c"][i] for u in ups], axis=0) for i in range(len(x))]
        x = s.aggregate(rnd, x, ups)
        _close(x, exp_x)
        _close(s.client_payload(rnd + 1)["c"], c)


def test_scaffold_requires_delta_c_and_refuses_mean_delta() -> None:
    rng = np.random.default_rng(15)
    s = make_strategy("scaffold", num_clients=5)
    g = _weights(rng)
    with pytest.raises(StrategyError, match=r"client 'c0': missing extras\['delta_c'\]"):
        s.aggregate(0, g, _updates(rng, 2))
    bad = [ClientUpdate("c9", _weights(rng), 1, extras={"delta_c": _weights(rng)[:2]})]
    with pytest.raises(StrategyError, match=r"client 'c9': extras\['delta_c'\] has 2 arrays"):
        s.aggregate(0, g, bad)
    with pytest.raises(StrategyError, match="individual client updates"):
        s.aggregate_mean_delta(0, g, g)
    with pytest.raises(StrategyError, match="num_clients"):
        make_strategy("scaffold", num_clients=2).aggregate(0, g, _scaffold_updates(rng, 3))


def test_scaffold_client_update_option_ii() -> None:
    """c_i+ = c_i - c + (x - y_i) / (K eta_l)  (Karimireddy et al. 2020, eq. 4, option II)."""
    rng = np.random.default_rng(16)
    c_i, c, x, y = (_weights(rng) for _ in range(4))
    k, lr = 7, 0.05
    new, delta = scaffold_client_update(c_i, c, x, y, num_steps=k, lr=lr)
    for i in range(len(SHAPES)):
        expected = c_i[i] - c[i] + (x[i] - y[i]) / (k * lr)
        np.testing.assert_allclose(new[i], expected, rtol=1e-12)
        np.testing.assert_allclose(delta[i], expected - c_i[i], rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------- FedOpt

def _fedopt_reference(kind: str, eta: float, b1: float, b2: float, tau: float,
                      g0: list[np.ndarray], rounds: list[list[ClientUpdate]]) -> list[list[np.ndarray]]:
    """Reddi et al. 2021 Algorithm 2, written out coordinate-wise: m_{-1}=0, v_{-1}=tau^2."""
    x = [a.copy() for a in g0]
    m = [np.zeros_like(a) for a in g0]
    v = [np.full_like(a, tau ** 2) for a in g0]
    out = []
    for ups in rounds:
        d = _mean_delta(x, ups)
        for i in range(len(x)):
            m[i] = b1 * m[i] + (1 - b1) * d[i]
            d2 = d[i] ** 2
            if kind == "fedadagrad":
                v[i] = v[i] + d2
            elif kind == "fedyogi":
                v[i] = v[i] - (1 - b2) * d2 * np.sign(v[i] - d2)
            else:
                v[i] = b2 * v[i] + (1 - b2) * d2
            x[i] = x[i] + eta * m[i] / (np.sqrt(v[i]) + tau)
        out.append([a.copy() for a in x])
    return out


@pytest.mark.parametrize("kind", ["fedadagrad", "fedyogi", "fedadam"])
def test_fedopt_matches_algorithm_2(kind: str) -> None:
    rng = np.random.default_rng(17)
    eta, b1, b2, tau = 0.03, 0.8, 0.95, 1e-2
    g0 = _weights(rng)
    rounds = [[ClientUpdate(u.client_id, [w * 0.1 for w in u.weights], u.num_examples) for u in _updates(rng)]
              for _ in range(3)]
    expected = _fedopt_reference(kind, eta, b1, b2, tau, g0, rounds)
    s = make_strategy(kind, eta=eta, beta1=b1, beta2=b2, tau=tau)
    x = g0
    for rnd, ups in enumerate(rounds):
        x = s.aggregate(rnd, x, ups)
        _close(x, expected[rnd])


def test_fedopt_mean_delta_path_and_client_lr() -> None:
    rng = np.random.default_rng(18)
    g, ups = _weights(rng), _updates(rng)
    a = make_strategy("fedadam", eta=0.1, eta_l=0.02)
    b = make_strategy("fedadam", eta=0.1)
    assert a.client_config(0) == {"lr": 0.02} and b.client_config(0) == {}
    _close(a.aggregate(0, g, ups), b.aggregate_mean_delta(0, g, _mean_delta(g, ups)))
    with pytest.raises(StrategyError, match="beta2"):
        make_strategy("fedyogi", beta2=1.0)
    with pytest.raises(StrategyError, match="tau"):
        make_strategy("fedadam", tau=0.0)


# --------------------------------------------------------------------------- FedBuff

def test_fedbuff_staleness_weighted_buffer() -> None:
    """Nguyen et al. 2022: x += eta_g / K * sum_k (y_k - x_{base_k}) / sqrt(1 + staleness_k)."""
    rng = np.random.default_rng(19)
    eta = 0.8
    s = make_strategy("fedbuff", buffer_size=3, server_lr=eta)
    assert s.asynchronous and not s.supports_secure_aggregation
    g0 = _weights(rng)
    ups0 = [ClientUpdate(f"a{k}", _weights(rng), 10, base_round=0) for k in range(3)]
    g1 = s.aggregate(0, g0, ups0)
    _close(g1, [g0[i] + eta / 3 * sum(u.weights[i] - g0[i] for u in ups0) for i in range(len(g0))])
    ups1 = [ClientUpdate("b0", _weights(rng), 10, base_round=0),   # started from g0: staleness 1
            ClientUpdate("b1", _weights(rng), 99, base_round=1),   # fresh
            ClientUpdate("b2", _weights(rng), 1, base_round=0)]
    g2 = s.aggregate(1, g1, ups1)
    bases = [g0, g1, g0]
    stale = [1, 0, 1]
    exp = [g1[i] + eta / 3 * sum((u.weights[i] - b[i]) / np.sqrt(1 + t) for u, b, t in zip(ups1, bases, stale))
           for i in range(len(g0))]
    _close(g2, exp)


def test_fedbuff_rejects_bad_staleness() -> None:
    rng = np.random.default_rng(20)
    s = make_strategy("fedbuff", buffer_size=2, max_staleness=1)
    g = _weights(rng)
    for r in range(3):
        g = s.aggregate(r, g, [ClientUpdate("a", _weights(rng), 1, base_round=r)])
    with pytest.raises(StrategyError, match="'x': FedBuff needs base_round"):
        s.validate_update(3, g, ClientUpdate("x", _weights(rng), 1))
    with pytest.raises(StrategyError, match="'x': base_round 5 is ahead"):
        s.aggregate(3, g, [ClientUpdate("x", _weights(rng), 1, base_round=5)])
    with pytest.raises(StrategyError, match="'x': staleness 2 exceeds max_staleness 1"):
        s.aggregate(3, g, [ClientUpdate("x", _weights(rng), 1, base_round=1)])
    s.validate_update(3, g, ClientUpdate("x", _weights(rng), 1, base_round=2))  # within bound
    with pytest.raises(StrategyError, match="cannot run on the mean delta"):
        s.aggregate_mean_delta(3, g, g)


# --------------------------------------------------------------------------- robust

def test_median_and_trimmed_mean_formulas() -> None:
    rng = np.random.default_rng(21)
    g, ups = _weights(rng), _updates(rng, n=7)
    med = make_strategy("median").aggregate(0, g, ups)
    tm = make_strategy("trimmed_mean", beta=0.3).aggregate(0, g, ups)  # floor(0.3*7) = 2 each side
    for i in range(len(g)):
        st = np.stack([u.weights[i] for u in ups])
        np.testing.assert_array_equal(med[i], np.median(st, axis=0))
        flat = st.reshape(7, -1)
        exp = np.array([np.mean(sorted(flat[:, j])[2:5]) for j in range(flat.shape[1])]).reshape(g[i].shape)
        np.testing.assert_allclose(tm[i], exp, rtol=1e-12)
    with pytest.raises(StrategyError, match="beta"):
        make_strategy("trimmed_mean", beta=0.5)


def test_krum_scores_and_selection_by_hand() -> None:
    """Blanchard et al. 2017: score(i) = sum of the n-f-2 smallest ||V_i - V_j||^2, j != i."""
    pts = [0.0, 1.0, 2.0, 4.0, 100.0]   # 1-d, one array
    g = [np.zeros(1)]
    ups = [ClientUpdate(f"c{k}", [np.array([p])], 1) for k, p in enumerate(pts)]
    f = 1  # n-f-2 = 2 nearest
    exp_scores = []
    for i, p in enumerate(pts):
        d = sorted((p - q) ** 2 for j, q in enumerate(pts) if j != i)
        exp_scores.append(sum(d[:2]))
    k = make_strategy("krum", f=f)
    assert isinstance(k, Krum)
    np.testing.assert_allclose(k.scores([u.weights for u in ups]), exp_scores)
    best = int(np.argmin(exp_scores))
    assert k.aggregate(0, g, ups)[0][0] == pts[best]
    order = np.argsort(exp_scores, kind="stable")[:3]
    mk = make_strategy("multikrum", f=f, m=3).aggregate(0, g, ups)
    assert mk[0][0] == pytest.approx(np.mean([pts[j] for j in order]), rel=1e-12)
    with pytest.raises(StrategyError, match="more than 2f\\+2"):
        make_strategy("krum", f=2).aggregate(0, g, ups)


@pytest.mark.parametrize("name, params", [("median", {}), ("trimmed_mean", {"beta": 0.2}),
                                          ("krum", {"f": 1}), ("multikrum", {"f": 1, "m": 3}),
                                          ("multikrum", {"f": 1})])
def test_robust_aggregate_stays_in_honest_range(name: str, params: dict) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(22)
    g = _weights(rng)
    honest = [ClientUpdate(f"h{k}", [a + 0.1 * rng.standard_normal(a.shape) for a in g], 10) for k in range(4)]
    evil = ClientUpdate("evil", [np.full_like(a, 1e6) for a in g], 10)
    s = make_strategy(name, **params)
    assert s.needs_individual_updates and not s.supports_secure_aggregation
    out = s.aggregate(0, g, honest[:2] + [evil] + honest[2:])
    for i in range(len(g)):
        st = np.stack([u.weights[i] for u in honest])
        assert np.all(out[i] >= st.min(axis=0) - 1e-12) and np.all(out[i] <= st.max(axis=0) + 1e-12)
    with pytest.raises(StrategyError, match="individual client updates"):
        s.aggregate_mean_delta(0, g, g)
    # FedAvg, for contrast, is dragged away
    assert np.abs(FedAvg().aggregate(0, g, honest + [evil])[0]).max() > 1e5


# --------------------------------------------------------------------------- contract suite (every strategy)

CONTRACT_PARAMS: dict[str, dict] = {  # type: ignore[type-arg]
    "fedavg": {}, "fedavgm": {"momentum": 0.5}, "fedprox": {"proximal_mu": 0.1},
    "scaffold": {"num_clients": 10}, "fedadagrad": {}, "fedyogi": {}, "fedadam": {},
    "fedbuff": {"buffer_size": 5}, "median": {}, "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 1}, "multikrum": {"f": 1},
}


def _contract_updates(rng: np.random.Generator, rnd: int, dtype: type = np.float32) -> list[ClientUpdate]:
    return [ClientUpdate(f"c{k}", _weights(rng, dtype=dtype), int(rng.integers(1, 30)), base_round=rnd,
                         extras={"delta_c": _weights(rng, 0.1, dtype=dtype)}) for k in range(5)]


def _state_equal(a: dict, b: dict) -> bool:  # type: ignore[type-arg]
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_every_registered_strategy_is_in_the_contract_suite() -> None:
    assert set(STRATEGIES) == set(CONTRACT_PARAMS)


@pytest.mark.parametrize("name", sorted(CONTRACT_PARAMS))
def test_contract(name: str) -> None:
    """Shapes and dtypes kept; a rejected call changes no state; state_dict is flat
    arrays/scalars and restores the same next step."""
    rng = np.random.default_rng(23)
    s = make_strategy(name, **CONTRACT_PARAMS[name])
    g = _weights(rng, dtype=np.float32)
    s.setup(g)
    g1 = s.aggregate(0, g, _contract_updates(rng, 0))
    assert [a.shape for a in g1] == SHAPES and all(a.dtype == np.float32 for a in g1)
    state = s.state_dict()
    for k, v in state.items():
        assert isinstance(k, str) and isinstance(v, (np.ndarray, int, float, str)), (k, type(v))
    np.savez(__import__("io").BytesIO(), **state)  # checkpointable without pickle
    good = _contract_updates(rng, 1)
    bad = list(good)
    bad[3] = ClientUpdate("c3", [good[3].weights[0], good[3].weights[1], np.full((2, 2, 2), np.nan, np.float32)],
                          3, base_round=1, extras=good[3].extras)
    with pytest.raises(StrategyError, match=r"client 'c3': weights\[2\] holds non-finite"):
        s.aggregate(1, g1, bad)
    assert _state_equal(s.state_dict(), state)
    with pytest.raises(StrategyError, match=r"client 'c3'"):
        s.validate_update(1, g1, bad[3])
    fresh = make_strategy(name, **CONTRACT_PARAMS[name])
    fresh.load_state_dict(state)
    _close(fresh.aggregate(1, g1, good), s.aggregate(1, g1, good), rtol=0)
    if s.supports_secure_aggregation:
        d = _mean_delta([a.astype(np.float64) for a in g1],
                        [ClientUpdate(u.client_id, [w.astype(np.float64) for w in u.weights], u.num_examples)
                         for u in good])
        out = make_strategy(name, **CONTRACT_PARAMS[name]).aggregate_mean_delta(1, g1, d)
        assert all(a.dtype == np.float32 for a in out)
