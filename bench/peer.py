"""Peer-mode benchmark: our collectives against torch's, in one run on CPU with Gloo (or NCCL).

Measures, with D ranks (default 2; each rank a process of this script with ``--rank R``, one
torch thread on CPU) in one process group:

(a) All-reduce bus bandwidth at 16 and 64 MiB (``--quick``: 4 and 16 MiB): raw
    ``torch.distributed.all_reduce`` of one float32 tensor of that size, and ours on the same
    bytes: ``GroupReducer.finish`` over a flat buffer of 1 MiB parameters with the
    default 25 MiB buckets (bucketing, the mean's division, the waits). Bus bandwidth =
    2 (D-1)/D x bytes / time. Repeats alternate raw and ours; min and median of the repeats.
(b) A data-parallel training step of ``gpt`` (dim 128, 4 layers, seq 64, vocab 256, 8 sequences
    per rank; ``--quick``: dim 64, 2 layers) with ours (``Trainer`` + ``DataParallelSync``: hooks,
    buckets, Adam) against ``torch.nn.parallel.DistributedDataParallel`` (same initial model,
    batches, bucket size 25 MiB, Adam). Rounds alternate ours and DDP; step time per step after
    warm-up, min and median.
(c) Per-rank bytes kept between steps for ZeRO 0 (plain DP), 1, 2, 3 on the same gpt model after
    two Adam steps: optimizer state, gradients, parameters (``memory()`` of each sync), and each
    stage's peak gradient bytes during backward.

(d) MoE dispatch: ``MoE.dispatch`` (the per-expert counts exchanged, then the rows with variable
    splits) against raw ``all_to_all_single`` with the same splits, 64 MiB per rank (``--quick``:
    16) routed unevenly to 2 x D experts; repeats alternate; bus bandwidth = (D-1)/D x bytes / time.
(e) A training step of an E=4 top-2 MoE ``gpt`` (experts of hidden 2 x dim, ``--ep D``) against
    the dense ``gpt`` (hidden 4 x dim: the same active parameters per token), rounds alternating.
(f) The pipeline bubble with P = world stages and m = 8 micro-batches, GPipe and 1F1B (gpt,
    4 blocks per stage, dim 128, stages balanced by compute): per step, the mean over ranks of
    the fraction of the step blocked in receives (waiting on the other stages), against
    (P-1)/(m+P-1); also the fraction in sends and the fraction not in forward/backward compute
    at all (bubble + communication + bookkeeping); min and median over 16 steps each.
(g) The same gpt step with tensor parallelism T=2 (``DataParallelSync`` over the mesh's DP group; D = world/2), with and
    without sequence parallelism, against DP over all ranks (``DataParallelSync``), same global batch;
    rounds alternate the three; min and median step time.
(h) Activation bytes per rank that autograd keeps for backward in the transformer layers (one
    batch of 8 sequences): one process (T=1), TP=2, TP=2 + SP. Megatron's per-layer formula
    (Korthikanti et al. 2022, without the attention-score term) predicts SP/TP = 34/t / (10 + 24/t)
    = 0.77 at t=2 and SP/(T=1) = 1/t.

Output: a table, then a final line of JSON (also written to ``--json-out``) with
``allreduce_ratio`` (ours / raw bus bandwidth, the smaller of the two sizes' median ratios),
``dp_step_ratio`` (ours / DDP median step time), ``zero1_state_ratio``, ``zero2_grad_ratio``,
``zero3_param_ratio`` (each against plain DP per rank), ``zero3_pp_state_ratio`` (per-rank
optimizer state under PP=2 x DP=2 with ZeRO-3 on DP against PP=2 x DP=2 without ZeRO: its own
4-rank launch, goal <= 0.55), ``alltoall_ratio`` (ours / raw all-to-all
bus bandwidth, medians), ``moe_step_ratio`` (MoE / dense median step time), ``bubble_measured``
(1F1B, median of the blocked-in-receives fraction) and ``bubble_theory``, ``tp_vs_dp_step_ratio``
(TP=2 / DP median step time), ``sp_activation_ratio`` (activation bytes with SP / without, both at
T=2), ``sp_activation_ratio_vs_t1`` (with SP at T=2 / one process), and the figures behind them. The machine
may be shared and noisy: compare ratios from the same run.

DDP's process group is not torn down (torch 2.13 can deadlock freeing a DDP ``ProcessGroupGloo``);
the ranks exit with ``os._exit`` after reporting.

Run::

    python bench/peer.py                 # under a minute on 2 idle CPU cores (more under load)
    python bench/peer.py --quick         # smoke run
    python bench/peer.py --world 4 --device cuda --backend nccl
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 2**20
QUIET_RUNQUEUE = 0.02  # pipeline bubble: a step is quiet if no rank waited > 2% of it on a CPU run queue
PARTS = ("allreduce", "dp", "zero", "alltoall", "moe", "pipeline", "tp", "pp_zero", "auto_tp")
PP_ZERO_WORLD = 4  # the pp_zero part's own launch: PP=2 x DP=2, whatever --world is


def _bus_gbps(nbytes: int, seconds: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def _runqueue_s() -> float:
    """Seconds the calling thread (the one that computes and drives the sends and receives) has
    waited on a CPU run queue: runnable, not running, the time other load on the cores took from
    it; from Linux's /proc/thread-self/schedstat (0 where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_allreduce(mesh: Any, sizes_mib: list[int], repeats: int, bar: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from worker.peer import GroupReducer

    out: dict[str, Any] = {}
    for mib in sizes_mib:
        n = mib * MiB // 4
        raw = torch.ones(n, device=mesh.device)
        params = nn.ParameterList([nn.Parameter(torch.ones(MiB // 4, device=mesh.device)) for _ in range(mib)])
        ours = GroupReducer(list(params), device=mesh.device)
        t_raw, t_ours = [], []
        for _ in range(repeats):
            dist.barrier()
            _sync(mesh.device)
            t0 = time.perf_counter()
            dist.all_reduce(raw)
            _sync(mesh.device)
            t_raw.append(time.perf_counter() - t0)
            ours.flat.grad.zero_()  # type: ignore[union-attr]
            dist.barrier()
            _sync(mesh.device)
            t0 = time.perf_counter()
            ours.finish()
            _sync(mesh.device)
            t_ours.append(time.perf_counter() - t0)
            bar.update(1)
        nbytes = n * 4
        out[f"{mib}"] = {
            "raw_gbps_med": _bus_gbps(nbytes, statistics.median(t_raw), mesh.world),
            "raw_gbps_max": _bus_gbps(nbytes, min(t_raw), mesh.world),
            "ours_gbps_med": _bus_gbps(nbytes, statistics.median(t_ours), mesh.world),
            "ours_gbps_max": _bus_gbps(nbytes, min(t_ours), mesh.world),
            "raw_ms_min": 1e3 * min(t_raw), "raw_ms_med": 1e3 * statistics.median(t_raw),
            "ours_ms_min": 1e3 * min(t_ours), "ours_ms_med": 1e3 * statistics.median(t_ours),
            "buckets": len(ours.buckets),
        }
        out[f"{mib}"]["ratio"] = out[f"{mib}"]["ours_gbps_med"] / out[f"{mib}"]["raw_gbps_med"]
        del raw, params, ours
    return out


def _gpt_opts(quick: bool) -> dict[str, Any]:
    return {"vocab": 256, "seq": 64, "dim": 64 if quick else 128, "layers": 2 if quick else 4, "heads": 4, "test_size": 8}


def bench_dp_step(mesh: Any, quick: bool, rounds: int, steps: int, warmup: int, batch: int, bar: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.peer import DataParallelSync
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    task = load_task("gpt", **_gpt_opts(quick))
    base = copy.deepcopy(task.model)
    ddp_model = DDP(copy.deepcopy(base).to(mesh.device), bucket_cap_mb=25, device_ids=None)
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=3e-3)
    t_ours: list[float] = []
    t_ddp: list[float] = []
    for r in range(rounds):
        # ours: the trainer's step pipeline with DataParallelSync (ZeRO stage 0), as `tessera peer` runs it
        task.model = copy.deepcopy(base)
        sync = DataParallelSync(task.model, task.dense_optimizer, device=mesh.device, bucket_mb=25.0)
        stamps: list[float] = []
        cfg = TrainConfig(
            mode="dp", steps=warmup + steps, batch_size=batch, worker_index=mesh.rank, num_workers=mesh.world,
            device=str(mesh.device), progress=False, evaluate=False, name=f"rank{mesh.rank}",
        )
        dist.barrier()
        t0 = time.perf_counter()
        Trainer(task, sync, cfg, on_step=functools.partial(_stamp, stamps)).run()
        stamps.insert(0, t0)
        t_ours += [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
        bar.update(1)
        # DDP: the same loop by hand
        data = task.batches(mesh.rank, mesh.world, batch, 0)
        dist.barrier()
        last = time.perf_counter()
        for s in range(warmup + steps):
            b = next(data).to(mesh.device)
            ddp_opt.zero_grad()
            loss = task.loss(ddp_model, b)
            loss.backward()
            ddp_opt.step()
            g = loss.detach().to(torch.float64).reshape(1)  # the global loss, as the trainer logs it
            dist.all_reduce(g)
            float(g)
            now = time.perf_counter()
            if s >= warmup:
                t_ddp.append(now - last)
            last = now
        bar.update(1)
    params = sum(p.numel() for p in base.parameters())
    tokens = batch * mesh.world * task.info["tokens_per_example"]
    return {
        "params": params, "batch_per_rank": batch, "seq": task.info["tokens_per_example"],
        "ours_ms_min": 1e3 * min(t_ours), "ours_ms_med": 1e3 * statistics.median(t_ours),
        "ddp_ms_min": 1e3 * min(t_ddp), "ddp_ms_med": 1e3 * statistics.median(t_ddp),
        "ours_tokens_per_s": tokens / statistics.median(t_ours), "ddp_tokens_per_s": tokens / statistics.median(t_ddp),
        "ratio": statistics.median(t_ours) / statistics.median(t_ddp),
    }


def bench_zero_memory(mesh: Any, quick: bool, batch: int, bar: Any) -> dict[str, Any]:
    from worker.peer import SyncPlan, make_sync
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    out: dict[str, Any] = {}
    for mode in ("dp", "zero1", "zero2", "zero3"):
        task = load_task("gpt", **_gpt_opts(quick))
        sync = make_sync(SyncPlan(mode, task.dense_optimizer, device=mesh.device), task.model)
        cfg = TrainConfig(
            mode=mode, steps=2, batch_size=batch, worker_index=mesh.rank, num_workers=mesh.world,
            device=str(mesh.device), progress=False, evaluate=False, name=f"rank{mesh.rank}",
        )
        Trainer(task, sync, cfg).run()
        mem = sync.memory()  # type: ignore[attr-defined]
        mem.setdefault("peak_grad_bytes", mem["grad_bytes"])
        out[mode] = mem
        bar.update(1)
    return out


def bench_alltoall(mesh: Any, mib: int, repeats: int, bar: Any) -> dict[str, Any]:
    """MoE dispatch (``MoE.dispatch``: the per-expert counts exchanged, then the rows with variable
    splits) against raw ``all_to_all_single`` with the same splits on the same bytes. Rows go to
    E=2 x world experts by a fixed uneven routing (expert e gets weight 1 + e)."""
    import torch
    import torch.distributed as dist

    from worker.peer.moe import MoE, MoEConfig, expert_groups

    dim = 256
    experts = 2 * mesh.world
    rows = mib * MiB // (dim * 4)
    w = torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (w / w.sum() * rows).floor().to(torch.int64)
    counts[-1] += rows - int(counts.sum())
    layer = MoE(8, MoEConfig(experts=experts, top_k=1, hidden=8)).to(mesh.device)
    groups = expert_groups(mesh.world)
    layer.shard(groups.group, mesh.world, groups.rank)
    x = torch.randn(rows, dim, device=mesh.device)
    counts = counts.to(mesh.device)
    in_splits = counts.view(mesh.world, -1).sum(1).tolist()
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    out_splits = recv_counts.view(mesh.world, -1).sum(1).tolist()
    raw_out = x.new_empty(sum(out_splits), dim)
    t_raw, t_ours = [], []
    for _ in range(repeats):
        dist.barrier()
        _sync(mesh.device)
        t0 = time.perf_counter()
        dist.all_to_all_single(raw_out, x, out_splits, in_splits)
        _sync(mesh.device)
        t_raw.append(time.perf_counter() - t0)
        dist.barrier()
        _sync(mesh.device)
        t0 = time.perf_counter()
        recv, _, _, _ = layer.dispatch(x, counts)
        _sync(mesh.device)
        t_ours.append(time.perf_counter() - t0)
        bar.update(1)
    assert torch.equal(recv, raw_out)
    # bus bandwidth of an all-to-all: the bytes that leave the rank / time
    nbytes = x.numel() * 4 * (mesh.world - 1) / mesh.world

    def gbps(t: float) -> float:
        return nbytes / t / 1e9

    return {
        "mib": mib, "experts": experts, "raw_gbps_med": gbps(statistics.median(t_raw)), "ours_gbps_med": gbps(statistics.median(t_ours)),
        "raw_ms_min": 1e3 * min(t_raw), "raw_ms_med": 1e3 * statistics.median(t_raw),
        "ours_ms_min": 1e3 * min(t_ours), "ours_ms_med": 1e3 * statistics.median(t_ours),
        "ratio": statistics.median(t_raw) / statistics.median(t_ours), "ratio_min": min(t_raw) / min(t_ours),
    }


def _stamp(stamps: list[float], step: int, trainer: Any) -> None:
    stamps.append(time.perf_counter())


def bench_moe_step(mesh: Any, quick: bool, rounds: int, steps: int, warmup: int, batch: int, bar: Any) -> dict[str, Any]:
    """A training step of an E=4 top-2 MoE ``gpt`` (expert hidden 2 x dim, experts split over the
    ranks: ``--ep world``) against the dense ``gpt`` (MLP hidden 4 x dim: the same active
    parameters per token), both through the trainer; rounds alternate; step time after warm-up."""
    import torch.distributed as dist

    from worker.peer import DataParallelSync
    from worker.peer.moe import MoESync
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    times: dict[str, list[float]] = {"dense": [], "moe": []}
    info: dict[str, Any] = {}
    for _ in range(rounds):
        for kind in ("dense", "moe"):
            moe = {"moe_experts": 4, "moe_top_k": 2, "moe_hidden": 2 * _gpt_opts(quick)["dim"]} if kind == "moe" else {}
            task = load_task("gpt", **_gpt_opts(quick), **moe)
            if kind == "moe":
                sync: Any = MoESync(task.model, task.dense_optimizer, ep=mesh.world, device=mesh.device)
            else:
                sync = DataParallelSync(task.model, task.dense_optimizer, device=mesh.device)
            info[f"{kind}_params"] = int(task.info["params"])
            info[f"{kind}_flops_per_token"] = task.info["flops_per_token"]
            stamps: list[float] = []
            cfg = TrainConfig(
                mode="dp", steps=warmup + steps, batch_size=batch, worker_index=mesh.rank, num_workers=mesh.world,
                device=str(mesh.device), progress=False, evaluate=False, name=f"rank{mesh.rank}",
            )
            dist.barrier()
            t0 = time.perf_counter()
            Trainer(task, sync, cfg, on_step=functools.partial(_stamp, stamps)).run()
            stamps.insert(0, t0)
            times[kind] += [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
            bar.update(1)
    return {
        **info, "dense_ms_min": 1e3 * min(times["dense"]), "dense_ms_med": 1e3 * statistics.median(times["dense"]),
        "moe_ms_min": 1e3 * min(times["moe"]), "moe_ms_med": 1e3 * statistics.median(times["moe"]),
        "ratio": statistics.median(times["moe"]) / statistics.median(times["dense"]),
    }


def bench_pp_zero(mesh: Any, quick: bool, bar: Any) -> dict[str, Any]:
    """Per-rank optimizer state of the gpt task (Adam) under PP=2 x DP=2, ZeRO-3 on the DP dimension
    against no ZeRO: the same pipeline (1F1B, 4 micro-batches) and steps, the state each rank holds
    after 2 steps; the largest over the ranks (the stage with more parameters decides the memory)."""
    import torch
    import torch.distributed as dist

    from worker.peer.mesh import ParallelMesh
    from worker.peer.pipeline import PipelineEngine, gpt_layers, stage_sync
    from worker.sync_api import Grads
    from worker.tasks import load_task

    pm = ParallelMesh.build(mesh.world // 2, 1, 2, device=mesh.device, seed=0)
    opts = {**_gpt_opts(quick), "layers": 4}
    m, per_rank = 4, 8
    out: dict[str, Any] = {"layout": f"PP=2 x DP={pm.dp}"}
    for stage in (0, 3):
        task = load_task("gpt", **opts)
        eng = PipelineEngine(gpt_layers(task.model), pp_ranks=pm.pp_ranks, kind="1f1b", micro_batches=m, pp_group=pm.pp_group,
                             dp_group=pm.dp_group, dp_size=pm.dp, device=pm.device, reduce_grads=False)
        sync = stage_sync(task.model, eng, task.dense_optimizer, stage=stage, dp_group=pm.dp_group)
        sync.join()
        data = task.batches(pm.dp_idx, pm.dp, per_rank, 0)
        seq = task.model.pos.num_embeddings
        for step in range(2):
            mbs = list(next(data).to(pm.device).chunk(m))
            sync.zero_grad()
            eng.step([x[:, :-1] for x in mbs], [x[:, 1:] for x in mbs], (per_rank // m, seq, task.model.tok.embedding_dim))
            sync.push(step, Grads(None))
        mine = torch.tensor([sync.memory()["state_bytes"]], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(mesh.world)]
        dist.all_gather(every, mine)
        out[f"zero{stage}_state_bytes"] = [int(t) for t in every]
        sync.leave()
        bar.update(1)
    out["ratio"] = max(out["zero3_state_bytes"]) / max(out["zero0_state_bytes"])
    return out


def bench_pipeline_bubble(mesh: Any, quick: bool, repeats: int, bar: Any) -> dict[str, Any]:
    """Pipeline bubble with P = world stages (D = 1) and m = 8 micro-batches, GPipe and 1F1B. Per
    step and rank, as fractions of the step time: time blocked in receives (waiting on the other
    stages: the bubble), time in sends (Gloo's isend, on the compute thread), and everything but
    forward/backward compute (the bubble plus all communication and bookkeeping); each step's
    figures are means over ranks. Stages balanced by compute (``gpt_layer_costs``). Steps alternate
    schedules (``repeats`` each, after one warm-up round), so load from outside hits both alike.

    Also measured: each stage's forward and backward time per micro-batch (medians over the steps),
    each message's delivery delay (from the later of its isend and its irecv to the data in hand),
    and from them the theory corrected for what (P-1)/(m+P-1) assumes away: the schedule simulated
    (``simulate``) with the measured per-stage times (``theory_corrected``: the stages' imbalance,
    e.g. the last stage's head and loss), with each send's measured cost added to the compute
    before it (``theory_corrected_sends``), and with the median delivery delay on every message
    (``theory_corrected_comm``: imbalance, sends and transport)."""
    import torch
    import torch.distributed as dist

    from worker.peer.pipeline import (
        PipelineEngine,
        bubble_theory,
        gpt_layer_costs,
        gpt_layers,
        schedule,
        simulate,
    )
    from worker.tasks import load_task

    P, m, mb = mesh.world, 8, 2 if quick else 4
    opts = {"vocab": 256, "seq": 64, "dim": 64 if quick else 128, "layers": 2 * P if quick else 4 * P, "heads": 4, "test_size": 8}
    fields = ("wait", "send_act", "send_grad", "fwd", "bwd", "wall", "runqueue")

    class _Spans:
        def __init__(self) -> None:
            self.t = dict.fromkeys(fields, 0.0)
            self.sends: dict[tuple[str, str], float] = {}  # (act|grad, micro-batch) -> when isend was called
            self.recvs: dict[tuple[str, str], tuple[float, float]] = {}  # -> (receive posted, data in hand)

        def complete(self, name: str, cat: str, start: float, end: float) -> None:
            op, mb = name.split()[:2]
            key = {"F": "fwd", "B": "bwd", "SEND_ACT": "send_act", "SEND_GRAD": "send_grad"}.get(op, "wait")
            self.t[key] += end - start
            if op.startswith("SEND"):
                self.sends[(op[5:], mb)] = start
            elif op.startswith("RECV"):
                self.recvs[(op[5:], mb)] = (start, end)

    out: dict[str, Any] = {"P": P, "m": m, "theory": bubble_theory(P, m), "micro_batch": mb, "layers": opts["layers"]}
    engines = {}
    for kind in ("gpipe", "1f1b"):
        task = load_task("gpt", **opts)
        engines[kind] = (task, PipelineEngine(
            gpt_layers(task.model), pp_ranks=list(range(P)), kind=kind, micro_batches=m,
            costs=gpt_layer_costs(task.model), device=mesh.device,
        ))
    out["stages"] = [list(b) for b in engines["1f1b"][1].bounds]
    seen: dict[str, list[torch.Tensor]] = {k: [] for k in engines}  # per step: (P, fields) of every rank
    delays: dict[str, list[float]] = {k: [] for k in engines}  # every message's delivery delay, seconds
    for rep in range(repeats + 1):  # the first round warms up
        for kind, (task, eng) in engines.items():
            data = next(task.batches(0, 1, m * mb, rep))
            mbs = list(data.to(mesh.device).chunk(m))
            eng.zero_grad()
            spans = _Spans()
            dist.barrier()
            rq0 = _runqueue_s()
            t0 = time.perf_counter()
            eng.step([x[:, :-1] for x in mbs], [x[:, 1:] for x in mbs], (mb, opts["seq"], opts["dim"]), tracer=spans)
            _sync(mesh.device)
            spans.t["wall"] = time.perf_counter() - t0
            spans.t["runqueue"] = _runqueue_s() - rq0
            mine = torch.tensor([spans.t[f] for f in fields], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(P)]
            dist.all_gather(every, mine)
            # delivery delay of each message: from the later of its send and its receive being posted
            # to the data in hand (perf_counter is CLOCK_MONOTONIC: one clock for every process here)
            books: list[Any] = [None] * P
            dist.all_gather_object(books, (spans.sends, spans.recvs))
            sent = {k: v for b in books for k, v in b[0].items()}
            if rep:
                seen[kind].append(torch.stack(every))
                delays[kind] += [end - max(posted, sent[k]) for b in books for k, (posted, end) in b[1].items() if k in sent]
            bar.update(1)
    col = {f: i for i, f in enumerate(fields)}
    for kind, steps in seen.items():
        st = torch.stack(steps)  # (steps, P, fields)
        wall = st[:, :, col["wall"]]
        waits = (st[:, :, col["wait"]] / wall).mean(1)
        wait = waits.tolist()
        # steps in which no rank waited on a run queue for more than QUIET of the step: outside load
        # (other processes on the cores) stalls a stage, and the other stage's wait for it reads as bubble
        stolen = (st[:, :, col["runqueue"]] / wall).max(1).values
        quiet = [w for w, q in zip(wait, stolen.tolist()) if q <= QUIET_RUNQUEUE]
        send = ((st[:, :, col["send_act"]] + st[:, :, col["send_grad"]]) / wall).mean(1).tolist()
        idle = (1.0 - (st[:, :, col["fwd"]] + st[:, :, col["bwd"]]) / wall).mean(1).tolist()
        med = st.median(0).values  # (P, fields): each rank's median step
        f_ms, b_ms = (1e3 * med[:, col["fwd"]] / m).tolist(), (1e3 * med[:, col["bwd"]] / m).tolist()
        sa, sg = (1e3 * med[:, col["send_act"]] / m).tolist(), (1e3 * med[:, col["send_grad"]] / m).tolist()
        sched = schedule(kind, P, m)
        out[kind] = {
            "bubble_all_med": statistics.median(wait), "quiet_steps": len(quiet),
            "bubble_quiet_med": statistics.median(quiet) if quiet else float("nan"),
            "runqueue_med": statistics.median(stolen.tolist()), "runqueue_max": max(stolen.tolist()),
            # the figure: the median over quiet steps when at least a third of the steps were quiet
            "bubble_med": statistics.median(quiet) if 3 * len(quiet) >= len(wait) else statistics.median(wait),
            "bubble_min": min(wait), "send_med": statistics.median(send),
            "per_step": [[round(w, 4), round(q, 4)] for w, q in zip(wait, stolen.tolist())],  # bubble, run-queue wait
            "noncompute_min": min(idle), "noncompute_med": statistics.median(idle), "steps": len(wait),
            "bubble_q1": statistics.quantiles(wait, n=4)[0] if len(wait) > 1 else wait[0],
            "bubble_q3": statistics.quantiles(wait, n=4)[2] if len(wait) > 1 else wait[0],
            "fwd_ms": f_ms, "bwd_ms": b_ms, "send_act_ms": sa, "send_grad_ms": sg,
            "step_ms_med": 1e3 * statistics.median(wall.max(1).values.tolist()),
            "imbalance": max(f + b for f, b in zip(f_ms, b_ms)) / min(f + b for f, b in zip(f_ms, b_ms)),
            "theory_corrected": simulate(sched, m, t_fwd=f_ms, t_bwd=b_ms)["bubble_mean"],
            "theory_corrected_sends": simulate(
                sched, m, t_fwd=[f + s for f, s in zip(f_ms, sa)], t_bwd=[b + s for b, s in zip(b_ms, sg)])["bubble_mean"],
            "delivery_ms_med": 1e3 * statistics.median(delays[kind]) if delays[kind] else 0.0,
            "delivery_ms_q3": 1e3 * statistics.quantiles(delays[kind], n=4)[2] if len(delays[kind]) > 1 else 0.0,
        }
        out[kind]["theory_corrected_comm"] = simulate(
            sched, m, t_fwd=[f + s for f, s in zip(f_ms, sa)], t_bwd=[b + s for b, s in zip(b_ms, sg)],
            t_comm=out[kind]["delivery_ms_med"])["bubble_mean"]
    return out


def bench_tp(mesh: Any, quick: bool, rounds: int, steps: int, warmup: int, batch: int, bar: Any) -> dict[str, Any]:
    """(g) TP=2 (and TP=2 with sequence parallelism) against DP on the same gpt model and global
    batch, through the trainer; (h) activation bytes per rank in the transformer layers."""
    import torch.distributed as dist

    from worker.peer import DataParallelSync, SyncPlan, make_sync
    from worker.peer.mesh import ParallelMesh
    from worker.peer.tensor_parallel import tensor_parallel_task
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    tp = 2
    pm = ParallelMesh.build(mesh.world // tp, tp, 1, device=mesh.device, seed=0)
    gb = batch * mesh.world
    times: dict[str, list[float]] = {"dp": [], "tp": [], "tp_sp": []}
    for _ in range(rounds):
        for kind in ("dp", "tp", "tp_sp"):
            task = load_task("gpt", **_gpt_opts(quick))
            if kind == "dp":
                sync: Any = DataParallelSync(task.model, task.dense_optimizer, device=mesh.device, bucket_mb=25.0)
                index, workers = mesh.rank, mesh.world
            else:
                task = tensor_parallel_task(task, pm, sequence_parallel=kind == "tp_sp")
                sync = make_sync(SyncPlan("dp", task.dense_optimizer, sequence_parallel=kind == "tp_sp"), task.model, pm)
                index, workers = pm.dp_idx, pm.dp
            stamps: list[float] = []
            cfg = TrainConfig(
                mode="dp", steps=warmup + steps, batch_size=gb // workers, worker_index=index, num_workers=workers,
                device=str(mesh.device), progress=False, evaluate=False, name=f"rank{mesh.rank}",
            )
            dist.barrier()
            t0 = time.perf_counter()
            Trainer(task, sync, cfg, on_step=functools.partial(_stamp, stamps)).run()
            stamps.insert(0, t0)
            times[kind] += [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
            bar.update(1)
    out: dict[str, Any] = {"tp": tp, "dp_world": mesh.world, "global_batch": gb}
    for kind, ts in times.items():
        out[f"{kind}_ms_min"], out[f"{kind}_ms_med"] = 1e3 * min(ts), 1e3 * statistics.median(ts)
    out.update(bench_activations(mesh, pm, quick, batch))
    bar.update(1)
    return out


def step_times(task: Any, sync: Any, mesh: Any, batch_size: int, index: int, workers: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` trainer steps after ``warmup`` (every rank starts together)."""
    import torch.distributed as dist

    from worker.trainer import TrainConfig, Trainer

    cfg = TrainConfig(
        mode="dp", steps=warmup + steps, batch_size=batch_size, worker_index=index, num_workers=workers,
        device=str(mesh.device), progress=False, evaluate=False, name=f"rank{mesh.rank}",
    )
    stamps: list[float] = []
    dist.barrier()
    t0 = time.perf_counter()
    Trainer(task, sync, cfg, on_step=functools.partial(_stamp, stamps)).run()
    stamps.insert(0, t0)
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]


def bench_auto_tp(mesh: Any, quick: bool, rounds: int, steps: int, warmup: int, batch: int, bar: Any) -> dict[str, Any]:
    """(i) A user transformer (tests/multiproc/user_models.py's gated LM: plain nn.Linear q/k/v/o, an
    up/gate/down MLP, a tied head) split over T=2 by ``parallelize(plan="auto")`` against the same model
    split by its hand-written plan, through the trainer and the same sync; rounds alternate; step time.
    The goal is <= 1.02: the automatic plan costs nothing once chosen."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "multiproc"))
    import user_models  # type: ignore[import-not-found]

    from worker.peer import SyncPlan, make_sync
    from worker.peer.mesh import ParallelMesh
    from worker.peer.parallelize import parallelize

    tp = 2
    pm = ParallelMesh.build(mesh.world // tp, tp, 1, device=mesh.device, seed=0)
    gb = batch * mesh.world
    opts = dict(vocab=256, seq=64, dim=64 if quick else 128, heads=4, layers=2 if quick else 4, opt="adam", lr=1e-3)
    times: dict[str, list[float]] = {"auto": [], "hand": []}
    for _ in range(rounds):
        for kind in ("auto", "hand"):
            task = user_models.gated_task(**opts)
            model = parallelize(task.model, pm, "auto" if kind == "auto" else user_models.GATED_PLAN, verbose=False)
            task.model = model.to(mesh.device)
            sync = make_sync(SyncPlan("dp", task.dense_optimizer), task.model, pm)
            times[kind] += step_times(task, sync, mesh, gb // pm.dp, pm.dp_idx, pm.dp, warmup, steps)
            bar.update(1)
    out: dict[str, Any] = {"tp": tp, "global_batch": gb}
    for kind, ts in times.items():
        out[f"{kind}_ms_min"], out[f"{kind}_ms_med"] = 1e3 * min(ts), 1e3 * statistics.median(ts)
    out["ratio"] = out["auto_ms_med"] / out["hand_ms_med"]
    return out


ACT_VARIANTS = (  # name, T, sequence parallel, recompute
    ("t1", 1, False, "none"), ("tp", 2, False, "none"), ("tp_sp", 2, True, "none"),
    ("tp_sel", 2, False, "selective"), ("tp_sp_sel", 2, True, "selective"),
)


def act_formula(t: int, sp: bool, selective: bool, heads: int, seq: int, dim: int, fp32: bool = False) -> float:
    """Activation bytes per layer over s b h (Korthikanti et al. 2022, section 4): Megatron's 16-bit
    accounting 10 (replicated: the layer norms', qkv's and the MLP's inputs, two dropout masks)
    + 24/t (split: q, k, v, the projection's input, GELU's input and output) + 5 a s / (h t) (the
    scores: softmax output, dropout mask, dropped probabilities); with sequence parallelism all of
    it /t; selective recompute drops the score term. ``fp32``: the same items in 4-byte values and
    1-byte masks (what an fp32 CPU run keeps): 18 + 48/t + 9 a s / (h t)."""
    rep, split, score = (18, 48, 9) if fp32 else (10, 24, 5)
    per = (rep + split) / t if sp else rep + split / t
    return per + (0.0 if selective else score * heads * seq / (dim * t))


def bench_activations(mesh: Any, pm: Any, quick: bool, batch: int) -> dict[str, Any]:
    """(h) Bytes autograd keeps for backward in the transformer layers, per rank, one batch of
    ``batch`` sequences, with Megatron's dropout (0.1 on the attention probabilities and the residual
    stream) and a sequence 4 x the head dimension (so the attention scores matter): one process
    (the TP model on a group of one), TP=2, TP=2 + SP, TP=2 + selective recompute, TP=2 + SP +
    selective; each against ``act_formula`` (Megatron's, and its fp32 version)."""
    from worker.peer.mesh import ParallelMesh, RNGStreams
    from worker.peer.tensor_parallel import TensorParallelGPT, activation_bytes
    from worker.tasks import load_task

    opts = dict(_gpt_opts(quick))
    head_dim = opts["dim"] // opts["heads"]
    opts["seq"] = 4 * head_dim
    one = ParallelMesh.build(mesh.world, 1, 1, device=mesh.device, seed=0)  # TP groups of one rank
    task = load_task("gpt", **opts)
    ids = next(task.batches(0, 1, batch, 0))[:, :-1].to(mesh.device)
    acts: dict[str, int] = {}
    for name, t, sp, rec in ACT_VARIANTS:
        group, tp_idx = (one.tp_group, 0) if t == 1 else (pm.tp_group, pm.tp_idx)
        m = TensorParallelGPT(task.model, group, sp, RNGStreams(0, tp_idx, 0, mesh.device), dropout=0.1,
                              attention_dropout=0.1, recompute=rec).to(mesh.device)
        x = m.tok(ids.t()).detach().requires_grad_(True)  # under SP already this rank's S/T positions
        with activation_bytes(m) as ab:
            y = x
            for blk in m.blocks:
                y = blk(y)
        y.sum().backward()
        acts[name] = ab["bytes"]
    sbh = opts["layers"] * opts["seq"] * batch * opts["dim"]
    predicted = {
        name: {"megatron": act_formula(t, sp, rec == "selective", opts["heads"], opts["seq"], opts["dim"]),
               "fp32": act_formula(t, sp, rec == "selective", opts["heads"], opts["seq"], opts["dim"], fp32=True)}
        for name, t, sp, rec in ACT_VARIANTS
    }
    return {"activation_bytes": acts, "activation_per_sbh": {k: v / sbh for k, v in acts.items()},
            "activation_predicted": predicted,
            "activation_config": {**{k: opts[k] for k in ("seq", "dim", "heads", "layers")}, "batch": batch, "head_dim": head_dim,
                                  "dropout": 0.1, "attention_dropout": 0.1}}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from worker.peer import init_mesh

    mesh = init_mesh(args.backend, args.device, timeout_s=300)
    if mesh.device.type == "cpu":
        torch.set_num_threads(1)
    quick = args.quick
    sizes = [4, 16] if quick else [16, 64]
    repeats = 3 if quick else 15
    rounds, steps, warmup = (2, 3, 1) if quick else (4, 10, 2)
    batch = 8
    pipe_repeats = 3 if quick else 24
    parts = set(args.parts.split(","))
    total = sum(n for part, n in (("allreduce", len(sizes) * repeats), ("dp", 2 * rounds), ("zero", 4), ("alltoall", repeats),
                                  ("moe", 2 * rounds), ("pipeline", 2 * (pipe_repeats + 1)), ("tp", 3 * rounds + 1), ("auto_tp", 2 * rounds),
                                  ("pp_zero", 2)) if part in parts)
    bar = tqdm(total=total, desc="bench/peer", disable=mesh.rank != 0 or args.no_progress, file=sys.stderr, mininterval=0.5)
    t0 = time.time()
    res: dict[str, Any] = {}
    if "allreduce" in parts:
        res["allreduce"] = bench_allreduce(mesh, sizes, repeats, bar)
    if "dp" in parts:
        res["dp_step"] = bench_dp_step(mesh, quick, rounds, steps, warmup, batch, bar)
    if "zero" in parts:
        res["zero_memory"] = bench_zero_memory(mesh, quick, batch, bar)
    if "alltoall" in parts:
        res["alltoall"] = bench_alltoall(mesh, sizes[-1], repeats, bar)
    if "moe" in parts:
        res["moe_step"] = bench_moe_step(mesh, quick, rounds, steps, warmup, batch, bar)
    if "pipeline" in parts:
        res["pipeline"] = bench_pipeline_bubble(mesh, quick, pipe_repeats, bar)
    if "tp" in parts:
        res["tp"] = bench_tp(mesh, quick, rounds, steps, warmup, batch, bar)
    if "auto_tp" in parts:
        res["auto_tp"] = bench_auto_tp(mesh, quick, rounds, steps, warmup, batch, bar)
    if "pp_zero" in parts:
        res["pp_zero"] = bench_pp_zero(mesh, quick, bar)
    bar.close()
    if mesh.rank == 0:
        result = {"world": mesh.world, "backend": mesh.backend, "device": str(mesh.device), "quick": quick, **res,
                  "seconds": time.time() - t0}
        with open(args.result, "w") as f:
            json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see the module docstring: no teardown of DDP's process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if "allreduce" in res:
        ar = res["allreduce"]
        sizes = sorted(ar, key=int)
        figures["allreduce_ratio"] = min(ar[s]["ratio"] for s in sizes)
        for s in sizes:
            figures[f"allreduce_{s}mib_ratio"] = ar[s]["ratio"]
            figures[f"raw_{s}mib_busbw_gbps"] = ar[s]["raw_gbps_med"]
            figures[f"ours_{s}mib_busbw_gbps"] = ar[s]["ours_gbps_med"]
    if "dp_step" in res:
        dp = res["dp_step"]
        figures.update({
            "dp_step_ratio": dp["ratio"],
            "ours_step_ms": dp["ours_ms_med"], "ddp_step_ms": dp["ddp_ms_med"], "ours_step_ms_min": dp["ours_ms_min"],
            "ddp_step_ms_min": dp["ddp_ms_min"], "ours_tokens_per_s": dp["ours_tokens_per_s"], "gpt_params": dp["params"],
        })
    if "zero_memory" in res:
        zm = res["zero_memory"]
        base = zm["dp"]
        figures.update({
            "zero1_state_ratio": zm["zero1"]["state_bytes"] / base["state_bytes"],
            "zero2_grad_ratio": zm["zero2"]["grad_bytes"] / base["grad_bytes"],
            "zero3_param_ratio": zm["zero3"]["param_bytes"] / base["param_bytes"],
            "zero2_peak_grad_ratio": zm["zero2"]["peak_grad_bytes"] / base["grad_bytes"],
            "zero3_state_ratio": zm["zero3"]["state_bytes"] / base["state_bytes"],
        })
    if "pipeline" in res:
        figures.update(pipeline_figures(res["pipeline"]))
    if "alltoall" in res and "moe_step" in res:
        figures.update(moe_figures(res))
    if "tp" in res:
        figures.update(tp_figures(res))
    if "auto_tp" in res:
        figures["auto_tp_step_ratio"] = res["auto_tp"]["ratio"]
        figures["auto_tp_step_ms"], figures["hand_tp_step_ms"] = res["auto_tp"]["auto_ms_med"], res["auto_tp"]["hand_ms_med"]
    if "pp_zero" in res:
        figures["zero3_pp_state_ratio"] = res["pp_zero"]["ratio"]
    figures.update({
        "world": res["world"], "backend": res["backend"], "device": res["device"], "quick": res["quick"],
        "seconds": round(res["seconds"], 1), "loadavg": list(os.getloadavg()),
    })
    return figures


def moe_figures(res: dict[str, Any]) -> dict[str, Any]:
    a, m = res["alltoall"], res["moe_step"]
    return {
        "alltoall_ratio": a["ratio"], "alltoall_ratio_min": a["ratio_min"], "raw_alltoall_busbw_gbps": a["raw_gbps_med"], "ours_alltoall_busbw_gbps": a["ours_gbps_med"],
        "moe_step_ratio": m["ratio"], "moe_step_ratio_min": m["moe_ms_min"] / m["dense_ms_min"], "moe_step_ms": m["moe_ms_med"], "dense_step_ms": m["dense_ms_med"],
    }


def tp_figures(res: dict[str, Any]) -> dict[str, Any]:
    tp = res["tp"]
    a, pred = tp["activation_bytes"], tp["activation_predicted"]
    out = {
        "tp_step_ms": tp["tp_ms_med"], "tp_sp_step_ms": tp["tp_sp_ms_med"], "tp_dp_step_ms": tp["dp_ms_med"],
        "tp_step_ms_min": tp["tp_ms_min"], "tp_dp_step_ms_min": tp["dp_ms_min"],
        "tp_vs_dp_step_ratio": tp["tp_ms_med"] / tp["dp_ms_med"],
    }
    for fig, num, den in (("sp_activation_ratio", "tp_sp", "tp"), ("sp_selective_activation_ratio", "tp_sp_sel", "tp"),
                          ("selective_activation_ratio", "tp_sel", "tp"), ("sp_activation_ratio_vs_t1", "tp_sp", "t1"),
                          ("sp_selective_activation_ratio_vs_t1", "tp_sp_sel", "t1"), ("tp_activation_ratio_vs_t1", "tp", "t1")):
        out[fig] = a[num] / a[den]
        out[fig + "_megatron"] = pred[num]["megatron"] / pred[den]["megatron"]
        out[fig + "_fp32_formula"] = pred[num]["fp32"] / pred[den]["fp32"]
    return out


def print_tp_table(res: dict[str, Any]) -> None:
    tp = res["tp"]
    print(f"\ngpt step, global batch {tp['global_batch']}: TP={tp['tp']} against DP={tp['dp_world']} (same model)")
    print(f"{'':<14}{'ms min':>10}{'ms median':>12}")
    for kind, label in (("dp", f"DP={tp['dp_world']}"), ("tp", f"TP={tp['tp']}"), ("tp_sp", f"TP={tp['tp']} + SP")):
        print(f"{label:<14}{tp[kind + '_ms_min']:>10.1f}{tp[kind + '_ms_med']:>12.1f}")
    a, per, pred, c = tp["activation_bytes"], tp["activation_per_sbh"], tp["activation_predicted"], tp["activation_config"]
    print(f"\nactivation bytes per rank kept for backward ({c['layers']} layers, seq {c['seq']} = 4 x head dim {c['head_dim']}, "
          f"hidden {c['dim']}, {c['heads']} heads, batch {c['batch']}, dropout {c['dropout']}, attention dropout {c['attention_dropout']})")
    print("per s b h per layer: measured, the fp32 formula (4-byte values, 1-byte masks), Megatron's (16-bit); ratios measured / Megatron")
    print(f"{'':<22}{'bytes':>12}{'per sbh':>9}{'fp32 f.':>9}{'Megatron':>10}{'/ TP=2':>8}{'Megatron':>10}{'/ T=1':>8}{'Megatron':>10}")
    for name, label in (("t1", "one process (T=1)"), ("tp", "TP=2"), ("tp_sp", "TP=2 + SP"), ("tp_sel", "TP=2 + selective"),
                        ("tp_sp_sel", "TP=2 + SP + selective")):
        print(f"{label:<22}{a[name]:>12,}{per[name]:>9.2f}{pred[name]['fp32']:>9.2f}{pred[name]['megatron']:>10.2f}"
              f"{a[name] / a['tp']:>8.3f}{pred[name]['megatron'] / pred['tp']['megatron']:>10.3f}"
              f"{a[name] / a['t1']:>8.3f}{pred[name]['megatron'] / pred['t1']['megatron']:>10.3f}")


def print_moe_table(res: dict[str, Any]) -> None:
    a, m = res["alltoall"], res["moe_step"]
    print(f"\nMoE dispatch all-to-all, {a['mib']} MiB per rank to {a['experts']} experts (uneven splits)")
    print(f"{'':<8}{'GB/s med':>10}{'ms min':>10}{'ms median':>12}")
    print(f"{'raw':<8}{a['raw_gbps_med']:>10.3f}{a['raw_ms_min']:>10.1f}{a['raw_ms_med']:>12.1f}")
    print(f"{'ours':<8}{a['ours_gbps_med']:>10.3f}{a['ours_ms_min']:>10.1f}{a['ours_ms_med']:>12.1f}")
    print(f"ours / raw bus bandwidth: {a['ratio']:.3f} (medians), {a['ratio_min']:.3f} (best times)")
    print(f"\ngpt step: E=4 top-2 MoE ({m['moe_params']:,} params, EP = world) vs dense ({m['dense_params']:,} params), "
          f"same active parameters per token")
    print(f"{'':<8}{'ms min':>10}{'ms median':>12}")
    print(f"{'dense':<8}{m['dense_ms_min']:>10.1f}{m['dense_ms_med']:>12.1f}")
    print(f"{'moe':<8}{m['moe_ms_min']:>10.1f}{m['moe_ms_med']:>12.1f}")
    print(f"MoE / dense step time: {m['ratio']:.3f}")


def pipeline_figures(pb: dict[str, Any]) -> dict[str, Any]:
    """``bubble_measured`` (1F1B: median fraction of the step blocked in receives), ``bubble_theory``
    (P-1)/(m+P-1), per schedule, the fraction not spent in compute at all, and the theory corrected
    for the measured stage imbalance (and sends)."""
    b1 = pb["1f1b"]
    out = {"bubble_measured": b1["bubble_med"], "bubble_theory": pb["theory"],
           "bubble_ratio": b1["bubble_med"] / pb["theory"],
           "bubble_theory_corrected": b1["theory_corrected"], "bubble_theory_corrected_sends": b1["theory_corrected_sends"],
           "bubble_theory_corrected_comm": b1["theory_corrected_comm"], "bubble_delivery_ms": b1["delivery_ms_med"],
           "bubble_ratio_corrected": b1["bubble_med"] / b1["theory_corrected_comm"],
           "pipeline_stage_imbalance": b1["imbalance"], "bubble_all_steps": b1["bubble_all_med"],
           "bubble_quiet_steps": b1["quiet_steps"], "bubble_steps": b1["steps"], "bubble_runqueue_med": b1["runqueue_med"],
           "bubble_1f1b_per_step": b1["per_step"]}
    for kind in ("gpipe", "1f1b"):
        b = pb[kind]
        out.update({f"bubble_{kind}": b["bubble_med"], f"bubble_{kind}_min": b["bubble_min"], f"send_{kind}": b["send_med"],
                    f"noncompute_{kind}": b["noncompute_med"], f"noncompute_{kind}_min": b["noncompute_min"]})
    return out


def print_pipeline(pb: dict[str, Any]) -> None:
    print(f"\npipeline bubble, P={pb['P']} m={pb['m']} ({pb['layers']} blocks, stages {pb['stages']}, "
          f"{pb['micro_batch']} sequences per micro-batch, {pb['1f1b']['steps']} steps each): "
          f"theory (P-1)/(m+P-1) = {pb['theory']:.3f}")
    print("fractions of the step time, mean over ranks; bubble = blocked in receives; not compute = all but forward/backward;")
    print("corrected theory = the schedule simulated with each stage's measured forward/backward times, + its sends'"
          " cost, + the median message delivery delay")
    print(f"{'schedule':<10}{'bubble min':>11}{'q1':>7}{'median':>8}{'q3':>7}{'/ theory':>10}{'corrected':>11}"
          f"{'+ sends':>9}{'+ delivery':>12}{'/ corr.':>9}{'sends':>8}{'delivery ms':>13}{'not compute':>13}")
    for kind in ("gpipe", "1f1b"):
        b = pb[kind]
        print(f"{kind:<10}{b['bubble_min']:>11.3f}{b['bubble_q1']:>7.3f}{b['bubble_med']:>8.3f}{b['bubble_q3']:>7.3f}"
              f"{b['bubble_med'] / pb['theory']:>10.2f}{b['theory_corrected']:>11.3f}{b['theory_corrected_sends']:>9.3f}"
              f"{b['theory_corrected_comm']:>12.3f}{b['bubble_med'] / b['theory_corrected_comm']:>9.2f}{b['send_med']:>8.3f}"
              f"{b['delivery_ms_med']:>8.2f}/{b['delivery_ms_q3']:<4.1f}{b['noncompute_med']:>13.3f}")
    for kind in ("gpipe", "1f1b"):
        b = pb[kind]
        print(f"{kind:<10}quiet steps (no rank > {QUIET_RUNQUEUE:.0%} of the step on a CPU run queue): {b['quiet_steps']} of {b['steps']}, "
              f"their median bubble {b['bubble_quiet_med']:.3f}; all steps' {b['bubble_all_med']:.3f}; "
              f"run-queue wait median {b['runqueue_med']:.3f}, max {b['runqueue_max']:.3f} of a step")
    print("per stage, ms per micro-batch (medians): forward / backward / send after it")
    for kind in ("gpipe", "1f1b"):
        b = pb[kind]
        cells = "  ".join(f"stage {r}: {f:.2f} / {bw:.2f} / {sa + sg:.2f}"
                          for r, (f, bw, sa, sg) in enumerate(zip(b["fwd_ms"], b["bwd_ms"], b["send_act_ms"], b["send_grad_ms"])))
        print(f"{kind:<10}{cells}   imbalance {b['imbalance']:.3f}, step {b['step_ms_med']:.0f} ms")


def print_table(res: dict[str, Any]) -> None:
    print(f"peer mode, world {res['world']}, {res['backend']} on {res['device']}")
    if "pp_zero" in res:
        pz = res["pp_zero"]
        print(f"optimizer state per rank, {pz['layout']} (gpt, Adam): no ZeRO {pz['zero0_state_bytes']}, "
              f"ZeRO-3 on DP {pz['zero3_state_bytes']}: ratio of the largest {pz['ratio']:.3f}")
    if "allreduce" in res:
        ar = res["allreduce"]
        print(f"{'all-reduce':<14}{'raw GB/s med/max':>20}{'ours GB/s med/max':>20}{'raw ms min/med':>18}{'ours ms min/med':>18}{'ratio':>8}")
        for s in sorted(ar, key=int):
            a = ar[s]
            print(
                f"{s + ' MiB':<14}{a['raw_gbps_med']:>11.3f}/{a['raw_gbps_max']:<8.3f}{a['ours_gbps_med']:>11.3f}/{a['ours_gbps_max']:<8.3f}"
                f"{a['raw_ms_min']:>9.1f}/{a['raw_ms_med']:<8.1f}{a['ours_ms_min']:>9.1f}/{a['ours_ms_med']:<8.1f}{a['ratio']:>8.3f}"
            )
    if "dp_step" in res:
        dp = res["dp_step"]
        print(f"\ngpt DP step ({dp['params']:,} params, {dp['batch_per_rank']} x {dp['seq']:.0f} tokens per rank)")
        print(f"{'':<8}{'ms min':>10}{'ms median':>12}{'tokens/s':>12}")
        print(f"{'ours':<8}{dp['ours_ms_min']:>10.1f}{dp['ours_ms_med']:>12.1f}{dp['ours_tokens_per_s']:>12,.0f}")
        print(f"{'DDP':<8}{dp['ddp_ms_min']:>10.1f}{dp['ddp_ms_med']:>12.1f}{dp['ddp_tokens_per_s']:>12,.0f}")
        print(f"ours / DDP step time: {dp['ratio']:.3f}")
    if "zero_memory" in res:
        print("\nper-rank bytes kept between steps (gpt, Adam)")
        print(f"{'stage':<8}{'params':>12}{'grads':>12}{'opt state':>12}{'peak grads':>12}")
        for mode, m in res["zero_memory"].items():
            print(f"{mode:<8}{m['param_bytes']:>12,}{m['grad_bytes']:>12,}{m['state_bytes']:>12,}{m['peak_grad_bytes']:>12,}")
    if "pipeline" in res:
        print_pipeline(res["pipeline"])
    if "alltoall" in res and "moe_step" in res:
        print_moe_table(res)
    if "tp" in res:
        print_tp_table(res)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: smaller sizes, fewer repeats")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (each rank cuda:RANK)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    if args.rank >= 0:
        rank_main(args)
        return 0
    parts = args.parts.split(",")
    main_parts = [x for x in parts if x != "pp_zero"]
    res = _launch(args, args.world, main_parts) if main_parts else {"world": args.world, "seconds": 0.0}
    if res is not None and "pp_zero" in parts:  # its own PP=2 x DP=2 launch
        pp = _launch(args, PP_ZERO_WORLD, ["pp_zero"])
        res = None if pp is None else {**pp, **res, "pp_zero": pp["pp_zero"], "seconds": res["seconds"] + pp["seconds"]}
    if res is None:
        return 1
    print_table(res)
    figures = summarize(res)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(figures, f)
    print(json.dumps(figures))
    return 0


def _launch(args: argparse.Namespace, world: int, parts: list[str]) -> dict[str, Any] | None:
    """``world`` rank processes running ``parts``; their result, or None (said on stderr) if they failed."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        port = _free_port()
        procs = []
        for r in range(world):
            env = dict(
                os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
            )
            cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--result", result,
                   "--backend", args.backend, "--device", args.device]
            cmd += ["--quick"] if args.quick else []
            cmd += ["--parts", ",".join(parts)]
            cmd += ["--no-progress"] if args.no_progress else []
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"bench/peer: ranks did not finish in {args.timeout:.0f} s", file=sys.stderr)
            return None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        bad = [r for r, proc in enumerate(procs) if proc.returncode != 0]
        if bad or not os.path.exists(result):
            print(f"bench/peer: ranks {bad} failed", file=sys.stderr)
            return None
        with open(result) as f:
            return json.load(f)  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
