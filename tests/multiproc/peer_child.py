"""One rank of the peer-mode equivalence tests (started by test_peer_equivalence.py with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would). Runs the checks named on the command line
in one process group and prints ``OK <check> <detail>`` per passed check; a failed check raises
(non-zero exit, the assertion on stderr).

Reference for every check: one process (this one, outside the group) training a deep copy of the
same initial model with ``torch.optim`` on the *global* batch (the ranks' batches concatenated),
compared after every step.
"""
from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.peer import SyncPlan, init_mesh, make_sync, shutdown_group
from worker.tasks import Task, load_task
from worker.trainer import TrainConfig, Trainer

STEPS, B = 4, 4  # steps per check; per-rank batch


def tiny_task(dtype: torch.dtype = torch.float32, optimizer: Any = None, seed: int = 0) -> Task:
    """An MLP regression on generated data: step t's global batch comes from rng (seed, t)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)

    def batches(worker_index: int, num_workers: int, batch_size: int, start: int) -> Iterator[Any]:
        g = num_workers * batch_size
        step = start
        while True:
            rng = np.random.default_rng([seed, step])
            x = torch.from_numpy(rng.standard_normal((g, 6))).to(dtype)
            y = torch.sin(x.sum(1, keepdim=True))
            sl = slice(worker_index * batch_size, (worker_index + 1) * batch_size)
            yield x[sl], y[sl]
            step += 1

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(m(x), y)

    from ps import OptimizerSpec

    return Task("tiny", model, batches, loss, None, dense_optimizer=optimizer or OptimizerSpec("adam", {"lr": 0.01}))


def reference(task: Task, opt: Callable[[Any], torch.optim.Optimizer], world: int, batch: int, steps: int):
    """[(global loss, flat params after the step)] of one process with the global batch."""
    model = copy.deepcopy(task.model)
    o = opt(model.parameters())
    data = task.batches(0, 1, world * batch, 0)
    out = []
    for _ in range(steps):
        o.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        o.step()
        out.append((float(loss.detach()), torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    return out


def train(task: Task, mode: str, world: int, rank: int, batch: int, steps: int, **kw: Any):
    """[(global loss, flat params after the step)] of this rank in peer ``mode``, and the sync."""
    accumulate = kw.pop("accumulate", 1)
    ckpt = kw.pop("checkpoint", None)
    sync = make_sync(SyncPlan(mode, task.dense_optimizer, **kw), task.model)
    if ckpt:
        sync.set_checkpointing(*ckpt)
    seen: list[tuple[float, torch.Tensor]] = []

    def on_step(step: int, tr: Trainer) -> None:
        # the trainer's loss is the global batch's mean loss (the mean of the DP ranks' means)
        seen.append((tr.last_loss, tr.flat))

    cfg = TrainConfig(
        mode=mode, steps=steps, batch_size=batch, worker_index=rank, num_workers=world, progress=False,
        evaluate=False, accumulate=accumulate, name=f"rank{rank}",
    )
    Trainer(task, sync, cfg, on_step=on_step).run()
    return seen, sync


def compare(name: str, got, want, rtol: float, atol: float) -> None:
    assert len(got) == len(want), (name, len(got), len(want))
    for t, ((gl, gp), (wl, wp)) in enumerate(zip(got, want)):
        torch.testing.assert_close(gp, wp.to(gp.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{name} step {t} params: {m}")
        assert abs(gl - wl) <= atol + rtol * abs(wl), f"{name} step {t} loss {gl} != reference {wl}"
    assert not torch.equal(want[-1][1], want[0][1]), f"{name}: parameters never moved"


def adam(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=0.01)


def main(checks: list[str]) -> None:
    torch.set_num_threads(1)
    mesh = init_mesh("gloo", "cpu", timeout_s=60)
    rank, world = mesh.rank, mesh.world
    from ps import OptimizerSpec

    for check in checks:
        if check == "dp":  # fp32 Adam, buckets of one parameter each (several buckets, launched from the hooks)
            task = tiny_task()
            want = reference(task, adam, world, B, STEPS)
            got, sync = train(task, "dp", world, rank, B, STEPS, bucket_mb=1e-6)
            compare("dp", got, want, 1e-5, 1e-6)
            st = sync.stats()
            assert st["buckets"] == 6 and st["launched_in_backward"] == 6 * STEPS, st
            print(f"OK dp buckets={st['buckets']} launched_in_backward={st['launched_in_backward']}", flush=True)
        elif check == "dp64":  # fp64, SGD lr=1: a uniform scaling error of the averaged gradient cannot hide
            task = tiny_task(torch.float64, OptimizerSpec("sgd", {"lr": 1.0}))
            want = reference(task, lambda p: torch.optim.SGD(p, lr=1.0), world, B, STEPS)
            got, _ = train(task, "dp", world, rank, B, STEPS)
            compare("dp64", got, want, 1e-12, 1e-12)
            print("OK dp64", flush=True)
        elif check in ("zero1", "zero2", "zero3"):
            task = tiny_task()
            want = reference(task, adam, world, B, STEPS)
            got, sync = train(task, check, world, rank, B, STEPS)
            compare(check, got, want, 1e-5, 1e-6)
            mem = sync.memory()
            print(f"OK {check} {mem}", flush=True)
        elif check in ("accum-dp", "accum-zero2", "accum-zero3"):  # k=2 micro-batches == the 2x batch
            mode = check.split("-")[1]
            task = tiny_task()
            want = reference(task, adam, world, 2 * B, STEPS)
            got, _ = train(task, mode, world, rank, 2 * B, STEPS, accumulate=2)
            compare(check, got, want, 1e-5, 1e-6)
            print(f"OK {check}", flush=True)
        elif check in ("bf16", "bf16-zero2"):  # 16-bit transport, fp32 sums: close, not exact (SGD: the error stays linear)
            task = tiny_task(optimizer=OptimizerSpec("sgd", {"lr": 0.1}))
            want = reference(task, lambda p: torch.optim.SGD(p, lr=0.1), world, B, STEPS)
            # ZeRO-2: each unit's 16-bit reduce-scatter launched from the backward hooks
            got, sync = train(task, "zero2" if check == "bf16-zero2" else "dp", world, rank, B, STEPS, compress="bf16",
                              bucket_mb=1e-6)
            compare(check, got, want, 2e-2, 2e-3)
            assert sync.stats()["compress"] == "bf16" and not torch.equal(got[-1][1], want[-1][1]), check  # it ran 16-bit
            print(f"OK {check}", flush=True)
        elif check == "gpt-zero3":  # the transformer, per-layer gathers, against the reference
            # SGD, not Adam: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift),
            # and Adam would turn the rounding noise there into steps of up to lr in either direction
            kw = dict(vocab=32, seq=8, dim=16, layers=1, heads=2, test_size=4)
            task = load_task("gpt", **kw)
            task.dense_optimizer = OptimizerSpec("sgd", {"lr": 0.5})
            want = reference(task, lambda p: torch.optim.SGD(p, lr=0.5), world, 2, 3)
            got, _ = train(task, "zero3", world, rank, 2, 3)
            compare(check, got, want, 1e-5, 1e-6)
            print("OK gpt-zero3", flush=True)
        elif check.startswith("hybrid-sync:"):
            # ctr: PSEmbedding rows on the PS (BSP here, so the run is deterministic), the MLP all-reduced;
            # reference: one process, the MLP with torch Adam and the rows with torch Adagrad (the table's
            # optimizer: lr 0.05, initial accumulator 0.1), both on the global batch
            from ps.client import PSClient
            from ps.initializers import init_rows, table_key
            from worker.peer import HybridSync

            addresses = check.split(":", 1)[1].split(",")
            task = load_task("ctr", vocab=2000, test_size=100, hidden=[32])
            emb = task.model.emb
            ref_mlp = copy.deepcopy(task.model.mlp)
            data = task.batches(0, 1, world * B, 0)
            batches = [next(data) for _ in range(STEPS)]
            ids_all = np.unique(np.concatenate([b.ids.numpy().reshape(-1) for b in batches]))
            ref_emb = nn.Parameter(torch.from_numpy(init_rows(emb.init, table_key(emb.table, emb.seed), ids_all, emb.dim).copy()))
            client = PSClient(addresses, timeout=60)
            sync = HybridSync(task.model, client, task.name, task.dense_optimizer, rank=rank, world=world,
                              sparse_mode="sync", sparse_ids=task.sparse_ids)
            seen: list[torch.Tensor] = []
            cfg = TrainConfig(mode="hybrid", steps=STEPS, batch_size=B, worker_index=rank, num_workers=world,
                              progress=False, evaluate=False, name=f"rank{rank}")
            Trainer(task, sync, cfg, on_step=lambda s, tr: seen.append(tr.flat)).run()
            opt_d = torch.optim.Adam(ref_mlp.parameters(), lr=1e-3)
            opt_s = torch.optim.Adagrad([ref_emb], lr=0.05, initial_accumulator_value=0.1, eps=1e-10)
            for t, b in enumerate(batches):
                rows = F.embedding(torch.from_numpy(np.searchsorted(ids_all, b.ids.numpy())), ref_emb)
                logits = ref_mlp(torch.cat([rows.flatten(1), b.dense], 1)).squeeze(1)
                opt_d.zero_grad()
                opt_s.zero_grad()
                F.binary_cross_entropy_with_logits(logits, b.label).backward()
                opt_d.step()
                opt_s.step()
                want = torch.cat([p.detach().reshape(-1) for p in ref_mlp.parameters()])
                torch.testing.assert_close(seen[t], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"hybrid dense step {t}: {m}")
            dist.barrier()  # every rank's last row push is in
            got = client.pull_sparse(emb.table, ids_all)
            torch.testing.assert_close(torch.from_numpy(got), ref_emb.detach(), rtol=1e-5, atol=1e-6)
            client.close()
            print("OK hybrid-sync", flush=True)
        elif check.startswith(("ckpt-save:", "ckpt-load:")):
            # save: train 4 steps, checkpoint after 3; load: resume from it (any world size, any mode)
            # and train step 3 only. Both print step 3's global loss and the parameters after it.
            kind, directory, mode = check.split(":")
            task = tiny_task()
            got, sync = train(task, mode, world, rank, 16 // world, 4, checkpoint=(directory, 3))
            if kind == "ckpt-load":
                assert sync.resumed_from and sync.resumed_from.endswith("step-3"), sync.resumed_from
                assert len(got) == 1, len(got)
            loss, params = got[-1]
            print(f"CKPT {kind} {mode} " + json.dumps({"loss": loss, "params": params.tolist()}), flush=True)
            print(f"OK {check}", flush=True)
        elif check in ("debug-mismatch", "debug-stall"):
            # faults injected by subclassing (rank 1 only): an extra collective the others do not issue,
            # or a stall longer than the checker's 2 s; with --debug-collectives on, the ranks must name
            # rank and op (the test reads the CollectiveMismatchError on stderr)
            from worker.peer import DataParallelSync, debug

            class ExtraCollective(DataParallelSync):
                def push(self, step: int, grads: Any) -> Any:
                    if step == 1:
                        t = torch.ones(1)
                        debug.fingerprint("all_reduce", t)
                        dist.all_reduce(t)
                    return super().push(step, grads)

            class Stall(DataParallelSync):
                calls = 0

                def zero_grad(self) -> None:
                    super().zero_grad()
                    self.calls += 1
                    if self.calls == 2:
                        time.sleep(6)

            debug.enable(rank, world, timeout_s=2)
            task = tiny_task()
            cls = DataParallelSync if rank == 0 else (ExtraCollective if check == "debug-mismatch" else Stall)
            sync = cls(task.model, task.dense_optimizer, bucket_mb=1e-6)
            cfg = TrainConfig(mode="dp", steps=STEPS, batch_size=B, worker_index=rank, num_workers=world, progress=False,
                              evaluate=False, name=f"rank{rank}")
            Trainer(task, sync, cfg).run()
            raise SystemExit(f"{check}: the fault went unnoticed")
        else:
            raise SystemExit(f"unknown check {check!r}")
    shutdown_group()


if __name__ == "__main__":
    main(sys.argv[1:])
