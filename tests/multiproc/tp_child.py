"""One rank of the tensor/sequence-parallel tests (started by test_tensor_parallel.py with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would). ``tp_child.py D T P check ...``: builds one
``ParallelMesh`` (D, T, P) and runs the checks in it, printing ``OK <check> <detail>`` per passed
check; a failed check raises (non-zero exit, the assertion on stderr).

Reference for the training checks: one process (this one, outside the group) training a deep copy
of the same plain ``GPT`` with ``torch.optim`` on the *global* batch, compared after every step
(global loss, and every parameter gathered back from the TP shards in the plain model's order).
"""
from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ps import OptimizerSpec
from worker.peer import DataParallelSync, SyncPlan, make_sync, shutdown_group
from worker.peer.mesh import ParallelMesh, PeerConfigError, RNGStreams, init_mesh
from worker.peer.pipeline import (
    PipelineEngine,
    stage_sync,
    tp_gpt_layers,
    tp_gpt_loss,
)
from worker.peer.tensor_parallel import (
    TensorParallelGPT,
    activation_bytes,
    tensor_parallel_task,
    vocab_parallel_cross_entropy,
)
from worker.sync_api import Grads
from worker.tasks import Task, load_task
from worker.trainer import TrainConfig, Trainer

STEPS = 3
GPT = {"vocab": 32, "seq": 8, "dim": 16, "layers": 2, "heads": 4, "test_size": 4}
GPT_SELECTIVE = {**GPT, "seq": 16}  # sequence 4 x the head dimension: the attention scores are most of the activations


