"""Binding a torch model to PS tables.

- Dense parameters: every trainable parameter of the model (outside
  ``PSEmbedding``) becomes a view into one flat buffer, and their gradients
  views into one flat gradient buffer; the flat vector is one dense PS table
  (``{prefix}/dense``), cut by the shards into contiguous slices. A pull fills
  the buffer, a push sends the buffer: no per-parameter copies or RPCs.
- Sparse layers: ``PSEmbedding`` (like ``nn.Embedding``/``nn.EmbeddingBag``)
  holds no rows. For a batch it gets the rows of the batch's *unique* ids from
  the PS (prefetched by the trainer, or pulled on first use), runs the lookup
  on a leaf tensor of those rows, and after backward hands back one gradient
  row per unique id for the push. Tables far larger than the worker's memory
  train this way.

The user does not write the mapping: ``ModelBinding(model, client, prefix)``
finds the parameters and the ``PSEmbedding`` modules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import InitializerSpec, OptimizerSpec, PSClient, SyncPolicy
from ps.errors import TableNotFoundError

__all__ = ["PSEmbedding", "ModelBinding", "SparseGrad"]


@dataclass
class _Rows:
    """Rows of one batch's unique ids, as pulled."""

    ids: torch.Tensor | None  # the batch's ids tensor they were fetched for (identity match), or None
    uniq: np.ndarray  # int64 unique ids
    inverse: np.ndarray  # index into uniq per id, ids' shape
    rows: np.ndarray  # float32 (len(uniq), dim)
    versions: np.ndarray  # int64 row versions (for staleness)
    clock: int = 0  # the table's BSP clock at the pull


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
        **hparams: float,
    ) -> None:
        super().__init__()
        if mode not in (None, "sum", "mean"):
            raise ValueError(f"PSEmbedding mode must be None, 'sum' or 'mean', got {mode!r}")
        self.table, self.dim, self.mode = table, dim, mode
        self.optimizer = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(optimizer, hparams)
        self.init = init if isinstance(init, InitializerSpec) else InitializerSpec(init)
        self.seed = seed
        self.client: PSClient | None = None
        self.policy: SyncPolicy | None = None  # the trainer sets the policy of the current step
        self._prefetched: _Rows | None = None
        self._pending: list[tuple[_Rows, torch.Tensor]] = []

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}, mode={self.mode}, optimizer={self.optimizer.name}"

    # ------------------------------------------------------------------ rows
    def fetch(self, ids: torch.Tensor, policy: SyncPolicy | None = None) -> _Rows:
        """Pull the rows of ``ids``' unique ids (blocking; safe to call from a prefetch thread)."""
        if self.client is None:
            raise RuntimeError(f"PSEmbedding {self.table!r} is not bound to a PSClient (use ModelBinding)")
        flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        uniq, inverse = np.unique(flat, return_inverse=True)
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
        grads = np.concatenate([g.detach().cpu().numpy() for _, g in parts])
        versions = np.concatenate([r.versions for r, _ in parts])
        return SparseGrad(self.table, ids, grads, versions)

    def discard(self) -> None:
        self._pending.clear()
        self._prefetched = None


class ModelBinding:
    """Maps ``model``'s dense parameters to one flat PS table and finds its PSEmbedding layers.

    After construction the parameters are views into ``self.flat`` (on
    ``device``) and their ``.grad`` views into ``self.flat_grad``.
    """

    def __init__(self, model: nn.Module, client: PSClient, prefix: str, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.client = client
        self.prefix = prefix
        self.device = torch.device(device)
        self.embeddings: dict[str, PSEmbedding] = {n: m for n, m in model.named_modules() if isinstance(m, PSEmbedding)}
        for m in self.embeddings.values():
            m.client = client
        model.to(self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.dense_table = f"{prefix}/dense"
        self.flat = torch.empty(self.numel, device=self.device)
        self.flat_grad = torch.zeros(self.numel, device=self.device)
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self.flat[off : off + n].copy_(p.reshape(-1))
                p.data = self.flat[off : off + n].view_as(p)
                p.grad = self.flat_grad[off : off + n].view_as(p)
                off += n

    @property
    def ready_table(self) -> str:
        return f"{self.prefix}/ready"

    def create_tables(self, dense_optimizer: OptimizerSpec, creator: bool, timeout: float = 120.0) -> None:
        """``creator`` (worker 0) creates every table, seeds the dense one with the model's own initial
        values, then marks the model ready; the others wait for that mark, so nobody reads a table
        before its initial values are in."""
        if creator:
            if self.numel:
                self.client.create_dense(self.dense_table, self.numel, optimizer=dense_optimizer, init=self.flat.cpu().numpy())
            for m in self.embeddings.values():
                self.client.create_sparse(m.table, m.dim, optimizer=m.optimizer, init=m.init, seed=m.seed)
            self.client.create_dense(self.ready_table, 1)
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.describe(self.ready_table)
                break
            except TableNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"tables of {self.prefix!r} not ready after {timeout:.0f} s: is worker 0 running?"
                    ) from None
                time.sleep(0.2)
        if self.numel:
            self.client.describe(self.dense_table)
        for m in self.embeddings.values():
            self.client.describe(m.table)

    def sparse_gradients(self) -> list[SparseGrad]:
        return [g for g in (m.gradients() for m in self.embeddings.values()) if g is not None]

    def set_policy(self, policy: SyncPolicy | None) -> None:
        for m in self.embeddings.values():
            m.policy = policy

    def load_flat(self, values: Any) -> None:
        """Copy pulled dense values (a host tensor, pinned on CUDA) into the model's parameters."""
        with torch.no_grad():
            self.flat.copy_(values, non_blocking=True)
