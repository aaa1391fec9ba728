"""One shard's part of a table: values, optimizer state and versions.

``DenseTable`` holds a contiguous range of a dense table, stored as blocks of
``chunk_elems`` elements (the wire chunk). An update stages new blocks (values
and state are cloned, then updated) and swaps them in only when the whole
push arrived and validated, so a rejected or broken push changes nothing, and
committed blocks are never mutated: a pull streams a consistent snapshot
without holding the lock.

``SparseTable`` holds the rows whose ids map to this shard, created lazily on
first pull with a deterministic initializer, with optional admission and
eviction, and lazy optimizer updates that touch only the pushed rows.

Thread-safety: each table has one lock; methods take it themselves.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterator, Sized

import numpy as np
import torch

from ps.config import TableSpec
from ps.errors import NonFiniteError, ResourceExhaustedError, ShapeMismatchError, WrongShardError
from ps.index import BYTES_PER_SLOT, IdIndex
from ps.initializers import init_dense, init_rows, table_key, uniform01
from ps.optim import Optimizer, make_optimizer, scaled_lr
from ps.partition import SlotMap, dense_range, slot_of
from ps.sketch import CountMinSketch

__all__ = ["DenseTable", "DenseUpdate", "SparseTable", "SparsePush", "RowDelta", "PushResult", "StalenessStats", "GRADIENT", "ASSIGN"]

GRADIENT = "gradient"
ASSIGN = "assign"


def _check_finite(spec: TableSpec, x: np.ndarray, what: str) -> None:
    if not spec.allow_nonfinite and not np.isfinite(x).all():
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
        raise NonFiniteError(f"table {spec.name!r}: {what} holds {bad} NaN/Inf value(s); rejected (nothing applied)")


@dataclass
class StalenessStats:
    """Running staleness of applied updates (version applied against - version computed from)."""

    count: int = 0
    total: int = 0
    max: int = 0

    def add(self, staleness: np.ndarray | int) -> None:
        s = np.atleast_1d(np.asarray(staleness, dtype=np.int64))
        s = s[s >= 0]
        if s.size:
            self.count += int(s.size)
            self.total += int(s.sum())
            self.max = max(self.max, int(s.max()))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else -1.0


@dataclass(frozen=True)
class PushResult:
    applied: int
    dropped: int
    mean_staleness: float
    max_staleness: int
    version: int = 0
    late: int = 0  # BSP: shards that found the push's clock already applied (not applied there)
    clock: int = -1  # BSP: the table's clock after the push (min over shards)


@dataclass(frozen=True)
class SparsePush:
    """A validated sparse push: unique ids, their summed gradient rows, base versions (or None)."""

    ids: np.ndarray
    grads: torch.Tensor
    base_versions: np.ndarray | None


@dataclass(frozen=True)
class RowDelta:
    """The new state of the rows one sparse push updated: what a backup stores to match its primary."""

    ids: np.ndarray
    values: np.ndarray
    state: dict[str, np.ndarray]
    versions: np.ndarray


class _Block:
    """Immutable once committed: values and optimizer state of one chunk."""

    __slots__ = ("param", "state")

    def __init__(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.param = param
        self.state = state

    def clone(self) -> "_Block":
        return _Block(self.param.clone(), {k: v.clone() for k, v in self.state.items()})


class DenseTable:
    """Shard ``shard_index``'s contiguous range of a dense table and the optimizer state for it."""

    def __init__(self, spec: TableSpec, shard_index: int, num_shards: int, chunk_elems: int) -> None:
        self.spec = spec
        self.start, self.stop = dense_range(spec.numel, shard_index, num_shards)
        self.length = self.stop - self.start
        self.chunk_elems = chunk_elems
        self.optimizer: Optimizer = make_optimizer(spec.optimizer.name, spec.optimizer.hparams)
        key = table_key(spec.name, spec.seed)
        self._blocks: list[_Block] = []
        for off in range(0, self.length, chunk_elems):
            n = min(chunk_elems, self.length - off)
            p = torch.from_numpy(init_dense(spec.initializer, key, self.start + off, self.start + off + n))
            self._blocks.append(_Block(p, self.optimizer.init_state(p)))
        self.version = 0
        self.staleness = StalenessStats()
        self.rejected = 0
        self.lock = threading.Lock()  # guards the swap of _blocks/version (held for microseconds)
        self.write_lock = threading.Lock()  # serializes commits (held while one push computes)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def block_len(self, k: int) -> int:
        return min(self.chunk_elems, self.length - k * self.chunk_elems)

    def param_bytes(self) -> int:
        return self.length * 4

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for b in self._blocks for v in b.state.values())

    def held_bytes(self) -> int:
        """Memory this table holds on the shard (params + optimizer state)."""
        return self.param_bytes() + self.state_bytes()

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        """(version, value blocks) as of now; the blocks never change afterwards."""
        with self.lock:
            return self.version, [b.param for b in self._blocks]

    def values(self) -> np.ndarray:
        """This shard's range as one float32 array (a copy)."""
        _, blocks = self.snapshot()
        return torch.cat(blocks).numpy() if blocks else np.zeros(0, np.float32)

    def check_chunk(self, offset: int, data: np.ndarray, seen: Container[int] = (), what: str = "gradient") -> int:
        """Validate one pushed chunk (offset, size, finite; not in ``seen``); returns its block number."""
        name = self.spec.name
        if offset < 0 or offset % self.chunk_elems or offset >= max(self.length, 1):
            raise ShapeMismatchError(
                f"table {name!r}: chunk offset {offset} is not a multiple of {self.chunk_elems} inside this shard's {self.length} elements"
            )
        k = offset // self.chunk_elems
        if k in seen:
            raise ShapeMismatchError(f"table {name!r}: chunk at offset {offset} sent twice in one push")
        if data.ndim != 1 or data.shape[0] != self.block_len(k):
            raise ShapeMismatchError(
                f"table {name!r}: chunk at offset {offset} has {data.size} elements, expected {self.block_len(k)}"
            )
        _check_finite(self.spec, data, what)
        return k

    def check_complete(self, blocks: Sized) -> None:
        if len(blocks) != self.num_blocks:
            missing = self.num_blocks - len(blocks)
            raise ShapeMismatchError(
                f"table {self.spec.name!r}: push covered {len(blocks)} of {self.num_blocks} chunks ({missing} missing); nothing applied"
            )

    def begin_update(self, op: str, base_version: int = -1, staleness_aware_lr: bool = False) -> "DenseUpdate":
        """Start a push. Staging takes no lock: only commit() does, so a slow or stalled push never
        blocks pulls or other pushes of this table."""
        return DenseUpdate(self, op, base_version, staleness_aware_lr)

    def apply_mean(
        self, contributions: list[dict[int, np.ndarray]], before_swap: "Callable[[PushResult, DenseUpdate], None] | None" = None
    ) -> PushResult:
        """Apply the mean of whole-range gradients given as {block: chunk} (a BSP round)."""
        update = self.begin_update(GRADIENT)
        n = len(contributions)
        for k in range(self.num_blocks):
            parts = [c[k] for c in contributions]
            if n == 1:
                g = parts[0]
            else:
                acc = torch.from_numpy(np.array(parts[0], np.float32, copy=True))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only request bytes, only read here
                    for p in parts[1:]:
                        acc.add_(torch.from_numpy(np.asarray(p, np.float32)))
                g = acc.div_(n).numpy()
            update.apply(k * self.chunk_elems, g)
        return update.commit(before_swap)

    def export_state(self, along: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Values, optimizer state and version of this shard's range (a consistent snapshot, copies).

        ``along()`` runs in the same critical section (no commit in between); its result is
        returned as ``"along"`` (the dedup records that match this state)."""
        with self.write_lock, self.lock:
            blocks, version = list(self._blocks), self.version
            extra = along() if along is not None else None
        names = list(self.optimizer.init_state(torch.zeros(1)).keys())
        state = {k: torch.cat([b.state[k] for b in blocks]).numpy().copy() for k in names} if blocks else {}
        values = torch.cat([b.param for b in blocks]).numpy().copy() if blocks else np.zeros(0, np.float32)
        return {"version": version, "values": values, "state": state, "start": self.start, "stop": self.stop, "along": extra}

    def load_state(self, snap: dict[str, Any]) -> None:
        """Replace values, optimizer state and version with ``snap`` (from export_state of the same range)."""
        values = np.asarray(snap["values"], np.float32)
        if values.shape != (self.length,):
            raise ShapeMismatchError(
                f"table {self.spec.name!r}: snapshot holds {values.size} elements, this shard's range has {self.length}"
            )
        blocks = []
        for k in range(self.num_blocks):
            a, b = k * self.chunk_elems, k * self.chunk_elems + self.block_len(k)
            p = torch.from_numpy(values[a:b].copy())
            st = self.optimizer.init_state(p)
            for name in st:
                st[name] = torch.from_numpy(np.asarray(snap["state"][name], np.float32)[a:b].copy())
            blocks.append(_Block(p, st))
        with self.write_lock, self.lock:
            self._blocks = blocks
            self.version = int(snap["version"])


class DenseUpdate:
    """A push in progress: chunks are validated and staged (no lock held); commit() computes the
    new blocks under the table's write lock and swaps them in atomically."""

    def __init__(self, table: DenseTable, op: str, base_version: int, staleness_aware_lr: bool = False) -> None:
        self.table = table
        self.op = op
        self.base_version = base_version
        self.staleness_aware_lr = staleness_aware_lr
        self.staged: dict[int, np.ndarray] = {}
        self.done = False

    def apply(self, offset: int, data: np.ndarray) -> None:
        """Validate and stage the chunk at ``offset`` (shard-relative). ``data`` is kept, not copied:
        it must not change until commit (request bytes never do)."""
        t = self.table
        k = t.check_chunk(offset, data, self.staged, "gradient" if self.op == GRADIENT else "assigned values")
        self.staged[k] = data

    def commit(
        self, before_swap: "Callable[[PushResult, DenseUpdate], None] | None" = None, timeout: float = 60.0,
        once: "Callable[[], PushResult | None] | None" = None,
    ) -> PushResult:
        """Apply the staged chunks and swap them in. The push must have covered every chunk of the range.

        Under the table's write lock: ``once()`` first (deduplication: a result it returns is
        returned as is, nothing applied); then the new blocks are computed; then
        ``before_swap(result, self)`` runs before they become visible (replication, the dedup record);
        if it raises, nothing is applied."""
        t = self.table
        try:
            t.check_complete(self.staged)
            if not t.write_lock.acquire(timeout=timeout):
                raise ResourceExhaustedError(f"table {t.spec.name!r}: timed out after {timeout:.0f} s waiting to commit a push")
            try:
                prior = once() if once is not None else None
                if prior is not None:
                    self.done = True
                    return prior
                staleness = t.version - self.base_version if self.base_version >= 0 else -1
                opt = t.optimizer
                if self.staleness_aware_lr and staleness > 1:
                    opt = scaled_lr(t.optimizer, 1.0 / staleness)
                new: dict[int, _Block] = {}
                for k, data in self.staged.items():
                    block = t._blocks[k].clone()
                    if self.op == ASSIGN:
                        block.param = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
                    else:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", UserWarning)  # read-only request bytes, only read
                            incoming = torch.from_numpy(np.asarray(data, dtype=np.float32))
                        opt.update(block.param, incoming, block.state, t.version + 1)
                    new[k] = block
                version = t.version + (1 if self.op == GRADIENT else 0)
                result = PushResult(t.num_blocks, 0, float(staleness), staleness, version)
                if before_swap is not None:
                    before_swap(result, self)
                with t.lock:
                    for k, b in new.items():
                        t._blocks[k] = b
                    t.version = version
                if self.op == GRADIENT:
                    t.staleness.add(staleness)
                self.done = True
                return result
            finally:
                t.write_lock.release()
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.table.rejected += 1
        self.staged.clear()


class SparseTable:
    """The rows of a sparse table that hash to this shard.

    Rows live in preallocated arrays grown by doubling; ``_index`` (a vectorized hash, keyed per
    table) maps id -> row. Every row carries a version (updates applied) and the table step of
    its last touch (for TTL/LRU eviction).

    Memory: ``held_bytes()`` counts everything the table allocates (rows, free or live, with their
    optimizer state; the index; the slot map; the admission sketch), and every allocation that
    grows it asks ``max_bytes_fn(extra)`` first (which raises ResourceExhaustedError when over
    budget), so a refused request allocated nothing. ``fixed_bytes(spec, num_shards)``: what the
    constructor allocates (the caller reserves it).
    """

    INITIAL_INDEX = 16  # slots of the id index of an empty table (it doubles as rows come)

    def __init__(
        self, spec: TableSpec, shard_index: int, num_shards: int, max_bytes_fn=lambda extra: None
    ) -> None:
        self.spec = spec
        self.dim = spec.dim
        self.shard_index = shard_index
        self.slots = SlotMap(spec.num_slots, num_shards)
        self.optimizer = make_optimizer(spec.optimizer.name, spec.optimizer.hparams)
        self._key = table_key(spec.name, spec.seed)
        self._reserve = max_bytes_fn  # raises ResourceExhaustedError when growth is over budget
        self._index = IdIndex(self.INITIAL_INDEX)
        self._free: list[int] = []
        self._cap = 0
        self._n_alloc = 0  # rows [0, _n_alloc) have been handed out at least once
        self.values = torch.zeros((0, self.dim))
        self.state: dict[str, torch.Tensor] = self.optimizer.init_state(self.values)
        self.versions = np.zeros(0, np.int64)
        self.last_touch = np.zeros(0, np.int64)
        self.row_ids = np.zeros(0, np.int64)
        # admission: sightings of ids not yet admitted, in fixed memory
        self._seen = CountMinSketch() if spec.admission.enabled else None
        self.track_evictions = False
        self._evicted_ids: list[np.ndarray] = []
        self.step = 0  # pushes applied to this table on this shard
        self.updates = 0
        self.evicted = 0
        self.dropped = 0
        self.rejected = 0
        self.staleness = StalenessStats()
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ sizes
    @property
    def rows(self) -> int:
        return len(self._index)

    def _bytes_per_row(self) -> tuple[int, int]:
        per_param = self.dim * 4
        per_state = sum(v[:1].numel() * v.element_size() for v in self.state.values()) if self._cap else (
            4 * (self.dim * len(self.optimizer.elementwise_state) + len(self.optimizer.rowwise_state))
        )
        return per_param, per_state

    def _row_bytes(self) -> int:
        """Everything one allocated row costs: values, optimizer state, and its version, last touch
        and id (int64 each)."""
        return sum(self._bytes_per_row()) + 3 * 8

    def param_bytes(self) -> int:
        return self.rows * self._bytes_per_row()[0]

    def state_bytes(self) -> int:
        return self.rows * self._bytes_per_row()[1]

    def held_bytes(self) -> int:
        """Memory this table holds on the shard: rows allocated, live or free (params, optimizer
        state, version, last touch, id), the id index, the slot map and the admission sketch."""
        return (
            self._cap * self._row_bytes() + self._index.nbytes + self.slots.nbytes
            + (self._seen.nbytes if self._seen is not None else 0)
        )

    @classmethod
    def fixed_bytes(cls, spec: TableSpec) -> int:
        """Bytes the constructor allocates for ``spec`` (empty index, admission sketch; the default
        slot map is computed, not stored)."""
        sketch = CountMinSketch.bytes_for() if spec.admission.enabled else 0
        return cls.INITIAL_INDEX * BYTES_PER_SLOT + sketch

    # ------------------------------------------------------------------ validation
    def check_ids(self, ids: np.ndarray) -> None:
        if ids.size:
            owner = self.slots.shard_of(ids)
            wrong = np.nonzero(owner != self.shard_index)[0]
            if wrong.size:
                i = int(wrong[0])
                raise WrongShardError(
                    f"table {self.spec.name!r}: id {int(ids[i])} belongs to shard {int(owner[i])}, not {self.shard_index} "
                    f"({wrong.size} misrouted id(s); client and server disagree on num_shards or slots)"
                )

    # ------------------------------------------------------------------ storage
    def _cap_for(self, need: int) -> int:
        cap = max(1024, self._cap)
        while cap < need:
            cap *= 2
        return cap

    def _room_bytes(self, fresh: int, new_ids: int) -> int:
        """Bytes that storing ``new_ids`` more ids, ``fresh`` of them in rows never used, allocates."""
        rows = (self._cap_for(self._n_alloc + fresh) - self._cap) if fresh else 0
        return rows * self._row_bytes() + self._index.grow_bytes(new_ids)

    def _grow(self, need: int, new_ids: int = 0) -> None:
        """Make room for ``need`` rows (and ``new_ids`` more index entries); the budget is asked first."""
        cap = self._cap_for(need) if need > self._cap else self._cap
        index_growth = self._index.grow_bytes(new_ids)
        if cap == self._cap and not index_growth:
            return
        self._reserve(self._row_bytes() * (cap - self._cap) + index_growth)
        if cap == self._cap:
            return
        values = torch.empty((cap, self.dim))
        values[: self._cap] = self.values[: self._cap]
        self.values = values
        new_state = self.optimizer.init_state(torch.empty((cap, self.dim)))
        for k, v in new_state.items():
            v[: self._cap] = self.state[k][: self._cap]
        self.state = new_state
        self.versions = np.resize(self.versions, cap)
        self.last_touch = np.resize(self.last_touch, cap)
        self.row_ids = np.resize(self.row_ids, cap)
        self._cap = cap

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._index.lookup(ids)

    def _admit(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(mask of the missing ``ids`` (unique) admitted now, their earlier sightings). Changes
        nothing: ``_sighted`` records the sightings once the rows were created."""
        adm = self.spec.admission
        if self._seen is None:
            return np.ones(len(ids), bool), None
        seen = self._seen.estimate(ids)  # earlier sightings
        if adm.probability > 0:
            # the n-th sighting of an id draws afresh (deterministically per id and n)
            with np.errstate(over="ignore"):
                u = uniform01(ids.view(np.uint64) ^ self._key ^ (seen.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)))
            ok = u <= adm.probability
        else:
            ok = seen + 1 >= adm.min_count
        return ok, seen

    def _sighted(self, ids: np.ndarray, ok: np.ndarray, seen: np.ndarray | None) -> None:
        """Count a sighting of the ``ids`` not admitted. Admitted ids are not taken back out of the
        sketch: its counters are shared, and subtracting one id's count lowered its neighbours'
        below their true counts (a count-min sketch may over-count, never under-count); an
        admitted id whose row is evicted later is simply re-admitted sooner."""
        if self._seen is not None and seen is not None:
            self._seen.add(ids[~ok], seen[~ok])

    def _create(self, ids: np.ndarray, pinned: np.ndarray | None = None) -> np.ndarray:
        """Allocate and initialize rows for new ``ids``; returns their row numbers. LRU eviction to
        make room never picks a ``pinned`` row (the rows the same request reads)."""
        n = len(ids)
        evict = max(0, self.rows + n - self.spec.eviction.max_rows) if self.spec.eviction.max_rows else 0
        # the budget before anything changes (the rows eviction frees are reused, not allocated)
        self._reserve(self._room_bytes(max(0, n - len(self._free) - evict), n))
        if evict:
            self._evict_lru(evict, pinned)
        take = min(n, len(self._free))
        fresh = n - take
        self._grow(self._n_alloc + fresh, n)  # the budget first: refused, nothing was taken
        reused = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        self._n_alloc += fresh
        r = np.concatenate([np.asarray(reused[::-1], np.int64), np.arange(self._n_alloc - fresh, self._n_alloc, dtype=np.int64)])
        rt = torch.from_numpy(r)
        self.values[rt] = torch.from_numpy(init_rows(self.spec.initializer, self._key, ids, self.dim))
        fill = self.spec.optimizer.hparams.get("initial_accumulator", 0.0)
        for k, v in self.state.items():
            v[rt] = fill if k in ("sum", "n") else 0.0
        self.versions[r] = 0
        self.last_touch[r] = self.step
        self.row_ids[r] = ids
        self._index.insert(ids, r)
        return r

    def take_evicted(self) -> np.ndarray:
        """Ids evicted since the last call (tracked only while ``track_evictions``; caller holds the lock)."""
        out = np.concatenate(self._evicted_ids) if self._evicted_ids else np.zeros(0, np.int64)
        self._evicted_ids = []
        return out

    def _drop_rows(self, rows: np.ndarray) -> None:
        if self.track_evictions:  # a backup must drop them too (sent with the next replicated push)
            self._evicted_ids.append(self.row_ids[rows].copy())
        self._index.delete(self.row_ids[rows])
        self._free.extend(rows.tolist())
        self.evicted += len(rows)

    def _evict_lru(self, count: int, pinned: np.ndarray | None = None) -> None:
        live = self._index.values()
        if pinned is not None and pinned.size:
            live = live[~np.isin(live, pinned)]
        if count <= 0 or not live.size:
            return
        count = min(count, live.size)
        oldest = live[np.argpartition(self.last_touch[live], count - 1)[:count]]
        self._drop_rows(oldest)

    def evict_expired(self) -> int:
        """Drop rows untouched for more than ttl_steps table updates; returns how many."""
        ttl = self.spec.eviction.ttl_steps
        if not ttl or not len(self._index):
            return 0
        with self.lock:
            live = self._index.values()
            old = live[self.last_touch[live] < self.step - ttl]
            if old.size:
                self._drop_rows(old)
            return int(old.size)

    # ------------------------------------------------------------------ API
    def pull(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows for int64 ``ids`` (any order, duplicates allowed): (float32 (n, dim), int64 versions).

        Missing rows are created with the initializer (unless admission says
        not yet: then the initial values are returned but nothing is stored).
        """
        self.check_ids(ids)
        uniq, inverse = np.unique(ids, return_inverse=True)
        cap = self.spec.eviction.max_rows
        if cap and len(uniq) > cap:
            raise ResourceExhaustedError(
                f"table {self.spec.name!r}: one pull touches {len(uniq)} distinct rows on shard {self.shard_index}, "
                f"more than its eviction.max_rows of {cap}; split the request or raise max_rows"
            )
        with self.lock:
            rows = self._lookup(uniq)
            missing = np.nonzero(rows < 0)[0]
            out_vals = np.empty((len(uniq), self.dim), np.float32)
            out_vers = np.zeros(len(uniq), np.int64)
            if missing.size:
                ok, seen = self._admit(uniq[missing])
                admitted = missing[ok]
                if admitted.size:
                    # the rows this request already found are pinned: eviction must not reuse them
                    rows[admitted] = self._create(uniq[admitted], pinned=rows[rows >= 0])
                self._sighted(uniq[missing], ok, seen)
                pending = missing[rows[missing] < 0]
                if pending.size:
                    out_vals[pending] = init_rows(self.spec.initializer, self._key, uniq[pending], self.dim)
            have = np.nonzero(rows >= 0)[0]
            if have.size:
                r = rows[have]
                out_vals[have] = self.values[torch.from_numpy(r)].numpy()
                out_vers[have] = self.versions[r]
                self.last_touch[r] = self.step
        return out_vals[inverse], out_vers[inverse]

    def prepare_push(self, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None) -> "SparsePush":
        """Validate a push and sum duplicate ids; changes nothing."""
        name = self.spec.name
        if grads.ndim != 2 or grads.shape != (len(ids), self.dim):
            raise ShapeMismatchError(
                f"table {name!r}: gradient shape {tuple(grads.shape)} does not match {len(ids)} ids x dim {self.dim}"
            )
        if base_versions is not None and base_versions.shape != ids.shape:
            raise ShapeMismatchError(f"table {name!r}: {base_versions.size} base versions for {ids.size} ids")
        self.check_ids(ids)
        _check_finite(self.spec, grads, "gradient")
        uniq, inverse = np.unique(ids, return_inverse=True)
        g = torch.zeros((len(uniq), self.dim))
        g.index_add_(0, torch.from_numpy(inverse.astype(np.int64)), torch.from_numpy(np.array(grads, np.float32)))
        base = None
        if base_versions is not None:
            base = np.full(len(uniq), -1, np.int64)
            np.maximum.at(base, inverse, base_versions)  # the newest version any copy was computed from
        return SparsePush(uniq, g, base)

    def push(
        self, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None, staleness_aware_lr: bool = False
    ) -> PushResult:
        """Apply row gradients (duplicate ids are summed). Rows not present are dropped and counted.

        ``staleness_aware_lr``: scale this push's lr by 1/max(1, mean staleness of its rows)."""
        return self.apply_push(self.prepare_push(ids, grads, base_versions), staleness_aware_lr)

    def apply_mean(
        self, pushes: list["SparsePush"], before_swap: "Callable[[PushResult, RowDelta], None] | None" = None
    ) -> PushResult:
        """Apply the mean over ``pushes`` (a BSP round: each worker's rows, divided by the number of workers)."""
        ids = np.concatenate([p.ids for p in pushes])
        g = torch.cat([p.grads for p in pushes]).div_(len(pushes))
        return self.apply_push(self.prepare_push(ids, g.numpy()), before_swap=before_swap)

    def apply_push(
        self, p: "SparsePush", staleness_aware_lr: bool = False,
        once: "Callable[[], PushResult | None] | None" = None,
        before_swap: "Callable[[PushResult, RowDelta], None] | None" = None,
    ) -> PushResult:
        """Apply a prepared push under the table lock. ``once()`` first (deduplication: a result it
        returns is returned as is); ``before_swap(result, delta)`` sees the rows' new state before
        it is stored (replication); if it raises, nothing is applied."""
        uniq, g, base = p.ids, p.grads, p.base_versions
        with self.lock:
            prior = once() if once is not None else None
            if prior is not None:
                return prior
            rows = self._lookup(uniq)
            have = np.nonzero(rows >= 0)[0]
            dropped = len(uniq) - have.size
            stale = np.zeros(0, np.int64)
            if have.size:
                r = rows[have]
                rt = torch.from_numpy(r)
                if base is not None:
                    b = base[have]
                    stale = np.where(b >= 0, self.versions[r] - b, -1)
                    self.staleness.add(stale)
                opt = self.optimizer
                measured = stale[stale >= 0]
                if staleness_aware_lr and measured.size and measured.mean() > 1:
                    opt = scaled_lr(opt, 1.0 / float(measured.mean()))
                param = self.values[rt]
                state = {k: v[rt] for k, v in self.state.items()}
                step = torch.from_numpy(self.versions[r] + 1).to(torch.float64)[:, None]
                opt.update(param, g[torch.from_numpy(have)], state, step)
            else:
                r = np.zeros(0, np.int64)
                param, state = self.values[:0], {k: v[:0] for k, v in self.state.items()}
            valid = stale[stale >= 0]
            result = PushResult(
                int(have.size), dropped, float(valid.mean()) if valid.size else -1.0, int(valid.max()) if valid.size else -1,
                self.step + 1,
            )
            if before_swap is not None:
                before_swap(result, RowDelta(uniq[have], param.numpy(), {k: v.numpy() for k, v in state.items()}, self.versions[r] + 1))
            if have.size:
                self.values[rt] = param
                for k, v in state.items():
                    self.state[k][rt] = v
                self.versions[r] += 1
                self.last_touch[r] = self.step
            self.step += 1
            self.updates += int(have.size)
            self.dropped += dropped
        if self.spec.eviction.ttl_steps:
            self.evict_expired()
        return result

    def export_state(self, along: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Live rows (ids, values, optimizer state, versions) sorted by virtual slot, and the table step
        (copies); ``along()`` as for DenseTable.export_state."""
        with self.lock:
            extra = along() if along is not None else None
            ids, rows = self._index.items()
            order = np.lexsort((ids, slot_of(ids, self.spec.num_slots))) if ids.size else np.zeros(0, np.int64)
            ids, rows = ids[order], rows[order]
            rt = torch.from_numpy(rows)
            return {
                "step": self.step, "updates": self.updates, "ids": ids, "values": self.values[rt].numpy().copy(),
                "versions": self.versions[rows].copy(), "state": {k: v[rt].numpy().copy() for k, v in self.state.items()},
                "along": extra,
            }

    def load_state(self, snap: dict[str, Any]) -> None:
        """Replace every row with ``snap``'s (from export_state; ids must belong to this shard)."""
        ids = np.asarray(snap["ids"], np.int64)
        values = np.asarray(snap["values"], np.float32).reshape(len(ids), self.dim)
        self.check_ids(ids)
        with self.lock:
            self._index = IdIndex(max(self.INITIAL_INDEX, 2 * len(ids)))
            self._free, self._cap, self._n_alloc = [], 0, 0
            self.values = torch.zeros((0, self.dim))
            self.state = self.optimizer.init_state(self.values)
            self.versions = np.zeros(0, np.int64)
            self.last_touch = np.zeros(0, np.int64)
            self.row_ids = np.zeros(0, np.int64)
            self.step = int(snap["step"])
            self.updates = int(snap.get("updates", 0))
            if len(ids):
                self._upsert(ids, values, snap["state"], np.asarray(snap["versions"], np.int64))

    def _upsert(self, ids: np.ndarray, values: np.ndarray, state: dict[str, Any], versions: np.ndarray) -> None:
        """Store rows as given (create the missing ones). Caller holds the lock."""
        rows = self._lookup(ids)
        missing = np.nonzero(rows < 0)[0]
        if missing.size:
            n = missing.size
            take = min(n, len(self._free))
            fresh = n - take
            self._grow(self._n_alloc + fresh, n)  # the budget first
            reused = np.asarray(self._free[len(self._free) - take :][::-1], np.int64)
            del self._free[len(self._free) - take :]
            self._n_alloc += fresh
            new = np.concatenate([reused, np.arange(self._n_alloc - fresh, self._n_alloc, dtype=np.int64)])
            self._index.insert(ids[missing], new)
            self.row_ids[new] = ids[missing]
            rows[missing] = new
        rt = torch.from_numpy(rows)
        self.values[rt] = torch.from_numpy(np.asarray(values, np.float32))
        for k, v in self.state.items():
            v[rt] = torch.from_numpy(np.asarray(state[k], np.float32))
        self.versions[rows] = versions
        self.last_touch[rows] = self.step

    def apply_delta(self, delta: RowDelta, step: int, evicted: np.ndarray | None = None) -> None:
        """Make rows equal to a primary's (replication): upsert ``delta``, drop ``evicted`` ids, set the step."""
        with self.lock:
            if evicted is not None and evicted.size:
                rows = self._lookup(evicted)
                gone = rows[rows >= 0]
                if gone.size:
                    self._index.delete(self.row_ids[gone])
                    self._free.extend(gone.tolist())
            if delta.ids.size:
                self._upsert(delta.ids, delta.values, delta.state, delta.versions)
            self.updates += int(delta.ids.size)
            self.step = step

    def items(self) -> Iterator[tuple[int, int]]:
        """(id, row) pairs of live rows (a snapshot)."""
        with self.lock:
            ids, rows = self._index.items()
            return zip(ids.tolist(), rows.tolist())