def cross_entropy(m: Any, batch: torch.Tensor) -> torch.Tensor:
    """The gpt task's loss in the model's own precision (the task's computes it in fp32)."""
    logits = m(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def reference(task: Task, opt: Any, global_batch: int, steps: int) -> list[tuple[float, torch.Tensor]]:
    """[(global loss, flat params after the step)] of one process with the global batch."""
    model = copy.deepcopy(task.model)
    o = opt(model.parameters())
    data = task.batches(0, 1, global_batch, 0)
    out = []
    for _ in range(steps):
        o.zero_grad()
        loss = cross_entropy(model, next(data))
        loss.backward()
        o.step()
        out.append((float(loss.detach()), torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


def run(task: Task, sync: Any, mesh: ParallelMesh, index: int, workers: int, batch: int, steps: int, accumulate: int = 1):
    """[(global loss, all parameters in plain order after the step)] of the trainer's run."""
    seen: list[tuple[float, torch.Tensor]] = []

    def on_step(step: int, tr: Trainer) -> None:
        loss = torch.tensor([tr.last_loss], dtype=torch.float64)
        dist.all_reduce(loss)  # every TP rank of a replica has its replica's loss: mean over the world
        seen.append((float(loss) / mesh.world, tr.flat))

    cfg = TrainConfig(mode="dp", steps=steps, batch_size=batch, worker_index=index, num_workers=workers, progress=False,
                      evaluate=False, accumulate=accumulate, name=f"rank{mesh.rank}")
    Trainer(task, sync, cfg, on_step=on_step).run()
    return seen


def train(task: Task, mesh: ParallelMesh, sp: bool, global_batch: int, steps: int, accumulate: int = 1, checkpoint=None,
          zero: int = 0):
    tt = tensor_parallel_task(task, mesh, sequence_parallel=sp)
    sync: Any = make_sync(SyncPlan(f"zero{zero}" if zero else "dp", tt.dense_optimizer, sequence_parallel=sp), tt.model, mesh)
    if checkpoint:
        sync.set_checkpointing(*checkpoint)
    return run(tt, sync, mesh, mesh.dp_idx, mesh.dp, global_batch // mesh.dp, steps, accumulate), sync


def compare(name: str, got, want, rtol: float, atol: float) -> None:
    assert len(got) == len(want), (name, len(got), len(want))
    for t, ((gl, gp), (wl, wp)) in enumerate(zip(got, want)):
        torch.testing.assert_close(gp, wp.to(gp.dtype), rtol=rtol, atol=atol, msg=f"{name} step {t}: parameters differ from the reference")
        assert abs(gl - wl) <= atol + rtol * abs(wl), f"{name} step {t} loss {gl} != reference {wl}"
    assert not torch.equal(want[-1][1], want[0][1]), f"{name}: parameters never moved"


def main(dp: int, tp: int, pp: int, checks: list[str]) -> None:
    torch.set_num_threads(1)
    init_mesh("gloo", "cpu", timeout_s=180)  # the shared test machine can stall a rank for long
    mesh = ParallelMesh.build(dp, tp, pp, seed=0)
    for check in checks:
        if check == "mesh":  # coordinates, group membership (by a gather in each group), RNG streams
            d, t, p = ParallelMesh.coords(mesh.rank, dp, tp, pp)
            assert mesh.rank == p * dp * tp + d * tp + t and (d, t, p) == (mesh.dp_idx, mesh.tp_idx, mesh.pp_idx)
            for name in ("tp", "dp", "pp"):
                ranks = getattr(mesh, f"{name}_ranks")
                got = [torch.zeros(1) for _ in ranks]
                dist.all_gather(got, torch.tensor([float(mesh.rank)]), group=getattr(mesh, f"{name}_group"))
                assert [int(x) for x in got] == ranks, (name, got, ranks)
            assert mesh.rng is not None
            with mesh.rng.fork("tp"):
                a = torch.rand(4)
            b = torch.rand(4)  # the default (replicated) stream
            draws = [torch.zeros(8) for _ in range(tp)]
            dist.all_gather(draws, torch.cat([a, b]), group=mesh.tp_group)
            for r in range(1, tp):
                assert torch.equal(draws[r][4:], draws[0][4:]), "replicated stream differs across TP ranks"
                assert not torch.equal(draws[r][:4], draws[0][:4]), "tp stream agrees across TP ranks"
            # every rank reaches the same one-message verdict on a layout that does not fit
            try:
                ParallelMesh.build(dp, tp, pp, check={"heads": tp * 2 + 1, "layers": pp * 3 + 1, "global_batch": dp * 4 + 1})
            except PeerConfigError as e:
                msg = str(e)
                assert "heads" in msg and ("layers" in msg or pp == 1) and ("global batch" in msg or dp == 1), msg
            else:
                raise AssertionError("a misfit layout was accepted")
            print(f"OK mesh {mesh}", flush=True)
        elif check == "vocab-ce":  # the loss and its gradient from split logits == F.cross_entropy on full ones
            torch.manual_seed(1)
            full = torch.randn(10, 8 * tp, dtype=torch.float64, requires_grad=True)
            target = torch.randint(0, 8 * tp, (10,))
            ref = F.cross_entropy(full, target, reduction="none")
            ref.sum().backward()
            assert full.grad is not None
            n = 8
            local = full.detach()[:, mesh.tp_idx * n : (mesh.tp_idx + 1) * n].clone().requires_grad_(True)
            ce = vocab_parallel_cross_entropy(local, target, mesh.tp_idx * n, mesh.tp_group)
            ce.sum().backward()
            torch.testing.assert_close(ce, ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(local.grad, full.grad[:, mesh.tp_idx * n : (mesh.tp_idx + 1) * n], rtol=1e-12, atol=1e-12)
            print("OK vocab-ce", flush=True)
        elif check in ("tp", "tp-sp", "tp64", "tp-accum"):
            # fp32 SGD (Adam would amplify rounding noise in the key bias, whose exact gradient is 0)
            sp = check == "tp-sp"
            dtype = "float64" if check == "tp64" else "float32"
            lr = 1.0 if check == "tp64" else 0.5
            task = load_task("gpt", dtype=dtype, **GPT)
            task.dense_optimizer = OptimizerSpec("sgd", {"lr": lr})
            gb = 4 * dp
            want = reference(task, lambda p, lr=lr: torch.optim.SGD(p, lr=lr), gb, STEPS)
            got, sync = train(task, mesh, sp, gb, STEPS, accumulate=2 if check == "tp-accum" else 1)
            tol = (1e-12, 1e-12) if check == "tp64" else (1e-5, 1e-6)
            compare(check, got, want, *tol)
            print(f"OK {check} {sync.stats()}", flush=True)
        elif check in ("tp-zero1", "tp-zero2", "tp-zero3"):
            # ZeRO-k over the DP group with TP and SP (momentum SGD: per-element optimizer state;
            # 2 micro-batches: gradients reduce-scattered once, after the last)
            stage = int(check[-1])
            task = load_task("gpt", **GPT)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": 0.3, "momentum": 0.9})
            gb = 4 * dp
            want = reference(task, lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9), gb, STEPS)
            got, sync = train(task, mesh, True, gb, STEPS, zero=stage, accumulate=2)
            compare(check, got, want, 1e-5, 1e-6)
            mem = sync.memory()
            n, shard = sum(p.numel() for p in sync.opt.params), sync.opt.shard.numel()
            # one momentum buffer over this rank's shard: 1/D of its TP shards (each unit padded to D)
            assert mem["state_bytes"] == shard * 4 and shard * dp - n < dp * len(sync.opt.units), (mem, n, shard)
            print(f"OK {check} {mem}", flush=True)
        elif check == "sp-activations":
            # bytes autograd keeps for backward per rank, in the transformer layers (as Megatron counts
            # them), with and without SP. Megatron's formula per layer (no attention-score term):
            # sbh(10 + 24/t) without SP, sbh(34/t) with it: 17/22 = 0.77 at t=2. Under SP no saved tensor
            # outside the TP regions is a full-sequence (S, B, dim) one.
            task = load_task("gpt", vocab=64, seq=32, dim=64, layers=2, heads=4, test_size=4)
            batch = next(task.batches(0, 1, 4, 0))
            out = {}
            for sp in (False, True):
                m = TensorParallelGPT(task.model, mesh.tp_group, sp, mesh.rng)
                x = m.tok(batch[:, :-1].t()).detach().requires_grad_(True)
                with activation_bytes(m) as ab:
                    y = x
                    for blk in m.blocks:
                        y = blk(y)
                y.sum().backward()
                out[sp] = ab["bytes"]
                whole = [s for s in ab["shapes"] if s == (32, 4, 64)]
                assert bool(whole) != sp, (sp, ab["shapes"])
            ratio = out[True] / out[False]
            assert ratio <= 0.85, out
            print(f"OK sp-activations ratio={ratio:.3f} plain={out[False]} sp={out[True]}", flush=True)
        elif check.startswith(("ckpt-save:", "ckpt-load:")):
            # save: train 4 steps (momentum SGD: optimizer state that matters), checkpoint after 3; load:
            # resume from it in this layout (tp) or in plain DP over the whole world (dp), train step 3
            # only. Both print step 3's global loss and the parameters after it (plain order).
            kind, directory, mode = check.split(":")
            task = load_task("gpt", **GPT)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": 0.3, "momentum": 0.9})
            gb = 8
            if mode.startswith("tp"):
                got, sync = train(task, mesh, False, gb, 4, checkpoint=(directory, 3), zero=int(mode[-1]) if mode != "tp" else 0)
            else:
                dsync = DataParallelSync(task.model, task.dense_optimizer, stage=int(mode[-1]) if mode != "dp" else 0)
                dsync.set_checkpointing(directory, 3)
                got, sync = run(task, dsync, mesh, mesh.rank, mesh.world, gb // mesh.world, 4), dsync
            if kind == "ckpt-load":
                assert sync.resumed_from and sync.resumed_from.endswith("step-3"), sync.resumed_from
                assert len(got) == 1, len(got)
            loss, params = got[-1]
            print(f"CKPT {kind} {mode} " + json.dumps({"loss": loss, "params": params.tolist()}), flush=True)
            print(f"OK {check}", flush=True)
        elif check in ("selective", "selective-sp"):
            # selective recompute (the attention core again in backward) == no recompute, with attention
            # and residual dropout (masks from the tp stream: the recomputation must draw the same ones),
            # Adam, parameters after every step; and it keeps fewer activation bytes
            sp = check == "selective-sp"
            got, kept = {}, {}
            for rec in ("none", "selective"):
                task = load_task("gpt", **GPT_SELECTIVE)
                tt = tensor_parallel_task(task, mesh, sp, dropout=0.1, attention_dropout=0.1, recompute=rec,
                                          rng=RNGStreams(0, mesh.tp_idx, mesh.pp_idx))
                got[rec] = run(tt, make_sync(SyncPlan("dp", tt.dense_optimizer, sequence_parallel=sp), tt.model, mesh), mesh,
                               mesh.dp_idx, mesh.dp, 4, STEPS)
                batch = next(task.batches(0, 1, 4, 0))
                x = tt.model.tok(batch[:, :-1].t()).detach().requires_grad_(True)
                with activation_bytes(tt.model) as ab:
                    y = x
                    for blk in tt.model.blocks:
                        y = blk(y)
                y.sum().backward()
                kept[rec] = ab["bytes"]
            compare(check, got["selective"], got["none"], 1e-5, 1e-6)
            assert kept["selective"] < 0.8 * kept["none"], kept
            print(f"OK {check} bytes {kept}", flush=True)
        elif check in ("selective-ref", "selective-ref-sp"):  # no dropout: selective TP (and SP) == one process (SGD)
            sp = check == "selective-ref-sp"
            task = load_task("gpt", **GPT)
            task.dense_optimizer = OptimizerSpec("sgd", {"lr": 0.5})
            want = reference(task, lambda p: torch.optim.SGD(p, lr=0.5), 4 * dp, STEPS)
            tt = tensor_parallel_task(task, mesh, sp, recompute="selective")
            got_sel = run(tt, make_sync(SyncPlan("dp", tt.dense_optimizer, sequence_parallel=sp), tt.model, mesh), mesh,
                          mesh.dp_idx, mesh.dp, 4, STEPS)
            compare(check, got_sel, want, 1e-5, 1e-6)
            print(f"OK {check}", flush=True)
        elif check == "full-dropout":
            # full (per-layer) recompute in the pipeline's stages with TP dropout (attention and residual,
            # sequence parallel): the recomputation replays the mesh's streams, so it equals no recompute
            got_full = {}
            for rec in (False, True):
                task = load_task("gpt", **GPT_SELECTIVE)
                rng = RNGStreams(0, mesh.tp_idx, mesh.pp_idx)
                model = TensorParallelGPT(task.model, mesh.tp_group, True, rng, dropout=0.1, attention_dropout=0.1)
                eng = PipelineEngine(tp_gpt_layers(model), pp_ranks=[mesh.rank], kind="1f1b", micro_batches=2, recompute=rec,
                                     loss_fn=tp_gpt_loss(model), rng=rng)
                opt = stage_sync(model, eng, task.dense_optimizer, dp_group=mesh.dp_group, tp_group=mesh.tp_group,
                                 sequence_parallel=True)
                opt.join()
                data, seen = task.batches(0, 1, 4, 0), []
                for _ in range(STEPS):
                    mbs = list(next(data).chunk(2))
                    opt.zero_grad()
                    eng.step([b[:, :-1] for b in mbs], [b[:, 1:] for b in mbs], (GPT_SELECTIVE["seq"] // tp, 2, GPT_SELECTIVE["dim"]))
                    opt.push(0, Grads(None))
                    seen.append((0.0, torch.cat([p.reshape(-1) for p in model.full_parameters()])))
                got_full[rec] = seen
            compare(check, got_full[True], got_full[False], 1e-5, 1e-6)
            print(f"OK {check}", flush=True)
        elif check == "dropout":  # replicated dropout masks agree across TP ranks (the replicas stay equal)
            task = load_task("gpt", **GPT)
            batch = next(task.batches(0, 1, 2, 0))
            m = TensorParallelGPT(task.model, mesh.tp_group, False, mesh.rng, dropout=0.5)
            h = m.hidden(batch[:, :-1]).detach()
            hs = [torch.empty_like(h) for _ in range(tp)]
            dist.all_gather(hs, h, group=mesh.tp_group)
            assert all(torch.equal(x, hs[0]) for x in hs), "replicated activations diverged across TP ranks"
            m.eval()
            assert not torch.equal(m.hidden(batch[:, :-1]).detach(), h), "dropout did nothing"
            print("OK dropout", flush=True)
        else:
            raise SystemExit(f"unknown check {check!r}")
    shutdown_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
