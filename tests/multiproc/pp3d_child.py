"""One rank of the 3D (D x T x P) pipeline tests (started by test_pipeline_3d.py with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would): ``pp3d_child.py D T P check...``. Builds one
``ParallelMesh`` (rank = pp*(D*T) + dp*T + tp), runs the named checks in it and prints
``OK <check> <detail>`` per passed check; a failed check raises (non-zero exit).

Reference for every check: this process (outside the group) training a deep copy of the same initial
plain gpt model with ``torch.optim.SGD`` (lr 0.5, momentum 0.9) on the *global* batch; compared at
every step (the loss) and after the last step (this rank's parameters, gathered whole over the TP
group, by their plain names). fp32: rtol 1e-5. Pipeline stages are tensor-parallel blocks when T > 1
(worker.peer.pipeline.tp_gpt_layers), and the optimizer is worker.peer.pipeline.StageOptimizer.

Checks: ``<schedule>[-v<V>][-recompute][-zero1][-bf16][-sp]``. ``-sp``: sequence-parallel stages
(T > 1; activations between stages are (S/T, B, H) chunks), against the same reference. ``-zeroK``: ZeRO stage K over the DP group, and
the momentum state per rank is ceil(n/D) elements. ``-bf16``: autocast bf16 compute; the master
weights and their gradients stay fp32, and the loss and parameters are close to the fp32 reference
(loss rtol 2e-3, parameters rtol/atol 1e-2: bf16 keeps 8 significant bits, a relative rounding of
2^-9 of each matmul input, accumulated over matmuls of 16-64 terms and three steps of lr 0.5;
measured: loss 6e-5, parameters 1.6e-3) but not equal to it.
``-fp64``: float64 model and activations, SGD lr=1 without momentum on both sides, rtol 1e-12.
``same``: the fp32 checks run so far ended with bit-identical parameters.
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch

from worker.peer import init_mesh
from worker.peer.mesh import ParallelMesh, shutdown_group
from worker.peer.pipeline import (
    PipelineEngine,
    gpt_layers,
    gpt_loss,
    stage_sync,
    tp_gpt_layers,
    tp_gpt_loss,
)
from worker.peer.tensor_parallel import TensorParallelGPT
from worker.sync_api import Grads
from worker.tasks import load_task

M, STEPS, G = 4, 3, 8  # micro-batches, steps, global batch
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 4, "heads": 2, "lr": 3e-3}
SEQ, DIM = 8, 16


def make_opt(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def make_opt64(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=1.0)


def run(check: str, mesh: ParallelMesh) -> torch.Tensor:
    parts = check.split("-")
    kind, V = parts[0], 1
    for part in parts[1:]:
        if part.startswith("v"):
            V = int(part[1:])
    zero = next((int(p[4:]) for p in parts if p.startswith("zero")), 0)  # ZeRO stage on the DP dimension
    recompute, bf16, sp = "recompute" in parts, "bf16" in parts, "sp" in parts
    D, T = mesh.dp, mesh.tp
    fp64 = "fp64" in parts
    task = load_task("gpt", seed=0, dtype="float64" if fp64 else "float32", **OPTS)
    make = make_opt64 if fp64 else make_opt
    ref = copy.deepcopy(task.model)
    ref_opt = make(ref.parameters())
    plain = task.model
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in gpt_layers(plain)]
    model: Any = plain
    layers = gpt_layers(plain)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gpt_loss
    if T > 1:
        model = TensorParallelGPT(plain, mesh.tp_group, sp, mesh.rng)
        layers, loss_fn = tp_gpt_layers(model), tp_gpt_loss(model)
    eng = PipelineEngine(layers, pp_ranks=mesh.pp_ranks, kind=kind, micro_batches=M, virtual=V, pp_group=mesh.pp_group,
                         dp_group=mesh.dp_group, dp_size=D, recompute=recompute, loss_fn=loss_fn, costs=costs,
                         reduce_grads=False, precision="bf16" if bf16 else "fp32")
    opt = stage_sync(model, eng, make, stage=zero, dp_group=mesh.dp_group, tp_group=mesh.tp_group if T > 1 else None,
                     sequence_parallel=sp)
    opt.join()
    named = opt.specs  # (ShardSpec, parameter) of this rank's stages
    per_rank = G // D
    local, glob = task.batches(mesh.dp_idx, D, per_rank, 0), task.batches(0, 1, G, 0)
    act = (SEQ // T if sp else SEQ, per_rank // M, DIM) if T > 1 else (per_rank // M, SEQ, DIM)
    rtol, ltol = (1e-2, 2e-3) if bf16 else (1e-12, 1e-12) if fp64 else (1e-5, 1e-5)
    with opt.whole():
        before = {s.name: opt._tp_gather(s, p) for s, p in named}
    loss_err = 0.0
    for step in range(STEPS):
        gb = next(glob)
        ref_opt.zero_grad()
        logits = ref(gb[:, :-1])  # the gpt task's loss, in the model's dtype (the task's own casts to fp32)
        ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), gb[:, 1:].reshape(-1))
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        ref_opt.step()
        b = next(local)
        mbs = list(b.chunk(M))
        opt.zero_grad()
        loss = eng.step([x[:, :-1] for x in mbs], [x[:, 1:] for x in mbs], act,
                        act_dtype=torch.float64 if fp64 else torch.float32)
        if bf16:
            assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in eng.parameters()), "bf16: gradients not fp32"
        opt.push(step, Grads(None))
        loss_err = max(loss_err, abs(loss - float(ref_loss)) / abs(float(ref_loss)))
        assert loss_err <= ltol, f"{check} step {step}: loss {loss} vs reference {float(ref_loss)}"
    refp = dict(ref.named_parameters())
    worst = 0.0
    with opt.whole():
        after = {s.name: opt._tp_gather(s, p) for s, p in named}
    for s, p in named:
        full = after[s.name]

        def msg(m: str, n: str = s.name) -> str:
            return f"{check}: {n}: {m}"

        torch.testing.assert_close(full, refp[s.name].detach(), rtol=rtol, atol=rtol if bf16 else rtol * 0.1,
                                   msg=msg)
        assert not torch.equal(full, before[s.name]), f"{check}: {s.name} did not change"
        worst = max(worst, float((full - refp[s.name].detach()).abs().max()))
    detail = ""
    if bf16:
        assert all(p.dtype == torch.float32 for p in eng.parameters()), "bf16: master weights are not fp32"
        assert loss_err > 1e-6, f"bf16: the loss equals the fp32 reference ({loss_err:.2e}): is the compute bf16?"
        detail = f" loss_rel_err {loss_err:.2e}"
    if zero and not fp64:  # (plain SGD, the fp64 check's, keeps no state)
        n = sum(p.numel() for p in eng.parameters())
        held = sum(v.numel() for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
        units = len(opt.opt.units)  # each unit (a module's parameters) is padded to a multiple of D
        assert held == opt.opt.shard.numel() and held * D - n < D * units, f"{check}: ZeRO-{zero} holds {held} state elements of {n} at D={D}"
        detail += f" state {held}/{n}"
    print(f"OK {check} stages {eng.bounds} params {len(named)} max_abs_err {worst:.2e} loss {loss:.6f}{detail}", flush=True)
    # the whole model on every rank (each stage's owner contributes its tensors once), to compare schedules
    mine = after
    full = torch.cat([mine.get(n, torch.zeros_like(q)).reshape(-1) for n, q in plain.named_parameters()])
    if mesh.pp > 1:
        torch.distributed.all_reduce(full, group=mesh.pp_group)
    return full


def main() -> None:
    D, T, P = (int(a) for a in sys.argv[1:4])
    init_mesh("gloo", "cpu", timeout_s=120)
    torch.set_num_threads(1)
    mesh = ParallelMesh.build(D, T, P, seed=0)
    finals: dict[str, torch.Tensor] = {}
    for check in sys.argv[4:]:
        if check == "same":
            items = [(k, v) for k, v in finals.items() if "bf16" not in k and "fp64" not in k]
            k0, v0 = items[0]
            for k, v in items[1:]:
                assert torch.equal(v0, v), f"{k} and {k0} differ: max {float((v - v0).abs().max()):.3e}"
            print(f"OK same {[k for k, _ in items]}", flush=True)
            continue
        finals[check] = run(check, mesh)
    shutdown_group()


if __name__ == "__main__":
    main()
