"""Server-side optimizers as plain torch code.

torch.optim has no FTRL or row-wise Adagrad, so those are checked against the
papers' formulas written out in numpy (McMahan et al. 2013, Algorithm 1; FBGEMM's
row-wise Adagrad). The torch.optim-backed ones are compared end to end through
real shards in tests/multiproc/test_ps_numerics.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import OptimizerSpec
from ps.errors import InvalidArgumentError
from ps.optim import make_optimizer


def _opt(name: str, **h: float):
    spec = OptimizerSpec(name, h)
    return make_optimizer(spec.name, spec.hparams)


def test_ftrl_matches_paper() -> None:
    rng = np.random.default_rng(0)
    lr, beta, l1, l2 = 0.1, 1.0, 3.0, 0.01
    opt = _opt("ftrl", lr=lr, beta=beta, l1=l1, l2=l2)
    w = torch.zeros(50)
    state = opt.init_state(w)
    z = np.zeros(50)
    n = np.zeros(50)
    w_ref = np.zeros(50)
    for t in range(1, 30):
        g = rng.normal(size=50)
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / lr
        z += g - sigma * w_ref
        n += g * g
        w_ref = np.where(np.abs(z) <= l1, 0.0, -(z - np.sign(z) * l1) / ((beta + np.sqrt(n)) / lr + l2))
        opt.update(w, torch.from_numpy(g.astype(np.float32)), state, t)
        np.testing.assert_allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-6)
    assert (w == 0).any() and (w != 0).any()  # l1 produces exact zeros, not only zeros


def test_rowwise_adagrad_one_accumulator_per_row() -> None:
    opt = _opt("rowwise_adagrad", lr=0.5)
    p = torch.ones(3, 4)
    state = opt.init_state(p)
    assert state["sum"].shape == (3,)
    g = torch.arange(12, dtype=torch.float32).view(3, 4)
    opt.update(p, g, state, torch.ones(3, 1, dtype=torch.float64))
    acc = (g**2).mean(1)
    torch.testing.assert_close(state["sum"], acc)
    torch.testing.assert_close(p, 1 - 0.5 * g / (acc.sqrt() + 1e-10)[:, None])


def test_per_row_steps_give_per_row_bias_correction() -> None:
    """Lazy Adam: a row at its k-th update uses bias correction for step k, whatever other rows did."""
    opt = _opt("adam", lr=0.1)
    p = torch.zeros(2, 3)
    state = opt.init_state(p)
    g = torch.ones(2, 3)
    opt.update(p, g, state, torch.tensor([[1.0], [5.0]], dtype=torch.float64))
    ref = torch.zeros(1, 3, requires_grad=True)
    o = torch.optim.Adam([ref], lr=0.1)
    ref.grad = torch.ones(1, 3)
    o.step()
    torch.testing.assert_close(p[0], ref.detach()[0])
    assert not torch.allclose(p[1], p[0])


@pytest.mark.parametrize(
    "name,h,match",
    [
        ("adamm", {}, "unknown optimizer"),
        ("adam", {"bta1": 0.9}, "unknown parameter"),
        ("adam", {"lr": -1.0}, "lr must be > 0"),
        ("adam", {"beta1": 1.0}, "beta1"),
        ("sgd", {"lr": float("nan")}, "finite"),
        ("ftrl", {"weight_decay": 0.1}, "unknown parameter"),
    ],
)
def test_bad_hyperparameters_are_named(name: str, h: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        OptimizerSpec(name, h)


@pytest.mark.parametrize("hp", [dict(lr=0.05, initial_accumulator=0.1, eps=1e-10),
                                dict(lr=0.1, lr_decay=0.01, weight_decay=0.001, eps=1e-8)], ids=["plain", "decay"])
def test_fused_adagrad_equals_the_unfused_update_and_torch_optim(hp: dict) -> None:
    """The fused kernel (torch._fused_adagrad_) gives what the single-tensor code gives (and
    torch.optim.Adagrad, the reference), dense slices with a step count and sparse rows with per-row
    steps (lr_decay set: the per-row path, not fused), to float32 rounding."""
    rng = np.random.default_rng(1)
    fused, plain = _opt("adagrad", **hp), _opt("adagrad", **hp)
    plain.fused = False
    w0 = torch.from_numpy(rng.normal(size=(64, 8)).astype(np.float32))
    wf, wp, wt = w0.clone(), w0.clone(), torch.nn.Parameter(w0.clone())
    sf, sp = fused.init_state(wf), plain.init_state(wp)
    ref = torch.optim.Adagrad([wt], lr=hp["lr"], lr_decay=hp.get("lr_decay", 0.0), weight_decay=hp.get("weight_decay", 0.0),
                              initial_accumulator_value=hp.get("initial_accumulator", 0.0), eps=hp["eps"])
    for t in range(1, 8):
        g = torch.from_numpy(rng.normal(size=(64, 8)).astype(np.float32))
        fused.update(wf, g, sf, t)
        plain.update(wp, g, sp, t)
        wt.grad = g.clone()
        ref.step()
        torch.testing.assert_close(wf, wp, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sf["sum"], sp["sum"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(wf, wt.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(wf, w0)
    # sparse rows: per-row steps (an (n, 1) tensor)
    steps = torch.from_numpy(rng.integers(1, 5, size=(64, 1)).astype(np.float64))
    g = torch.from_numpy(rng.normal(size=(64, 8)).astype(np.float32))
    fused.update(wf, g, sf, steps)
    plain.update(wp, g, sp, steps)
    torch.testing.assert_close(wf, wp, rtol=1e-6, atol=1e-7)
