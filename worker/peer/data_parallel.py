"""Data parallelism by bucketed all-reduce, launched from backward hooks.

The model's parameters are one ``FlatParams``; the flat gradient is cut into buckets of about
``bucket_mb`` (whole parameters, in reverse parameter order: roughly the order backward produces
gradients). A post-accumulate-grad hook on each parameter counts down its bucket; when a bucket's
last gradient is in, the bucket's all-reduce is launched asynchronously (in bucket order, the same
on every rank), so communication overlaps the rest of backward. ``push`` waits for the buckets and
steps the optimizer (any ``torch.optim``) on the averaged gradient.

Compression (``compress="bf16"|"fp16"``): a bucket travels as 16-bit but is summed in fp32: an
all-to-all sends each rank its chunk of every rank's bucket, the rank sums them in fp32, and an
all-gather returns the summed chunks (the same bytes on the wire as a ring all-reduce, half the
width). Gradient accumulation: micro-batches under ``no_sync()`` launch nothing.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.flat import FlatParams
from worker.peer.checkpoint import (
    Checkpointing,
    CheckpointReader,
    Piece,
    load_whole_params,
    optimizer_pieces,
)
from worker.peer.debug import fingerprint
from worker.peer.mesh import (
    PeerConfigError,
    all_gather_into,
    check_agreement,
    torch_optimizer,
)
from worker.sync_api import Fetched, Grads, ParamSync, PushResult

__all__ = ["COMPRESS", "AllReduceDP", "Bucket", "make_buckets", "optimizer_state_bytes"]

COMPRESS = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Bucket:
    """Parameters ``params`` (indices into ``FlatParams.params``) whose gradients are ``flat.grad[start:stop]``."""

    index: int
    start: int
    stop: int
    params: list[int]
    pending: int = 0
    launched: bool = False
    works: list[Any] = field(default_factory=list)
    staged: Any = None  # compressed: (send, recv) buffers between the two phases

    @property
    def numel(self) -> int:
        return self.stop - self.start


FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket, so communication starts early in backward


def make_buckets(flat: FlatParams, bucket_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
    """Contiguous ranges of whole parameters, from the last parameter backwards, each closed once it
    holds ``bucket_bytes`` (the first one once it holds ``min(first_bytes, bucket_bytes)``, as
    DDP does; a parameter larger than that is a bucket of its own)."""
    out: list[Bucket] = []
    cur: list[int] = []
    size = 0
    elem = flat.data.element_size()
    for seg in reversed(flat.segments):
        cur.append(seg.index)
        size += seg.numel * elem
        if size >= (min(first_bytes, bucket_bytes) if not out else bucket_bytes):
            out.append(_bucket(flat, len(out), cur))
            cur, size = [], 0
    if cur:
        out.append(_bucket(flat, len(out), cur))
    return out


def _bucket(flat: FlatParams, index: int, params: list[int]) -> Bucket:
    segs = [flat.segments[i] for i in params]
    return Bucket(index, min(s.offset for s in segs), max(s.offset + s.numel for s in segs), sorted(params))


class AllReduceDP(ParamSync, Checkpointing):
    """Every rank holds the whole model; gradients are averaged by bucketed all-reduce.

    ``model``: moved to ``device``; its trainable parameters become a ``FlatParams``.
    ``optimizer``: a task's ``OptimizerSpec`` or a factory ``params -> torch.optim.Optimizer``.
    ``bucket_mb``: bucket size (MiB of gradient). ``compress``: None, ``bf16`` or ``fp16``.
    ``settings``: extra fields every rank must agree on (checked in ``join``).

    Collectives: ``pipelined`` is False, so the trainer calls fetch and push on the main thread.
    """

    pipelined = False

    def __init__(
        self, model: nn.Module, optimizer: Any, *, device: torch.device | str = "cpu", bucket_mb: float = 25.0,
        compress: str | None = None, settings: dict[str, Any] | None = None, name: str = "dp",
    ) -> None:
        if compress not in COMPRESS:
            raise PeerConfigError(f"compress must be one of none, bf16, fp16, got {compress!r}")
        if bucket_mb <= 0:
            raise PeerConfigError(f"bucket size must be > 0 MiB, got {bucket_mb}")
        self.name = name
        self.model = model
        self.device = torch.device(device)
        self.flat = FlatParams.of(model, self.device)
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names[id(p)] for p in self.flat.params]
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.compress = COMPRESS[compress]
        self.compress_name = compress or "none"
        self.settings = dict(settings or {})
        self.buckets = make_buckets(self.flat, self.bucket_bytes)
        self._bucket_of = {i: b for b in self.buckets for i in b.params}
        self.optimizer = torch_optimizer(optimizer)(self.flat.params)
        self._hooks: list[Any] = []
        self.tracer: Any = None  # a worker.peer.trace.Tracer: each bucket's collective on the timeline
        self._syncing = True
        self._next = 0  # the next bucket to launch (launches go in bucket order on every rank)
        self.world = 1
        self.comm_wait_s = 0.0  # time push waited for communication backward did not hide
        self.launched_in_backward = 0  # buckets launched by the hooks (not by push): the overlap
        self.bytes_reduced = 0

    # ------------------------------------------------------------------ membership
    def join(self) -> int:
        """Check that every rank agrees (model size, buckets, settings), broadcast rank 0's initial
        parameters (so all ranks start equal whatever their seeds), register the hooks."""
        self.world = dist.get_world_size()
        check_agreement({
            "mode": self.name, "numel": self.flat.numel, "params": len(self.flat.params),
            "bucket_bytes": self.bucket_bytes, "compress": self.compress_name, **self.settings,
        }, self._agree_device())
        fingerprint("broadcast", self.flat.data)
        dist.broadcast(self.flat.data, 0)
        start = self._resume()  # the newest checkpoint, if checkpointing is on and there is one
        for p in self.flat.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))
        self._reset()
        return start

    def _agree_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def leave(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ step
    def fetch(self, step: int, batch: Any) -> Fetched:
        return Fetched(step, batch, step)  # the parameters are local and current

    def zero_grad(self) -> None:
        self.flat.zero_grad()
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending, b.launched, b.works, b.staged = len(b.params), False, [], None
        self._next = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation micro-batches: gradients add up locally, nothing is sent."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _param_index(self, p: torch.Tensor) -> int:
        return self._index[id(p)]

    @property
    def _index(self) -> dict[int, int]:
        idx = getattr(self, "_index_cache", None)
        if idx is None:
            idx = self._index_cache = {id(p): i for i, p in enumerate(self.flat.params)}
        return idx

    def _ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: the gradient of ``p`` is final for this backward."""
        if not self._syncing:
            return
        b = self._bucket_of[self._param_index(p)]
        b.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending > 0 and not force:
                return
            self._launch(b)
            self.launched_in_backward += not force
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        g = self.flat.grad[b.start : b.stop]
        g.div_(self.world)  # the mean over ranks; dividing first keeps 16-bit values in range
        b.launched = True
        self.bytes_reduced += g.numel() * g.element_size()
        if self.compress is None:
            fingerprint("all_reduce", g)
            b.works = [dist.all_reduce(g, async_op=True)]
            if self.tracer is not None:
                self.tracer.work(f"all_reduce bucket {b.index}", b.works[0], bytes=g.numel() * g.element_size())
            return
        # phase 1: rank r receives chunk r of every rank's bucket (16-bit on the wire)
        n = -(-b.numel // self.world) * self.world
        send = torch.zeros(n, dtype=self.compress, device=g.device)
        send[: b.numel].copy_(g)
        recv = torch.empty_like(send)
        fingerprint("all_to_all", send)
        b.works = [dist.all_to_all_single(recv, send, async_op=True)]
        if self.tracer is not None:
            self.tracer.work(f"all_to_all bucket {b.index}", b.works[0], bytes=send.numel() * send.element_size())
        b.staged = (send, recv)

    def _finish(self, b: Bucket) -> None:
        for w in b.works:
            w.wait()
        b.works = []
        if self.compress is None:
            return
        send, recv = b.staged
        chunk = send.numel() // self.world
        summed = recv.view(self.world, chunk).to(torch.float32).sum(0)  # fp32 accumulation
        out = torch.empty_like(send)
        fingerprint("all_gather", out)
        all_gather_into(out, summed.to(self.compress))  # phase 2: everyone's summed chunk
        self.flat.grad[b.start : b.stop].copy_(out[: b.numel])

    def gradients(self, step: int) -> Grads:
        return Grads(None)  # the hooks already sent them; push finishes the exchange

    def push(self, step: int, grads: Grads) -> PushResult:
        """Launch any bucket whose gradients never came (unused parameters: zeros), wait for every
        bucket, step the optimizer on the averaged gradient."""
        t0 = time.perf_counter()
        self.allreduce_gradients()
        self.comm_wait_s += time.perf_counter() - t0
        self.optimizer.step()
        self._maybe_save(step + 1)
        return PushResult()

    def allreduce_gradients(self) -> None:
        """Average ``flat.grad`` over the ranks: launch the buckets the hooks have not launched (in
        bucket order), wait for all of them. Blocking; every rank calls it."""
        self._launch_ready(force=True)
        for b in self.buckets:
            self._finish(b)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        """Rank 0 saves every parameter and its optimizer state whole (they are replicated)."""
        pieces: list[Piece] = []
        scalars: dict[str, float] = {}
        if dist.get_rank() != 0:
            return pieces, scalars
        for p, n in zip(self.flat.params, self.names):
            pieces.append(Piece(f"param/{n}", 0, p.detach().reshape(-1)))
            ps, sc = optimizer_pieces(self.optimizer.state.get(p, {}), n, p.numel(), 0, p.numel(), 0)
            pieces += ps
            scalars.update(sc)
        return pieces, scalars

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """Every parameter and (if saved) its optimizer state from ``reader``, whole."""
        load_whole_params(reader, self.flat.params, self.names, self.optimizer)

    def stats(self) -> dict[str, Any]:
        return {
            "buckets": len(self.buckets), "launched_in_backward": self.launched_in_backward, "bytes_reduced": self.bytes_reduced, "comm_wait_s": self.comm_wait_s,
            "compress": self.compress_name,
        }

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters, gradients, optimizer state."""
        return {"param_bytes": self.flat.nbytes(), "grad_bytes": self.flat.nbytes(), "state_bytes": optimizer_state_bytes(self.optimizer)}


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state`` (moments, accumulators, step counters)."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
