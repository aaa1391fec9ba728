"""The data-parallel core: two objects, each given ``(parameters, process group)``, that every peer
layout composes (DP, ZeRO 1-3, the DP dimension of TP and PP, the TP sum of replicated gradients,
MoE's expert and non-expert parameters). No layout carries its own copy of either.

``GroupReducer``: the mean (or sum) of some parameters' gradients over a group, by flat buckets
of about ``bucket_mb`` (whole parameters, in reverse parameter order: roughly the order backward
produces gradients). With ``attach()``, a post-accumulate-grad hook per parameter counts down its
bucket and launches the bucket's all-reduce asynchronously when its last gradient is in (bucket
order, the same on every rank), so communication overlaps the rest of backward; ``finish()``
launches the rest and waits. Micro-batches under ``no_sync()`` launch nothing (accumulation).
Compression (``bf16``/``fp16``): a bucket travels 16-bit but is summed in fp32 (an all-to-all of
chunks, an fp32 sum per rank, an all-gather: the bytes of a ring all-reduce at half the width).
``divide_by`` (default the group size) turns the sum into the mean, or
into the mean over more ranks (experts: summed over their replicas, divided by all DP ranks).
``own=True`` re-homes the parameters into one ``FlatParams`` (buckets are slices of it, reduced in
place); ``own=False`` leaves them where they are (a subset of another buffer: the TP-replicated
parameters, a pipeline stage's) and stages each bucket through one buffer.

``ShardedOptimizer``: ZeRO stage 0/1/2/3 over a group. Stage 0 is a ``GroupReducer`` and the
optimizer on whole parameters. Stages 1-3: every module that owns parameters directly (a unit)
gets one flat buffer, padded to a multiple of the group size and split evenly; rank r owns chunk r
of every unit, and its chunks, concatenated, are one ``nn.Parameter`` (the shard) that any
``torch.optim`` optimizer steps: optimizer state is 1/D at every stage. Gradients are
reduce-scattered (mean) into the shard's gradient, the shard steps, and the updated chunks are
all-gathered (stage 1/2) or gathered just in time (stage 3). Compressed (``bf16``/``fp16``), the
reduce-scatter is the first half of the reducer's: an all-to-all of 16-bit chunks and an fp32 sum
per rank (the updated values are all-gathered at full width). Stage 2 keeps a unit's full gradient
only from its backward to its reduce-scatter; stage 3 keeps only the shard between steps.
With ``overlap=True`` (plain DP/ZeRO) a unit's reduce-scatter launches from its gradient hooks and
stage 3 gathers each unit before its forward and backward; with ``overlap=False`` (TP, PP, MoE
layouts, where forward and backward do not follow module calls one by one) nothing is reduced
during backward: ``step()`` reduce-scatters once after the last micro-batch, and stage 3 gathers
every unit at ``zero_grad()`` and keeps them across the step's micro-batches.

Freeing is ``untyped_storage().resize_(0)`` on a unit buffer: parameters and gradients stay views
of it (autograd's saved references stay valid) and are refilled in place.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.flat import FlatParams
from worker.peer.debug import fingerprint
from worker.peer.mesh import PeerConfigError, torch_optimizer

__all__ = ["ALONE", "COMPRESS", "Bucket", "GroupReducer", "ShardedOptimizer", "group_rank", "group_size", "make_buckets",
           "optimizer_state_bytes"]

COMPRESS = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket, so communication starts early in backward


#: the group of this rank alone (no collective at all): e.g. experts no other rank holds
ALONE = "alone"


def group_size(group: Any) -> int:
    """Ranks in ``group`` (None: the default group; 1 for ``ALONE`` or when no process group is initialised)."""
    return 1 if group is ALONE or not dist.is_initialized() else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This process's rank inside ``group``."""
    return 0 if group is ALONE or not dist.is_initialized() else dist.get_rank(group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` (size * len(inp)) <- every rank's ``inp`` in group rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` (len(inp) / size) <- this rank's chunk of the sum of every rank's ``inp``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state`` (moments, accumulators, step counters)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


class _Gated:
    """``no_sync()``: while inside, the backward hooks launch nothing (accumulation micro-batches:
    gradients add up locally; the last micro-batch, outside it, communicates)."""

    _syncing = True

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self._gate()

    @contextlib.contextmanager
    def _gate(self) -> Iterator[None]:
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True


# ---------------------------------------------------------------------------------------------- reducer
@dataclass
class Bucket:
    """Parameters ``params`` (indices into the reducer's list) whose gradients are elements
    ``[start, stop)`` of the (possibly virtual) flat gradient."""

    index: int
    start: int
    stop: int
    params: list[int]
    pending: int = 0
    launched: bool = False
    works: list[Any] = field(default_factory=list)
    staged: Any = None  # compressed: (send, recv); own=False: the staging buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


def make_buckets(sizes: Sequence[int], elem: int, bucket_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Contiguous ranges of whole parameters (``sizes``: their element counts, in order; ``elem``:
    bytes per element), from the last parameter backwards, each closed once it holds
    ``bucket_bytes`` (the first once it holds ``min(first_bytes, bucket_bytes)``, as DDP does; a
    parameter larger than that is a bucket of its own)."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    out: list[Bucket] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(sizes))):
        cur.append(i)
        size += sizes[i] * elem
        if size >= (min(first_bytes, bucket_bytes) if not out else bucket_bytes):
            out.append(Bucket(len(out), offsets[min(cur)], offsets[max(cur) + 1], sorted(cur)))
            cur, size = [], 0
    if cur:
        out.append(Bucket(len(out), offsets[min(cur)], offsets[max(cur) + 1], sorted(cur)))
    return out


class GroupReducer(_Gated):
    """The sum of ``params``' gradients over ``group`` (None: the default group; ``ALONE``: none),
    divided by ``divide_by`` (default: the group size, so the mean; 1: the sum), in buckets of about
    ``bucket_mb``; see the module docstring. Blocking calls are
    collectives every rank of the group makes in the same order. Not thread-safe."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: Any = None, *, bucket_mb: float = 25.0, compress: str | None = None,
        divide_by: int | None = None, own: bool = True, device: torch.device | str | None = None,
    ) -> None:
        if compress not in COMPRESS:
            raise PeerConfigError(f"compress must be one of none, bf16, fp16, got {compress!r}")
        if bucket_mb <= 0:
            raise PeerConfigError(f"bucket size must be > 0 MiB, got {bucket_mb}")
        self.params = list(params)
        self.group, self.size = group, group_size(group)
        self.divide_by, self.own = divide_by if divide_by is not None else self.size, own
        self.flat = FlatParams(self.params, device) if own else None
        self.compress, self.compress_name = COMPRESS[compress], compress or "none"
        self.bucket_bytes = int(bucket_mb * 2**20)
        elem = self.params[0].element_size() if self.params else 4
        self.buckets = make_buckets([p.numel() for p in self.params], elem, self.bucket_bytes)
        self._bucket_of = {i: b for b in self.buckets for i in b.params}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks: list[Any] = []
        self._next = 0  # the next bucket to launch (launches go in bucket order on every rank)
        self.tracer: Any = None  # a worker.peer.trace.Tracer: each bucket's collective on the timeline
        self.launched_in_backward = 0  # buckets launched by the hooks (not by finish): the overlap
        self.bytes_reduced = 0
        self.reset()

    def attach(self) -> None:
        """Launch each bucket from backward, when its last gradient is in (post-accumulate-grad hooks)."""
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reset(self) -> None:
        """Before a step's first micro-batch: no bucket launched."""
        for b in self.buckets:
            b.pending, b.launched, b.works, b.staged = len(b.params), False, [], None
        self._next = 0

    def _ready(self, p: torch.Tensor) -> None:
        if not self._syncing:
            return
        self._bucket_of[self._index[id(p)]].pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending > 0 and not force:
                return
            self._launch(b)
            self.launched_in_backward += not force
            self._next += 1

    def _grad(self, b: Bucket) -> torch.Tensor:
        if self.flat is not None:
            return self.flat.grad[b.start : b.stop]
        ps = [self.params[i] for i in b.params]
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])

    def _launch(self, b: Bucket) -> None:
        g = self._grad(b)
        if self.divide_by != 1:
            g.div_(self.divide_by)  # dividing first keeps 16-bit values in range
        b.launched = True
        self.bytes_reduced += g.numel() * g.element_size()
        if self.compress is None:
            fingerprint("all_reduce", g, group=self.group)
            b.works = [dist.all_reduce(g, group=self.group, async_op=True)]
            b.staged = g
            if self.tracer is not None:
                self.tracer.work(f"all_reduce bucket {b.index}", b.works[0], bytes=g.numel() * g.element_size())
            return
        # phase 1: rank r receives chunk r of every rank's bucket (16-bit on the wire)
        n = -(-b.numel // self.size) * self.size
        send = torch.zeros(n, dtype=self.compress, device=g.device)
        send[: b.numel].copy_(g)
        recv = torch.empty_like(send)
        fingerprint("all_to_all", send, group=self.group)
        b.works = [dist.all_to_all_single(recv, send, group=self.group, async_op=True)]
        if self.tracer is not None:
            self.tracer.work(f"all_to_all bucket {b.index}", b.works[0], bytes=send.numel() * send.element_size())
        b.staged = (send, recv)

    def _finish(self, b: Bucket) -> None:
        for w in b.works:
            w.wait()
        b.works = []
        if self.compress is None:
            out = b.staged
        else:
            send, recv = b.staged
            chunk = send.numel() // self.size
            summed = recv.view(self.size, chunk).to(torch.float32).sum(0)  # fp32 accumulation
            gathered = torch.empty_like(send)
            fingerprint("all_gather", gathered, group=self.group)
            _all_gather(gathered, summed.to(self.compress), self.group)  # phase 2: everyone's summed chunk
            out = gathered[: b.numel]
        b.staged = None
        if self.flat is not None:
            if self.compress is not None:
                self.flat.grad[b.start : b.stop].copy_(out)
            return
        off = 0
        for i in b.params:  # own=False: back into the parameters' own gradients
            p = self.params[i]
            part = out[off : off + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            off += p.numel()

    def finish(self) -> None:
        """Reduce every bucket: launch those backward did not (in bucket order), wait for all of
        them. Blocking; every rank of the group calls it. A group of one only divides."""
        if self.size > 1:
            self._launch_ready(force=True)
            for b in self.buckets:
                self._finish(b)
        elif self.divide_by != 1:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(self.divide_by)
        self.reset()

    def stats(self) -> dict[str, Any]:
        return {"buckets": len(self.buckets), "launched_in_backward": self.launched_in_backward,
                "bytes_reduced": self.bytes_reduced, "compress": self.compress_name}


# ---------------------------------------------------------------------------------------------- ZeRO
@dataclass
class _Unit:
    module: nn.Module
    params: list[nn.Parameter]
    numel: int
    chunk: int  # elements per rank
    offset: int  # of this unit's chunk in the rank's shard
    full: torch.Tensor  # size * chunk: the unit's parameters (views into it)
    grad: torch.Tensor  # size * chunk: the unit's gradients (views into it)
    pending: int = 0
    works: list[Any] = field(default_factory=list)
    staged: Any = None  # compressed: (sent, received) 16-bit chunks until the all-to-all is done
    gathered: bool = True
    grad_alive: bool = True


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    want = t.numel() * t.element_size()
    if t.untyped_storage().size() != want:
        t.untyped_storage().resize_(want)


class ShardedOptimizer(_Gated):
    """ZeRO ``stage`` 0-3 of ``params`` (default: ``model``'s trainable parameters; ``model`` gives
    the units and, at stage 3, the forward hooks) over ``group``; see the module docstring.

    ``optimizer``: a task's ``OptimizerSpec`` or a factory ``params -> torch.optim.Optimizer`` (stage
    0: called with the parameters; 1-3: with the one shard parameter). ``bucket_mb``: stage 0's
    buckets; ``compress``: 16-bit gradients on the wire at every stage. Call ``attach()`` once the replicas hold equal
    values (``broadcast()``), ``zero_grad()`` before each step, ``step()`` after its backward.
    Collectives on the calling thread, in the same order on every rank. Not thread-safe."""

    def __init__(
        self, model: nn.Module, optimizer: Any, group: Any = None, *, stage: int = 1,
        params: Sequence[nn.Parameter] | None = None, device: torch.device | str = "cpu", overlap: bool = True,
        bucket_mb: float = 25.0, compress: str | None = None, divide_by: int | None = None,
    ) -> None:
        if stage not in (0, 1, 2, 3):
            raise PeerConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        if compress not in COMPRESS:
            raise PeerConfigError(f"compress must be one of none, bf16, fp16, got {compress!r}")
        if stage and divide_by is not None:
            raise PeerConfigError("a divisor other than the group size is for ZeRO stage 0 only")
        self.stage, self.group, self.overlap = stage, group, overlap
        self.compress, self.compress_name = COMPRESS[compress], compress or "none"
        self.size, self.rank = group_size(group), group_rank(group)
        self.device = torch.device(device)
        model.to(self.device)
        keep = {id(p) for p in (params if params is not None else model.parameters()) if p.requires_grad}
        self.tracer: Any = None
        self.comm_wait_s = 0.0
        self.peak_grad_bytes = 0
        self._hooks: list[Any] = []
        self.reducer: GroupReducer | None = None
        self.units: list[_Unit] = []
        if stage == 0:
            seen: set[int] = set()
            ps = [p for p in model.parameters() if id(p) in keep and not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]
            self.reducer = GroupReducer(ps, group, bucket_mb=bucket_mb, compress=compress, divide_by=divide_by, device=self.device)
            self.params = ps
            self.optimizer = torch_optimizer(optimizer)(ps)
            return
        offset, claimed = 0, set[int]()
        for m in model.modules():
            ps = [p for p in m.parameters(recurse=False) if id(p) in keep and id(p) not in claimed]
            if not ps:
                continue
            claimed.update(id(p) for p in ps)  # a tied parameter belongs to its first module
            n = sum(p.numel() for p in ps)
            chunk = -(-n // self.size)
            full = torch.zeros(chunk * self.size, dtype=ps[0].dtype, device=self.device)
            grad = torch.zeros_like(full)
            off = 0
            with torch.no_grad():
                for p in ps:
                    full[off : off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = full[off : off + p.numel()].view(p.shape)
                    p.grad = grad[off : off + p.numel()].view(p.shape)
                    off += p.numel()
            self.units.append(_Unit(m, ps, n, chunk, offset, full, grad))
            offset += chunk
        self.params = [p for u in self.units for p in u.params]
        dtype = self.units[0].full.dtype if self.units else torch.float32
        self.shard = nn.Parameter(torch.zeros(offset, dtype=dtype, device=self.device))
        self.shard_grad = self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = torch_optimizer(optimizer)([self.shard])
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._inflight: list[_Unit] = []  # stage 2/3 with overlap: units whose reduce-scatter may still run
        self.pull_shard()

    # ------------------------------------------------------------------ setup
    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def agreement(self) -> dict[str, Any]:
        """What every rank of the group must agree on (for ``check_agreement``)."""
        out: dict[str, Any] = {"stage": self.stage, "numel": self.numel, "params": len(self.params), "compress": self.compress_name}
        if self.reducer is not None:
            out.update(bucket_bytes=self.reducer.bucket_bytes)
        else:
            out.update(units=len(self.units), shard=self.shard.numel())
        return out

    def broadcast(self) -> None:
        """The group's first rank's values everywhere (replicas start equal whatever their seeds)."""
        if self.size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group not in (None, dist.group.WORLD) else 0
        with torch.no_grad():
            if self.reducer is not None:
                assert self.reducer.flat is not None
                fingerprint("broadcast", self.reducer.flat.data, group=self.group)
                dist.broadcast(self.reducer.flat.data, src, group=self.group)
                return
            for u in self.units:
                fingerprint("broadcast", u.full, group=self.group)
                dist.broadcast(u.full, src, group=self.group)
        self.pull_shard()

    def pull_shard(self) -> None:
        """The shard <- this rank's chunk of every unit's (gathered) values: after the parameters were
        written from outside (a broadcast, a checkpoint)."""
        if self.reducer is not None:
            return
        with torch.no_grad():
            for u in self.units:
                if u.gathered:
                    self.shard.data[u.offset : u.offset + u.chunk].copy_(u.full[self.rank * u.chunk : (self.rank + 1) * u.chunk])

    def attach(self) -> None:
        """Register the hooks (after the values are final: stage 2/3 free buffers here)."""
        if self.reducer is not None:
            if self.overlap:
                self.reducer.attach()
            return
        for u in self.units:
            if self.overlap:
                for p in u.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))
                if self.stage == 3:
                    self._hooks.append(u.module.register_forward_pre_hook(self._before_forward))
                if self.stage >= 2:  # the output's gradient hook allocates (stage 3: gathers) the unit just in time
                    self._hooks.append(u.module.register_forward_hook(self._after_forward))
        if self.stage >= 2:
            for u in self.units:
                _free(u.grad)
                u.grad_alive = False
        if self.stage == 3:
            for u in self.units:
                _free(u.full)
                u.gathered = False
        self._reset()

    def detach(self) -> None:
        if self.reducer is not None:
            self.reducer.detach()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ stage 3: values just in time
    def _gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        _alloc(u.full)
        fingerprint("all_gather", u.full, group=self.group)
        with torch.no_grad(), self._span("all_gather unit"):
            _all_gather(u.full, self.shard.data[u.offset : u.offset + u.chunk], self.group)
        u.gathered = True

    def _release(self, u: _Unit) -> None:
        if self.stage == 3 and u.gathered:
            _free(u.full)
            u.gathered = False

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole inside the block (stage 3: gathered, a collective; freed after)."""
        was = [u.gathered for u in self.units]
        for u in self.units:
            self._gather(u)
        try:
            yield
        finally:
            for u, w in zip(self.units, was):
                if not w:
                    self._release(u)

    def _span(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.tracer.span(name, "comm") if self.tracer is not None else contextlib.nullcontext()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(self._unit_of[id(next(p for p in module.parameters(recurse=False) if id(p) in self._unit_of))])

    def _after_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        u = self._unit_of[id(next(p for p in module.parameters(recurse=False) if id(p) in self._unit_of))]
        if torch.is_grad_enabled():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            hooked = False
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u: self._before_backward(u))
                    hooked = True
            if not hooked:
                return  # nothing will flow back through it: keep it (rare)
        self._release(u)

    def _before_backward(self, u: _Unit) -> None:
        self._gather(u)
        self._grad_alloc(u)

    # ------------------------------------------------------------------ gradients
    def _grad_alloc(self, u: _Unit) -> None:
        if not u.grad_alive:
            _alloc(u.grad)
            u.grad.zero_()
            u.grad_alive = True
            alive = sum(v.grad.numel() * v.grad.element_size() for v in self.units if v.grad_alive)
            self.peak_grad_bytes = max(self.peak_grad_bytes, alive + self.shard_grad.numel() * self.shard_grad.element_size())

    def zero_grad(self) -> None:
        """Before a step's first micro-batch. Without overlap, stage 2/3 allocate every unit's
        gradient (and stage 3 gathers every unit) here, kept across the step's micro-batches."""
        if self.reducer is not None:
            self.reducer.flat.grad.zero_()  # type: ignore[union-attr]
            self.reducer.reset()
            return
        for u in self.units:
            if self.stage == 1:
                u.grad.zero_()
            elif u.grad_alive:
                _free(u.grad)
                u.grad_alive = False
            if not self.overlap and self.stage >= 2:
                self._gather(u)
                self._grad_alloc(u)
        self.shard_grad.zero_()
        self._reset()

    def _reset(self) -> None:
        for u in self.units:
            u.pending, u.works, u.staged = len(u.params), [], None
        self._inflight = []

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulation micro-batches: full gradients add up locally (stage 2/3 keep them for the step)."""
        return self.reducer.no_sync() if self.reducer is not None else super().no_sync()

    def _ready(self, p: torch.Tensor) -> None:
        u = self._unit_of[id(p)]
        if not self._syncing:
            return
        u.pending -= 1
        if u.pending == 0:
            self._launch(u)

    def _launch(self, u: _Unit) -> None:
        """The unit's gradients are in: reduce-scatter them (mean over the group) into the shard gradient."""
        if not u.grad_alive:  # no gradient reached it this step (stage 2/3): zeros, still exchanged
            self._grad_alloc(u)
        u.grad.div_(self.size)
        if self.compress is None:
            fingerprint("reduce_scatter", u.grad, group=self.group)
            u.works = [_reduce_scatter(self.shard_grad[u.offset : u.offset + u.chunk], u.grad, self.group, async_op=True)]
        else:  # rank r receives chunk r of every rank's gradient, 16-bit; summed in fp32 by _wait
            send = u.grad.to(self.compress)
            u.staged = (send, torch.empty_like(send))
            fingerprint("all_to_all", send, group=self.group)
            u.works = [dist.all_to_all_single(u.staged[1], send, group=self.group, async_op=True)]
        if self.tracer is not None:
            self.tracer.work("reduce_scatter unit", u.works[0], bytes=u.staged[0].nbytes if u.staged else u.grad.nbytes)
        if self.overlap:
            self._release(u)  # stage 3: its values are not needed again until the next forward
        u.pending = -1  # launched
        if self.stage >= 2 and self.overlap:
            # at most 2 reduce-scatters in flight: the older ones are waited for and their full gradients freed
            self._inflight.append(u)
            while len(self._inflight) > 2:
                self._retire(self._inflight.pop(0))

    def _wait(self, u: _Unit) -> None:
        """The unit's reduce-scatter done: its mean gradient chunk in the shard's gradient."""
        for w in u.works:
            w.wait()
        u.works = []
        if u.staged is not None:
            chunks = u.staged[1].view(self.size, u.chunk).to(torch.float32)
            self.shard_grad[u.offset : u.offset + u.chunk].copy_(chunks.sum(0))  # fp32 accumulation
            u.staged = None

    def _retire(self, u: _Unit) -> None:
        self._wait(u)
        if self._syncing and u.grad_alive:
            _free(u.grad)
            u.grad_alive = False

    def reduce(self) -> None:
        """The step's gradients, averaged over the group: stage 0 in the parameters' gradients,
        stages 1-3 in the shard's (launching the units backward never reached, in unit order)."""
        t0 = time.perf_counter()
        if self.reducer is not None:
            self.reducer.finish()
        else:
            for u in self.units:
                if u.pending != -1:
                    self._launch(u)
            for u in self.units:
                self._wait(u)
                if self.stage >= 2 and u.grad_alive:
                    _free(u.grad)
                    u.grad_alive = False
            self._inflight.clear()
        self.comm_wait_s += time.perf_counter() - t0

    def step(self) -> None:
        """``reduce()``, the optimizer's step, then the updated values shared (stage 1/2: every
        unit all-gathered; stage 3: freed, gathered again when needed). Blocking; every rank calls it."""
        self.reduce()
        self.optimizer.step()
        if self.reducer is not None:
            return
        with torch.no_grad(), self._span("all_gather updated chunks"):
            for u in self.units:
                if self.stage == 3:
                    self._release(u)
                elif u.gathered:
                    fingerprint("all_gather", u.full, group=self.group)
                    _all_gather(u.full, self.shard.data[u.offset : u.offset + u.chunk], self.group)

    # ------------------------------------------------------------------ whole values and state
    def local_states(self) -> dict[int, dict[str, Any]]:
        """The optimizer state of every parameter, whole (``{id(param): {key: tensor shaped like it,
        or a scalar}}``): stages 1-3 gather the shard's state over the group (a collective)."""
        if self.reducer is not None:
            return {id(p): dict(self.optimizer.state.get(p, {})) for p in self.params}
        st = self.optimizer.state.get(self.shard, {})
        full: dict[str, Any] = {}
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                allv = torch.empty(v.numel() * self.size, dtype=v.dtype, device=v.device)
                _all_gather(allv, v.contiguous(), self.group)
                full[k] = allv.view(self.size, v.numel())
            else:
                full[k] = v
        out: dict[int, dict[str, Any]] = {}
        for u in self.units:
            per = {k: (v[:, u.offset : u.offset + u.chunk].reshape(-1)[: u.numel] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                   for k, v in full.items()}
            off = 0
            for p in u.params:
                out[id(p)] = {k: (v[off : off + p.numel()].view(p.shape) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                              for k, v in per.items()}
                off += p.numel()
        return out

    def load_states(self, states: dict[int, dict[str, torch.Tensor]], scalars: dict[str, torch.Tensor]) -> None:
        """Optimizer state from whole per-parameter tensors (``states[id(param)]``, the form
        ``local_states`` returns) and ``scalars`` (step counters); every rank keeps its part. Call
        after writing the parameters' values (inside ``gathered()``) and ``pull_shard()``."""
        if self.reducer is not None:
            if states:  # one scalar tensor per parameter: Adam increments ``step`` in place
                index = {id(p): i for i, p in enumerate(self.params)}
                self.optimizer.load_state_dict({
                    "state": {index[i]: {**st, **{k: v.clone() for k, v in scalars.items()}} for i, st in states.items()},
                    "param_groups": self.optimizer.state_dict()["param_groups"],
                })
            return
        # every rank loads optimizer state if any rank has some (ranks with empty shards too)
        has = torch.tensor([1 if states else 0], dtype=torch.int64, device=self.device)
        if self.size > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
        if not int(has):
            return
        keys = sorted({k for st in states.values() for k in st})
        chunk: dict[str, torch.Tensor] = {k: torch.zeros_like(self.shard.data) for k in keys}
        for u in self.units:
            for k in keys:
                flat = torch.zeros(u.chunk * self.size, dtype=self.shard.dtype, device=self.device)
                off = 0
                for p in u.params:
                    if k in states.get(id(p), {}):
                        flat[off : off + p.numel()].copy_(states[id(p)][k].reshape(-1))
                    off += p.numel()
                chunk[k][u.offset : u.offset + u.chunk].copy_(flat[self.rank * u.chunk : (self.rank + 1) * u.chunk])
        sd = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": {0: {**chunk, **scalars}}, "param_groups": sd["param_groups"]})

    # ------------------------------------------------------------------ measuring
    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters (stage 3: the shard), gradients (stage 2/3:
        the shard's), optimizer state; and the peak of gradient bytes during backward."""
        state = optimizer_state_bytes(self.optimizer)
        if self.reducer is not None:
            nb = self.reducer.flat.nbytes()  # type: ignore[union-attr]
            return {"param_bytes": nb, "grad_bytes": nb, "state_bytes": state, "peak_grad_bytes": nb}
        shard = self.shard.numel() * self.shard.element_size()
        full = sum(u.full.numel() * u.full.element_size() for u in self.units)
        return {
            "param_bytes": (shard if self.stage == 3 else full + shard),
            "grad_bytes": (shard if self.stage >= 2 else full + shard),
            "state_bytes": state,
            "peak_grad_bytes": self.peak_grad_bytes if self.stage >= 2 else full + shard,
        }

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage, "comm_wait_s": self.comm_wait_s, "compress": self.compress_name}
        if self.reducer is not None:
            out.update(self.reducer.stats())
        else:
            out.update(units=len(self.units), **self.memory())
        return out
