"""The PERSIA-style hybrid: embeddings on the PS, the dense part synchronised among peers.

A model's ``PSEmbedding`` rows live on the parameter server and go through a ``PSSync`` built
with ``dense=False`` (rows pulled for the batch's ids, row gradients pushed; ``sparse_mode``
``async`` by default, so a rank never waits for the others' rows: huge tables, loose
consistency), while its dense parameters go through the sync ``make_sync`` builds for the same
layout without a PS (``DataParallelSync`` at any ZeRO stage, over every rank or the DP dimension of
a tensor-parallel mesh, ``MoESync`` for a model with MoE layers, ``PipelineSync`` running the
schedule): synchronous. With
``sparse_mode="sync"`` the rows are BSP on the PS too and the run equals one process with the
global batch.

Rows are pushed once per step and data-parallel replica: in a mesh only the first TP rank of each
replica (in a pipeline: of the stage holding the rows) is a worker on the PS (its TP peers computed the same row gradients from the same batch:
the gradient reaching a replicated input is whole on every TP rank); the others only read rows
(pulls need no membership), so each BSP round waits for the D replicas. In async/SSP mode the TP
ranks of a replica read the rows when each asks, so they may see them one push apart.
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
from worker.peer.data_parallel import WrapsDense
from worker.peer.mesh import PeerConfigError

__all__ = ["HybridSync"]


class HybridSync(WrapsDense, ParamSync):
    """``PSEmbedding`` rows through ``client`` (tables ``{prefix}/...`` as the model names them) beside
    ``dense``, the sync of the dense parameters (None: ``make_sync``'s for every rank one replica, ZeRO
    stage 0; with MoE layers their experts over ``ep`` ranks). ``rank``/``world``: the worker's index
    and count on the PS (a mesh's DP index and size); ``pushes`` False: this rank reads rows but
    pushes none (a TP rank other than the first, a stage without them). Collectives on the main thread (``pipelined`` False)."""

    pipelined = False

    def __init__(
        self, model: nn.Module, client: PSClient, prefix: str, optimizer: Any, *, rank: int, world: int,
        device: torch.device | str = "cpu", bucket_mb: float = 25.0, compress: str | None = None,
        sparse_mode: str = "async", lease_s: float = 30.0, sparse_ids: Callable[[Any], dict[str, torch.Tensor]] | None = None,
        settings: dict[str, Any] | None = None, stop: threading.Event | None = None, ep: int = 1,
        dense: ParamSync | None = None, pushes: bool = True,
    ) -> None:
        if sparse_mode not in ("async", "sync", "ssp"):
            raise PeerConfigError(f"hybrid sparse mode must be async, ssp or sync, got {sparse_mode!r}")
        self.name = "hybrid"
        if dense is None:
            from worker.peer.sync_plan import SyncPlan, _dense_sync

            dense = _dense_sync(SyncPlan("hybrid", optimizer, bucket_mb=bucket_mb, compress=compress, ep=ep, device=device,
                                         sparse_mode=sparse_mode, settings=settings or {}), model, None)
        self.dense: Any = dense
        self.pushes = pushes
        self.sparse = PSSync(
            model, client, prefix, mode=sparse_mode, worker_index=rank, num_workers=world, worker_name=f"rank{rank}",
            lease_s=lease_s, device=device, sparse_ids=sparse_ids, dense=False, stop=stop,
        )
        if not self.sparse.embeddings:
            raise PeerConfigError("hybrid mode needs a model with PSEmbedding layers (use dp for a dense model)")
        self.flat = self.dense.flat

    def join(self) -> int:
        """The PS first (worker 0 creates the tables; the workers wait for each other, a reader for the
        tables), then the peer group."""
        if self.pushes:
            start = self.sparse.join()
        else:
            start = 0
            self.sparse.create_tables(creator=False)
        if start != 0 or self.dense.join() != 0:
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
        rows = self.sparse.gradients(step)  # the row gradients; the dense ones are the dense part's
        return rows if self.pushes else Grads(None)

    def push(self, step: int, grads: Grads) -> PushResult:
        """Row gradients to the PS (a worker's), then the dense part's reduction and optimizer step."""
        result = self.sparse.push(step, grads) if self.pushes else PushResult()
        self.dense.push(step, Grads(None))
        return result

    def leave(self) -> None:
        if self.pushes:
            self.sparse.leave()
        self.dense.leave()

    def close(self) -> None:
        self.sparse.close()

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        for m in self.sparse.embeddings.values():
            m.policy = None  # evaluation reads the rows as they are
        return self.dense.evaluate(step, final, fn)  # type: ignore[no-any-return]

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         micro_batches: int) -> torch.Tensor:
        return self.dense.forward_backward(model, batch, loss_fn, micro_batches)  # type: ignore[no-any-return]

    def global_loss(self, loss: torch.Tensor) -> float:
        return self.dense.global_loss(loss)  # type: ignore[no-any-return]

    def window_metrics(self) -> dict[str, Any]:
        """The dense part's (MoE: tokens per expert, drops, all-to-all)."""
        return self.dense.window_metrics()  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return {**self.dense.stats(), **self.sparse.stats()}
