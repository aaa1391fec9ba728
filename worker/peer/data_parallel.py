"""``DataParallelSync``: the one peer ``ParamSync`` of dense models in every layout without a PS:
data parallelism and ZeRO 1-3 over all ranks, and the DP dimension of a tensor- or
pipeline-parallel mesh. It is a composition of the core's two objects (``worker.peer.core``): a
``ShardedOptimizer`` over the data-parallel group and, under sequence parallelism, a
``GroupReducer`` that sums the TP-replicated parameters' gradients over the TP group first (each TP
rank saw S/T positions, so their gradients are partial sums).

Checkpoints (``set_checkpointing``) are one format for every layout: each plain tensor whole under
its plain name (``param/<name>``, ``state/<key>/<name>``), gathered over the TP group (``specs``
say how a local tensor maps to the plain one) and over the DP group (ZeRO's shards), written by
the first DP and TP rank; so a checkpoint of any (D, T, P, ZeRO stage) loads into any other.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.peer.checkpoint import Checkpointing, CheckpointReader, Piece, read_whole_tensors, whole_tensor_pieces
from worker.peer.debug import fingerprint
from worker.peer.core import GroupReducer, ShardedOptimizer, group_rank, group_size
from worker.peer.mesh import check_agreement
from worker.sync_api import Fetched, Grads, ParamSync, PushResult

__all__ = ["DataParallelSync", "WrapsDense", "whole_specs"]


def whole_specs(model: nn.Module, params: Sequence[nn.Parameter] | None = None) -> list[tuple[Any, nn.Parameter]]:
    """``(ShardSpec, parameter)`` of ``params`` (default: all) in ``model``'s order: a tensor-parallel
    model's own ``specs``, or for a plain model every parameter whole under its name."""
    from worker.peer.tensor_parallel import ShardSpec

    pairs = list(model.specs) if hasattr(model, "specs") else [  # type: ignore[arg-type]
        (ShardSpec(n, tuple(p.shape), None, None), p) for n, p in model.named_parameters() if p.requires_grad
    ]
    if params is None:
        return pairs
    mine = {id(p) for p in params}
    return [(s, p) for s, p in pairs if id(p) in mine]


class WrapsDense:
    """Mixin of syncs whose timeline tracer is their parts' (``_traced``: attribute paths, the first one
    read back): a ``DataParallelSync`` named ``dense`` (MoE, the PS hybrid, pipelines), or the
    ``DataParallelSync``'s own optimizer and reducer."""

    _traced: tuple[str, ...] = ("dense",)

    @property
    def tracer(self) -> Any:
        """A ``worker.peer.trace.Tracer`` (or None): the parts' collectives on the timeline."""
        return attrgetter(self._traced[0])(self).tracer

    @tracer.setter
    def tracer(self, value: Any) -> None:
        for part in (attrgetter(name)(self) for name in self._traced):
            if part is not None:
                part.tracer = value


