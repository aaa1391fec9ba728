"""Pipeline parallelism: a model's layers split into P stages, micro-batches, and schedules as data.

Three parts, usable alone:

- ``partition(costs, parts)``: contiguous split of a layer list into ``parts`` stages minimising
  the largest stage cost (cost = parameter count by default, or any cost given per layer).
- ``schedule(kind, P, m, V=1)``: the schedule as DATA, one list of ``Action``s per pipeline rank:
  ``F``/``B`` (forward / backward of micro-batch ``mb`` on virtual stage ``stage``) and the
  point-to-point ``SEND_ACT``/``RECV_ACT``/``SEND_GRAD``/``RECV_GRAD`` around them. Kinds:
  ``gpipe`` (all forwards, then all backwards: m activations in flight per rank), ``1f1b``
  (PipeDream-Flush / Megatron: P - r warm-up forwards on rank r, then one forward one backward:
  at most P in flight) and ``interleaved`` (Megatron's interleaved 1F1B: V virtual stages per rank,
  virtual stage s lives on rank s % P; m must be a multiple of P). ``simulate`` executes a schedule
  without communication (sends never block, receives block until the matching send ran) and
  checks it: every forward before its backward, every send matched by one receive, data
  available where it is used, no deadlock; it reports the peak in-flight activations per rank and
  the makespan under given forward/backward costs (hence the bubble).
- ``PipelineEngine``: runs this rank's part of a schedule with ``torch.distributed`` point-to-point
  (``isend`` for sends, each tensor kept until its receiver has it; ``irecv`` + wait for receives,
  right before the compute that needs them), given the pipeline's process group as a list of
  global ranks in stage order, so it works inside any mesh (the layout rank = pp*(D*T) + dp*T + tp
  puts a pipeline's ranks D*T apart). Messages carry a tag naming (kind, micro-batch, stage), so
  they match by tag on Gloo. Activation checkpointing per layer (``recompute``) re-runs a layer's
  forward in its backward (``torch.utils.checkpoint``, non-reentrant; with the mesh's ``RNGStreams``
  given, their states are replayed too, so tensor-parallel dropout draws the same masks).
  ``tessera peer --recompute selective`` instead recomputes only each block's attention core (the
  tensor-parallel model's, ``TensorParallelGPT(recompute="selective")``, at any T).

Loss scaling over micro-batches (explicit): the last stage computes each micro-batch's loss as
the task's mean over that micro-batch and back-propagates ``loss / m``; parameter gradients
accumulate over the m micro-batches, so they are the gradient of the mean loss over the
pipeline's whole batch (micro-batches are equal in size). Data parallelism on top (``dp_group``)
all-reduces the summed gradients and divides by D: the gradient of the global batch's mean loss,
what one process computes on the global batch. ``step`` returns that global mean loss on every
rank.

Why not ``torch.distributed.pipelining``: its schedules are classes that run themselves, not data
a test can check without communication; its stage split traces the model (``pipeline()`` needs
torch.export on the whole model) or needs hand-built stage modules anyway; and its executor owns
the loss scaling and the data-parallel step, which here must compose with our own DP all-reduce
and ZeRO. What we own is the split, the schedules and a ~100-line executor; the transport is
``torch.distributed``'s isend/irecv.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.peer.data_parallel import WrapsDense
from worker.peer.flags import KINDS, PRECISIONS, recompute_mode
from worker.peer.mesh import ParallelMesh, PeerConfigError, check_agreement
from worker.peer.moe import MoE, MoESync, moe_layers, recomputing
from worker.sync_api import Fetched, Grads, ParamSync, PushResult, split_batch

__all__ = ["Action", "PipelineEngine", "PipelinePlan", "PipelineSync", "ScheduleError", "bubble_theory", "gpt_layer_costs",
           "gpt_layers", "layout_groups", "partition", "pipeline_config", "pipeline_layout", "schedule", "simulate",
           "stage_sync", "tp_gpt_layers", "tp_gpt_loss"]

_OPS = ("F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")


class ScheduleError(ValueError):
    """A schedule (or its parameters) is invalid: names the rank and action."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``op`` on micro-batch ``mb`` at virtual stage ``stage`` (the
    stage this rank computes); for sends and receives, ``peer`` is the other pipeline rank."""

    op: str
    mb: int
    stage: int
    peer: int = -1

    def __str__(self) -> str:
        return f"{self.op}(mb={self.mb}, stage={self.stage}{'' if self.peer < 0 else f', peer={self.peer}'})"


def bubble_theory(P: int, m: int, V: int = 1) -> float:
    """The pipeline bubble fraction (P-1)/(m+P-1) of GPipe and 1F1B; interleaved: (P-1)/(V m + P-1)."""
    return (P - 1) / (V * m + P - 1)


# ---------------------------------------------------------------- partition


def partition(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of ``costs`` (one per layer) into ``parts`` non-empty stages,
    minimising the largest stage's total cost (dynamic programming, exact)."""
    n = len(costs)
    if parts < 1 or parts > n:
        raise ScheduleError(f"cannot split {n} layers into {parts} stages (need 1 <= stages <= layers)")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ScheduleError(f"layer costs must be >= 0, got {c}")
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest max-cost splitting the first i layers into k stages; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    out, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        out.append((j, i))
        i = j
    return out[::-1]


# ---------------------------------------------------------------- schedules


