"""Mixture-of-experts layers and expert parallelism.

``MoE`` replaces a transformer block's MLP: a learned router (fp32 logits at least, softmax) picks the
top-1 or top-2 of ``experts`` MLPs for every token; the token's output is the gate-weighted sum of
its experts' outputs (top-2: the two gates renormalised to sum to 1, as in GShard; top-1: the
router probability, as in the Switch Transformer).

Routing groups are sequences (GShard's "groups"): each expert takes at most
``capacity = ceil(capacity_factor * top_k * seq / experts)`` tokens of one sequence, first
choices before second choices, in token order; an assignment past capacity is dropped (the token
gets nothing from that expert, so a token dropped by all its experts passes through the block's
residual unchanged). The Switch Transformer's load-balancing loss ``E * sum_e f_e * P_e`` (f_e:
share of the group's tokens whose first choice is e, P_e: mean router probability of e) is taken
per sequence and averaged, and the router z-loss is the mean squared log-sum-exp of the logits.
Because everything is per sequence, the result does not depend on how a batch is split over
ranks: a distributed run drops exactly the tokens a single process with the global batch drops.

Expert parallelism (``MoESync``, ``--ep P``): the data-parallel ranks are cut into expert-parallel
groups of P consecutive ranks; rank j of a group keeps experts ``[j*E/P, (j+1)*E/P)`` only.
A layer sends each kept assignment to the rank holding its expert with
``torch.distributed.all_to_all_single`` (variable split sizes, exchanged first by an all-to-all
of the per-expert counts), the experts run on what they received, and a second all-to-all brings
the outputs back (backward: the same two exchanges reversed). Expert gradients are summed over
the ranks holding the same experts (one rank per EP group) and divided by the world size; the
other parameters (embeddings, attention, router, norms) go through ``DataParallelSync`` (ZeRO
stage 0-3) over the DP ranks as in plain data parallelism. With tensor parallelism each expert's MLP
is split by hidden over the TP group (``MoE.tensor_parallel``); with sequence parallelism too, the
layer gathers its TP group's chunks into whole sequences (``sp_group``), so routing and capacity
stay per sequence. In a pipeline each stage's layers are synced alike (``part``), and a stage may
hold none; in the PS hybrid ``MoESync`` is the dense part beside the PS rows.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.peer.checkpoint import Checkpointing, CheckpointReader, Piece, read_whole_tensors, whole_tensor_pieces
from worker.peer.core import _all_gather
from worker.peer.data_parallel import WrapsDense
from worker.peer.mesh import PeerConfigError
from worker.sync_api import Fetched, Grads, ParamSync, PushResult

__all__ = ["Expert", "ExpertGroups", "MoE", "MoEConfig", "MoESync", "Router", "aux_loss", "expert_groups", "moe_layers",
           "recomputing"]


@dataclass(frozen=True)
class MoEConfig:
    """``experts`` per MoE layer, ``top_k`` (1 or 2) experts per token, an MoE MLP in every
    ``every``-th block (the last of each ``every``), expert ``hidden`` size (0: 4 x dim),
    ``capacity_factor`` (> 0), and the coefficients of the balance loss and of the z-loss."""

    experts: int = 4
    top_k: int = 2
    every: int = 1
    hidden: int = 0
    capacity_factor: float = 1.25
    aux_coef: float = 0.01
    z_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise PeerConfigError(f"moe experts must be >= 1, got {self.experts}")
        if self.top_k not in (1, 2) or self.top_k > self.experts:
            raise PeerConfigError(f"moe top-k must be 1 or 2 (and <= experts {self.experts}), got {self.top_k}")
        if self.every < 1:
            raise PeerConfigError(f"moe every must be >= 1, got {self.every}")
        if self.hidden < 0:
            raise PeerConfigError(f"moe hidden must be >= 0, got {self.hidden}")
        if not self.capacity_factor > 0:
            raise PeerConfigError(f"moe capacity factor must be > 0, got {self.capacity_factor}")
        if self.aux_coef < 0 or self.z_coef < 0:
            raise PeerConfigError(f"moe loss coefficients must be >= 0, got aux {self.aux_coef}, z {self.z_coef}")

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has an MoE MLP."""
        return layer % self.every == self.every - 1


