"""The PERSIA-style hybrid: embeddings on the PS, the dense part all-reduced among peers.

A model's ``PSEmbedding`` rows live on the parameter server and go through a ``PSSync`` built
with ``dense=False`` (rows pulled for the batch's ids, row gradients pushed; ``sparse_mode``
``async`` by default, so a rank never waits for the others' rows: huge tables, loose
consistency), while its dense parameters are a ``DataParallelSync`` (bucketed all-reduce from the
backward hooks, the optimizer on every rank: synchronous). With ``sparse_mode="sync"`` the rows
are BSP on the PS too and the run equals one process with the global batch. A model with MoE
layers has a ``MoESync`` as its dense part instead (the experts split over ``ep`` ranks, the rest
as above).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ps import PSClient
from worker.paramsync import Fetched, Grads, ParamSync, PSSync, PushResult
from worker.peer.data_parallel import DataParallelSync, WrapsDense
from worker.peer.mesh import PeerConfigError

__all__ = ["HybridSync"]


class HybridSync(WrapsDense, ParamSync):
    """``PSEmbedding`` rows through ``client`` (tables ``{prefix}/...`` as the model names them),
    dense parameters through ``DataParallelSync`` (ZeRO stage 0: bucketed all-reduce), or with MoE
    layers through ``MoESync`` (experts over ``ep`` ranks, the rest the same). ``rank``/``world`` are the worker's index and count
    on the PS (the peer group's). Collectives on the main thread (``pipelined`` False)."""

    pipelined = False

    def __init__(
        self, model: nn.Module, client: PSClient, prefix: str, optimizer: Any, *, rank: int, world: int,
        device: torch.device | str = "cpu", bucket_mb: float = 25.0, compress: str | None = None,
        sparse_mode: str = "async", lease_s: float = 30.0, sparse_ids: Callable[[Any], dict[str, torch.Tensor]] | None = None,
        settings: dict[str, Any] | None = None, stop: threading.Event | None = None, ep: int = 1,
    ) -> None:
        from worker.peer.moe import MoESync, moe_layers

        if sparse_mode not in ("async", "sync", "ssp"):
            raise PeerConfigError(f"hybrid sparse mode must be async, ssp or sync, got {sparse_mode!r}")
        self.name = "hybrid"
        settings = {**(settings or {}), "sparse_mode": sparse_mode}
        self.dense: Any
        if moe_layers(model):
            self.dense = MoESync(model, optimizer, ep=ep, device=device, bucket_mb=bucket_mb, compress=compress, settings=settings)
        else:
            self.dense = DataParallelSync(model, optimizer, device=device, bucket_mb=bucket_mb, compress=compress,
                                          settings=settings, name="hybrid")
        self.sparse = PSSync(
            model, client, prefix, mode=sparse_mode, worker_index=rank, num_workers=world, worker_name=f"rank{rank}",
            lease_s=lease_s, device=device, sparse_ids=sparse_ids, dense=False, stop=stop,
        )
        if not self.sparse.embeddings:
            raise PeerConfigError("hybrid mode needs a model with PSEmbedding layers (use dp for a dense model)")
        self.flat = self.dense.flat

    def join(self) -> int:
        """The PS first (worker 0 creates the tables; everyone waits for all ranks), then the peer group."""
        start = self.sparse.join()
        dense_start = self.dense.join()
        if start != 0 or dense_start != 0:
            raise PeerConfigError("hybrid mode starts fresh runs only (its tables already have a clock; use new table names)")
        return start

    def fetch(self, step: int, batch: Any) -> Fetched:
        return self.sparse.fetch(step, batch)

    def load(self, fetched: Fetched) -> None:
        self.sparse.load(fetched)

    def discard(self) -> None:
        self.sparse.discard()

    def zero_grad(self) -> None:
        self.dense.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.dense.no_sync()

    def gradients(self, step: int) -> Grads:
        return self.sparse.gradients(step)  # the row gradients; the dense ones are already on their way

    def push(self, step: int, grads: Grads) -> PushResult:
        """Row gradients to the PS, then the dense all-reduce and optimizer step."""
        result = self.sparse.push(step, grads)
        self.dense.push(step, Grads(None))
        return result

    def leave(self) -> None:
        self.sparse.leave()
        self.dense.leave()

    def close(self) -> None:
        self.sparse.close()

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        for m in self.sparse.embeddings.values():
            m.policy = None  # evaluation reads the rows as they are
        return fn(), {}

    def global_loss(self, loss: torch.Tensor) -> float:
        return self.dense.global_loss(loss)

    def window_metrics(self) -> dict[str, Any]:
        """The dense part's (MoE: tokens per expert, drops, all-to-all)."""
        return self.dense.window_metrics()  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return {**self.dense.stats(), **self.sparse.stats()}