class DataParallelSync(WrapsDense, ParamSync, Checkpointing):
    """ZeRO ``stage`` (0: plain DP, bucketed all-reduce) of ``model``'s parameters (or ``params``)
    over ``group`` (None: every rank), as a ``ParamSync``.

    ``optimizer``: a task's ``OptimizerSpec`` or a factory ``params -> torch.optim.Optimizer``.
    ``bucket_mb``: stage 0's buckets; ``compress``: 16-bit gradients on the wire (any stage; the TP
    sum of replicated gradients stays exact). ``overlap``: reduce from
    backward hooks (False in meshes: once per step, after the last micro-batch). ``specs``: the
    ``(ShardSpec, param)`` pairs of a tensor-parallel model (default: ``model.specs`` or every
    parameter whole), ``tp_group`` the group they are split over, ``tp_replicated`` the parameters
    whose gradients are summed over it before the DP reduction (sequence parallelism).
    ``settings``: fields every rank must agree on (checked in ``join``; ``agree=False``: the caller
    checks, e.g. pipeline stages, whose sizes differ by design). Collectives on the main
    thread (``pipelined`` False), the same order on every rank."""

    pipelined = False
    _traced = ("opt", "opt.reducer")

    def __init__(
        self, model: nn.Module, optimizer: Any, *, stage: int = 0, group: Any = None, device: torch.device | str = "cpu",
        bucket_mb: float = 25.0, compress: str | None = None, overlap: bool = True, params: Sequence[nn.Parameter] | None = None,
        specs: Sequence[tuple[Any, nn.Parameter]] | None = None, tp_group: Any = None,
        tp_replicated: Sequence[nn.Parameter] = (), settings: dict[str, Any] | None = None, name: str | None = None,
        agree: bool = True,
    ) -> None:
        self.name = name or ("dp" if stage == 0 else f"zero{stage}")
        self.model, self.device, self.group = model, torch.device(device), group
        self.settings = dict(settings or {})
        self.specs = list(specs) if specs is not None else whole_specs(model, params)
        self.tp_group, self.tp = tp_group, group_size(tp_group) if tp_group is not None else 1
        tp_sum = list(tp_replicated) if self.tp > 1 else []
        self.opt = ShardedOptimizer(model, optimizer, group, stage=stage, params=params, device=device,
                                    overlap=overlap and not tp_sum, bucket_mb=bucket_mb, compress=compress)
        self.tp_sum = GroupReducer(tp_sum, tp_group, divide_by=1, own=False) if tp_sum else None
        self.optimizer = self.opt.optimizer
        self.flat = self.opt.reducer.flat if self.opt.reducer is not None else None  # type: ignore[assignment]
        self.writer = group_rank(group) == 0 and (tp_group is None or group_rank(tp_group) == 0)
        self.agree = agree

    # ------------------------------------------------------------------ membership
    def join(self) -> int:
        """Check that every rank agrees, start the replicas equal (the group's first rank's values),
        resume from the newest checkpoint if checkpointing is on, register the hooks."""
        if self.agree:
            check_agreement({"mode": self.name, "dp": group_size(self.group), "tp": self.tp, **self.opt.agreement(), **self.settings},
                            self.device if dist.get_backend() == "nccl" else torch.device("cpu"))
        self.opt.broadcast()
        start = self._resume()
        self.opt.attach()
        return start

    def leave(self) -> None:
        self.opt.detach()

    # ------------------------------------------------------------------ step
    def fetch(self, step: int, batch: Any) -> Fetched:
        return Fetched(step, batch, step)  # the parameters are local and current

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.opt.no_sync()

    def gradients(self, step: int) -> Grads:
        return Grads(None)  # the hooks (or push) send them

    def push(self, step: int, grads: Grads) -> PushResult:
        """The TP sum of the replicated gradients (sequence parallelism), the optimizer's step over
        the DP group (reduce, step, share), a checkpoint if one is due."""
        if self.tp_sum is not None:
            self.tp_sum.finish()
        self.opt.step()
        self._maybe_save(step + 1)
        return PushResult()

    def global_loss(self, loss: torch.Tensor) -> float:
        """The mean of the step's loss over the DP group (TP ranks of a replica computed the same)."""
        if group_size(self.group) == 1:
            return float(loss)
        t = loss.detach().to(self.device, torch.float64).reshape(1)
        fingerprint("all_reduce", t, group=self.group)
        dist.all_reduce(t, group=self.group)
        return float(t) / group_size(self.group)

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        with self.opt.gathered() if not self.opt.overlap else contextlib.nullcontext():
            return fn(), {}

    # ------------------------------------------------------------------ whole tensors
    def _tp_gather(self, spec: Any, local: torch.Tensor) -> torch.Tensor:
        """The plain tensor of ``local`` (a copy: ZeRO-3 frees the local one after ``whole()``)."""
        if spec.dim is None or self.tp == 1:
            return spec.unshard([local.detach()]).clone()  # type: ignore[no-any-return]
        shards = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(shards, local.detach().contiguous(), group=self.tp_group)
        return spec.unshard(shards)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every local parameter gathered over the DP group inside the block (ZeRO-3; a collective)."""
        with torch.no_grad(), self.opt.gathered():
            yield

    def parameters(self) -> torch.Tensor:
        """The plain model's parameters, whole, in its order (a collective)."""
        with self.whole():
            return torch.cat([self._tp_gather(s, p).reshape(-1) for s, p in self.specs])

    def checkpoint_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        """Every plain tensor and its optimizer state whole; the writer rank keeps them."""
        with self.whole():
            return whole_tensor_pieces(self.specs, self.opt.local_states(), self._tp_gather, self.writer)

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """This rank's part of every parameter and (if saved) of its optimizer state, from any layout."""
        with self.whole():
            state = read_whole_tensors(reader, self.specs, group_rank(self.tp_group) if self.tp > 1 else 0, self.tp)
            self.opt.pull_shard()
        self.opt.load_states(state, {k: torch.tensor(v, dtype=torch.float32) for k, v in reader.scalars.items()})

    # ------------------------------------------------------------------ measuring
    def stats(self) -> dict[str, Any]:
        out = self.opt.stats()
        if self.tp_sum is not None:
            out["tp_sum_bytes"] = self.tp_sum.bytes_reduced
        return out

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters, gradients, optimizer state (and the peak
        of gradient bytes during backward)."""
        return self.opt.memory()
