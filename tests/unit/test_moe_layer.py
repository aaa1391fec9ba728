"""The MoE layer alone, one process (no process group): routing, capacity, losses, bad settings.

References are written out by hand here: a per-token loop over the router's top-k choices with
the experts applied one token at a time (the layer batches tokens by expert), the Switch
balance-loss formula on one sequence, and the drop order (first choices before second choices,
in token order) computed from the router's choices."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from worker.peer.mesh import PeerConfigError
from worker.peer.moe import MoE, MoEConfig, aux_loss, window_metrics
from worker.tasks import load_task


def _layer(top_k: int, capacity: float, experts: int = 4, dim: int = 8) -> MoE:
    torch.manual_seed(0)
    layer = MoE(dim, MoEConfig(experts=experts, top_k=top_k, hidden=16, capacity_factor=capacity))
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)  # decisive routing
    return layer


def _by_hand(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, dropped (B, T, k)) from a loop over sequences, choices and tokens."""
    b, t, _ = x.shape
    k, e_n = layer.cfg.top_k, layer.num_experts
    cap = layer.capacity(t)
    out = torch.zeros_like(x)
    dropped = torch.zeros(b, t, k, dtype=torch.bool)
    for s in range(b):
        probs = (x[s] @ layer.router.weight.T).softmax(-1)
        top_p, top_i = probs.topk(k, -1)
        gates = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
        used = [0] * e_n
        for j in range(k):  # first choices of every token, then second choices
            for tok in range(t):
                e = int(top_i[tok, j])
                if used[e] >= cap:
                    dropped[s, tok, j] = True
                    continue
                used[e] += 1
                out[s, tok] += gates[tok, j] * layer.experts[str(e)](x[s, tok : tok + 1])[0]
    return out, dropped


@pytest.mark.parametrize("top_k,capacity", [(1, 4.0), (2, 2.0), (1, 0.5), (2, 0.5)])
def test_output_and_drops_equal_a_token_by_token_loop(top_k: int, capacity: float) -> None:
    layer = _layer(top_k, capacity)
    x = torch.randn(3, 10, 8)
    with torch.no_grad():
        got = layer(x)
        want, dropped = _by_hand(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer.last_dropped, dropped)
    assert bool(dropped.any()) == (capacity < 1), dropped.sum()


def test_a_token_dropped_by_every_expert_passes_through_the_block_residual() -> None:
    layer = _layer(1, 0.1)  # capacity 1 per expert per sequence: most tokens are dropped
    x = torch.randn(1, 12, 8)
    with torch.no_grad():
        y = layer(x)
    gone = layer.last_dropped.all(-1)[0]
    assert int(gone.sum()) >= 12 - 4
    assert torch.equal(y[0, gone], torch.zeros_like(y[0, gone]))  # the block adds nothing: x + 0


def test_balance_and_z_losses_follow_their_formulas() -> None:
    layer = MoE(8, MoEConfig(experts=4, top_k=2, hidden=16, aux_coef=0.5, z_coef=0.25))
    x = torch.randn(2, 6, 8)
    layer.train()
    layer(x)
    want_balance = 0.0
    zs = []
    for s in range(2):  # (x and the router weight as plain tensors: no graph)
        logits = x[s] @ layer.router.weight.detach().T
        probs = logits.softmax(-1)
        f = torch.bincount(probs.argmax(-1), minlength=4).float() / 6
        want_balance += 4 * float((f * probs.mean(0)).sum()) / 2
        zs.append(torch.logsumexp(logits, -1).pow(2))
    want_z = float(torch.cat(zs).mean())
    assert layer.aux is not None
    assert math.isclose(float(layer.aux.detach()), 0.5 * want_balance + 0.25 * want_z, rel_tol=1e-5)
    w = window_metrics([layer])
    assert math.isclose(w["moe_balance_loss"], want_balance, rel_tol=1e-5)
    assert sum(w["moe_tokens_per_expert"][0]) == 2 * 6 * 2 and w["moe_dropped"] >= 0
    assert window_metrics([layer]) == {}  # taken


def test_gpt_loss_adds_the_aux_losses_and_the_test_loss_does_not() -> None:
    from worker.tasks.gpt import MarkovCorpus

    task = load_task("gpt", vocab=32, seq=8, dim=16, layers=2, heads=2, test_size=4, moe_experts=4, moe_every=2)
    assert [type(b.mlp).__name__ if b.mlp is not None else None for b in task.model.blocks] == [None, "MoE"]
    batch = next(task.batches(0, 1, 4, 0))
    test = MarkovCorpus(32, 8, 0).block(0, 4, stream=1)

    def ce(b: torch.Tensor) -> float:
        logits = task.model(b[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, 32), b[:, 1:].reshape(-1)))

    with torch.no_grad():
        loss = float(task.loss(task.model, batch))
        extra = aux_loss(task.model)
        assert isinstance(extra, torch.Tensor) and float(extra) > 0
        assert math.isclose(loss, ce(batch) + float(extra), rel_tol=1e-5)
        assert task.evaluate is not None
        assert math.isclose(task.evaluate(task.model)["test_loss"], ce(test), rel_tol=1e-6)


@pytest.mark.parametrize("kw,needle", [
    ({"experts": 0}, "experts must be >= 1"),
    ({"top_k": 3}, "top-k must be 1 or 2"),
    ({"experts": 1, "top_k": 2}, "top-k must be 1 or 2"),
    ({"capacity_factor": 0.0}, "capacity factor must be > 0"),
    ({"every": 0}, "every must be >= 1"),
    ({"aux_coef": -1.0}, "coefficients must be >= 0"),
])
def test_bad_settings_are_named(kw: dict, needle: str) -> None:
    with pytest.raises(PeerConfigError, match=needle):
        MoEConfig(**kw)
