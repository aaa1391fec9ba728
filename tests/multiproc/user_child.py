"""One rank of the user-model tests (started by test_user_models.py with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set, as torchrun would). ``user_child.py LAYOUT [LAYOUT ...]`` with LAYOUT =
``D,T,P``: for each layout it builds a ``ParallelMesh`` and trains both models of user_models.py
(split by ``parallelize(plan="auto")`` and, with P > 1, cut into stages by ``pipeline_layers``) in
fp64 with SGD and with AdamW and in fp32 with SGD, printing ``OK <layout> <model> <dtype> <opt>``
per passed check. A failed check raises (non-zero exit, the assertion on stderr).

Reference: one process (this one, outside the group) training a deep copy of the same source
model with ``torch.optim`` on the *global* batch: the global loss at every step and every parameter
after every step (gathered from the TP shards; with P > 1 those of this rank's stages) within 1e-10
relative (fp64) or 1e-5 (fp32, SGD). Also checked: the source model is unchanged by training its
split copy (weights are copied, not viewed), and at T > 1 that the automatic plan trains to the
very same parameters as the explicit plans in user_models.py.

The data-parallel and pipeline glue here is written out (mean of the gradients over the DP group;
the sum, over the pipeline group, of the gradient of a weight two stages share): the thing under
test is the split of the model, ``parallelize`` and ``pipeline_layers``.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.distributed as dist

import user_models  # type: ignore[import-not-found]
from worker.peer import shutdown_group
from worker.peer.mesh import ParallelMesh, init_mesh, torch_optimizer
from worker.peer.parallelize import parallelize
from worker.peer.pipeline import PipelineEngine
from worker.peer.split import pipeline_source, shared_parameters
from worker.peer.tensor_parallel import TPMultiheadAttention

STEPS, GLOBAL_BATCH, MICRO = 2, 8, 2
CONFIGS = [("float64", "sgd", 0.1, 1e-10), ("float64", "adamw", 1e-2, 1e-10), ("float32", "sgd", 0.1, 1e-5)]
MODELS = {"mha": (user_models.mha_task, user_models.MHA_PLAN), "gated": (user_models.gated_task, user_models.GATED_PLAN)}


def reference(task: Any, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = copy.deepcopy(task.model)
    opt = torch_optimizer(task.dense_optimizer)(model.parameters())
    data = task.batches(0, 1, GLOBAL_BATCH, 0)
    losses, params = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _mean_over(params: list[torch.nn.Parameter], group: Any, size: int) -> None:
    if size == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(size)


def train(task: Any, mesh: ParallelMesh, plan: Any, steps: int, sp: bool = False) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """[global loss per step], [{source name: whole tensor after the step}] (with P > 1: this rank's stages').
    ``sp``: sequence parallelism (the auto plan's blocks and final norm run on a chunk of the sequence)."""
    m = parallelize(task.model, mesh, plan, sequence_parallel=sp, verbose=False)
    per_rank = GLOBAL_BATCH // mesh.dp
    data = task.batches(mesh.dp_idx, mesh.dp, per_rank, 0)
    losses, params = [], []
    if mesh.pp == 1:
        mine = list(m.parameters())
        opt = torch_optimizer(task.dense_optimizer)(mine)
        step_fn = None
    else:
        first = next(task.batches(0, 1, per_rank // MICRO, 0))
        src = pipeline_source(task.loss, m, mesh.pp, first)
        eng = PipelineEngine(src.layers, pp_ranks=mesh.pp_ranks, kind="1f1b", micro_batches=MICRO, pp_group=mesh.pp_group,
                             dp_group=mesh.dp_group, dp_size=mesh.dp, loss_fn=src.loss_fn, costs=src.costs, reduce_grads=False)
        # a weight two stages share (the tied embedding and head): its gradient summed over the pipeline
        shared = shared_parameters(src.layers, eng.bounds)
        mine = eng.parameters()
        opt = torch_optimizer(task.dense_optimizer)(mine)

        def step_fn(batch: torch.Tensor) -> float:
            mbs = list(batch.chunk(MICRO))
            eng.zero_grad()
            loss = eng.step([src.inputs(b) for b in mbs], mbs, src.act_shape, src.act_dtype)
            for p in shared:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=mesh.pp_group)
            return loss

    names = {id(p): s.name for s, p in m.specs}
    own = {id(p) for p in mine}
    for _ in range(steps):
        batch = next(data)
        if step_fn is None:
            opt.zero_grad()
            loss = task.loss(m, batch)
            loss.backward()
            total = loss.detach().clone()
            if mesh.dp > 1:
                dist.all_reduce(total, group=mesh.dp_group)
            loss_v = float(total) / mesh.dp
        else:
            loss_v = step_fn(batch)
        for p in m.tp_sum_parameters():  # sequence parallelism: partial sums over the TP ranks (this rank's stages)
            if id(p) in own:
                dist.all_reduce(p.grad, group=mesh.tp_group)
        _mean_over(mine, mesh.dp_group, mesh.dp)
        opt.step()
        losses.append(loss_v)
        whole = m.full_parameters()
        params.append({s.name: t for (s, p), t in zip(m.specs, whole) if id(p) in own})
    assert set(names.values()) == {n for n, _ in task.model.named_parameters()}
    return losses, params


def close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g}"


def check(layout: str, mesh: ParallelMesh) -> None:
    for name, (make, explicit) in MODELS.items():
        for dtype, opt, lr, tol in CONFIGS:
            task = make(dtype=dtype, opt=opt, lr=lr)
            before = {n: p.detach().clone() for n, p in task.model.named_parameters()}
            ref_losses, ref_params = reference(task, STEPS)
            losses, params = train(task, mesh, "auto", STEPS)
            for step, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) <= tol * abs(b), f"{layout} {name} {dtype} {opt}: step {step} loss {a!r} vs one process {b!r}"
            for step, (got, want) in enumerate(zip(params, ref_params)):
                assert got, f"{layout} {name}: no parameters on this rank"
                for n, t in got.items():
                    close(t, want[n], tol, f"{layout} {name} {dtype} {opt}: step {step} parameter {n}")
            for n, p in task.model.named_parameters():
                assert torch.equal(p.detach(), before[n]), f"{layout} {name}: training the split copy changed source parameter {n}"
            print(f"OK {layout} {name} {dtype} {opt}", flush=True)
        if mesh.tp > 1:  # sequence parallelism: the same reference
            task = make(dtype="float64", opt="adamw", lr=1e-2)
            ref_losses, ref_params = reference(task, STEPS)
            losses, params = train(task, mesh, "auto", STEPS, sp=True)
            for step, (a, b) in enumerate(zip(losses, ref_losses)):
                assert abs(a - b) <= 1e-10 * abs(b), f"{layout} {name} SP: step {step} loss {a!r} vs one process {b!r}"
            for n, t in params[-1].items():
                close(t, ref_params[-1][n], 1e-10, f"{layout} {name} SP: parameter {n}")
            print(f"OK {layout} {name} sequence-parallel", flush=True)
        if mesh.tp > 1 and mesh.pp == 1:
            task = make(dtype="float64", opt="sgd", lr=0.1)
            _, auto = train(task, mesh, "auto", STEPS)
            _, hand = train(task, mesh, explicit, STEPS)
            for n, t in auto[-1].items():
                assert torch.equal(t, hand[-1][n]), f"{layout} {name}: auto plan and explicit plan differ at {n}"
            print(f"OK {layout} {name} auto-vs-explicit", flush=True)