class Router(nn.Linear):
    """The router: ``dim -> experts`` logits, computed in fp32 at least whatever the model's dtype
    (fp64 in an fp64 model; a module of its own, so ZeRO's per-module hooks see it)."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # bf16 compute (autocast) leaves the routing in fp32
            return F.linear(x.to(dtype), self.weight.to(dtype))


class Expert(nn.Module):
    """One expert: the dense block's MLP (``fc``, GELU, ``out``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


@dataclass
class _Meter:
    """What the layer did since the last ``take``: training forwards only (with gradients, each once)."""

    forwards: int = 0
    assignments: float = 0.0
    dropped: float = 0.0
    counts: torch.Tensor | None = None  # (E,) assignments per expert (before dropping), float64
    balance: float = 0.0
    z: float = 0.0
    a2a_s: float = 0.0
    a2a_bytes: int = 0


_RECOMPUTING = [False]


@contextlib.contextmanager
def recomputing() -> Any:
    """Inside: forwards re-run in backward (activation recomputation): the layers' meters count each
    training forward once."""
    before, _RECOMPUTING[0] = _RECOMPUTING[0], True
    try:
        yield
    finally:
        _RECOMPUTING[0] = before


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the group's ranks (``in_splits`` rows to each), rows from them
    (``out_splits``); backward sends the gradients back the same way reversed. The forward's
    output lands in ``buffers[slot]`` (kept and reused: its consumers copy it at once, and a fresh
    16 MiB CPU tensor costs its page faults on every call)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, meter: _Meter,
        buffers: dict[str, torch.Tensor], slot: str,
    ) -> torch.Tensor:
        ctx.args = (out_splits, in_splits, group, meter)
        shape = (sum(out_splits), *x.shape[1:])
        n = math.prod(shape)
        buf = buffers.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != x.dtype or buf.device != x.device:
            buf = buffers[slot] = x.new_empty(max(n, 1))
        return _exchange(x, buf[:n].view(shape), out_splits, in_splits, group, meter)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits, group, meter = ctx.args
        out = g.new_empty((sum(in_splits), *g.shape[1:]))
        return _exchange(g, out, in_splits, out_splits, group, meter), None, None, None, None, None, None


