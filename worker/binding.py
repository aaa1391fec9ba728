"""PS embeddings: sparse layers whose rows live on the parameter server.

(Dense parameters are a ``worker.flat.FlatParams``; how they meet the PS is ``worker.paramsync.PSSync``.)

- Sparse layers: ``PSEmbedding`` (like ``nn.Embedding``/``nn.EmbeddingBag``)
  holds no rows. For a batch it gets the rows of the batch's *unique* ids from
  the PS (prefetched by the trainer, or pulled on first use), runs the lookup
  on a leaf tensor of those rows, and after backward hands back one gradient
  row per unique id for the push. Tables far larger than the worker's memory
  train this way.

The user does not write the mapping: ``PSSync`` finds the ``PSEmbedding`` modules
of a model and binds them to its ``PSClient``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import InitializerSpec, OptimizerSpec, PSClient, SyncPolicy
from ps.rowdtype import ROW_DTYPES

if TYPE_CHECKING:
    from worker.emb_cache import EmbCache

__all__ = ["PSEmbedding", "SparseGrad"]

_PLAIN = frozenset({"policy", "_prefetched", "_pending"})  # PSEmbedding's attributes set every step


@dataclass
class _Rows:
    """Rows of one batch's unique ids, as pulled."""

    ids: torch.Tensor | None  # the batch's ids tensor they were fetched for (identity match), or None
    uniq: np.ndarray  # int64 unique ids
    inverse: np.ndarray  # index into uniq per id, ids' shape
    rows: np.ndarray  # float32 (len(uniq), dim)
    versions: np.ndarray  # int64 row versions (for staleness)
    clock: int = 0  # the table's BSP clock at the pull
    cached: Any = None  # a worker.emb_cache.CachedRows (rows already on the device) when a cache served them


@dataclass
class SparseGrad:
    table: str
    ids: np.ndarray
    grads: np.ndarray
    base_versions: np.ndarray


class PSEmbedding(nn.Module):
    """An embedding table stored on the parameter server.

    ``forward(ids)``: ids of any shape (int64) -> ``ids.shape + (dim,)``; with
    ``mode="sum"|"mean"`` the last ids dimension is reduced (an embedding bag):
    ``(B, L) -> (B, dim)``. Rows are created on the shards on first touch with
    ``init`` (deterministic per id), and updated there by ``optimizer``.
    ``row_dtype`` (float32, float16, bfloat16): how the shards store (and send)
    the rows; the forward computes in float32, gradients are pushed as float32.

    ``cache``: an optional ``worker.emb_cache.EmbCache`` (``attach_caches``): training fetches then
    take hot rows from the worker's device and pull only the others (see that module for the rules).

    Not thread-safe: one forward/backward at a time (as for any module).
    """

    def __init__(
        self,
        table: str,
        dim: int,
        mode: str | None = None,
        optimizer: str | OptimizerSpec = "adagrad",
        init: str | InitializerSpec = InitializerSpec("normal", {"std": 0.01}),
        seed: int = 0,
        row_dtype: str = "float32",
        **hparams: float,
    ) -> None:
        super().__init__()
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"PSEmbedding mode must be None, 'sum' or 'mean', got {mode!r}")
        if row_dtype not in ROW_DTYPES:
            raise ValueError(f"PSEmbedding {table!r}: row_dtype must be one of {sorted(ROW_DTYPES)}, got {row_dtype!r}")
        self.table, self.dim, self.mode = table, dim, mode
        self.optimizer = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(optimizer, hparams)
        self.init = init if isinstance(init, InitializerSpec) else InitializerSpec(init)
        self.seed = seed
        self.row_dtype = row_dtype  # how the shards store the rows; pulled rows arrive widened to float32
        self.client: PSClient | None = None
        self.policy: SyncPolicy | None = None  # the trainer sets the policy of the current step
        self._prefetched: _Rows | None = None
        self._pending: list[tuple[_Rows, torch.Tensor]] = []
        self.cache: EmbCache | None = None  # hot rows on the device (worker.emb_cache.attach_caches)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PLAIN:  # per-step state, never a parameter, buffer or module: no nn.Module bookkeeping (~2 us a set)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}, mode={self.mode}, optimizer={self.optimizer.name}, row_dtype={self.row_dtype}"

    # ------------------------------------------------------------------ rows
    def fetch(self, ids: torch.Tensor, policy: SyncPolicy | None = None) -> _Rows:
        """Pull the rows of ``ids``' unique ids (blocking; safe to call from a prefetch thread)."""
        if self.client is None:
            raise RuntimeError(f"PSEmbedding {self.table!r} is not bound to a PSClient (train it with PSSync)")
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        uniq, inverse = np.unique(flat, return_inverse=True)
        if self.cache is not None and policy is not None and self.training:  # a training step's rows
            counts = np.bincount(inverse, minlength=len(uniq))
            c = self.cache.fetch(self.client, self.table, uniq, counts, policy.clock, policy)
            empty = np.zeros((0, self.dim), np.float32)
            return _Rows(ids, uniq, inverse.reshape(tuple(ids.shape)), empty, c.versions, c.clock, c)
        rows, versions, clock = self.client.pull_sparse(self.table, uniq, return_versions=True, policy=policy, return_clock=True)
        return _Rows(ids, uniq, inverse.reshape(tuple(ids.shape)), rows, versions, clock)

    def prefetched(self, rows: _Rows) -> None:
        """Use ``rows`` for the next forward on the same ids tensor."""
        self._prefetched = rows

    def _rows_for(self, ids: torch.Tensor) -> _Rows:
        p, self._prefetched = self._prefetched, None
        if p is not None and p.ids is not None and (
            p.ids is ids or (p.ids.shape == ids.shape and torch.equal(p.ids.to(ids.device), ids))
        ):
            return p
        return self.fetch(ids, self.policy)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        r = self._rows_for(ids)
        if r.cached is not None and self.cache is not None:
            leaf = self.cache.ready(r.cached).to(ids.device)
        else:
            leaf = torch.from_numpy(r.rows).to(ids.device, non_blocking=True)
        if self.training and torch.is_grad_enabled():
            leaf.requires_grad_(True)
            self._pending.append((r, leaf))
        out = F.embedding(torch.from_numpy(r.inverse).to(ids.device, non_blocking=True), leaf)
        if self.mode == "sum":
            out = out.sum(dim=-2)
        elif self.mode == "mean":
            out = out.mean(dim=-2)
        return out

    def gradients(self) -> SparseGrad | None:
        """Row gradients of the forwards since the last call (after backward): one row per unique id."""
        pending, self._pending = self._pending, []
        parts = [(r, leaf.grad) for r, leaf in pending if leaf.grad is not None]
        if not parts:
            return None
        ids = np.concatenate([r.uniq for r, _ in parts])
        cache = self.cache
        grads = np.concatenate([
            cache.grads_to_host(g) if cache is not None and r.cached is not None else g.detach().cpu().numpy() for r, g in parts
        ])
        versions = np.concatenate([r.versions for r, _ in parts])
        return SparseGrad(self.table, ids, grads, versions)

    def discard(self) -> None:
        """Drop the prefetched rows and the pending row gradients (a step that will not be pushed)."""
        self._pending.clear()
        self._prefetched = None
