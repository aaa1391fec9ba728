"""The plan style ``experts`` of worker.peer.parallelize (an MoE layer split by its experts' hidden
size), without a process group: the automatic plan gives it every MoE layer of the gpt task and
leaves the layer's insides (router, experts' fc/out) alone; an explicit plan may name it only on an
MoE layer; a hidden size TP does not divide is refused naming the layer. The numerics (MoE models
split by the auto plan against one process) are tests/multiproc/test_moe.py."""
from __future__ import annotations

import pytest

from worker.peer.mesh import PeerConfigError
from worker.peer.parallelize import auto_plan, resolve_plan
from worker.tasks import load_task


def _moe_gpt(**kw: int) -> object:
    return load_task("gpt", dim=16, seq=16, vocab=32, layers=2, heads=2, moe_experts=4, moe_every=2, **kw).model


def test_auto_plan_splits_every_moe_layer_as_experts_and_nothing_inside_it() -> None:
    plan, notes = auto_plan(_moe_gpt(), 2)  # type: ignore[arg-type]
    assert plan["blocks.1.mlp"] == "experts", plan
    assert not [n for n in plan if n.startswith("blocks.1.mlp.")], plan  # not the experts' fc/out as an MLP, nor the router
    assert (plan["blocks.0.fc"], plan["blocks.0.out"]) == ("colwise", "rowwise")  # block 0's dense MLP as before
    assert not [n for n in notes if "mlp" in n], notes


def test_experts_style_only_on_an_moe_layer_and_hidden_divisible() -> None:
    with pytest.raises(PeerConfigError, match=r"blocks\.0\.qkv: Linear cannot be experts"):
        resolve_plan(_moe_gpt(), {"blocks.0.qkv": "experts"}, 2)  # type: ignore[arg-type]
    with pytest.raises(PeerConfigError, match=r"blocks\.1\.mlp: MoE cannot be colwise"):
        resolve_plan(_moe_gpt(), {"blocks.1.mlp": "colwise"}, 2)  # type: ignore[arg-type]
    # experts' hidden 4 x 16 = 64, not divisible by 3
    with pytest.raises(PeerConfigError, match=r"blocks\.1\.mlp: the experts' hidden size 64 is not divisible by tp 3"):
        resolve_plan(_moe_gpt(), {"blocks.1.mlp": "experts"}, 3)  # type: ignore[arg-type]
    plan, _ = resolve_plan(_moe_gpt(), {"blocks.*.mlp": "experts"}, 2)  # type: ignore[arg-type]
    assert plan == {"blocks.1.mlp": "experts"}