class _Wrap(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def _grads(m: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (gathered over the TP group by the layout's specs)."""
    out = {}
    for s, p in m.specs:
        g = p.grad.detach()
        if s.dim is not None:
            parts = [torch.empty_like(g) for _ in range(m.tp)]
            dist.all_gather(parts, g.contiguous(), group=m.group)
            g = s.unshard(parts)
        out[s.name] = g
    return out


def check_attention_variants(layout: str, mesh: ParallelMesh) -> None:
    """TPMultiheadAttention against nn.MultiheadAttention where the user models do not go: a
    sequence-first nn.TransformerDecoderLayer (self- and cross-attention, a causal boolean mask, a key
    padding mask on the memory), and a batch-first attention with other key/value widths returning
    per-head and averaged weights under a per-head float mask: outputs, weights and every gradient
    (parameters and inputs) within 1e-10 in fp64."""
    torch.manual_seed(1)
    s, b, e = 6, 4, 16
    dec = _Wrap(torch.nn.TransformerDecoderLayer(e, 4, 32, dropout=0.0)).double()
    tgt, mem = torch.randn(s, b, e, dtype=torch.float64), torch.randn(s + 2, b, e, dtype=torch.float64)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    pad = torch.zeros(b, s + 2, dtype=torch.bool)
    pad[0, -2:] = True
    attn = _Wrap(torch.nn.MultiheadAttention(e, 4, kdim=8, vdim=12, batch_first=True)).double()
    q, k, v = (torch.randn(b, n, w, dtype=torch.float64) for n, w in ((s, e), (s + 1, 8), (s + 1, 12)))
    mask = torch.randn(b * 4, s, s + 1, dtype=torch.float64)
    cases = [
        ("decoder", dec, lambda m, x: m(x[0], x[1], tgt_mask=causal, memory_key_padding_mask=pad), [tgt, mem]),
        ("weights", attn, lambda m, x: torch.cat([m(*x, attn_mask=mask, average_attn_weights=False)[1].flatten(),
                                                  m(*x, attn_mask=mask)[0].flatten(), m(*x)[1].flatten()]), [q, k, v]),
    ]
    for name, model, call, inputs in cases:
        split = parallelize(model, mesh, "auto", verbose=False)
        assert any(isinstance(x, TPMultiheadAttention) for x in split.modules()), name
        outs = []
        for m in (model, split):
            xs = [x.clone().requires_grad_() for x in inputs]
            y = call(m, xs)
            (y * torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
            outs.append((y.detach(), [x.grad for x in xs]))
        close(outs[1][0], outs[0][0], 1e-10, f"{layout} {name}: output")
        for a, bb in zip(outs[1][1], outs[0][1]):
            close(a, bb, 1e-10, f"{layout} {name}: input gradient")
        want = {n: p.grad for n, p in model.named_parameters()}
        for n, g in _grads(split).items():
            close(g, want[n], 1e-10, f"{layout} {name}: gradient of {n}")
        print(f"OK {layout} attention-{name}", flush=True)


def main(layouts: list[str]) -> None:
    base = init_mesh("gloo", "cpu", 120.0)
    torch.set_num_threads(1)
    try:
        for layout in layouts:
            d, t, p = (int(x) for x in layout.split(","))
            mesh = ParallelMesh.build(d, t, p, seed=0)
            if t > 1 and p == 1:
                check_attention_variants(layout, mesh)
            check(layout, mesh)
    finally:
        shutdown_group(barrier=False)
    del base


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if "," in a])  # the launcher's leading "D T P" are not layouts