def _exchange(x: torch.Tensor, out: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, meter: _Meter) -> torch.Tensor:
    x = x.contiguous()
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    meter.a2a_s += time.perf_counter() - t0
    meter.a2a_bytes += x.numel() * x.element_size()
    return out


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``(B, T, dim) -> (B, T, dim)``; after a training forward, ``aux``
    holds the layer's weighted auxiliary loss (balance + z) to add to the task loss.

    ``experts`` is a ``ModuleDict`` keyed by the global expert index; under expert parallelism
    (``shard``) it holds this rank's experts only, so parameter names stay global.
    """

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.experts
        self.router = Router(dim, cfg.experts)
        hidden = cfg.hidden or 4 * dim
        self.experts = nn.ModuleDict({str(e): Expert(dim, hidden) for e in range(cfg.experts)})
        self.group: Any = None  # the expert-parallel group (None: every expert is here)
        self.ep_size, self.ep_rank = 1, 0
        self.tp_group: Any = None  # tensor parallelism: each expert's MLP split by hidden over this group
        # sequence parallelism: the input and output are this rank's chunk of every sequence (dimension 1)
        # over this group (the TP group); the layer runs on the whole sequences, as every TP rank does without SP
        self.sp_group: Any = None
        self.aux: torch.Tensor | None = None
        self.meter = _Meter()
        self._a2a_out: dict[str, torch.Tensor] = {}  # the all-to-alls' forward outputs, reused
        self.last_dropped: torch.Tensor | None = None  # (B, T, k) bool: assignments dropped in the last forward

    # ------------------------------------------------------------------ expert parallelism
    @property
    def local_experts(self) -> range:
        per = self.num_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def shard(self, group: Any, ep_size: int, ep_rank: int) -> None:
        """Keep only the experts of EP rank ``ep_rank`` of ``ep_size``; exchange tokens over ``group``."""
        if self.num_experts % ep_size:
            raise PeerConfigError(f"--ep {ep_size} does not divide the {self.num_experts} experts of an MoE layer")
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        keep = {str(e) for e in self.local_experts}
        for k in list(self.experts.keys()):
            if k not in keep:
                del self.experts[k]

    def tensor_parallel(self, group: Any, shard: Any) -> MoE:
        """This layer split over the TP ``group`` (``T`` ranks): the router replicated, every
        expert's MLP by its hidden dimension (``fc`` column-parallel: rows of its weight and bias;
        ``out`` row-parallel: columns of its weight, the bias replicated). ``shard(name, dim)`` gives
        this rank's chunk of the parameter ``name`` (relative to the layer) split along ``dim``
        (None: replicated). Parameter names stay the plain layer's."""
        t = dist.get_world_size(group)
        hidden = self.cfg.hidden or 4 * self.router.in_features
        if hidden % t:
            raise PeerConfigError(f"tensor parallelism: the experts' hidden size {hidden} is not divisible by tp {t}")
        if self.ep_size > 1:
            raise PeerConfigError("MoE.tensor_parallel: split by TP before sharding the experts by EP")
        dim = self.router.in_features
        with torch.random.fork_rng(devices=[]):  # its initial values are overwritten: leave the RNG alone
            layer = MoE(dim, replace(self.cfg, hidden=hidden // t))
        with torch.no_grad():
            layer.router.weight.copy_(shard("router.weight"))
            for e in range(self.num_experts):
                ex: Any = layer.experts[str(e)]
                pre = f"experts.{e}."
                ex.fc.weight.copy_(shard(pre + "fc.weight", 0))
                ex.fc.bias.copy_(shard(pre + "fc.bias", 0))
                ex.out.weight.copy_(shard(pre + "out.weight", 1))
                ex.out.bias.copy_(shard(pre + "out.bias"))
        layer.to(self.router.weight.dtype)
        layer.tp_group = group
        return layer

    # ------------------------------------------------------------------ forward
    def capacity(self, seq: int) -> int:
        """Assignments one expert takes from one sequence of ``seq`` tokens."""
        return max(1, math.ceil(self.cfg.capacity_factor * self.cfg.top_k * seq / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is None:
            return self._route(x)
        # routing and capacity are per sequence: gather the sequences (backward: this rank's chunk of the
        # gradient, which every TP rank computes whole and alike), and give back this rank's chunk
        from worker.peer.tensor_parallel import _GatherFeatures, _SplitToSeq

        whole = _GatherFeatures.apply(x, self.sp_group, 1)
        return _SplitToSeq.apply(self._route(whole), self.sp_group, 1)  # type: ignore[no-any-return]

    def _route(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        e_n, k = self.num_experts, self.cfg.top_k
        logits = self.router(x)  # (B, T, E), fp32 at least
        probs = logits.softmax(-1)
        top_p, top_i = probs.topk(k, dim=-1)  # (B, T, k)
        gates = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
        # slots: per sequence, first choices (in token order) before second choices
        chosen = F.one_hot(top_i.transpose(1, 2).reshape(b, k * t), e_n)  # (B, k*T, E): assignment a = j*T + t
        slot = ((chosen.cumsum(1) - 1) * chosen).sum(-1)  # (B, k*T)
        keep = (slot < self.capacity(t)).reshape(-1)
        expert = top_i.transpose(1, 2).reshape(-1)  # (B*k*T,) assignment order (b, j, t)
        token = (torch.arange(b, device=x.device)[:, None, None] * t + torch.arange(t, device=x.device)).expand(b, k, t).reshape(-1)
        kept = keep.nonzero().squeeze(1)
        order = kept[torch.argsort(expert[kept], stable=True)]  # kept assignments grouped by expert
        counts = torch.bincount(expert[kept], minlength=e_n)
        y_sorted = self._experts(x.reshape(b * t, d)[token[order]], counts)
        y = y_sorted.new_zeros(b * k * t, d).index_copy(0, order, y_sorted).view(b, k, t, d)  # autocast: bf16
        out = (y.to(gates.dtype) * gates.transpose(1, 2).unsqueeze(-1)).sum(1).to(x.dtype)
        # auxiliary losses, per sequence (so linear in the batch)
        first = F.one_hot(top_i[..., 0], e_n).float().mean(1)  # (B, E): f_e
        balance = (e_n * (first * probs.mean(1)).sum(-1)).mean()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        self.aux = self.cfg.aux_coef * balance + self.cfg.z_coef * z
        self.last_dropped = (~keep).view(b, k, t).transpose(1, 2)
        # training forwards only: not a recomputation in backward (the same tokens again), nor a forward
        # without gradients (a pipeline's probe of its activation shapes)
        if self.training and torch.is_grad_enabled() and not _RECOMPUTING[0]:
            m = self.meter
            c = torch.bincount(expert, minlength=e_n).double().cpu()
            m.counts = c if m.counts is None else m.counts + c
            m.forwards += 1
            m.assignments += expert.numel()
            m.dropped += float(expert.numel() - kept.numel())
            m.balance += float(balance.detach())
            m.z += float(z.detach())
        return out

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for ``rows`` (grouped by expert, ``counts`` per expert), wherever the experts live."""
        if self.ep_size == 1:
            return self._run(rows, counts.tolist())
        recv, recv_counts, in_splits, out_splits = self.dispatch(rows, counts)
        p, per = recv_counts.shape
        row_expert = torch.repeat_interleave(torch.arange(per, device=rows.device).repeat(p), recv_counts.reshape(-1))
        perm = torch.argsort(row_expert, stable=True)
        y = self._run(recv[perm], recv_counts.sum(0).tolist())
        back = torch.zeros_like(y).index_copy(0, perm, y)
        return _AllToAll.apply(back, in_splits, out_splits, self.group, self.meter, self._a2a_out, "combine")  # type: ignore[no-any-return]

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Send ``rows`` (grouped by expert, ``counts`` (E,) per expert) to the ranks holding their
        experts: the counts first (an all-to-all of E integers), then the rows (variable splits).
        Returns the rows received (by source rank, then local expert), the received counts
        (source rank x local expert), and the send and receive splits (rows per rank)."""
        p, per = self.ep_size, self.num_experts // self.ep_size
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(p, per)
        in_splits = counts.view(p, per).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = _AllToAll.apply(rows, out_splits, in_splits, self.group, self.meter, self._a2a_out, "dispatch")
        return recv, recv_counts, in_splits, out_splits

    def _run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by local expert (``counts`` rows each) through their experts. Under TP
        every expert's partial output (its hidden slice) is summed over the TP group in one all-reduce
        for all local experts (the TP ranks of a replica hold the same rows: same tokens, same router)."""
        if self.tp_group is not None and rows.shape[0]:
            from worker.peer.tensor_parallel import _CopyToTP, _ReduceFromTP

            rows = _CopyToTP.apply(rows, self.tp_group)
            parts, bias, start = [], [], 0
            for e, n in zip(self.local_experts, counts):
                ex: Any = self.experts[str(e)]
                parts.append(F.linear(F.gelu(ex.fc(rows[start : start + n])), ex.out.weight))
                bias.append(ex.out.bias.expand(n, -1))
                start += n
            return _ReduceFromTP.apply(torch.cat(parts), self.tp_group) + torch.cat(bias)  # type: ignore[no-any-return]
        outs, start = [], 0
        for e, n in zip(self.local_experts, counts):
            outs.append(self.experts[str(e)](rows[start : start + n]))
            start += n
        return torch.cat(outs) if outs else rows[:0]

    def take(self) -> _Meter:
        """The meter since the last call (and a fresh one)."""
        m, self.meter = self.meter, _Meter()
        return m


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """``(name, layer)`` of the model's MoE layers, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sum of the MoE layers' auxiliary losses from the last forward (0.0 without MoE layers)."""
    total: torch.Tensor | float = 0.0
    for m in model.modules():
        if isinstance(m, MoE) and m.aux is not None:
            total = total + m.aux
    return total


def window_metrics(layers: list[MoE], steps: int = 0) -> dict[str, Any]:
    """The layers' meters since the last call as metrics, per step (``steps`` in the window; 0:
    one step per training forward): tokens per expert (a list per layer), the coefficient of
    variation of those counts (mean over layers; 0 is perfect balance), the dropped share of
    assignments, the balance loss and z-loss (mean per forward, summed over layers, unweighted),
    all-to-all milliseconds and MiB (this rank, forward and backward)."""
    ms = [m.take() for m in layers]
    ms = [m for m in ms if m.forwards]
    if not ms:
        return {}
    steps = steps or ms[0].forwards
    per_layer = [(m.counts / steps).tolist() if m.counts is not None else [] for m in ms]
    cvs = [float(torch.tensor(c).std(unbiased=False) / torch.tensor(c).mean().clamp_min(1e-12)) for c in per_layer]
    return {
        "moe_tokens_per_expert": [[round(v, 2) for v in c] for c in per_layer],
        "moe_cv": sum(cvs) / len(cvs),
        "moe_dropped": sum(m.dropped for m in ms) / max(sum(m.assignments for m in ms), 1.0),
        "moe_balance_loss": sum(m.balance / m.forwards for m in ms),
        "moe_z_loss": sum(m.z / m.forwards for m in ms),
        "a2a_ms": 1e3 * sum(m.a2a_s for m in ms) / steps,
        "a2a_mb": sum(m.a2a_bytes for m in ms) / steps / 2**20,
    }


# ---------------------------------------------------------------------- expert parallelism
@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel ``group`` (``size`` ranks, it is ``rank`` in it) and the
    ``replicas`` group of the ranks that hold the same experts (None when it is this rank alone)."""

    size: int
    rank: int
    group: Any
    replicas: Any
    replica_count: int


def expert_groups(ep: int, mesh: Any = None) -> ExpertGroups:
    """EP groups carved from the data-parallel ranks: for each (PP, TP) index of ``mesh`` (None: every
    rank one replica), its D replicas cut into groups of ``ep`` consecutive ones; ``replicas``: the
    ranks with this rank's PP, TP and EP index (the same expert shards). Every rank creates every
    group, in the same order."""
    world = dist.get_world_size()
    if mesh is None:
        lines, here, pos, what = [list(range(world))], 0, dist.get_rank(), "data-parallel ranks"
    else:
        lines = [[mesh.rank_of(d, t, p, mesh.dp, mesh.tp) for d in range(mesh.dp)] for p in range(mesh.pp) for t in range(mesh.tp)]
        here, pos, what = mesh.pp_idx * mesh.tp + mesh.tp_idx, mesh.dp_idx, "data-parallel replicas (dp)"
    if ep < 1:
        raise PeerConfigError(f"--ep must be >= 1, got {ep}")
    if len(lines[0]) % ep:
        raise PeerConfigError(f"--ep {ep} does not divide the {len(lines[0])} {what}")
    groups = len(lines[0]) // ep
    mine: Any = None
    replicas: Any = None
    if ep > 1:
        for i, line in enumerate(lines):
            for g in range(groups):
                pg = dist.new_group(line[g * ep : (g + 1) * ep])
                if i == here and g == pos // ep:
                    mine = pg
    if groups > 1:
        for i, line in enumerate(lines):
            for j in range(ep):
                members = [line[g * ep + j] for g in range(groups)]
                pg = dist.group.WORLD if len(members) == world else dist.new_group(members)
                if i == here and j == pos % ep:
                    replicas = pg
    return ExpertGroups(ep, pos % ep, mine, replicas, groups)


class MoESync(WrapsDense, ParamSync, Checkpointing):
    """The ``ParamSync`` of a model with MoE layers, in any layout: the experts split over ``ep``
    data-parallel ranks (expert parallelism; 1: every rank holds every expert), composed of the
    core's two objects (``worker.peer.core``):

    - the non-expert parameters (embeddings, attention, router, norms): a ``DataParallelSync`` over
      the DP group at ZeRO ``stage`` 0-3 (without a mesh: every rank; with a ``ParallelMesh``: its
      DP dimension, the model a tensor-parallel one whose experts are split by hidden over TP);
    - the experts: a ``ShardedOptimizer`` at stage 0 over the ranks holding the same experts (same
      EP index, same TP index), gradients summed there and divided by the DP size (each expert saw
      the tokens of its whole EP group). ZeRO never shards experts: EP already splits them.

    ``model``'s MoE layers are sharded here (every rank builds the same full model first, so the
    experts a rank keeps start from the single-process model's values). ``parameters()`` and
    checkpoints give the plain model's tensors whole, in its order and under its names (gathered
    over TP, experts over EP): a checkpoint of any layout loads into any other. ``part``: the
    modules this rank trains (a pipeline rank's stages; default the whole model): only its
    parameters are reduced, stepped, reported and saved, while every MoE layer of ``model`` is
    sharded alike. ``agree=False``: the caller checks that the ranks agree (pipeline stages differ
    in size by design)."""

    pipelined = False

    def __init__(
        self, model: nn.Module, optimizer: Any, mesh: Any = None, *, ep: int = 1, stage: int = 0,
        device: torch.device | str = "cpu", bucket_mb: float = 25.0, compress: str | None = None,
        settings: dict[str, Any] | None = None, part: nn.Module | None = None, agree: bool = True,
    ) -> None:
        from worker.peer.core import ALONE, ShardedOptimizer
        from worker.peer.data_parallel import DataParallelSync, whole_specs

        self.name = "moe"
        every = moe_layers(model)
        if not every:
            raise PeerConfigError("the model has no MoE layers (use --moe-experts E with the gpt task)")
        scope = part if part is not None else model
        mine = {id(m) for m in scope.modules()}
        self.layers = [(n, m) for n, m in every if id(m) in mine]  # the layers this rank trains
        self.model, self.mesh = model, mesh
        self.device = torch.device(mesh.device if mesh is not None else device)
        trained = {id(p) for p in scope.parameters()}
        self.order = [s.name for s, p in whole_specs(model) if id(p) in trained]  # the plain model's order, before sharding
        self.groups = expert_groups(ep, mesh)
        for _, layer in every:  # every layer alike on every rank (a pipeline's other stages too: evaluations run them)
            layer.shard(self.groups.group, ep, self.groups.rank)
        specs = whole_specs(model, list(scope.parameters()))  # this rank's (experts: the local ones only)
        expert_ids = {id(p) for _, m in self.layers for p in m.experts.parameters()}
        self.expert_specs = [(s, p) for s, p in specs if id(p) in expert_ids]
        dense_specs = [(s, p) for s, p in specs if id(p) not in expert_ids]
        dp = mesh.dp if mesh is not None else dist.get_world_size()
        self.tp = mesh.tp if mesh is not None else 1
        self.tp_group = mesh.tp_group if mesh is not None and mesh.tp > 1 else None
        tp_partial: list[nn.Parameter] = []
        if self.tp_group is not None and getattr(model, "sequence_parallel", False):
            # SP: the replicated parameters that ran on a chunk of the sequence hold partial gradients, summed
            # over TP; not the routers (an MoE layer runs on whole sequences, alike on every TP rank)
            partial = model.tp_sum_parameters() if hasattr(model, "tp_sum_parameters") else model.replicated_parameters()  # type: ignore[operator]
            ids = {id(p) for p in partial} - {id(p) for _, m in every for p in m.parameters()}
            tp_partial = [p for _, p in dense_specs if id(p) in ids]
        settings = {**(settings or {}), "ep": ep, "experts": every[0][1].num_experts}
        self.dense = DataParallelSync(
            model, optimizer, stage=stage, group=mesh.dp_group if mesh is not None else None, device=self.device,
            bucket_mb=bucket_mb, compress=compress, overlap=mesh is None, params=[p for _, p in dense_specs], specs=dense_specs,
            tp_group=self.tp_group, tp_replicated=tp_partial, settings=settings, name="moe", agree=agree,
        )
        # None: this rank trains no MoE layer (a pipeline stage without one); its replicas neither
        self.experts = ShardedOptimizer(
            model, optimizer, self.groups.replicas if self.groups.replicas is not None else ALONE, stage=0,
            params=[p for _, p in self.expert_specs], device=self.device, overlap=False, divide_by=dp, compress=compress,
        ) if self.expert_specs else None
        self.flat = self.dense.flat
        first_tp = mesh is None or mesh.tp_idx == 0
        self.expert_writer = first_tp and (mesh.dp_idx if mesh is not None else dist.get_rank()) < self.groups.size
        self._window_steps = 0  # steps since the last window_metrics

    def join(self) -> int:
        """The dense part's join (agreement, the DP group's first values), then the experts: each
        replica group takes its first member's values; then the newest checkpoint, if any."""
        start = self.dense.join()
        if self.experts is not None:
            self.experts.broadcast()
        return max(start, self._resume())

    def leave(self) -> None:
        self.dense.leave()

    def fetch(self, step: int, batch: Any) -> Fetched:
        return Fetched(step, batch, step)

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        if self.experts is not None:
            self.experts.zero_grad()

    def no_sync(self) -> Any:
        return self.dense.no_sync()

    def gradients(self, step: int) -> Grads:
        return Grads(None)

    def push(self, step: int, grads: Grads) -> PushResult:
        """The dense part's reduction and step, the experts' (summed over replicas, / DP size)."""
        self.dense.push(step, grads)  # it saves no checkpoint of its own
        if self.experts is not None:
            self.experts.step()
        self._window_steps += 1
        self._maybe_save(step + 1)
        return PushResult()

    def global_loss(self, loss: torch.Tensor) -> float:
        return self.dense.global_loss(loss)

    def evaluate(self, step: int, final: bool, fn: Any) -> tuple[dict[str, float], dict[str, Any]]:
        return self.dense.evaluate(step, final, fn)

    def whole(self) -> contextlib.AbstractContextManager[None]:
        """The non-expert parameters gathered over the DP group inside the block (ZeRO-3; a collective)."""
        return self.dense.whole()

    def window_metrics(self) -> dict[str, Any]:
        """MoE metrics since the last call, per step (see ``window_metrics``)."""
        steps, self._window_steps = self._window_steps, 0
        return window_metrics([m for _, m in self.layers], steps)

    def stats(self) -> dict[str, Any]:
        n = sum(p.numel() for _, p in self.expert_specs)
        return {**self.dense.stats(), "ep": self.groups.size, "expert_params": n,
                **({"tp": self.mesh.tp, "dp": self.mesh.dp} if self.mesh is not None else {})}

    def memory(self) -> dict[str, int]:
        m = self.dense.memory()
        e = self.experts.memory() if self.experts is not None else {}
        return {k: m[k] + e.get(k, 0) for k in ("param_bytes", "grad_bytes", "state_bytes")} | {"peak_grad_bytes": m["peak_grad_bytes"]}

    # ------------------------------------------------------------------ whole tensors
    def _whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (this rank's whole-over-TP tensors by plain name, experts: the local ones) with
        every layer's other experts gathered over the EP group (a collective on every rank)."""
        out = dict(tensors)
        if self.groups.size == 1:
            return out
        for name, layer in self.layers:
            local = list(layer.local_experts)
            subs = [n for n, _ in layer.experts[str(local[0])].named_parameters()]
            flat = torch.cat([tensors[f"{name}.experts.{e}.{sub}"].reshape(-1) for e in local for sub in subs])
            allv = flat.new_empty(self.groups.size * flat.numel())
            _all_gather(allv, flat, self.groups.group)
            off = 0
            for j in range(self.groups.size):  # EP rank j's experts, in its order
                for i in range(len(local)):
                    for sub in subs:
                        like = tensors[f"{name}.experts.{local[0]}.{sub}"]
                        out[f"{name}.experts.{j * len(local) + i}.{sub}"] = allv[off : off + like.numel()].view(like.shape)
                        off += like.numel()
        return out

    def parameters(self) -> torch.Tensor:
        """The plain model's parameters, whole, in its order (a collective)."""
        with self.dense.whole():
            mine = {s.name: self.dense._tp_gather(s, p) for s, p in self.dense.specs + self.expert_specs}
        whole = self._whole(mine)
        return torch.cat([whole[n].reshape(-1) for n in self.order])

    def checkpoint_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        """The dense part's pieces; the experts whole (over TP), with their optimizer state, from the
        TP-first ranks of the first EP group: any layout can read them back."""
        pieces, scalars = self.dense.checkpoint_pieces()
        if self.experts is None:
            return pieces, scalars
        ps, sc = whole_tensor_pieces(self.expert_specs, self.experts.local_states(), self.dense._tp_gather, self.expert_writer)
        return pieces + ps, {**scalars, **sc}

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        for s, _ in self.expert_specs:
            if not reader.has(f"param/{s.name}"):
                raise PeerConfigError(f"checkpoint {reader.path} has no {s.name!r}: saved from another model (experts?)")
        self.dense.load_checkpoint(reader)
        if self.experts is None:
            return
        state = read_whole_tensors(reader, self.expert_specs, self.mesh.tp_idx if self.mesh is not None else 0, self.tp)
        self.experts.load_states(state, {k: torch.tensor(v, dtype=torch.float32) for k, v in reader.scalars.items()})
