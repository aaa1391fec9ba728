"""The disk tier of sparse tables: a resident-bytes budget per shard and the file-backed cold rows.

``ResidentBudget(limit)``: one per shard (``ShardConfig.max_resident_bytes``), shared by its
sparse tables. A table asks :meth:`ResidentBudget.rows_for` how many rows it may keep resident:
the bytes left by every other member (registered with ``register(fn)``: a table's resident
bytes, or a dense table's held bytes) divided by its own bytes per resident row. Beyond that, the
table demotes its least recently used rows to its :class:`ColdTier`.

``ColdTier``: rows that are not resident. Their payload (values in the row dtype, optimizer
state) sits in a :class:`~ps.rowstore.FileBacking` (memory-mapped chunks of an unlinked temporary
file under ``directory``); their metadata (id, version, last touch) stays in RAM, so LRU/TTL
eviction and checkpoints need no disk read to choose rows. What a cold row costs in RAM: its
metadata (26 bytes) and its id-index entry.

Snapshots without copying the file: :meth:`ColdTier.hold` (under the table's lock) freezes the
payload of every cold row there is: while a hold is active, released slots are not handed out
again (rows demoted meanwhile go to fresh slots) and the owning table never overwrites a cold
row in place (it brings the row back first); ``clear``/``close`` leave the held file to the
holder. So a checkpoint reads the cold rows it listed straight from the file, outside the lock,
while the table goes on serving. A hold ends when its :class:`Hold` is released or garbage
collected (from any thread, without the table's lock: applied at the tier's next use).

Not thread-safe: the owning table's lock guards a tier (except ``Hold.release``); the budget's own
lock guards its members.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ps.rowstore import Column, FileBacking, RowStore

__all__ = ["ResidentBudget", "ColdTier", "Hold"]


class ResidentBudget:
    """Bytes a shard's tables may keep resident (``limit``; 0: no limit)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_resident_bytes must be >= 0, got {limit}")
        self.limit = int(limit)
        self._members: dict[int, Callable[[], int]] = {}
        self._lock = threading.Lock()
        self._next = 0

    def register(self, resident_bytes: Callable[[], int]) -> int:
        """Count ``resident_bytes()`` against the budget; returns a handle for ``unregister``/``rows_for``."""
        with self._lock:
            self._next += 1
            self._members[self._next] = resident_bytes
            return self._next

    def unregister(self, handle: int) -> None:
        with self._lock:
            self._members.pop(handle, None)

    def rows_for(self, handle: int, row_nbytes: int) -> int:
        """Rows of ``row_nbytes`` member ``handle`` may keep resident in what the others leave (-1: unlimited)."""
        if not self.limit:
            return -1
        with self._lock:
            others = [f for h, f in self._members.items() if h != handle]
        return max(0, (self.limit - sum(f() for f in others)) // max(1, row_nbytes))


class Hold:
    """A snapshot's claim on a :class:`ColdTier`'s file (see ``ColdTier.hold``): the payload store
    to read held slots from (``payload``). Ends at ``release()`` or when collected."""

    def __init__(self, tier: "ColdTier", token: int) -> None:
        self.payload = tier.payload
        self._end = weakref.finalize(self, tier._done.append, token)  # deque.append: no lock, any thread

    def release(self) -> None:
        self._end()


class ColdTier:
    """Cold rows: ``payload`` columns in a file, ``meta`` columns in RAM, numbered alike (slots)."""

    def __init__(self, payload: Sequence[Column], meta: Sequence[Column], chunk_rows: int, directory: str | None) -> None:
        self.backing = FileBacking(directory)
        self.payload = RowStore(payload, chunk_rows, first_rows=chunk_rows, backing=self.backing)
        self.meta = RowStore(meta, chunk_rows, first_rows=chunk_rows)
        self.payload_names = [c.name for c in payload]
        self.meta_names = [c.name for c in meta]
        self._holds: set[int] = set()
        self._done: collections.deque[int] = collections.deque()
        self._tokens = 0

    def hold(self) -> Hold:
        """Freeze the payload of the rows cold now until the returned Hold ends (see the module doc)."""
        self._tokens += 1
        self._holds.add(self._tokens)
        self._sync()
        return Hold(self, self._tokens)

    @property
    def held(self) -> bool:
        """Is a snapshot reading the file? (Then: no slot reuse, no in-place payload writes.)"""
        self._sync()
        return bool(self._holds)

    def _sync(self) -> None:
        while self._done:
            self._holds.discard(self._done.popleft())
        self.payload.reuse = self.meta.reuse = not self._holds

    def alloc(self, n: int) -> np.ndarray:
        """``n`` slots (payload and metadata numbered alike; fresh ones only while held)."""
        self._sync()
        slots = self.payload.alloc(n)
        same = self.meta.alloc(n)
        assert np.array_equal(slots, same), "cold tier stores out of step"
        return slots

    @property
    def live(self) -> int:
        return self.meta.live

    @property
    def ram_bytes(self) -> int:
        """RAM the tier holds: the cold rows' metadata and the payload store's free stack (the payload
        itself is on disk)."""
        return self.meta.nbytes + self.payload.free_nbytes

    def ram_alloc_bytes(self, n: int) -> int:
        """Bytes by which ``ram_bytes`` grows when ``n`` slots are allocated (``alloc(n)``, ``put``)."""
        self._sync()
        fresh = self.meta.fresh_for(n)
        return self.meta.grow_bytes(fresh) + self.payload.free_grow_bytes(fresh)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the tier's file (sparse: blocks never written take no disk)."""
        return self.backing.file_bytes

    def put(self, data: Mapping[str, torch.Tensor | np.ndarray]) -> np.ndarray:
        """Store rows (every payload and meta column given); returns their slots."""
        n = len(next(iter(data.values())))
        slots = self.alloc(n)
        self.payload.scatter(slots, {k: data[k] for k in self.payload_names})
        self.meta.scatter(slots, {k: data[k] for k in self.meta_names})
        self.backing.drop_pages()
        return slots

    def get(self, slots: np.ndarray, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the rows at ``slots`` (every column by default)."""
        names = self.payload_names + self.meta_names if names is None else list(names)
        out = {}
        p = [n for n in names if n in self.payload_names]
        if p:
            out.update(self.payload.gather(slots, p))
            self.backing.drop_pages()
        m = [n for n in names if n in self.meta_names]
        if m:
            out.update(self.meta.gather(slots, m))
        return out

    def update(self, slots: np.ndarray, data: Mapping[str, torch.Tensor | np.ndarray | float | int]) -> None:
        """Overwrite columns of the rows at ``slots`` in place (payload columns: not while held)."""
        p = {k: v for k, v in data.items() if k in self.payload_names}
        if p:
            if self.held:
                raise RuntimeError("a held cold tier's payload is not overwritten in place (bring the rows back first)")
            self.payload.scatter(slots, p)
            self.backing.drop_pages()
        m = {k: v for k, v in data.items() if k in self.meta_names}
        if m:
            self.meta.scatter(slots, m)

    def release(self, slots: np.ndarray) -> None:
        self.payload.release(slots)
        self.meta.release(slots)

    def clear(self) -> None:
        self.payload.clear()
        self.meta.clear()

    def close(self) -> None:
        self.payload.close()
        self.meta.close()