def _compute_order(kind: str, P: int, m: int, V: int, r: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s forwards and backwards in order: (op, micro-batch, virtual stage)."""
    if kind == "gpipe":
        return [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]
    if kind == "1f1b" or (kind == "interleaved" and V == 1):
        warm = min(P - r - 1, m)
        out = [("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            out += [("F", warm + i, r), ("B", i, r)]
        return out + [("B", i, r) for i in range(m - warm, m)]
    # interleaved (Megatron): forward k runs chunk (k // P) % V of micro-batch (k // (P V)) P + k % P
    total = m * V

    def fwd(k: int) -> tuple[str, int, int]:
        g, w = divmod(k, P * V)
        return ("F", g * P + w % P, (w // P) * P + r)

    def bwd(k: int) -> tuple[str, int, int]:
        g, w = divmod(k, P * V)
        return ("B", g * P + w % P, (V - 1 - w // P) * P + r)

    warm = min((P - r - 1) * 2 + (V - 1) * P, total)
    out = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        out += [fwd(warm + i), bwd(i)]
    return out + [bwd(k) for k in range(total - warm, total)]


def schedule(kind: str, P: int, m: int, V: int = 1) -> list[list[Action]]:
    """The schedule ``kind`` (gpipe, 1f1b, interleaved) for ``P`` pipeline ranks, ``m``
    micro-batches and ``V`` virtual stages per rank (interleaved only; 1 otherwise): one list of
    actions per rank. Virtual stage s (of P V) lives on rank s % P."""
    if kind not in KINDS:
        raise ScheduleError(f"schedule must be one of {', '.join(KINDS)}, got {kind!r}")
    if P < 1 or m < 1 or V < 1:
        raise ScheduleError(f"pipeline ranks, micro-batches and virtual stages must be >= 1, got P={P}, m={m}, V={V}")
    if V > 1 and kind != "interleaved":
        raise ScheduleError(f"virtual stages (V={V}) need the interleaved schedule, not {kind}")
    if kind == "interleaved" and V > 1 and m % P:
        raise ScheduleError(f"the interleaved schedule needs micro-batches divisible by pipeline ranks: m={m}, P={P}")
    S = P * V
    out: list[list[Action]] = []
    for r in range(P):
        acts: list[Action] = []
        for op, mb, s in _compute_order(kind, P, m, V, r):
            if op == "F":
                if s > 0 and (s - 1) % P != r:
                    acts.append(Action("RECV_ACT", mb, s, (s - 1) % P))
                acts.append(Action("F", mb, s))
                if s < S - 1 and (s + 1) % P != r:
                    acts.append(Action("SEND_ACT", mb, s, (s + 1) % P))
            else:
                if s < S - 1 and (s + 1) % P != r:
                    acts.append(Action("RECV_GRAD", mb, s, (s + 1) % P))
                acts.append(Action("B", mb, s))
                if s > 0 and (s - 1) % P != r:
                    acts.append(Action("SEND_GRAD", mb, s, (s - 1) % P))
        out.append(acts)
    return out


def _message(a: Action) -> tuple[str, int, int]:
    """The message a send produces or a receive consumes: (kind, micro-batch, receiving stage)."""
    if a.op == "SEND_ACT":
        return ("act", a.mb, a.stage + 1)
    if a.op == "RECV_ACT":
        return ("act", a.mb, a.stage)
    if a.op == "SEND_GRAD":
        return ("grad", a.mb, a.stage - 1)
    return ("grad", a.mb, a.stage)


def simulate(
    sched: list[list[Action]], m: int, V: int = 1, t_fwd: float | Sequence[float] = 1.0, t_bwd: float | Sequence[float] = 2.0,
    t_comm: float = 0.0,
) -> dict[str, Any]:
    """Run ``sched`` without communication and check it; raises ``ScheduleError`` naming the rank
    and action otherwise. Sends never block; a receive blocks until its send ran. Checks: each
    (micro-batch, stage) forward and backward exactly once, forward before backward, the stage on
    the rank that holds it, a forward's input (and a backward's output gradient) available when it
    runs, every send received once by the right peer, no deadlock. Returns ``peak_in_flight`` (per
    rank: the most forwards whose backward has not run), ``makespan`` and ``busy`` per rank under
    costs ``t_fwd``/``t_bwd`` of one micro-batch's forward/backward on one virtual stage (one number
    for every stage, or one per rank: an unbalanced pipeline), a message arriving ``t_comm`` after its
    send (0: communication free), ``bubble``
    (1 - busy / makespan, worst rank) and ``bubble_mean`` (its mean over ranks: the fraction of the
    ranks' time idle, what a measurement averaged over ranks compares with)."""
    P = len(sched)
    S = P * V
    tf = [float(t_fwd)] * P if isinstance(t_fwd, (int, float)) else [float(t) for t in t_fwd]
    tb = [float(t_bwd)] * P if isinstance(t_bwd, (int, float)) else [float(t) for t in t_bwd]
    if len(tf) != P or len(tb) != P or min(tf + tb) < 0:
        raise ScheduleError(f"forward/backward costs: one number or one >= 0 per rank ({P}), got {t_fwd!r}, {t_bwd!r}")
    pos = [0] * P
    clock = [0.0] * P
    busy = [0.0] * P
    sent: dict[tuple[str, int, int], tuple[int, int, float]] = {}  # message -> (from, to, time)
    received: set[tuple[str, int, int]] = set()
    avail: list[dict[tuple[str, int, int], float]] = [{} for _ in range(P)]  # (act|grad, mb, stage) usable here
    done_f: set[tuple[int, int]] = set()
    done_b: set[tuple[int, int]] = set()
    in_flight = [0] * P
    peak = [0] * P
    while any(pos[r] < len(sched[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(sched[r]):
                a = sched[r][pos[r]]
                where = f"rank {r}, action {pos[r]} {a}"
                if a.op not in _OPS:
                    raise ScheduleError(f"{where}: unknown op")
                if not (0 <= a.mb < m and 0 <= a.stage < S) or a.stage % P != r:
                    raise ScheduleError(f"{where}: micro-batch or stage out of range, or the stage is not on this rank")
                key = (a.mb, a.stage)
                if a.op in ("RECV_ACT", "RECV_GRAD"):
                    msg = _message(a)
                    if msg not in sent:
                        break  # blocks
                    src, dst, t = sent[msg]
                    if msg in received or dst != r or src != a.peer:
                        raise ScheduleError(f"{where}: receives a message sent by rank {src} to rank {dst}, or twice")
                    received.add(msg)
                    t += t_comm
                    clock[r] = max(clock[r], t)
                    avail[r][msg] = t
                elif a.op in ("SEND_ACT", "SEND_GRAD"):
                    msg = _message(a)
                    have = key in done_f if a.op == "SEND_ACT" else key in done_b
                    if not have or msg in sent or not (0 <= msg[2] < S) or msg[2] % P != a.peer:
                        raise ScheduleError(f"{where}: sends what it has not computed, twice, or to the wrong rank")
                    sent[msg] = (r, a.peer, clock[r])
                elif a.op == "F":
                    if key in done_f:
                        raise ScheduleError(f"{where}: forward twice")
                    if a.stage > 0 and ("act", a.mb, a.stage) not in avail[r]:
                        raise ScheduleError(f"{where}: forward before its input activation arrived")
                    done_f.add(key)
                    clock[r] += tf[r]
                    busy[r] += tf[r]
                    if a.stage < S - 1 and (a.stage + 1) % P == r:  # next stage on this rank: no message
                        avail[r][("act", a.mb, a.stage + 1)] = clock[r]
                    in_flight[r] += 1
                    peak[r] = max(peak[r], in_flight[r])
                else:  # B
                    if key not in done_f or key in done_b:
                        raise ScheduleError(f"{where}: backward before its forward, or twice")
                    if a.stage < S - 1 and ("grad", a.mb, a.stage) not in avail[r]:
                        raise ScheduleError(f"{where}: backward before its output gradient arrived")
                    done_b.add(key)
                    clock[r] += tb[r]
                    busy[r] += tb[r]
                    if a.stage > 0 and (a.stage - 1) % P == r:
                        avail[r][("grad", a.mb, a.stage - 1)] = clock[r]
                    in_flight[r] -= 1
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} at {sched[r][pos[r]]}" for r in range(P) if pos[r] < len(sched[r]))
            raise ScheduleError(f"deadlock: {stuck}")
    missing = [(mb, s) for mb in range(m) for s in range(S) if (mb, s) not in done_b]
    if missing:
        raise ScheduleError(f"micro-batch/stage pairs never computed: {missing[:5]}")
    unreceived = sorted(set(sent) - received)
    if unreceived:
        raise ScheduleError(f"messages sent but never received: {unreceived[:5]}")
    makespan = max(clock)
    return {
        "peak_in_flight": peak, "makespan": makespan, "busy": busy,
        "bubble": max(1.0 - b / makespan for b in busy) if makespan else 0.0,
        "bubble_mean": sum(1.0 - b / makespan for b in busy) / P if makespan else 0.0,
    }


# ---------------------------------------------------------------- layers of the gpt task


class _Embed(nn.Module):
    def __init__(self, gpt: Any) -> None:
        super().__init__()
        self.tok: nn.Embedding = gpt.tok
        self.pos: nn.Embedding = gpt.pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


def gpt_layers(model: Any) -> list[nn.Module]:
    """The ``gpt`` task's model as a layer list (embeddings, each block, final norm + head) whose
    modules share the model's parameters: running them in order is ``model.forward``."""
    return [_Embed(model), *model.blocks, nn.Sequential(model.ln, model.head)]


def gpt_layer_costs(model: Any) -> list[float]:
    """Forward FLOPs per token of each of ``gpt_layers(model)``: a split balanced by compute time
    (the embeddings cost next to nothing; a block 24 H^2 + 4 S H; the head 2 H V)."""
    H, S, V = model.tok.embedding_dim, model.pos.num_embeddings, model.tok.num_embeddings
    return [0.0] + [float(24 * H * H + 4 * S * H)] * len(model.blocks) + [float(2 * H * V)]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The gpt task's loss: mean token cross-entropy (in fp32, or fp64 for a float64 model)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _TPEmbed(nn.Module):
    """The first layer of a tensor-parallel pipeline: ``TensorParallelGPT.embed``, ``(B, S)`` ids -> the
    residual stream ``(S, B, H)`` (sequence-first, as TensorParallelGPT keeps it)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.tok: nn.Module = model.tok
        self.pos: nn.Parameter = model.pos
        self._owner = [model]  # not a submodule

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._owner[0].embed(ids)  # type: ignore[no-any-return]


def tp_gpt_layers(model: Any) -> list[nn.Module]:
    """A ``TensorParallelGPT``'s layers for a pipeline (sharing its parameters): vocab-parallel
    embedding, the tensor-parallel blocks, final norm + vocab-parallel head. The activation between
    stages is the residual stream ``(S, B, H)``, whole on every TP rank of the stage (under sequence
    parallelism: this rank's ``(S/T, B, H)`` chunk); each stage rank sends it to the next stage's rank
    with the same TP index. Under sequence parallelism the replicated parameters' gradients are
    partial per TP rank: ``stage_sync(sequence_parallel=True)`` sums them over the TP group."""
    return [_TPEmbed(model), *model.blocks, nn.Sequential(model.ln, model.head)]


def tp_gpt_loss(model: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gpt task's loss on the last stage of a ``TensorParallelGPT`` pipeline: ``model.stage_loss``."""
    return model.stage_loss  # type: ignore[no-any-return]


class _Stage(nn.Module):
    """Consecutive layers; with ``recompute``, each layer's activations are recomputed in backward.
    ``rng``: the mesh's ``RNGStreams`` when the layers draw from them (tensor-parallel dropout): a
    recomputation replays the streams' states of the forward, then puts back the current ones
    (``torch.utils.checkpoint`` replays only the global random state). A recomputation runs inside
    ``moe.recomputing()`` (MoE layers meter each forward once)."""

    def __init__(self, layers: Sequence[nn.Module], recompute: bool, rng: Any = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute, self.rng = recompute, rng

    def _replaying(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        snap = self.rng.snapshot() if self.rng is not None else None
        first = [True]

        def run(x: torch.Tensor) -> torch.Tensor:
            if first[0]:
                first[0] = False
                return layer(x)  # type: ignore[no-any-return]
            now = self.rng.snapshot() if self.rng is not None else None
            if snap is not None:
                self.rng.restore(snap)
            try:
                with recomputing():
                    return layer(x)  # type: ignore[no-any-return]
            finally:
                if now is not None:
                    self.rng.restore(now)

        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled() and x.is_floating_point():
                x = checkpoint(self._replaying(layer), x, use_reentrant=False)
            else:
                x = layer(x)
        return x


# ---------------------------------------------------------------- the executor


class PipelineEngine:
    """This rank's stages of a pipeline and the executor of its schedule.

    ``layers``: the whole model as a layer list (every rank passes the same list; this rank keeps
    the stages it owns). ``pp_ranks``: the global ranks of this pipeline in stage order (this
    process is one of them); ``pp_group``: their process group (for the loss broadcast).
    ``dp_group``/``dp_size``: the data-parallel group this rank's gradients are averaged over
    (None/1: none). ``costs``: per-layer cost for the split (default: parameter count).
    ``loss_fn(output, target)``: the mean loss of one micro-batch (default: the gpt task's).
    ``recompute``: full activation recomputation, per layer (selective recomputation is the
    tensor-parallel model's: ``TensorParallelGPT(recompute="selective")``). ``rng``: the mesh's
    ``RNGStreams`` when the layers draw dropout masks from them (replayed in a recomputation).
    """

    def __init__(
        self, layers: Sequence[nn.Module], *, pp_ranks: Sequence[int], kind: str = "1f1b", micro_batches: int = 1,
        virtual: int = 1, pp_group: Any = None, dp_group: Any = None, dp_size: int = 1,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gpt_loss, costs: Sequence[float] | None = None,
        recompute: bool = False, device: torch.device | str = "cpu", reduce_grads: bool = True,
        precision: str = "fp32", rng: Any = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ScheduleError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.reduce_grads, self.precision = reduce_grads, precision
        self._reducer: Any = None  # reduce_grads: a GroupReducer over the DP group (made on first use)
        self.P, self.m, self.V = len(pp_ranks), micro_batches, virtual
        me = dist.get_rank() if dist.is_initialized() else 0
        if me not in pp_ranks:
            raise ScheduleError(f"rank {me} is not in the pipeline ranks {list(pp_ranks)}")
        self.pp_ranks, self.r = list(pp_ranks), list(pp_ranks).index(me)
        self.kind, self.pp_group, self.dp_group, self.dp_size = kind, pp_group, dp_group, dp_size
        self.actions = schedule(kind, self.P, micro_batches, virtual)[self.r]
        S = self.P * virtual
        if len(layers) < S:
            raise ScheduleError(f"{len(layers)} layers cannot fill {S} pipeline stages (P={self.P} x V={virtual})")
        costs = list(costs) if costs is not None else [float(sum(p.numel() for p in m.parameters())) for m in layers]
        if len(costs) != len(layers):
            raise ScheduleError(f"{len(costs)} layer costs given for {len(layers)} layers")
        self.bounds = partition(costs, S)
        self.S, self.device, self.loss_fn = S, torch.device(device), loss_fn
        self.stages = {
            s: _Stage([layers[i] for i in range(*self.bounds[s])], recompute, rng).to(self.device)
            for s in range(self.r, S, self.P)
        }
        # MoE layers: their auxiliary loss (balance + z) of each micro-batch joins its stage's backward
        self._moe = {s: [m for m in st.modules() if isinstance(m, MoE)] for s, st in self.stages.items()}

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages, each once (as they are now: MoE layers keep only
        their expert-parallel rank's experts once sharded)."""
        return list(dict.fromkeys(p for st in self.stages.values() for p in st.parameters()))

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages."""
        return self.params

    def zero_grad(self) -> None:
        """Gradients to zero in place (allocated once: a steady memory footprint)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    def _autocast(self) -> Any:
        """bf16 compute (``precision="bf16"``): autocast around each stage's forward; the parameters
        (the master weights), their gradients and the gradient reduction stay fp32."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _tag(self, kind: int, mb: int, stage: int) -> int:
        return (kind * self.S + stage) * self.m + mb

    def step(
        self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None, act_shape: Sequence[int],
        act_dtype: torch.dtype = torch.float32, tracer: Any = None,
    ) -> float:
        """Forward and backward of the ``m`` micro-batches by this rank's schedule; gradients are
        accumulated into the parameters' ``.grad`` (zero them first) and averaged over the DP group.
        ``inputs`` (needed on the rank of stage 0) and ``targets`` (on the rank of the last stage):
        one tensor per micro-batch. ``act_shape``: the shape of the activation between stages.
        Returns the mean loss over the micro-batches (and DP ranks), on every rank; with MoE layers
        their auxiliary losses included, as the task's loss includes them in one process (each
        stage's back-propagated with its output, scaled by 1/m alike)."""
        if self.r == 0 and (inputs is None or len(inputs) != self.m):
            raise ScheduleError(f"the first stage needs {self.m} input micro-batches")
        if (self.S - 1) in self.stages and (targets is None or len(targets) != self.m):
            raise ScheduleError(f"the last stage needs {self.m} target micro-batches")
        scale = 1.0 / self.m
        acts: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> input activation
        grads: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> gradient of the stage's output
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Any]] = {}  # input, output, aux loss
        outbox: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[tuple[Any, torch.Tensor]] = []
        # the reported loss: fp32, or fp64 for a float64 model (the same dtype on every pipeline rank)
        total = torch.zeros((), dtype=torch.promote_types(act_dtype, torch.float32), device=self.device)
        for a in self.actions:
            key = (a.mb, a.stage)
            t0 = time.perf_counter()
            if a.op == "RECV_ACT" or a.op == "RECV_GRAD":
                buf = torch.empty(tuple(act_shape), dtype=act_dtype, device=self.device)
                kind = 0 if a.op == "RECV_ACT" else 1
                work = dist.irecv(buf, src=self.pp_ranks[a.peer], tag=self._tag(kind, a.mb, a.stage))
                assert work is not None
                work.wait()
                (acts if kind == 0 else grads)[key] = buf
            elif a.op == "SEND_ACT" or a.op == "SEND_GRAD":
                kind = 0 if a.op == "SEND_ACT" else 1
                t = outbox.pop(key)
                to = a.stage + 1 if kind == 0 else a.stage - 1
                sends.append((dist.isend(t, dst=self.pp_ranks[a.peer], tag=self._tag(kind, a.mb, to)), t))
            elif a.op == "F":
                if a.stage == 0:
                    assert inputs is not None
                    x = inputs[a.mb].to(self.device)
                else:
                    x = acts.pop(key).requires_grad_()
                with self._autocast():
                    out = self.stages[a.stage](x)
                moe = self._moe[a.stage]
                aux: Any = sum(m.aux for m in moe) * scale if moe else None  # type: ignore[misc]
                if aux is not None:
                    total += aux.detach().to(total.dtype)
                if a.stage == self.S - 1:
                    assert targets is not None
                    if self.precision == "bf16":
                        out = out.float()
                    target = targets[a.mb]
                    loss = self.loss_fn(out, target.to(self.device) if isinstance(target, torch.Tensor) else target) * scale
                    total += loss.detach().to(total.dtype)
                    saved[key] = (x, loss if aux is None else loss + aux, None)
                else:
                    saved[key] = (x, out, aux)
                    if (a.stage + 1) % self.P == self.r:
                        acts[(a.mb, a.stage + 1)] = out.detach()
                    else:
                        outbox[key] = out.detach().contiguous()
            else:  # B
                x, out, aux = saved.pop(key)
                if a.stage == self.S - 1:
                    out.backward()
                elif aux is not None:
                    torch.autograd.backward((out, aux), (grads.pop(key), torch.ones_like(aux)))
                else:
                    out.backward(grads.pop(key))
                if a.stage > 0:
                    g = x.grad
                    assert g is not None
                    if (a.stage - 1) % self.P == self.r:
                        grads[(a.mb, a.stage - 1)] = g
                    else:
                        outbox[key] = g.contiguous()
            if tracer is not None:
                tracer.complete(f"{a.op} mb{a.mb} s{a.stage}", "pipeline", t0, time.perf_counter())
            if sends:  # a sent tensor is freed once its receiver has it
                sends = [(w, t) for w, t in sends if not w.is_completed()]
        for w, _ in sends:
            w.wait()
        # the loss lives on the last stage's rank (MoE: and the auxiliary losses on each stage's): summed
        # over the pipeline (the other ranks add zeros, so exactly the last stage's without MoE), averaged over DP
        if self.P > 1:
            dist.all_reduce(total, group=self.pp_group)
        if self.reduce_grads and self.dp_size > 1:
            if self._reducer is None:
                from worker.peer.core import GroupReducer

                self._reducer = GroupReducer(self.params, self.dp_group, own=False)
            self._reducer.finish()
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        return float(total)


def layout_groups(P: int, D: int = 1, T: int = 1) -> tuple[list[int], Any, list[int], Any]:
    """(pipeline ranks, pipeline group, data-parallel ranks, data-parallel group) of this rank in
    the layout rank = pp*(D*T) + dp*T + tp. Collective: every rank creates every group, in order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != P * D * T:
        raise ScheduleError(f"world size {world} is not P x D x T = {P} x {D} x {T}")
    mine: dict[str, tuple[list[int], Any]] = {}
    for kind, lines in (("pp", [[p * D * T + d * T + t for p in range(P)] for d in range(D) for t in range(T)]),
                        ("dp", [[p * D * T + d * T + t for d in range(D)] for p in range(P) for t in range(T)])):
        for ranks in lines:  # the pipelines, then the DP groups, in this order on every rank
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = (ranks, g)
    return (*mine["pp"], *mine["dp"])


# ---------------------------------------------------------------- the pipeline as a ParamSync


@dataclass(frozen=True)
class PipelinePlan:
    """How a run is pipelined (``SyncPlan.pipeline``; ``make_sync`` builds a ``PipelineSync`` from it):
    ``source`` (``worker.peer.split.PipelineSource``: the layers, the first stage's input and the last
    stage's loss of one micro-batch, the activation between stages), the schedule ``kind`` over
    ``micro_batches`` with ``virtual_stages`` per rank (interleaved), ``recompute`` (per layer),
    ``precision`` (``bf16``: autocast compute, fp32 master weights) and ``rng`` (the mesh's random
    streams, replayed in a recomputation, when the layers draw dropout masks from them)."""

    source: Any
    kind: str = "1f1b"
    micro_batches: int = 1
    virtual_stages: int = 1
    recompute: bool = False
    precision: str = "fp32"
    rng: Any = None


class PipelineSync(WrapsDense, ParamSync):
    """This rank's stages of a (D, T, P) pipeline as a ``ParamSync``: the trainer's one loop runs it as
    any other sync. ``forward_backward`` runs the schedule (``PipelineEngine``) over the step's
    micro-batches; ``push`` sums the gradients of weights two stages share (a tied head) over the
    pipeline, then the stages' ``DataParallelSync`` (``stage_sync``: ZeRO 0-3 over ``dp_group``, the
    TP sum under sequence parallelism) reduces, steps and checkpoints. ``model``: the plain or
    tensor-parallel model the source's layers come from (its ``specs`` name the tensors of checkpoints
    and evaluations). Collectives on the main thread, the same order on every rank."""

    pipelined = False

    def __init__(self, plan: PipelinePlan, model: nn.Module, mesh: Any, optimizer: Any, *, stage: int = 0,
                 sequence_parallel: bool = False, compress: str | None = None, ep: int = 1) -> None:
        from worker.peer.split import shared_parameters

        src = plan.source
        self.plan, self.name = plan, f"pp-zero{stage}"
        # no DP group for the engine: the stages' DataParallelSync reduces the gradients, global_loss the loss
        self.engine = PipelineEngine(
            src.layers, pp_ranks=mesh.pp_ranks, kind=plan.kind, micro_batches=plan.micro_batches, virtual=plan.virtual_stages,
            pp_group=mesh.pp_group, loss_fn=src.loss_fn, costs=src.costs, recompute=plan.recompute, device=mesh.device,
            reduce_grads=False, precision=plan.precision, rng=plan.rng,
        )
        self.dense: Any
        if moe_layers(model):  # the stages' experts over their EP groups (carved from this stage's DP ranks), the rest ZeRO
            self.dense = MoESync(model, optimizer, mesh, ep=ep, stage=stage, compress=compress,
                                 part=nn.ModuleList(self.engine.stages.values()), agree=False)
        else:
            self.dense = stage_sync(model, self.engine, optimizer, stage=stage, dp_group=mesh.dp_group,
                                    tp_group=mesh.tp_group if mesh.tp > 1 else None, sequence_parallel=sequence_parallel,
                                    compress=compress)
        self.shared = shared_parameters(src.layers, self.engine.bounds)  # ranks that do not hold one add zeros
        # every stage's parameters, in the same order on every rank of the pipeline: what an evaluation shares
        self._stage_params = [list(dict.fromkeys(p for layer in src.layers[a:b] for p in layer.parameters()))
                              for a, b in self.engine.bounds]

    @property
    def flat(self) -> Any:  # type: ignore[override]
        return self.dense.flat

    def set_checkpointing(self, directory: str | None, every: int) -> None:
        """Checkpoints of the stages' tensors in every layout's format (``DataParallelSync``'s)."""
        self.dense.set_checkpointing(directory, every)

    def join(self) -> int:
        return self.dense.join()

    def leave(self) -> None:
        self.dense.leave()

    def fetch(self, step: int, batch: Any) -> Fetched:
        return Fetched(step, batch, step)  # the parameters are local and current

    def zero_grad(self) -> None:
        self.dense.zero_grad()  # not the engine's: ZeRO-2/3 free the gradient buffers

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         micro_batches: int) -> torch.Tensor:
        """This rank's part of the schedule over ``batch`` cut into the plan's micro-batches
        (``micro_batches`` must be that number): the first stage takes ``source.inputs`` of each, the
        last computes ``source.loss_fn`` (the task's loss, from which the plan was made: ``model`` and
        ``loss_fn`` are those the source's layers and loss came from). Gradients accumulate into the
        stages' parameters (each micro-batch's loss scaled by 1/m). Returns this pipeline's loss: the
        last stage's mean over the micro-batches, broadcast over the pipeline (a collective), the same
        on every rank of the pipeline."""
        if micro_batches != self.engine.m:
            raise ScheduleError(f"the pipeline runs {self.engine.m} micro-batches per step, asked for {micro_batches}")
        src = self.plan.source
        mbs = split_batch(batch, micro_batches)
        loss = self.engine.step([src.inputs(b) for b in mbs], mbs, src.act_shape, src.act_dtype, tracer=self.tracer)
        return torch.tensor(loss, dtype=torch.float64)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean of the pipelines' losses over the DP group (a collective), as every layout reports it."""
        return self.dense.global_loss(loss)

    def gradients(self, step: int) -> Grads:
        return Grads(None)

    def push(self, step: int, grads: Grads) -> PushResult:
        """Shared weights' gradients summed over the pipeline, then the stages' optimizer step over the
        DP group (and a checkpoint if one is due)."""
        for p in self.shared:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.engine.pp_group)
        return self.dense.push(step, grads)

    def window_metrics(self) -> dict[str, Any]:
        """MoE metrics of this rank's stages since the last call (none without MoE layers)."""
        return self.dense.window_metrics()

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        """``fn()`` on the whole model on every rank: each stage's parameters (gathered over the DP
        group under ZeRO-3) broadcast from its pipeline rank to the others, which hold the rest of the
        model's (tensor-parallel shards of their TP index) stale; then every rank evaluates it."""
        with self.dense.whole():
            for s, params in enumerate(self._stage_params):
                owner = self.engine.pp_ranks[s % self.engine.P]
                for p in params:
                    dist.broadcast(p.data, src=owner, group=self.engine.pp_group)
            return fn(), {}

    def parameters(self) -> torch.Tensor:
        """This rank's stages' parameters, whole over TP and DP, in the model's order (a collective)."""
        return self.dense.parameters()

    def stats(self) -> dict[str, Any]:
        return self.dense.stats()

    def memory(self) -> dict[str, int]:
        return self.dense.memory()

    def describe(self) -> dict[str, Any]:
        """The pipeline's side of the run's report: schedule, micro-batches, virtual stages, the layer
        range of each stage, the theoretical bubble, this rank's optimizer state bytes."""
        e = self.engine
        return {"schedule": e.kind, "micro_batches": e.m, "virtual_stages": e.V, "stages": [list(b) for b in e.bounds],
                "bubble_theory": bubble_theory(e.P, e.m, e.V), "precision": e.precision,
                "optimizer_state_bytes": self.dense.memory()["state_bytes"]}


def stage_sync(
    model: Any, eng: PipelineEngine, optimizer: Any, *, stage: int = 0, dp_group: Any = None, tp_group: Any = None,
    sequence_parallel: bool = False, compress: str | None = None,
) -> Any:
    """The optimizer of this pipeline rank's stages (``eng``, built with ``reduce_grads=False``) in a
    (D, T, P) mesh: the data-parallel core's ``DataParallelSync`` over ``dp_group`` at ZeRO ``stage``
    0-3 (gradients reduced once per step, after the last micro-batch; stage 3 gathers the stages'
    parameters at ``zero_grad`` and keeps them across the micro-batches), the TP-replicated
    parameters' gradients summed over ``tp_group`` first under sequence parallelism; ``compress``:
    16-bit gradients on the DP group's wire. ``model``: the
    plain or tensor-parallel model the layers come from (its ``specs`` name the tensors). Per step:
    ``zero_grad()``, ``eng.step(...)``, ``push(step, Grads(None))`` (reduce, step, checkpoint if due);
    ``join()`` once first (replicas start equal; returns the step of the newest checkpoint). The
    checkpoint format is every layout's (whole plain tensors), so any (D, T, P, ZeRO) loads any other.
    ``PipelineSync`` is the trainer's user of it."""
    from worker.peer.data_parallel import DataParallelSync, whole_specs

    params = eng.parameters()
    specs = whole_specs(model, params)
    return DataParallelSync(
        nn.ModuleList(eng.stages.values()), optimizer, stage=stage, group=dp_group, device=eng.device, overlap=False,
        compress=compress, params=params, specs=specs, tp_group=tp_group,
        tp_replicated=[p for s, p in specs if s.dim is None] if sequence_parallel else [], agree=False, name=f"pp-zero{stage}",
    )


# ---------------------------------------------------------------- command line glue


def pipeline_config(args: argparse.Namespace, world: int) -> tuple[int, int, int, int, int]:
    """(P, D, T, m, V) of a pipeline-path run, or ``PeerConfigError`` naming what does not fit (every rank
    checks the same, before any collective)."""
    P = int(args.pp)
    T = int(getattr(args, "tp", 1) or 1)
    acc, m = int(getattr(args, "accumulate", 1) or 1), int(args.micro_batches)
    if acc > 1 and m and m != acc:
        raise PeerConfigError(f"--accumulate {acc} and --micro-batches {m} contradict: a pipeline's micro-batches are its "
                              "accumulation (give one)")
    m = m or (acc if acc > 1 else 2 * P)
    V = int(args.virtual_stages) if args.schedule == "interleaved" else 1
    if user_pipeline(args) and recompute_mode(args) == "selective":
        raise PeerConfigError("--recompute selective is the gpt task's built-in split's (without --tp-plan/--pp-split); use full")
    if args.mode == "hybrid" and not user_pipeline(args):
        raise PeerConfigError("--pp, --recompute and --precision with the gpt task's built-in split run with --mode dp "
                              "(any --zero): it has no PS rows for --mode hybrid")
    if getattr(args, "sequence_parallel", False) and T == 1:
        raise PeerConfigError("--sequence-parallel needs --tp > 1")
    if P < 1 or T < 1 or world % (P * T):
        raise PeerConfigError(f"world size {world} is not divisible by --tp {T} x --pp {P}")
    D = world // (P * T)
    if getattr(args, "dp", 0) and args.dp != D:
        raise PeerConfigError(f"--dp {args.dp} x --tp {T} x --pp {P} is not the world size {world}")
    if args.global_batch % (D * m):
        raise PeerConfigError(f"global batch {args.global_batch} is not divisible by D {D} x micro-batches {m}")
    try:
        schedule(args.schedule, P, m, V)
    except ScheduleError as e:
        raise PeerConfigError(str(e)) from None
    return P, D, T, m, V


def pipeline_layout(args: argparse.Namespace, task: Any, world: int, device: torch.device) -> tuple[Any, Any, PipelinePlan]:
    """A pipeline-path run's (mesh, task, plan) on this rank (after ``pipeline_config``'s checks, which
    it repeats): the (D, T, P) ``ParallelMesh`` (every rank agreeing on the run first), the task with
    its model tensor-parallel over T (the gpt task's built-in ``TensorParallelGPT``, or ``parallelize``
    by ``--tp-plan`` for any task) and the ``PipelinePlan`` whose source cuts that model into P x V
    stages (the gpt task's layer list, or ``worker.peer.split`` by ``--pp-split``, balanced by
    parameter count without it). ``make_sync`` turns the plan into this rank's ``PipelineSync``."""
    from dataclasses import replace

    from worker.peer.cli import _kv
    from worker.peer.split import PipelineSource

    P, D, T, m, V = pipeline_config(args, world)
    opts = _kv(args.task_opt)
    recompute = recompute_mode(args)
    agree = {"task": args.task, "task_opts": json.dumps(opts, sort_keys=True), "pp": P, "tp": T, "schedule": args.schedule,
             "m": m, "V": V, "global_batch": args.global_batch, "steps": args.steps, "seed": args.seed, "mode": args.mode,
             "precision": args.precision, "recompute": recompute, "tp_plan": args.tp_plan, "pp_split": args.pp_split,
             "compress": args.compress, "ep": args.ep}
    per_rank = args.global_batch // D
    if user_pipeline(args):
        from worker.peer.parallelize import parallelize, plan_arg, resolve_plan
        from worker.peer.split import pipeline_layers, pipeline_source

        split = [s for s in args.pp_split.split(",") if s] if args.pp_split else None
        if split is not None:
            if len(split) != P * V - 1:
                raise PeerConfigError(f"--pp-split names {len(split)} split points; {P * V} stages need {P * V - 1}")
            pipeline_layers(task.model, split)  # the split points, checked on the plain model before any collective
        tp_plan = plan_arg(args.tp_plan or "auto") if T > 1 else None
        if T > 1:
            resolve_plan(task.model, tp_plan, T, bool(args.sequence_parallel))  # every size checked before any collective
        check_agreement(agree)
        mesh = ParallelMesh.build(D, T, P, device=device, seed=args.seed, check={"global_batch": args.global_batch, "micro_batches": m})
        model = parallelize(task.model, mesh, tp_plan, sequence_parallel=bool(args.sequence_parallel)) if T > 1 else task.model
        task = replace(task, model=model.to(mesh.device))
        first = next(task.batches(0, 1, per_rank // m, 0))
        src = pipeline_source(task.loss, task.model, P * V, task.to_device(first, mesh.device) if task.to_device else first, split)
        return mesh, task, PipelinePlan(src, args.schedule, m, V, recompute == "full", args.precision, mesh.rng if T > 1 else None)
    plain: Any = task.model
    layers = gpt_layers(plain)
    if len(layers) < P * V:
        raise PeerConfigError(f"the model has {len(layers)} layers (embeddings, {len(layers) - 2} blocks, head): too few for {P * V} stages")
    seq, dim = int(plain.pos.num_embeddings), int(plain.tok.embedding_dim)
    check = {"heads": plain.blocks[0].heads, "dim": dim, "vocab": plain.tok.num_embeddings, "global_batch": args.global_batch,
             "micro_batches": m, "seq": seq, "sequence_parallel": bool(args.sequence_parallel)}
    check_agreement(agree)
    mesh = ParallelMesh.build(D, T, P, device=device, seed=args.seed, check=check)
    costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]  # of the plain layers, at any T
    act_dtype = next(plain.parameters()).dtype
    split_model = T > 1 or recompute == "selective"  # selective recompute lives in the TP model's blocks (at T=1 too)
    if split_model:
        from worker.peer.tensor_parallel import tensor_parallel_task

        task = tensor_parallel_task(task, mesh, bool(args.sequence_parallel), recompute="selective" if recompute == "selective" else "none")
        layers, stage_loss = tp_gpt_layers(task.model), tp_gpt_loss(task.model)
        act: tuple[int, ...] = ((seq // T if args.sequence_parallel else seq), per_rank // m, dim)
    else:
        stage_loss, act = gpt_loss, (per_rank // m, seq, dim)

    def inputs(b: torch.Tensor) -> torch.Tensor:
        if b.shape[1] - 1 != seq:
            raise PeerConfigError(f"batch sequence length {b.shape[1] - 1} is not the model's {seq}")
        return b[:, :-1]

    src = PipelineSource(layers, costs, inputs, lambda out, b: stage_loss(out, b[:, 1:]), act, act_dtype)
    return mesh, task, PipelinePlan(src, args.schedule, m, V, recompute == "full", args.precision, mesh.rng if split_model else None)


def user_pipeline(args: argparse.Namespace) -> bool:
    """Whether a pipeline run cuts the task's model by ``worker.peer.split`` (any task but gpt, or gpt
    with ``--tp-plan``/``--pp-split``) rather than the gpt task's own layer list."""
    return args.task != "gpt" or bool(getattr(args, "tp_plan", "")) or bool(getattr(args, "pp_split", ""))
