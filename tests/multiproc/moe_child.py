"""One rank of the MoE / expert-parallelism tests (started by test_moe.py with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set, as torchrun would). Runs the checks named on the command line in one
process group and prints ``OK <check> <detail>`` per passed check; a failed check raises.

Reference for the equivalence checks: one process (this one, outside the group) training a deep
copy of the same initial MoE ``gpt`` (all experts, before sharding) with ``torch.optim.SGD`` on
the *global* batch (the ranks' batches concatenated), compared after every step: the global loss
(cross-entropy + balance + z-losses), every parameter (experts gathered), and which token
assignments the capacity dropped. The EP x TP checks (``eptp-*``) compare the same way, the
parameters gathered over TP and EP back into the plain model's order.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from ps import OptimizerSpec
from worker.peer import init_mesh, shutdown_group
from worker.peer.mesh import ParallelMesh
from worker.peer.moe import MoESync, moe_layers
from worker.peer.tensor_parallel import tensor_parallel_task
from worker.tasks import Task, load_task
from worker.trainer import TrainConfig, Trainer

B, STEPS, LR = 2, 3, 0.5  # per-rank sequences, steps, SGD learning rate
GPT = {"vocab": 32, "seq": 8, "dim": 16, "layers": 2, "heads": 2, "test_size": 4, "moe_experts": 4}


def make(top_k: int = 2, capacity: float = 2.0, **kw: Any) -> Task:
    task = load_task("gpt", **GPT, moe_top_k=top_k, moe_capacity=capacity, **kw)
    task.dense_optimizer = OptimizerSpec("sgd", {"lr": LR})
    return task


def reference(task: Task, world: int, steps: int) -> list[tuple[float, torch.Tensor, list[torch.Tensor]]]:
    """[(loss, flat params after the step, each MoE layer's dropped mask)] of one process, global batch."""
    model = copy.deepcopy(task.model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = task.batches(0, 1, world * B, 0)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt.step()
        drops = [m.last_dropped.clone() for _, m in moe_layers(model)]
        out.append((float(loss.detach()), torch.cat([p.detach().reshape(-1) for p in model.parameters()]), drops))
    return out


def train(task: Task, ep: int, world: int, rank: int, steps: int, ckpt: tuple[str, int] | None = None, mode: str = "dp"):
    """The same list from this rank's peer run with ``MoESync(ep, mode)`` (drops: this rank's sequences)."""
    sync = MoESync(task.model, task.dense_optimizer, ep=ep, stage=0 if mode == "dp" else int(mode[-1]))
    if ckpt:
        sync.set_checkpointing(*ckpt)
    seen: list[tuple[float, torch.Tensor, list[torch.Tensor]]] = []

    def on_step(step: int, tr: Trainer) -> None:
        loss = torch.tensor([tr.last_loss], dtype=torch.float64)
        dist.all_reduce(loss)
        drops = [m.last_dropped.clone() for _, m in sync.layers]
        seen.append((float(loss) / world, tr.flat, drops))

    cfg = TrainConfig(mode="dp", steps=steps, batch_size=B, worker_index=rank, num_workers=world, progress=False,
                      evaluate=False, name=f"rank{rank}")
    Trainer(task, sync, cfg, on_step=on_step).run()
    return seen, sync


def train_tp(task: Task, ep: int, tp: int, rank: int, steps: int, ckpt: tuple[str, int] | None = None, stage: int = 0):
    """The same list from this rank's EP x TP run: a (world/tp, tp, 1) mesh, the gpt model split by
    ``tensor_parallel_task`` (experts by hidden), ``MoESync(mesh, ep)``; each replica reads
    ``B * tp`` sequences, so the global batch is the other checks' (drops: this replica's sequences)."""
    world = dist.get_world_size()
    mesh = ParallelMesh.build(world // tp, tp, 1, seed=0)
    tt = tensor_parallel_task(task, mesh)
    sync = MoESync(tt.model, tt.dense_optimizer, mesh, ep=ep, stage=stage)  # ZeRO-stage on the non-expert params
    if ckpt:
        sync.set_checkpointing(*ckpt)
    seen: list[tuple[float, torch.Tensor, list[torch.Tensor]]] = []

    def on_step(step: int, tr: Trainer) -> None:
        loss = torch.tensor([tr.last_loss], dtype=torch.float64)
        dist.all_reduce(loss)  # every TP rank holds its replica's loss: the mean over the world is the global one
        seen.append((float(loss) / world, tr.flat, [m.last_dropped.clone() for _, m in sync.layers]))

    cfg = TrainConfig(mode="dp", steps=steps, batch_size=B * tp, worker_index=mesh.dp_idx, num_workers=mesh.dp,
                      progress=False, evaluate=False, name=f"rank{rank}")
    Trainer(tt, sync, cfg, on_step=on_step).run()
    return seen, sync, mesh


def compare(name: str, got, want, rank: int, rtol: float = 1e-5, atol: float = 1e-6, per: int = B) -> int:
    """Loss and parameters at every step; this rank's drop masks equal the reference's rows (``rank``:
    this rank's share of ``per`` sequences of the global batch). Returns drops seen."""
    assert len(got) == len(want), (name, len(got), len(want))
    dropped = 0
    for t, ((gl, gp, gd), (wl, wp, wd)) in enumerate(zip(got, want)):
        torch.testing.assert_close(gp, wp, rtol=rtol, atol=atol, msg=lambda m, t=t: f"{name} step {t} params: {m}")
        assert abs(gl - wl) <= atol + rtol * abs(wl), f"{name} step {t} loss {gl} != reference {wl}"
        for i, (g, w) in enumerate(zip(gd, wd)):
            mine = w[rank * per : (rank + 1) * per]
            assert torch.equal(g, mine), f"{name} step {t} layer {i}: dropped {g.nonzero().tolist()} != reference {mine.nonzero().tolist()}"
            dropped += int(g.sum())
    assert not torch.equal(want[-1][1], want[0][1]), f"{name}: parameters never moved"
    return dropped


def balance(rank: int, world: int, aux: float, out: str) -> list[dict[str, Any]]:
    """40 Adam steps of a top-1 MoE gpt whose routers start skewed to expert 0 (EP=2); the rank's
    metrics records (``kind == "step"``, every step)."""
    task = load_task("gpt", vocab=32, seq=16, dim=16, layers=2, heads=2, test_size=4, moe_experts=4, moe_top_k=1,
                     moe_capacity=4.0, moe_aux=aux, lr=3e-3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, m in moe_layers(task.model):  # ln2's bias along v, the router's expert-0 row 3v: logit 0 is +3
            blk = task.model.get_submodule(n.rsplit(".", 1)[0])
            v = torch.randn(blk.ln2.bias.shape, generator=g)
            v /= v.norm()
            blk.ln2.bias.copy_(v)
            m.router.weight[0].copy_(3 * v)
    sync = MoESync(task.model, task.dense_optimizer, ep=2)
    path = os.path.join(out, f"aux{aux}-rank{rank}.jsonl")
    cfg = TrainConfig(mode="dp", steps=40, batch_size=4, worker_index=rank, num_workers=world, progress=False,
                      evaluate=False, name=f"rank{rank}", log_every=1, metrics_out=path)
    Trainer(task, sync, cfg).run()
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


def main(checks: list[str]) -> None:
    torch.set_num_threads(1)
    mesh = init_mesh("gloo", "cpu", timeout_s=60)
    rank, world = mesh.rank, mesh.world
    for check in checks:
        if check.startswith("ep") and check[2:].isdigit():  # E=4 top-2, capacity for every token: no drops
            ep = int(check[2:])
            task = make()
            want = reference(task, world, STEPS)
            got, sync = train(task, ep, world, rank, STEPS)
            assert compare(check, got, want, rank) == 0, f"{check}: tokens were dropped at capacity factor 2"
            st = sync.stats()
            assert st["ep"] == ep, st
            print(f"OK {check} {st}", flush=True)
        elif check.startswith("zero"):  # ZeRO on the non-expert parameters, experts split by EP: zero<stage>-ep<P>
            stage, ep = check[4], int(check.split("-ep")[1])
            task = make(capacity=0.5)
            want = reference(task, world, STEPS)
            got, sync = train(task, ep, world, rank, STEPS, mode=f"zero{stage}")
            compare(check, got, want, rank)
            print(f"OK {check} {sync.memory()}", flush=True)
        elif check.startswith("drop-"):  # tight capacity: the same assignments dropped as the reference's
            top_k, ep = (int(c) for c in check.split("-")[1:])
            task = make(top_k=top_k, capacity=0.5)
            want = reference(task, world, STEPS)
            got, _ = train(task, ep, world, rank, STEPS)
            dropped = compare(check, got, want, rank)
            total = torch.tensor([dropped])
            dist.all_reduce(total)
            assert int(total) > 0, f"{check}: capacity 0.5 dropped nothing"
            print(f"OK {check} dropped={int(total)}", flush=True)
        elif check.startswith("eptp-") and check != "eptp-ckpt":
            # EP x TP: eptp-<ep>-<tp>-<capacity factor>[-zero<k>]; a tight capacity drops; zero<k>: ZeRO-k on the
            # non-expert parameters over the DP dimension
            f = check.split("-")
            ep, tp, cap = int(f[1]), int(f[2]), float(f[3])
            stage = int(f[4][4:]) if len(f) > 4 else 0
            task = make(capacity=cap)
            want = reference(task, world, STEPS)
            got, sync, mesh = train_tp(task, ep, tp, rank, STEPS, stage=stage)
            dropped = compare(check, got, want, mesh.dp_idx, per=B * tp)
            total = torch.tensor([dropped])
            dist.all_reduce(total)
            assert (int(total) > 0) == (cap < 1), f"{check}: {int(total)} assignments dropped"
            # this rank holds E/ep experts per layer, each MLP 1/tp of its hidden (out's bias whole)
            d, h = GPT["dim"], 4 * GPT["dim"]
            per_expert = (d * h + h + h * d) // tp + d
            assert sync.experts.numel == GPT["layers"] * GPT["moe_experts"] // ep * per_expert, sync.experts.numel
            assert sync.stats()["ep"] == ep, sync.stats()
            print(f"OK {check} dropped={int(total) // tp} {sync.stats()}", flush=True)
        elif check == "eptp-ckpt":  # saved at EP=2 x TP=2 after 3 steps, resumed at EP=1 / TP=1 (4 DP ranks): the same step 3; and back
            d = tempfile.mkdtemp(prefix="moe-tp-ckpt-") if rank == 0 else ""
            box = [d]
            dist.broadcast_object_list(box, 0)
            d = box[0]
            task = make(capacity=0.5)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": LR, "momentum": 0.9})  # state to carry over too
            full, _, _ = train_tp(task, 2, 2, rank, 4, ckpt=(d, 3))
            task = make(capacity=0.5)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": LR, "momentum": 0.9})
            resumed, sync = train(task, 1, world, rank, 4, ckpt=(d, 0))
            assert sync.resumed_from and sync.resumed_from.endswith("step-3"), sync.resumed_from
            assert len(resumed) == 1, len(resumed)
            (gl, gp, gd), (wl, wp, wd) = resumed[0], full[-1]
            torch.testing.assert_close(gp, wp, rtol=1e-5, atol=1e-6)
            assert abs(gl - wl) <= 1e-6 + 1e-5 * abs(wl), (gl, wl)
            # and back: saved at EP=2 (4 DP ranks, no TP), resumed at EP=2 x TP=2
            box = [tempfile.mkdtemp(prefix="moe-tp-ckpt-") if rank == 0 else ""]
            dist.broadcast_object_list(box, 0)
            task = make(capacity=0.5)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": LR, "momentum": 0.9})
            full, _ = train(task, 2, world, rank, 4, ckpt=(box[0], 3))
            task = make(capacity=0.5)
            task.dense_optimizer = OptimizerSpec("momentum", {"lr": LR, "momentum": 0.9})
            resumed, tsync, _ = train_tp(task, 2, 2, rank, 4, ckpt=(box[0], 0))
            assert tsync.resumed_from and tsync.resumed_from.endswith("step-3") and len(resumed) == 1, tsync.resumed_from
            torch.testing.assert_close(resumed[0][1], full[-1][1], rtol=1e-5, atol=1e-6)
            assert abs(resumed[0][0] - full[-1][0]) <= 1e-6 + 1e-5 * abs(full[-1][0]), (resumed[0][0], full[-1][0])
            print("OK eptp-ckpt", flush=True)
        elif check == "metrics":  # all-to-all time and bytes show up under EP (and not without it)
            task = make()
            sync = MoESync(task.model, task.dense_optimizer, ep=world)
            cfg = TrainConfig(mode="dp", steps=2, batch_size=B, worker_index=rank, num_workers=world, progress=False,
                              evaluate=False, name=f"rank{rank}", log_every=2)
            Trainer(task, sync, cfg).run()
            w = sync.window_metrics()
            assert w == {}, w  # taken by the trainer's record
            task.model.train()
            task.loss(task.model, next(task.batches(rank, world, B, 0))).backward()
            w = sync.window_metrics()
            assert w["a2a_mb"] > 0 and w["a2a_ms"] > 0 and w["moe_dropped"] == 0, w
            # every layer: 4 exchanges (forward: out and back; backward: the same reversed), each carrying
            # every kept assignment's row once over the group: layers x 4 x world x B x seq x top_k x dim x 4 bytes
            total = torch.tensor([w["a2a_mb"] * 2**20], dtype=torch.float64)
            dist.all_reduce(total)
            want_bytes = GPT["layers"] * 4 * world * B * GPT["seq"] * 2 * GPT["dim"] * 4
            assert abs(float(total) - want_bytes) < 1, (float(total), want_bytes)
            print(f"OK metrics {w}", flush=True)
        elif check == "ckpt":  # saved at EP=world after 3 steps, resumed at EP=world/2: the same step 3
            d = tempfile.mkdtemp(prefix="moe-ckpt-") if rank == 0 else ""
            box = [d]
            dist.broadcast_object_list(box, 0)
            d = box[0]
            task = make(capacity=0.5)
            full, _ = train(task, world, world, rank, 4, ckpt=(d, 3))
            task = make(capacity=0.5)
            resumed, sync = train(task, world // 2, world, rank, 4, ckpt=(d, 0))
            assert sync.resumed_from and sync.resumed_from.endswith("step-3"), sync.resumed_from
            assert len(resumed) == 1, len(resumed)
            (gl, gp, gd), (wl, wp, wd) = resumed[0], full[-1]
            torch.testing.assert_close(gp, wp, rtol=1e-5, atol=1e-6)
            assert abs(gl - wl) <= 1e-6 + 1e-5 * abs(wl), (gl, wl)
            assert all(torch.equal(a, b) for a, b in zip(gd, wd))
            print("OK ckpt", flush=True)
        elif check == "balance":
            out = tempfile.mkdtemp(prefix="moe-balance-")
            on = balance(rank, world, 0.1, out)
            off = balance(rank, world, 0.0, out)
            cv_on = [r["moe_cv"] for r in on]
            cv_off = [r["moe_cv"] for r in off]
            # the skew is reported: the first window's tokens per expert favour expert 0 (CV > 1)
            assert cv_on[0] > 1.0 and cv_off[0] > 1.0, (cv_on, cv_off)
            assert all(c[0] > 3 * max(c[1:]) for c in off[0]["moe_tokens_per_expert"]), off[0]
            # with the balance loss, the CV falls to a fraction of where it started, and below the run without it
            late_on, late_off = sum(cv_on[-10:]) / 10, sum(cv_off[-10:]) / 10  # the last 10 steps
            assert late_on < 0.25 * cv_on[0], cv_on
            assert late_on < late_off, (cv_on, cv_off)
            print(f"OK balance cv_on={[round(c, 3) for c in cv_on]} cv_off={[round(c, 3) for c in cv_off]}", flush=True)
        else:
            raise SystemExit(f"unknown check {check!r}")
    shutdown_group()


if __name__ == "__main__":
    main(sys.argv[1:])
