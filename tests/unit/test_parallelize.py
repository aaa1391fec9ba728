"""The plan side of worker.peer.parallelize and the cut side of worker.peer.split, without a process
group: plans resolved and checked for a TP size, the automatic plan's choices, bad input refused with
a message naming the module or split point, and shards that are copies (never views) of the source.
The numerics (split models against one process) are tests/multiproc/test_user_models.py."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "multiproc"))
import user_models  # type: ignore[import-not-found]  # noqa: E402

from worker.peer.mesh import PeerConfigError  # noqa: E402
from worker.peer.parallelize import auto_plan, resolve_plan  # noqa: E402
from worker.peer.split import pipeline_io, pipeline_layers, split_points  # noqa: E402
from worker.peer.tensor_parallel import ShardSpec  # noqa: E402


def test_auto_plan_finds_attention_mlps_embedding_and_heads() -> None:
    plan, notes = auto_plan(user_models.mha_task().model, 2)
    assert plan == {"layers.0.attn": "colwise", "layers.0.fc1": "colwise", "layers.0.fc2": "rowwise",
                    "layers.1.self_attn": "colwise", "layers.1.linear1": "colwise", "layers.1.linear2": "rowwise",
                    "tok": "vocab", "head": "vocab"}
    assert notes == ["position: replicated (MHATagger's own parameters: not a recognised block)"]
    plan, notes = auto_plan(user_models.gated_task().model, 2)
    for b in (0, 1):
        assert [plan[f"blocks.{b}.attn.{x}"] for x in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert [plan[f"blocks.{b}.mlp.{x}"] for x in ("up", "gate", "down")] == ["colwise", "colwise", "rowwise"]
    assert plan["tok"] == plan["lm_head"] == "vocab"  # tied: one parameter, the same rows on both
    assert notes == ["pos: replicated (a position embedding)"]


def test_auto_plan_equals_the_explicit_plans_and_replicates_what_does_not_divide() -> None:
    for make, explicit in ((user_models.mha_task, user_models.MHA_PLAN), (user_models.gated_task, user_models.GATED_PLAN)):
        model = make().model
        assert resolve_plan(model, "auto", 2)[0] == resolve_plan(model, explicit, 2)[0]
    model = user_models.gated_task(heads=3, dim=18).model
    plan, notes = auto_plan(model, 2)
    assert "blocks.0.attn.q" not in plan and any("blocks.0.attn.n_heads = 3 not divisible by tp 2" in n for n in notes)


def test_sequence_parallel_auto_plan_marks_blocks_and_final_norm() -> None:
    plan, _ = auto_plan(user_models.gated_task().model, 2, sequence_parallel=True)
    assert plan["blocks.0"] == plan["blocks.1"] == plan["norm"] == "sequence"


@pytest.mark.parametrize("plan, message", [
    ({"blocks.*.attn.nope": "colwise"}, "'blocks.*.attn.nope' names no module of the model"),
    ({"blocks.0.attn.q": "diagonal"}, "unknown style 'diagonal'"),
    ({"blocks.0.attn_norm": "colwise"}, "blocks.0.attn_norm: RMSNorm cannot be colwise"),
    ({"blocks.0.attn.q": "colwise"}, "blocks.0.attn.n_heads = 3 heads not divisible by tp 2"),
])
def test_bad_plans_are_refused_naming_the_module(plan: dict[str, str], message: str) -> None:
    model = user_models.gated_task(heads=3, dim=18).model
    with pytest.raises(PeerConfigError, match=message.replace("*", r"\*").replace(".", r"\.")):
        resolve_plan(model, plan, 2)


def test_plan_file(tmp_path) -> None:
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(user_models.GATED_PLAN))
    model = user_models.gated_task().model
    assert resolve_plan(model, str(f), 2)[0] == resolve_plan(model, user_models.GATED_PLAN, 2)[0]
    f.write_text("[1, 2")
    with pytest.raises(PeerConfigError, match="not JSON"):
        resolve_plan(model, str(f), 2)


def test_shards_are_copies_not_views() -> None:
    full = torch.arange(12.0).reshape(4, 3)
    for spec in (ShardSpec("w", (4, 3), None, 0), ShardSpec("w", (4, 3), None, None), ShardSpec("w", (4, 3), None, 1),
                 ShardSpec("w", (4, 3), (2, 2, 3), 1)):
        shard = spec.shard(full, 0, 2 if spec.dim is not None else 1)
        shard.add_(100.0)
        assert torch.equal(full, torch.arange(12.0).reshape(4, 3)), spec


def test_pipeline_cuts_compose_to_the_model_and_bad_split_points_are_refused() -> None:
    task = user_models.gated_task(dtype="float64")
    model = task.model
    assert split_points(model) == ["tok", "pos", "blocks.0", "blocks.1", "norm", "lm_head"]
    batch = next(task.batches(0, 1, 2, 0))
    inputs, loss_fn = pipeline_io(task.loss)
    for split in (None, ["blocks.1"], ["blocks.0", "norm"]):
        x = inputs(batch)
        for piece in pipeline_layers(model, split):
            x = piece(x)
        assert torch.equal(x, model(batch[:, :-1]))
        assert torch.equal(loss_fn(x, batch), task.loss(model, batch))
    with pytest.raises(PeerConfigError, match="'blocks.7': not a module the model's forward calls"):
        pipeline_layers(model, ["blocks.7"])
    with pytest.raises(PeerConfigError, match="split point 'pos': 2 values cross it"):
        pipeline_layers(model, ["pos"])
    with pytest.raises(PeerConfigError, match="distinct and in the model's order"):
        pipeline_layers(model, ["norm", "blocks.0"])
