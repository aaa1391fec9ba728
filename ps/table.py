"""One shard's part of a table: values, optimizer state and versions. ``DenseTable``: a contiguous
range of a dense table, in blocks of ``chunk_elems`` elements (the wire chunk); ``SparseTable``:
the rows whose ids map to this shard. Each class docstring states its contract.

Thread-safety: each table has one lock; methods take it themselves.
"""
from __future__ import annotations

import secrets
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterator, Mapping, Sized

import numpy as np
import torch

from ps.config import TableSpec
from ps.errors import NonFiniteError, ResourceExhaustedError, ShapeMismatchError, WrongShardError
from ps.index import new_index
from ps.initializers import init_dense, init_rows, table_key, uniform01
from ps import rowkernel
from ps.optim import Adagrad, Optimizer, make_optimizer, scaled_lr
from ps.partition import SlotMap, dense_range, slot_of
from ps.rowdtype import ROW_DTYPES, from_storage_array, round_rows, row_keys, to_storage_array
from ps.rowstore import Column, RowStore, chunk_rows_for, limit_heap_retention
from ps.sketch import CountMinSketch
from ps.tier import ColdTier, Hold, ResidentBudget

__all__ = ["all_finite", "DenseTable", "DenseUpdate", "SparseTable", "SparsePush", "TableMemory", "TieredRows", "RowDelta", "PushResult", "StalenessStats", "GRADIENT", "ASSIGN"]

GRADIENT = "gradient"
ASSIGN = "assign"


def all_finite(x: np.ndarray) -> bool:
    """No NaN/Inf anywhere in ``x``? For float32, one BLAS pass without a boolean temporary: a NaN or
    Inf makes x.x NaN/Inf, so a finite x.x says every element is finite (an x.x that overflows falls
    back to the exact check)."""
    if x.size == 0:
        return True
    if x.dtype == np.float32:
        flat = x.reshape(-1)
        if np.isfinite(float(np.dot(flat, flat))):  # BLAS, no temporary; half the time of isfinite().all()
            return True
    return bool(np.isfinite(x).all())


def _check_finite(spec: TableSpec, x: np.ndarray, what: str) -> None:
    if not spec.allow_nonfinite and not all_finite(x):
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
        raise NonFiniteError(f"table {spec.name!r}: {what} holds {bad} NaN/Inf value(s); rejected (nothing applied)")


@dataclass
class StalenessStats:
    """Running staleness of applied updates (version applied against - version computed from)."""

    count: int = 0
    total: int = 0
    max: int = 0

    def add(self, staleness: int) -> None:
        """One update's staleness (< 0: not measured, not counted)."""
        if staleness >= 0:
            self.merge((1, int(staleness), int(staleness)))

    def merge(self, stats: tuple[int, int, int]) -> tuple[int, int, int]:
        """Count ``stats``: (count, sum, max) of updates' staleness. Returns them."""
        n, total, most = stats
        if n:
            self.count, self.total, self.max = self.count + n, self.total + total, max(self.max, most)
        return stats

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
    # where a recent pull of exactly these ids found their rows, and the table's row layout then
    # (``SparseTable._layout``): apply_push reuses the locations if no row moved since
    loc: np.ndarray | None = None
    layout: int = -1


@dataclass(frozen=True)
class RowDelta:
    """The new state of the rows one sparse push updated: what a backup stores to match its primary."""

    ids: np.ndarray
    values: np.ndarray
    state: dict[str, np.ndarray]
    versions: np.ndarray


# CPython reference counts and torch's storage use count tell whether anything besides the spare
# pool still refers to a retired block (below). Without torch's counter no block is ever reused.
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


class _Block:
    """Values and optimizer state of one chunk. Once committed, written only by a commit that
    computes in place (``DenseUpdate.commit``: nothing but the table refers to it)."""

    __slots__ = ("param", "state")

    def __init__(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.param = param
        self.state = state


def _unreferenced(holder: list[_Block], i: int) -> bool:
    """Is ``holder[i]`` referred to by ``holder`` alone: no other reference to the block, its state dict,
    its tensors, or any tensor, view or numpy array sharing their memory?

    This is the reader count of a retired block. A reader gets blocks only from the table's current
    list (under its lock) and holds a reference for as long as it reads (the value tensors of
    ``snapshot()``, ``export_state``'s tensors, a push's base block); a view or numpy array made from a
    tensor holds its storage. Once retired a block is out of that list, so its counts only fall:
    when they are at their floor here, no reader is left and none can come."""
    if _storage_use_count is None:
        return False
    # the floors: getrefcount's argument + the one holding reference (list slot, block slot, dict value)
    if sys.getrefcount(holder[i]) != 2 or sys.getrefcount(holder[i].state) != 2 or sys.getrefcount(holder[i].param) != 2:
        return False
    if any(sys.getrefcount(holder[i].state[name]) != 2 for name in holder[i].state):
        return False
    # per tensor: its own TensorImpl + the storage object untyped_storage() makes for the call
    return all(_storage_use_count(x.untyped_storage()._cdata) == 2 for x in (holder[i].param, *holder[i].state.values()))


# A push computes early only where this shard's range has _EARLY_BLOCKS chunks or more: with few
# chunks there is little to overlap, and work done between two chunks holds the next one back (the
# stream's flow-control window opens as the handler reads); measured on 2 loaded cores, 4 chunks of
# 1 MiB took ~2-3 ms longer computed early. (Handing the chunks to worker threads was tried and
# dropped: a forked child's push failed now and then, and the gain was not resolved on 2 cores.)
_EARLY_BLOCKS = 8


def _readonly_tensor(data: np.ndarray) -> torch.Tensor:
    """A float32 torch view of ``data`` (request bytes: read-only, only read here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data, dtype=np.float32))


class DenseTable:
    """Shard ``shard_index``'s contiguous range of a dense table and the optimizer state for it.

    A reader never sees a block change: a commit computes a block in place only while nothing but
    the table refers to it (no pull being sent, no checkpoint being copied, no push reading it),
    holding the table's lock, so no reader can take it meanwhile. Otherwise (and for a push that
    computes early) the new block goes into a spare one (a block retired by an earlier push that
    no reader holds any more, else a fresh allocation), swapped in at commit; at most
    ``spare_generations`` retired blocks are kept per block.

    Memory: ``held_bytes()`` counts every block the table owns (current, spare, computed by a push
    not yet committed); a fresh block asks ``max_bytes_fn(bytes)`` first (holding ``growth_lock``,
    shared by a shard's tables), which raises ResourceExhaustedError over budget: the push is
    refused, nothing applied. A spare a reader still holds is let go before a fresh one is made
    (it could not be reused; the reader's reply keeps it until sent)."""

    spare_generations = 1

    def __init__(
        self, spec: TableSpec, shard_index: int, num_shards: int, chunk_elems: int,
        max_bytes_fn: Callable[[int], None] = lambda extra: None, growth_lock: "threading.Lock | threading.RLock | None" = None,
    ) -> None:
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
        self._state_names = tuple(self.optimizer.init_state(torch.zeros(1)).keys())
        self.version = 0
        self.generation = 0  # swaps so far (commits of either op, loads): what an early computation checks
        self.staleness = StalenessStats()
        self.rejected = 0
        # guards _blocks/version and the spares; held for microseconds, or while a commit computes in place
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()  # serializes commits (held while one push computes)
        # the spare generation is allocated with the table (the shard's budget grants both at create):
        # a push never has to grow a table the budget already holds, however full it gets meanwhile
        self._spares: list[list[_Block]] = [[self._fresh(k) for _ in range(self.spare_generations)] for k in range(len(self._blocks))]
        self._reserve = max_bytes_fn
        self._growth = growth_lock if growth_lock is not None else threading.Lock()
        # blocks owned beyond the current ones: spares and pushes' computed blocks
        self._extra_bytes = sum(self._block_nbytes(k) for k in range(len(self._blocks))) * self.spare_generations
        self._early: weakref.ref[DenseUpdate] | None = None  # the push computing as its chunks arrive
        self.blocks_allocated = 0  # fresh blocks a commit had to allocate (no spare was free)
        self.blocks_reused = 0  # spare blocks a commit wrote into
        self.blocks_in_place = 0  # blocks a commit computed in place (nothing else referred to them)
        self.recomputed = 0  # pushes computed early whose base a commit replaced first: computed again

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def block_len(self, k: int) -> int:
        return min(self.chunk_elems, self.length - k * self.chunk_elems)

    def param_bytes(self) -> int:
        return self.length * 4

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for b in self._blocks for v in b.state.values())

    @classmethod
    def fixed_bytes(cls, spec: TableSpec, num_shards: int) -> int:
        """Bytes the constructor allocates for ``spec`` on the largest of ``num_shards`` slices: values,
        elementwise optimizer state, and as much again for the spare generation made with them."""
        state = len(make_optimizer(spec.optimizer.name, spec.optimizer.hparams).elementwise_state)
        return -(-spec.numel // num_shards) * 4 * (1 + state) * (1 + cls.spare_generations)

    def held_bytes(self) -> int:
        """Memory this table holds on the shard: params + optimizer state, and the spare blocks and
        blocks computed by pushes not yet committed (lock-free: a budget check reads it while other
        tables' locks are held)."""
        return self.param_bytes() + self.state_bytes() + self._extra_bytes

    def _block_nbytes(self, k: int) -> int:
        return 4 * self.block_len(k) * (1 + len(self._state_names))

    def spare_blocks(self) -> int:
        """Retired blocks kept for reuse (at most ``spare_generations`` per block)."""
        with self.lock:
            return sum(len(s) for s in self._spares)

    def spare_bytes(self) -> int:
        """Memory held by the spare blocks (the commit's working set)."""
        with self.lock:
            return sum(self._block_nbytes(k) * len(s) for k, s in enumerate(self._spares))

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        """(version, value blocks) as of now; the blocks do not change while the caller holds them
        (a block is reused only once nothing refers to it)."""
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

    def begin_update(self, op: str, base_version: int = -1, staleness_aware_lr: bool = False, early: bool = False) -> "DenseUpdate":
        """Start a push. Staging takes no lock: only commit() does, so a slow or stalled push never
        blocks pulls or other pushes of this table. ``early``: the caller wants each new block as
        its chunk arrives (``DenseUpdate.early_block``): the push computes early where it can."""
        return DenseUpdate(self, op, base_version, staleness_aware_lr, early)

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
                for p in parts[1:]:
                    acc.add_(_readonly_tensor(p))
                g = acc.div_(n).numpy()
            update.apply(k * self.chunk_elems, g)
        return update.commit(before_swap)

    def export_state(self, along: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Values, optimizer state and version of this shard's range (a consistent snapshot, copies).

        ``along()`` runs in the same critical section (no commit in between); its result is
        returned as ``"along"`` (the dedup records that match this state)."""
        with self.write_lock, self.lock:
            # the tensors, not the blocks: holding them is what keeps a block from being reused
            params = [b.param for b in self._blocks]
            states = {k: [b.state[k] for b in self._blocks] for k in self._state_names}
            version = self.version
            extra = along() if along is not None else None
        state = {k: torch.cat(v).numpy().copy() for k, v in states.items()} if params else {}
        values = torch.cat(params).numpy().copy() if params else np.zeros(0, np.float32)
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
            st = {name: torch.from_numpy(np.asarray(snap["state"][name], np.float32)[a:b].copy()) for name in self._state_names}
            blocks.append(_Block(torch.from_numpy(values[a:b].copy()), st))
        with self.write_lock, self.lock:
            self._blocks = blocks
            self.version = int(snap["version"])
            self.generation += 1

    # ------------------------------------------------------------------ spare blocks
    def _fresh(self, k: int) -> _Block:
        n = self.block_len(k)
        return _Block(torch.empty(n), {name: torch.empty(n) for name in self._state_names})

    def _spare(self, k: int) -> _Block:
        """A block to compute block ``k``'s next value in: a retired one nothing refers to, else a new one."""
        with self.lock:
            return self._spare_locked(k)

    def _spare_locked(self, k: int) -> _Block:
        spares = self._spares[k]
        for i in range(len(spares)):
            if _unreferenced(spares, i):
                self.blocks_reused += 1
                return spares.pop(i)
        nbytes = self._block_nbytes(k)
        while spares:  # held by readers: not reusable now, and the budget should not count them twice
            spares.pop()
            self._extra_bytes -= nbytes
        with self._growth:
            self._reserve(nbytes)
            block = self._fresh(k)
            self._extra_bytes += nbytes
        self.blocks_allocated += 1
        return block

    def _keep_spare(self, k: int, block: _Block) -> None:
        """Keep ``block`` (retired from, or never part of, the table) for reuse; call with ``lock`` held.
        At the bound, first drops a kept one that is still referred to, else the oldest."""
        spares = self._spares[k]
        while spares and len(spares) >= self.spare_generations:
            spares.pop(next((i for i in range(len(spares)) if not _unreferenced(spares, i)), 0))
            self._extra_bytes -= self._block_nbytes(k)
        if self.spare_generations > 0:
            spares.append(block)
        else:
            self._extra_bytes -= self._block_nbytes(k)

    def _compute(self, k: int, base: _Block, data: np.ndarray, op: str, opt: Optimizer, step: int, out: _Block) -> None:
        """Block ``k``'s next value from ``base`` and the pushed chunk ``data``, written into ``out``."""
        if op == ASSIGN:
            out.param.copy_(_readonly_tensor(data))
            for name in self._state_names:
                out.state[name].copy_(base.state[name])
        else:
            opt.update_into(out.param, out.state, base.param, _readonly_tensor(data), base.state, step)

    def _compute_in_place(self, k: int, data: np.ndarray, op: str, opt: Optimizer, step: int) -> None:
        """``_compute`` into block ``k`` itself (call with ``lock`` held, the block unreferenced): no copy
        of its values and state first."""
        b = self._blocks[k]
        if op == ASSIGN:
            b.param.copy_(_readonly_tensor(data))
        else:
            opt.update(b.param, _readonly_tensor(data), b.state, step)
        self.blocks_in_place += 1

    def _swap(self, new: Mapping[int, _Block], version: int) -> None:
        """Swap in the new blocks and version; call with ``lock`` held."""
        for k, b in new.items():
            self._keep_spare(k, self._blocks[k])
            self._blocks[k] = b
        self.version = version
        self.generation += 1


class DenseUpdate:
    """A push in progress: chunks are validated and staged (no lock held); commit() computes the new
    blocks (in place where nothing else refers to a block) and swaps them in atomically under the
    table's write lock. A push whose caller wants its new blocks as they are computed
    (``early``), where this shard's range has 8 chunks or more, computes each block as its chunk
    arrives instead (each chunk's slice is independent of the others; one such push at a time per
    table), into spare blocks, from the table as it was at its first chunk; if a commit replaced
    the table's blocks before this push commits, commit() computes them again from the new ones."""

    def __init__(self, table: DenseTable, op: str, base_version: int, staleness_aware_lr: bool = False, early: bool = False) -> None:
        self.table = table
        self.early = early
        self.op = op
        self.base_version = base_version
        self.staleness_aware_lr = staleness_aware_lr
        self.staged: dict[int, np.ndarray] = {}
        self.done = False
        self._out: dict[int, _Block] = {}  # new blocks computed so far (not visible to anyone)
        self._computed: set[int] = set()  # blocks of _out computed from generation _gen
        self._gen = -1  # the table's generation this push computes from early (-1: computes at commit)
        self._version = 0
        self._opt: Optimizer = table.optimizer
        self._early = False
        # set by commit(): the blocks it swapped in are the ones computed early (early_block's values)
        self.early_final = False

    def _optimizer(self, version: int) -> tuple[Optimizer, int]:
        """The optimizer to apply at table version ``version`` and the staleness it sees."""
        t = self.table
        staleness = version - self.base_version if self.base_version >= 0 else -1
        if self.staleness_aware_lr and staleness > 1:
            return scaled_lr(t.optimizer, 1.0 / staleness), staleness
        return t.optimizer, staleness

    def apply(self, offset: int, data: np.ndarray) -> None:
        """Validate and stage the chunk at ``offset`` (shard-relative); the push computing early also
        computes its new block now. ``data`` is kept, not copied: it must not change until commit
        (request bytes never do)."""
        t = self.table
        k = t.check_chunk(offset, data, self.staged, "gradient" if self.op == GRADIENT else "assigned values")
        self.staged[k] = data
        if self.done:
            return
        with t.lock:
            if (
                self.early and not self.staged.keys() - {k} and t.num_blocks >= _EARLY_BLOCKS
                and (t._early is None or t._early() is None)
            ):
                t._early, self._early, self._gen, self._version = weakref.ref(self), True, t.generation, t.version
                self._opt = self._optimizer(self._version)[0]
            if not self._early:
                return
            if t.generation != self._gen:  # a commit replaced the base: compute at commit instead
                t._early, self._early = None, False
                return
            base = t._blocks[k]  # held while read: not reused under us
        self._into_spare(k, base, self._opt, self._version + 1)

    def _into_spare(self, k: int, base: _Block, opt: Optimizer, step: int, locked: bool = False) -> None:
        """Compute block ``k`` from ``base`` into a spare block (``locked``: the table's lock is held)."""
        t = self.table
        out = self._out.get(k) or (t._spare_locked(k) if locked else t._spare(k))
        self._out[k] = out
        self._computed.add(k)
        t._compute(k, base, self.staged[k], self.op, opt, step, out)

    def early_block(self, k: int) -> torch.Tensor | None:
        """Block ``k``'s new values if this push computed it early (as its chunk arrived, from the
        table as at the push's first chunk), else None. Provisional: they are the committed values
        only if commit() then sets ``early_final`` (no other commit came first, not a duplicate).
        The tensor is not written again once returned, except by a commit that recomputes it."""
        return self._out[k].param if self._early and k in self._computed else None

    def _stop_early(self) -> None:
        t = self.table
        if self._early:
            with t.lock:
                if t._early is not None and t._early() is self:
                    t._early = None
                self._early = False

    def commit(
        self, before_swap: "Callable[[PushResult, DenseUpdate], None] | None" = None, timeout: float = 60.0,
        once: "Callable[[], PushResult | None] | None" = None,
    ) -> PushResult:
        """Apply the staged chunks and swap them in. The push must have covered every chunk of the range.

        Under the table's write lock: ``once()`` first (deduplication: a result it returns is
        returned as is, nothing applied); then the blocks a reader holds are computed into spares
        (unless computed early from the blocks still current; a fresh spare the byte budget refuses:
        ResourceExhaustedError, nothing applied); then, under the table's lock (pulls wait), the
        blocks readers took meanwhile likewise, ``before_swap(result, self)`` (replication, the
        dedup record: it reads the staged chunks, not the new values; if it raises, nothing is
        applied), the other blocks computed in place and the new ones swapped in: no reader sees a
        block change, or the table half pushed. The chunks were validated when staged, so the in-place step cannot
        fail on the data; only memory running out inside the optimizer could stop it midway, and
        then the blocks before it would stay applied."""
        t = self.table
        try:
            self._stop_early()
            t.check_complete(self.staged)
            if not t.write_lock.acquire(timeout=timeout):
                raise ResourceExhaustedError(f"table {t.spec.name!r}: timed out after {timeout:.0f} s waiting to commit a push")
            try:
                prior = once() if once is not None else None
                if prior is not None:
                    self.done = True
                    return prior
                with t.lock:  # (no swap can come between: swaps hold the write lock)
                    generation, version = t.generation, t.version
                if self._gen != generation:
                    if self._computed:
                        t.recomputed += 1
                    self._computed.clear()
                early_final = bool(self._computed) and self._computed >= self.staged.keys()
                opt, staleness = self._optimizer(version)
                with t.lock:
                    held = [k for k in self.staged if k not in self._computed and not _unreferenced(t._blocks, k)]
                for k in held:  # a reader holds it: computed into a spare (readers go on meanwhile)
                    self._into_spare(k, t._blocks[k], opt, version + 1)
                new_version = version + (1 if self.op == GRADIENT else 0)
                result = PushResult(t.num_blocks, 0, float(staleness), staleness, new_version)
                with t.lock:  # no reader can take a block until the swap
                    for k in self.staged:  # taken by a reader since the check above: into a spare too
                        if k not in self._computed and not _unreferenced(t._blocks, k):
                            self._into_spare(k, t._blocks[k], opt, version + 1, locked=True)
                    # every block still to compute is now the table's alone: nothing below allocates (or
                    # fails for want of bytes) once before_swap has forwarded the push
                    if before_swap is not None:
                        before_swap(result, self)
                    for k in self.staged:
                        if k in self._computed:  # early, or held above
                            continue
                        stale = self._out.pop(k, None)  # computed early from a replaced base
                        if stale is not None:
                            t._keep_spare(k, stale)
                        t._compute_in_place(k, self.staged[k], self.op, opt, version + 1)
                    t._swap(self._out, new_version)
                self._out = {}
                self.early_final = early_final
                if self.op == GRADIENT:
                    t.staleness.add(staleness)
                self.done = True
                return result
            finally:
                t.write_lock.release()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the push (a no-op once committed): nothing applied; its computed blocks become spares."""
        self._stop_early()
        if not self.done:
            self.done = True
            self.table.rejected += 1
        self.staged.clear()
        if self._out:
            t = self.table
            with t.lock:
                while self._out:
                    t._keep_spare(*self._out.popitem())
        self._computed.clear()


@dataclass(frozen=True)
class TableMemory:
    """What one sparse table holds on this shard (``SparseTable.memory_stats()``; bytes unless said).

    ``payload_bytes_per_row``: what a row *is* (values in the row dtype + optimizer state);
    ``bytes_per_row``: RAM held per live row, every overhead included (held_bytes / rows);
    ``values_bytes`` / ``state_bytes`` / ``metadata_bytes``: the resident chunks' columns, allocated
    rows (live or free), each column's alignment padding included — metadata is version, last
    touch, id and admission count, the free stack (8 bytes per row of capacity), plus the cold
    rows' metadata; ``index_bytes``: the id index; ``other_bytes``: slot map and admission sketch;
    ``disk_bytes``: the disk tier's file."""

    rows: int
    resident_rows: int
    cold_rows: int
    free_rows: int
    row_dtype: str
    payload_bytes_per_row: int
    bytes_per_row: float
    values_bytes: int
    state_bytes: int
    metadata_bytes: int
    index_bytes: int
    other_bytes: int
    held_bytes: int
    disk_bytes: int
    chunks: int
    chunk_rows: int
    # how pushes update rows: "kernel" (ps.rowkernel: one compiled pass, GIL released) or "numpy (<why not>)"
    row_path: str = ""


class _ColumnView:
    """``table.values[rows]``-style read access to one column of the resident rows (compatibility:
    rows used to live in one tensor per column). Indexing gathers a copy."""

    def __init__(self, store: RowStore, name: str, as_numpy: bool) -> None:
        self._store, self._name, self._np = store, name, as_numpy

    def __getitem__(self, rows: Any) -> Any:
        r = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, np.int64)
        out = self._store.gather(np.atleast_1d(r).astype(np.int64), [self._name])[self._name]
        return out.numpy() if self._np else out

    @property
    def nbytes(self) -> int:
        return self._store.capacity * self._store.columns[self._name].row_nbytes


def _filled(shape: tuple[int, int], value: float, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``value``; zeros come from calloc (numpy), whose fresh pages cost nothing until written."""
    if value != 0.0:
        return torch.full(shape, value, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(shape, {4: np.int32, 2: np.int16}[itemsize])).view(dtype)


class TieredRows:
    """One column of a tiered table's export, read block by block (checkpoints stream it to disk:
    a table larger than RAM is never materialized). Rows at ``resident`` positions come from a
    copy taken at export time (at most the resident budget); the others straight from the disk
    tier's file, at the slots they had at that moment, which a :class:`~ps.tier.Hold` keeps from
    being overwritten until every column of the export is gone (no copy of the file, and the
    table is not locked while the rows are read). ``np.asarray`` materializes it.

    ``dtype``/``shape``: of the storage array (float32, float16, or uint16 bit patterns of bf16)."""

    BLOCK_ROWS = 1 << 15

    def __init__(self, name: str, width: int, torch_dtype: torch.dtype, resident: np.ndarray, hot: torch.Tensor,
                 cold_slots: np.ndarray, hold: Hold) -> None:
        self.name, self._width, self._tdtype = name, width, torch_dtype
        self._resident, self._hot, self._cold_slots = resident, hot, cold_slots
        self._hold, self._twin = hold, hold.payload  # the hold lives as long as any column of the export
        self._hot_idx = np.cumsum(resident) - 1
        self._cold_idx = np.cumsum(~resident) - 1
        n = len(resident)
        self.shape: tuple[int, ...] = (n, width) if width else (n,)
        self.dtype = to_storage_array(torch.empty(0, dtype=torch_dtype)).dtype

    def __len__(self) -> int:
        return self.shape[0]

    def blocks(self) -> Iterator[np.ndarray]:
        """The rows in order, as contiguous storage arrays of up to BLOCK_ROWS rows."""
        n = self.shape[0]
        for a in range(0, n, self.BLOCK_ROWS):
            b = min(n, a + self.BLOCK_ROWS)
            res = self._resident[a:b]
            out = torch.empty((b - a,) + self.shape[1:], dtype=self._tdtype)
            rp, cp = np.flatnonzero(res), np.flatnonzero(~res)
            if rp.size:
                out.index_copy_(0, torch.from_numpy(rp), self._hot.index_select(0, torch.from_numpy(self._hot_idx[a + rp])))
            if cp.size:
                part = self._twin.gather(self._cold_slots[self._cold_idx[a + cp]], [self.name])[self.name]
                out.index_copy_(0, torch.from_numpy(cp), part)
                self._twin.backing.drop_pages()
            yield to_storage_array(out)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.concatenate(list(self.blocks())) if self.shape[0] else np.zeros(self.shape, self.dtype)
        return a.astype(dtype) if dtype is not None else a


_META = (
    Column("version", torch.int64),  # updates applied to the row
    # table step of its last pull or push (LRU, TTL, residency): kept up only by a table that evicts or
    # has a resident budget (SparseTable._touches); others write it once, when the row is made or loaded
    Column("touch", torch.int64),
    Column("id", torch.int64),
    Column("admits", torch.int16),  # sightings when it was admitted (1 without admission; saturates)
)


class SparseTable:
    """The rows of a sparse table that hash to this shard.

    Rows live in a :class:`~ps.rowstore.RowStore`: fixed-size chunks holding each row's values
    (in the table's row dtype, ``spec.dtype``: float32, float16 or bfloat16), optimizer state
    (fp32, elementwise or row-wise) and metadata (version, last touch, id, admission count);
    ``_index`` (a hash table or sorted id arrays, ``ps.index``) maps id -> location. Eviction (TTL/LRU)
    releases rows to the store's free list, which new rows reuse before any chunk is added.

    Low precision: pulls widen stored rows to fp32 (``pull``) or return them as stored
    (``pull_rows``); a push widens, applies the optimizer in fp32, and rounds back (bf16:
    stochastic rounding, see ``ps.rowdtype``).

    Disk tier: with ``resident_budget`` (a :class:`~ps.tier.ResidentBudget` shared by a shard's
    tables), the rows beyond what the budget leaves this table are demoted, least recently
    touched first, to a file-backed :class:`~ps.tier.ColdTier` under ``spill_dir``; a push of a
    cold row brings it back (demoting others), a pull reads it where it lies. Index locations: row
    >= 0 resident, -1 absent, <= -2 cold slot ``-loc - 2``.

    Memory: every allocation that grows ``held_bytes()`` asks ``max_bytes_fn(extra)`` first, for
    exactly what it adds (which raises ResourceExhaustedError when over budget), holding
    ``growth_lock`` (shared by a shard's tables) from the question to the allocation: a refused
    request allocated nothing, and what the tables hold never exceeds the budget.

    Row kernel: pushes of the optimizers and row dtypes ``ps.rowkernel`` covers, and every pull of
    resident rows, go through one compiled pass that releases the GIL (the table's lock is held);
    ``row_path`` (and ``memory_stats().row_path``) says which path pushes take and why.
    ``row_kernel=False`` keeps the table on the numpy/torch path, the reference it matches bit for bit.

    Thread-safety: ``lock`` guards everything; public methods take it themselves.
    """

    def __init__(
        self, spec: TableSpec, shard_index: int, num_shards: int, max_bytes_fn: Callable[[int], None] = lambda extra: None,
        *, resident_budget: ResidentBudget | None = None, spill_dir: str | None = None, chunk_bytes: int = 64 << 20,
        growth_lock: "threading.Lock | threading.RLock | None" = None, row_kernel: bool = True,
    ) -> None:
        limit_heap_retention()  # the process holds sparse rows: freed temporaries go back to the kernel
        self.spec = spec
        self.dim = spec.dim
        self.shard_index = shard_index
        self.slots = SlotMap(spec.num_slots, num_shards)
        self.optimizer = make_optimizer(spec.optimizer.name, spec.optimizer.hparams)
        self.row_path = rowkernel.path_of(spec.optimizer.name, spec.optimizer.hparams, spec.dtype) if row_kernel else "numpy (asked for)"
        self._gather_kernel = rowkernel.KERNEL if row_kernel else None  # pulls: any optimizer, any row dtype
        if row_kernel:
            rowkernel.say_once()  # a shard without the kernel says so once, when its first sparse table is made
        if self.row_path == "kernel" and isinstance(self.optimizer, Adagrad) and not self.optimizer.fused and not self.optimizer.h["lr_decay"]:
            self.row_path = "numpy (adagrad's torch path unfused: the kernel matches the fused one)"
        self._kernel = rowkernel.kernel_for(spec.optimizer.name, spec.optimizer.hparams, spec.dtype) if self.row_path == "kernel" else None
        self._key = table_key(spec.name, spec.seed)
        self._reserve = max_bytes_fn  # raises ResourceExhaustedError when growth is over budget
        # held from a budget check to the allocation it allowed: shared by a shard's tables, so two
        # tables growing at once cannot both be granted the same headroom
        self._growth = growth_lock if growth_lock is not None else threading.Lock()
        self._index = new_index(kernel=self._gather_kernel is not None)
        self.row_dtype = ROW_DTYPES[spec.dtype]
        opt = self.optimizer
        self._state_names = list(opt.elementwise_state) + list(opt.rowwise_state)
        self._payload = (
            [Column("values", self.row_dtype, self.dim)]
            + [Column(k, torch.float32, self.dim) for k in opt.elementwise_state]
            + [Column(k, torch.float32, 0) for k in opt.rowwise_state]
        )
        self._budget = resident_budget if resident_budget is not None and resident_budget.limit else None
        row_nbytes = sum(c.row_nbytes for c in self._payload) + sum(c.row_nbytes for c in _META)
        # only LRU and TTL eviction and demotion to the disk tier read a row's last touch
        self._touches = bool(spec.eviction.max_rows or spec.eviction.ttl_steps or self._budget is not None)
        if self._budget is not None:  # a chunk is the budget's granularity: keep it well below the budget
            chunk_bytes = max(256 << 10, min(chunk_bytes, self._budget.limit // 8))
        self._chunk_rows = chunk_rows_for(row_nbytes, chunk_bytes, lo=64)
        self._store = RowStore(self._payload + list(_META), self._chunk_rows, first_rows=min(1024, max(64, self._chunk_rows // 8)))
        self._spill_dir = spill_dir
        self._cold: ColdTier | None = None
        self._budget_handle = 0
        if self._budget is not None:
            ref = weakref.ref(self)
            self._budget_handle = self._budget.register(lambda: t.resident_bytes() if (t := ref()) is not None else 0)
        # admission: sightings of ids not yet admitted, in fixed memory
        self._seen = CountMinSketch() if spec.admission.enabled else None
        self.track_evictions = False
        self._evicted_ids: list[np.ndarray] = []
        # Eviction epoch: changes whenever rows are dropped (eviction, a replica's drop) or replaced
        # (load_state). A row's version counts its updates and restarts at 0 when a dropped row is
        # created again, so (id, version) names one value only within one epoch; a conditional pull
        # trusts a caller's versions only when they were read at the current epoch. Starts at a
        # random value, so that epochs of two instances of a table (a restart, a failover to a
        # backup) practically never match. Version 0 needs no such care: the initializer is
        # deterministic per (table, id), and admission returns, for a row it does not store yet, the
        # values a later creation stores (same initializer, same cast to the row dtype).
        self.eviction_epoch = secrets.randbits(62) + 1
        self.step = 0  # pushes applied to this table on this shard
        self.updates = 0
        self.evicted = 0
        self.dropped = 0
        self.rejected = 0
        self.demoted = 0  # rows moved to the disk tier
        self.promoted = 0  # rows brought back from it
        self.staleness = StalenessStats()
        self.lock = threading.Lock()
        # Row locations of the last pulls (ids sorted, unique, validated; every row resident), so that
        # the push of the same ids (a worker pushes the rows it pulled) skips the ownership check and
        # the index lookup. ``_layout`` counts the changes that move or remove existing rows (drop,
        # demote, promote, load): a remembered location is used only while it is unchanged.
        self._layout = 0
        self._recent: tuple[tuple[np.ndarray, np.ndarray, int], ...] = ()  # replaced whole, never mutated: read without the lock
        # The initial values the last pulls computed for ids with no row (sorted ids, their rows): the
        # push that creates those rows next takes them instead of computing them again (they depend on
        # (table key, id) only). At most FRESH_PULLS entries, FRESH_BYTES in all; replaced whole.
        self._fresh: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    RECENT_PULLS = 16  # remembered pulls per table (a few per worker)
    FRESH_PULLS, FRESH_BYTES = 4, 4 << 20

    def _moved(self) -> None:
        """Existing rows moved or went away (caller holds the lock): remembered locations are void."""
        self._layout += 1
        self._recent = ()

    def _remember(self, uniq: np.ndarray, loc: np.ndarray) -> None:
        """A pull found (or made) every row of ``uniq`` (sorted and unique) at ``loc`` (caller holds the lock)."""
        if len(uniq):
            self._recent = (*self._recent[1 - self.RECENT_PULLS :], (np.array(uniq, np.int64), loc, self._layout))

    def _recall(self, ids: np.ndarray) -> tuple[np.ndarray, int] | None:
        """(locations, layout) of a remembered pull of exactly ``ids``, or None (no lock needed: the
        entries are immutable; apply_push checks the layout under the lock)."""
        n = len(ids)
        if not n or ids.ndim != 1:
            return None
        for u, loc, layout in self._recent:
            if len(u) == n and u[0] == ids[0] and u[-1] == ids[-1] and np.array_equal(u, ids):
                return loc, layout
        return None

    def close(self) -> None:
        """Give back the disk tier's file and leave the resident budget (the table is not used afterwards)."""
        with self.lock:
            if self._budget is not None:
                self._budget.unregister(self._budget_handle)
            if self._cold is not None:
                if not self._cold.held:  # else the snapshot reading it keeps the file until it is collected
                    self._cold.close()
                self._cold = None

    # ------------------------------------------------------------------ compatibility views
    @property
    def values(self) -> _ColumnView:
        """Resident rows' values by row number (``values[rows]`` gathers a copy, row dtype)."""
        return _ColumnView(self._store, "values", False)

    @property
    def state(self) -> dict[str, _ColumnView]:
        return {k: _ColumnView(self._store, k, False) for k in self._state_names}

    @property
    def versions(self) -> _ColumnView:
        return _ColumnView(self._store, "version", True)

    @property
    def last_touch(self) -> _ColumnView:
        return _ColumnView(self._store, "touch", True)

    @property
    def row_ids(self) -> _ColumnView:
        return _ColumnView(self._store, "id", True)

    # ------------------------------------------------------------------ sizes
    @property
    def rows(self) -> int:
        return len(self._index)

    @property
    def resident_rows(self) -> int:
        return self._store.live

    @property
    def cold_rows(self) -> int:
        return self._cold.live if self._cold is not None else 0

    def _bytes_per_row(self) -> tuple[int, int]:
        return self._payload[0].row_nbytes, sum(c.row_nbytes for c in self._payload[1:])

    def param_bytes(self) -> int:
        return self.rows * self._bytes_per_row()[0]

    def state_bytes(self) -> int:
        return self.rows * self._bytes_per_row()[1]

    def resident_bytes(self) -> int:
        """RAM of the resident rows' chunks (what the resident budget counts)."""
        return self._store.nbytes

    def held_bytes(self) -> int:
        """Memory this table holds on the shard: resident chunks (rows live or free: values, optimizer
        state, metadata), the id index, cold rows' metadata, the slot map and the admission sketch."""
        return (
            self._store.nbytes + self._index.nbytes + self.slots.nbytes
            + (self._seen.nbytes if self._seen is not None else 0)
            + (self._cold.ram_bytes if self._cold is not None else 0)
        )

    def memory_stats(self) -> TableMemory:
        """Where this table's bytes are (a snapshot; see TableMemory)."""
        with self.lock:
            st = self._store
            meta = st.column_nbytes([c.name for c in _META]) + st.free_nbytes + (self._cold.ram_bytes if self._cold is not None else 0)
            held = self.held_bytes()
            rows = self.rows
            return TableMemory(
                rows=rows, resident_rows=st.live, cold_rows=self.cold_rows, free_rows=st.capacity - st.live,
                row_dtype=self.spec.dtype, payload_bytes_per_row=sum(self._bytes_per_row()),
                bytes_per_row=held / rows if rows else 0.0, values_bytes=st.column_nbytes(["values"]),
                state_bytes=st.column_nbytes(self._state_names), metadata_bytes=meta, index_bytes=self._index.nbytes,
                other_bytes=self.slots.nbytes + (self._seen.nbytes if self._seen is not None else 0), held_bytes=held,
                disk_bytes=self._cold.disk_bytes if self._cold is not None else 0, chunks=st.num_chunks,
                chunk_rows=st.chunk_rows, row_path=self.row_path,
            )

    @classmethod
    def fixed_bytes(cls, spec: TableSpec) -> int:
        """Bytes the constructor allocates for ``spec`` (the admission sketch; the index starts empty, the default
        slot map is computed, not stored; chunks come with the first rows)."""
        return CountMinSketch.bytes_for() if spec.admission.enabled else 0

    # ------------------------------------------------------------------ validation
    def check_ids(self, ids: np.ndarray) -> None:
        if ids.size:
            owner = self.slots.shard_of(ids, self._gather_kernel)
            wrong = np.nonzero(owner != self.shard_index)[0]
            if wrong.size:
                i = int(wrong[0])
                raise WrongShardError(
                    f"table {self.spec.name!r}: id {int(ids[i])} belongs to shard {int(owner[i])}, not {self.shard_index} "
                    f"({wrong.size} misrouted id(s); client and server disagree on num_shards or slots)"
                )

    # ------------------------------------------------------------------ storage
    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Location of each id: row >= 0 resident, -1 absent, <= -2 cold."""
        return self._index.lookup(ids)

    def _resident_cap(self) -> int:
        """Rows this table may keep resident now (-1: no limit)."""
        return -1 if self._budget is None else self._budget.rows_for(self._budget_handle, self._store.row_nbytes)

    def _cold_tier(self) -> ColdTier:
        if self._cold is None:
            self._cold = ColdTier(self._payload, _META, self._chunk_rows, self._spill_dir)
        return self._cold

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

    def _make_resident(
        self, uniq: np.ndarray, loc: np.ndarray, cold_pos: np.ndarray, new_pos: np.ndarray, seen: np.ndarray | None = None,
    ) -> None:
        """Bring the cold rows at positions ``cold_pos`` of ``uniq`` back and create rows (initial
        values, version 0) for the ids at ``new_pos`` (``seen``: their earlier sightings); ``loc`` is
        updated in place. The byte budget is asked first (nothing changes if it refuses). Rows this
        request already found are pinned: neither LRU eviction nor demotion picks them."""
        n_new, n_in = new_pos.size, new_pos.size + cold_pos.size
        if not n_in:
            return
        st = self._store
        cap = self.spec.eviction.max_rows
        # what eviction and demotion will free, known before anything moves: the budget is asked for
        # exactly what this allocates (rows they free are reused before any new chunk)
        victims = self._lru_victims(self.rows + n_new - cap, pinned_ids=uniq[loc != -1]) if cap else None
        v_hot = int(np.count_nonzero(victims[1] >= 0)) if victims is not None else 0
        v_cold = len(victims[1]) - v_hot if victims is not None else 0
        pinned = loc[loc >= 0]
        limit = self._resident_cap()
        demote = 0
        if limit >= 0:
            excess = st.live - v_hot + n_in - limit
            if excess > 0:  # some slack: demotion is batched, not one row per push
                demote = min(excess + limit // 8, max(0, st.live - v_hot - pinned.size))
        need = st.alloc_bytes(max(0, n_in - v_hot - demote)) + self._index.grow_bytes(n_new)
        if demote:
            cold = self._cold_tier()
            need += cold.ram_alloc_bytes(max(0, demote - (v_cold if cold.meta.reuse else 0)))
        with self._growth:  # shard-wide: no other table grows between this check and the allocation
            self._reserve(need)
            if victims is not None and len(victims[0]):
                self._drop(*victims)
            if demote:
                self._demote(demote, pinned_rows=pinned)
            if cold_pos.size:
                loc[cold_pos] = self._promote(uniq[cold_pos], -loc[cold_pos] - 2)
            if new_pos.size:
                loc[new_pos] = self._create(uniq[new_pos], seen)

    def _trim(self) -> None:
        """After a request larger than the resident budget (its rows were pinned while it ran):
        demote the surplus, least recently touched first."""
        limit = self._resident_cap()
        if limit >= 0 and self._store.live > limit:
            with self._growth:
                try:
                    self._reserve(self._cold_tier().ram_alloc_bytes(self._store.live - limit))
                except ResourceExhaustedError:
                    return  # over the byte budget: stay resident (the next request tries again)
                self._demote(self._store.live - limit)

    def _create(self, ids: np.ndarray, seen: np.ndarray | None = None) -> np.ndarray:
        """Allocate and initialize rows for new ``ids`` (room was made); returns their row numbers."""
        rows = self._store.alloc(len(ids))
        fill = self.spec.optimizer.hparams.get("initial_accumulator", 0.0)
        data: dict[str, Any] = {
            "values": self._created_values(ids),
            "version": 0, "touch": self.step, "id": ids,
            "admits": 1 if seen is None else np.minimum(seen + 1, 32767).astype(np.int16),
            **{k: float(fill) if k in ("sum", "n") else 0.0 for k in self._state_names},
        }
        self._store.scatter(rows, data)
        self._index.insert(ids, rows)
        return rows

    def _uncreate(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Take back rows ``_create`` just made (a push that failed before storing anything): they
        held their initial values at version 0, which is what a pull of an absent id reads, so no
        caller can tell (no new eviction epoch, nothing counted)."""
        self._moved()
        self._index.delete(ids)
        self._store.release(rows)

    def _demote(self, count: int, pinned_rows: np.ndarray | None = None) -> None:
        """Move the ``count`` least recently touched resident rows (not ``pinned_rows``) to the disk tier."""
        live = self._store.all_rows()
        if pinned_rows is not None and pinned_rows.size:
            live = live[~np.isin(live, pinned_rows)]
        count = min(count, live.size)
        if count <= 0:
            return
        if count < live.size:
            touch = self._store.gather(live, ["touch"])["touch"].numpy()
            live = live[np.argpartition(touch, count - 1)[:count]]
        data = self._store.gather(live)
        slots = self._cold_tier().put(data)
        self._moved()
        self._index.assign(data["id"].numpy(), -slots - 2)
        self._store.release(live)
        self.demoted += count

    def _promote(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Bring the cold rows of ``ids`` (at ``slots``) back; returns their resident rows."""
        assert self._cold is not None
        data = self._cold.get(slots)
        rows = self._store.alloc(len(slots))
        self._store.scatter(rows, data)
        self._moved()
        self._index.assign(ids, rows)
        self._cold.release(slots)
        self.promoted += len(slots)
        return rows

    def _gather(self, loc: np.ndarray, names: list[str]) -> dict[str, torch.Tensor]:
        """Columns of rows at locations ``loc`` (resident or cold; none absent)."""
        res = loc >= 0
        if res.all():
            return self._store.gather(loc, names)
        cols = {c.name: c for c in self._store.columns.values()}
        out = {k: torch.empty((len(loc), cols[k].width) if cols[k].width else (len(loc),), dtype=cols[k].dtype) for k in names}
        rp, cp = np.flatnonzero(res), np.flatnonzero(~res)
        assert self._cold is not None
        for pos, part in ((rp, self._store.gather(loc[rp], names)), (cp, self._cold.get(-loc[cp] - 2, names))):
            pt = torch.from_numpy(pos)
            for k in names:
                out[k].index_copy_(0, pt, part[k])
        return out

    def _live(self, names: list[str]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """(locations, columns) of every live row, both tiers."""
        rows = self._store.all_rows()
        data = self._store.gather(rows, names)
        if self._cold is None or not self._cold.live:
            return rows, data
        slots = self._cold.meta.all_rows()
        cd = self._cold.get(slots, names)
        return np.concatenate([rows, -slots - 2]), {k: torch.cat([data[k], cd[k]]) for k in names}

    def take_evicted(self) -> np.ndarray:
        """Ids evicted since the last call (tracked only while ``track_evictions``; caller holds the lock)."""
        out = np.concatenate(self._evicted_ids) if self._evicted_ids else np.zeros(0, np.int64)
        self._evicted_ids = []
        return out

    def _drop(self, ids: np.ndarray, loc: np.ndarray, count: bool = True) -> None:
        """Remove rows (ids at locations ``loc``) from the index and free their storage (a new eviction epoch)."""
        self.eviction_epoch += 1
        if count and self.track_evictions:  # a backup must drop them too (sent with the next replicated push)
            self._evicted_ids.append(ids.copy())
        self._moved()
        self._index.delete(ids)
        res = loc >= 0
        if res.any():
            self._store.release(loc[res])
        if not res.all():
            assert self._cold is not None
            self._cold.release(-loc[~res] - 2)
        if count:
            self.evicted += len(ids)

    def _lru_victims(self, count: int, pinned_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, locations) of the ``count`` least recently touched rows of both tiers, ``pinned_ids``
        left out (fewer if there are not that many). Changes nothing."""
        empty = np.zeros(0, np.int64)
        if count <= 0:
            return empty, empty
        loc, d = self._live(["id", "touch"])
        ids, touch = d["id"].numpy(), d["touch"].numpy()
        if pinned_ids is not None and pinned_ids.size:
            keep = ~np.isin(ids, pinned_ids)
            loc, ids, touch = loc[keep], ids[keep], touch[keep]
        if not loc.size:
            return empty, empty
        count = min(count, loc.size)
        pick = np.argpartition(touch, count - 1)[:count]
        return ids[pick], loc[pick]

    def evict_expired(self) -> int:
        """Drop rows untouched for more than ttl_steps table updates; returns how many."""
        ttl = self.spec.eviction.ttl_steps
        if not ttl or not len(self._index):
            return 0
        with self.lock:
            loc, d = self._live(["id", "touch"])
            old = d["touch"].numpy() < self.step - ttl
            if old.any():
                self._drop(d["id"].numpy()[old], loc[old])
            return int(np.count_nonzero(old))

    # ------------------------------------------------------------------ API
    def pull_rows(self, ids: np.ndarray, checked: bool = False) -> tuple[torch.Tensor, np.ndarray]:
        """Rows for int64 ``ids`` (any order, duplicates allowed) as stored: ((n, dim) tensor in the
        row dtype, int64 versions).

        A read and nothing else: it creates, admits, evicts, promotes and touches no row (LRU and
        TTL see pushes only), takes no byte of the budget and counts nothing. An id with no row here
        (never pushed, not admitted yet, evicted) reads as its initial values at version 0,
        deterministic per (table, id, seed): the values a push that creates the row starts from.
        Cold rows are read from the disk tier where they lie. ``checked``: the caller ran
        ``check_ids(ids)`` already."""
        if not checked:
            self.check_ids(ids)
        if not len(ids):
            return torch.empty((0, self.dim), dtype=self.row_dtype), np.zeros(0, np.int64)
        fast = self._gather_kernel is not None and ids.ndim == 1  # every row resident (the common case): one C call
        if fast:
            ids = np.ascontiguousarray(ids, np.int64)
            vals = torch.empty((len(ids), self.dim), dtype=self.row_dtype)
            vers = np.empty(len(ids), np.int64)
        d: dict[str, torch.Tensor] = {}
        order = None  # where the gathered rows go, if not in the order of ``have``
        uniq, inverse = ids, None
        with self.lock:
            if fast:
                st = self._store
                loc, done, unique = self._index.lookup_rows(  # type: ignore[union-attr]
                    ids, self.dim * vals.element_size(), st.shift, st.pointers("values"), st.pointers("version"), vals, vers,
                )
                if done:
                    if unique:
                        self._remember(ids, loc)  # the push of these ids (a worker pushes what it pulled) finds them here
                    return vals, vers
            else:
                unique = _sorted_unique(ids)
            # ids sorted and unique already (what PSClient sends): no sort, no gather by inverse at the end,
            # and the fast path's lookup (of these ids, under this lock) is the one used
            if not unique:
                uniq, inverse = np.unique(ids, return_inverse=True)
            if not (fast and unique):
                loc = self._index.lookup(uniq)
            have = np.flatnonzero(loc != -1)
            hot = bool((loc[have] >= 0).all())
            if have.size == len(uniq) and hot:  # (uniq: the ids, sorted and unique, or np.unique's)
                self._remember(uniq, loc)  # the push of these ids (a worker pushes what it pulled) finds them here
            if have.size and hot and self._gather_kernel is not None:  # one compiled pass, in the ids' order
                rows = np.ascontiguousarray(loc[have])
                vals = torch.empty((have.size, self.dim), dtype=self.row_dtype)
                vers = np.empty(have.size, np.int64)
                st = self._store
                self._gather_kernel.gather(
                    self.dim * vals.element_size(), st.shift, rows, st.pointers("values"), st.pointers("version"), vals, vers
                )
                d = {"values": vals, "version": torch.from_numpy(vers)}
            elif have.size and hot:
                plan = self._store.plan(loc[have])  # the rows found, in chunk order
                d = self._store.gather(plan.rows, ["values", "version"], plan)
                order = plan.order
            elif have.size:
                d = self._gather(loc[have], ["values", "version"])  # some cold: read in place, not brought back
        if have.size == len(uniq) and order is None:
            out_vals, out_vers = d["values"], d["version"].numpy()
        else:
            # the ids with no row: their initial values, made outside the lock
            new = np.flatnonzero(loc == -1)
            init = self._initial(uniq[new])
            if not isinstance(init, float) and new.size:
                self._keep_fresh(uniq[new], init)
            if not have.size and isinstance(init, float):  # one value everywhere: calloc'd zeros need no pages yet
                return _filled((len(ids), self.dim), init, self.row_dtype), np.zeros(len(ids), np.int64)
            if isinstance(init, float):
                out_vals = torch.full((len(uniq), self.dim), init, dtype=self.row_dtype)
            else:
                out_vals = torch.empty((len(uniq), self.dim), dtype=self.row_dtype)
                out_vals.index_copy_(0, torch.from_numpy(new), torch.from_numpy(init).to(self.row_dtype))
            out_vers = np.zeros(len(uniq), np.int64)
            if have.size:
                at = have if order is None else have[order]
                out_vals.index_copy_(0, torch.from_numpy(at), d["values"])
                out_vers[at] = d["version"].numpy()
        if inverse is None:
            return out_vals, out_vers  # fresh tensors (gathered or built here), one row per id already
        inv = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
        return out_vals.index_select(0, inv), out_vers[inverse.reshape(-1)]

    def _keep_fresh(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Remember the initial ``rows`` a pull computed for sorted ``ids`` (``_fresh``)."""
        if rows.nbytes <= self.FRESH_BYTES:
            kept = (*self._fresh, (ids, rows))
            while len(kept) > self.FRESH_PULLS or sum(r.nbytes for _, r in kept) > self.FRESH_BYTES:
                kept = kept[1:]
            self._fresh = kept

    def _created_values(self, ids: np.ndarray) -> "np.ndarray | float":
        """``_initial(ids)`` for rows being created, taken from ``_fresh`` where a recent pull computed them."""
        fresh = self._fresh
        if not fresh or not len(ids):
            return self._initial(ids)
        out = np.empty((len(ids), self.dim), np.float32)
        left = np.arange(len(ids))  # positions still without values
        for kept_ids, kept_rows in reversed(fresh):
            want = ids[left]
            at = np.minimum(np.searchsorted(kept_ids, want), len(kept_ids) - 1)
            hit = kept_ids[at] == want
            out[left[hit]] = kept_rows[at[hit]]
            left = left[~hit]
            if not left.size:
                return out
        out[left] = self._initial(ids[left])
        return out

    def _initial(self, ids: np.ndarray) -> "np.ndarray | float":
        """The initial values of rows ``ids``: fp32 (n, dim), or one float for every element
        (zeros, constant: no (n, dim) temporary)."""
        init = self.spec.initializer
        if init.name in ("zeros", "constant"):
            return float(init.params.get("value", 0.0))
        return init_rows(init, self._key, ids, self.dim)

    def pull(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows for int64 ``ids`` (any order, duplicates allowed): (float32 (n, dim), int64 versions).
        Low-precision rows are widened exactly. See ``pull_rows``."""
        vals, vers = self.pull_rows(ids)
        return vals.float().numpy(), vers

    def prepare_push(
        self, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None, cap_rows: bool = True,
        hold: bool = True,
    ) -> "SparsePush":
        """Validate a push and sum duplicate ids; changes nothing. ``cap_rows``: refuse a push of more
        distinct ids than the table's ``eviction.max_rows`` (ResourceExhaustedError: it could not keep
        them all); a BSP round's merged push (``apply_mean``) is not refused, its rows beyond the cap
        go at the next push. ``hold`` False: the push is applied before ``grads`` can change (a
        request's own buffer, applied in the call that received it), so writable float32 rows are
        used in place, not copied."""
        name = self.spec.name
        if grads.ndim != 2 or grads.shape != (len(ids), self.dim):
            raise ShapeMismatchError(
                f"table {name!r}: gradient shape {tuple(grads.shape)} does not match {len(ids)} ids x dim {self.dim}"
            )
        if base_versions is not None and base_versions.shape != ids.shape:
            raise ShapeMismatchError(f"table {name!r}: {base_versions.size} base versions for {ids.size} ids")
        recalled = self._recall(ids)  # the ids a recent pull validated and found (a worker pushes what it pulled)
        if recalled is None:
            self.check_ids(ids)
        _check_finite(self.spec, grads, "gradient")
        plain = recalled is not None or _sorted_unique(ids)
        cap = self.spec.eviction.max_rows
        if cap_rows and cap and len(ids) > cap and (plain or len(np.unique(ids)) > cap):
            raise ResourceExhaustedError(
                f"table {name!r}: one push touches more than {cap} distinct rows on shard {self.shard_index}, "
                f"its eviction.max_rows; split the request or raise max_rows"
            )
        if plain:  # nothing to sum (what PSClient sends): at most one copy, no sort, no scatter-add
            base = None if base_versions is None else np.array(base_versions, np.int64)
            loc, layout = recalled if recalled is not None else (None, -1)
            rows = np.asarray(grads, np.float32)
            if hold or not (rows.flags.writeable and rows.flags.c_contiguous):
                rows = np.array(rows)
            return SparsePush(np.array(ids, np.int64), torch.from_numpy(rows), base, loc, layout)
        uniq, inverse = np.unique(ids, return_inverse=True)
        g = torch.zeros((len(uniq), self.dim))
        g.index_add_(0, torch.from_numpy(inverse.reshape(-1).astype(np.int64)), torch.from_numpy(np.array(grads, np.float32)))
        base = None
        if base_versions is not None:
            base = np.full(len(uniq), -1, np.int64)
            np.maximum.at(base, inverse.reshape(-1), base_versions)  # the newest version any copy was computed from
        return SparsePush(uniq, g, base)

    def push(
        self, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None, staleness_aware_lr: bool = False
    ) -> PushResult:
        """Apply row gradients (duplicate ids are summed). A row not present is created (initial
        values, version 0) and updated, unless admission refuses it: then it is dropped and counted.

        ``staleness_aware_lr``: scale this push's lr by 1/max(1, mean staleness of its rows)."""
        return self.apply_push(self.prepare_push(ids, grads, base_versions), staleness_aware_lr)

    def apply_mean(
        self, pushes: list["SparsePush"], before_swap: "Callable[[PushResult, RowDelta | None], None] | None" = None
    ) -> PushResult:
        """Apply the mean over ``pushes`` (a BSP round: each worker's rows, divided by the number of workers)."""
        ids = np.concatenate([p.ids for p in pushes])
        g = torch.cat([p.grads for p in pushes]).div_(len(pushes))
        return self.apply_push(self.prepare_push(ids, g.numpy(), cap_rows=False), before_swap=before_swap)

    def apply_push(
        self, p: "SparsePush", staleness_aware_lr: bool = False,
        once: "Callable[[], PushResult | None] | None" = None,
        before_swap: "Callable[[PushResult, RowDelta | None], None] | None" = None, delta: bool = True,
    ) -> PushResult:
        """Apply a prepared push under the table lock. ``once()`` first (deduplication: a result it
        returns is returned as is); ``before_swap(result, delta)`` sees the rows' new state before
        it is stored (replication); if it raises, nothing is applied: the rows it created are taken
        back (a cold row it brought back stays resident and rows LRU eviction dropped to make room
        stay dropped: no value changes). ``delta`` False: ``before_swap`` needs no new state (no
        backup to forward it to): it gets None, before the rows are updated in place.

        Rows are created here, never by a pull: an id with no row is admitted (admission counts
        one sighting per push that names it) and created with the initializer's values, then
        updated like the others; one admission refuses is dropped and counted (``dropped``).

        The optimizer runs in fp32; the new values are rounded to the row dtype (``ps.rowdtype``).
        Where ``row_path`` is "kernel", one compiled pass (``ps.rowkernel``, the GIL released) updates
        the rows, bit for bit as the torch path would."""
        uniq, g, base = p.ids, p.grads, p.base_versions
        with self.lock:
            prior = once() if once is not None else None
            if prior is not None:
                return prior
            created = np.zeros(0, np.int64)  # positions in ``uniq`` of the rows this push creates
            sighted: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
            if p.loc is not None and p.layout == self._layout:  # the rows a pull just found: still where they were
                loc = p.loc
            else:
                loc = self._lookup(uniq)
                missing = np.flatnonzero(loc == -1)
                cold = np.flatnonzero(loc < -1)
                ok, seen = self._admit(uniq[missing]) if missing.size else (np.zeros(0, bool), None)
                created = missing[ok]
                # rows are made by pushes only (pulls read): with the initializer's values, then updated below
                self._make_resident(uniq, loc, cold, created, seen[ok] if seen is not None else None)
                if missing.size:
                    sighted = (uniq[missing], ok, seen)
            have = np.flatnonzero(loc >= 0)
            dropped = len(uniq) - have.size
            update = self._kernel_update if self._kernel is not None else self._torch_update
            result = update(uniq, g, base, loc, have, dropped, staleness_aware_lr, before_swap, delta, created, sighted)
            self._trim()
            self.step += 1
            self.updates += int(have.size)
            self.dropped += dropped
        if self.spec.eviction.ttl_steps:
            self.evict_expired()
        return result

    def _staleness(self, base: np.ndarray | None, have: np.ndarray, versions: np.ndarray) -> tuple[int, int, int]:
        """The staleness measured of the rows at ``have`` at ``versions`` (those with a base version, where
        it is >= 0): (count, sum, max; -1 if none), counted in ``staleness``."""
        if not have.size or base is None:
            return _UNMEASURED
        b = base[have]
        d = versions - b
        m = d[(b >= 0) & (d >= 0)]
        return self.staleness.merge((m.size, int(m.sum()), int(m.max()) if m.size else -1))

    def _result(self, have: np.ndarray, dropped: int, stats: tuple[int, int, int]) -> PushResult:
        return PushResult(int(have.size), dropped, _mean_staleness(stats), stats[2] if stats[0] else -1, self.step + 1)

    def _commit_check(
        self, before_swap: "Callable[[PushResult, RowDelta | None], None] | None", result: PushResult, delta: "Callable[[], RowDelta] | None",
        uniq: np.ndarray, loc: np.ndarray, created: np.ndarray, sighted: "tuple[np.ndarray, np.ndarray, np.ndarray | None] | None",
    ) -> None:
        """``before_swap`` on the push's delta (None without ``delta``; the rows it created taken back
        if it raises), then the admission sightings: what every push does between computing rows and
        storing them."""
        if before_swap is not None:
            try:
                before_swap(result, delta() if delta is not None else None)
            except BaseException:
                if created.size:
                    self._uncreate(uniq[created], loc[created])
                raise
        if sighted is not None:
            self._sighted(*sighted)  # the ids not admitted: one more sighting each

    def _kernel_update(
        self, uniq: np.ndarray, g: torch.Tensor, base: np.ndarray | None, loc: np.ndarray, have: np.ndarray, dropped: int,
        staleness_aware_lr: bool, before_swap: "Callable[[PushResult, RowDelta | None], None] | None", want_delta: bool,
        created: np.ndarray, sighted: "tuple[np.ndarray, np.ndarray, np.ndarray | None] | None",
    ) -> PushResult:
        """apply_push's update through the row kernel (caller holds the lock): in place, or, where
        ``before_swap`` wants the delta, computed into buffers that the kernel stores once it returned."""
        k = self._kernel
        assert k is not None
        st = self._store
        rows = np.ascontiguousarray(loc[have])
        n = rows.size
        stale = _UNMEASURED
        cols: dict[str, np.ndarray | None] = {}
        if n:
            cols = {
                "values": st.pointers("values"), "version": st.pointers("version"),
                "s0": st.pointers(k.s0) if k.s0 else None, "s1": st.pointers(k.s1) if k.s1 else None,
                "s2": st.pointers(k.s2) if k.s2 else None, "touch": st.pointers("touch") if self._touches else None,
            }
            if base is not None:
                b = base if n == len(base) else base[have]
                stale = self.staleness.merge(k.kernel.staleness(st.shift, rows, st.pointers("version"), np.ascontiguousarray(b, np.int64)))
        h = self.optimizer.h
        if staleness_aware_lr and _mean_staleness(stale) > 1:
            h = {**h, "lr": h["lr"] * (1.0 / _mean_staleness(stale))}  # as scaled_lr
        grad = g if g.dtype == torch.float32 and g.is_contiguous() else g.float().contiguous()
        grad_idx = None if n == len(uniq) else have
        ids = np.ascontiguousarray(uniq[have])  # bf16's stochastic rounding hashes (id, version)
        dtype, key = self.spec.dtype, int(self._key)
        result = self._result(have, dropped, stale)
        if before_swap is None or not want_delta:
            self._commit_check(before_swap, result, None, uniq, loc, created, sighted)
            if n:
                k.kernel.push(k.opt, h, self.dim, st.shift, rows, grad, grad_idx, cols, self.step, row_dtype=dtype, ids=ids, table_key=key)
            return result
        out: dict[str, np.ndarray | None] = {
            "values": np.empty((n, self.dim), np.float32), "version": np.empty(n, np.int64),
            "s0": np.empty((n, self.dim), np.float32) if k.s0 else None, "s1": np.empty(n, np.float32) if k.s1 else None,
            "s2": np.empty((n, self.dim), np.float32) if k.s2 else None,
        }
        if n:
            k.kernel.push(
                k.opt, h, self.dim, st.shift, rows, grad, grad_idx, cols, self.step, out=out, row_dtype=dtype, ids=ids, table_key=key
            )
        state = {name: a for name, a in ((k.s0, out["s0"]), (k.s1, out["s1"]), (k.s2, out["s2"])) if name is not None and a is not None}
        assert out["values"] is not None and out["version"] is not None
        values, versions = out["values"], out["version"]
        self._commit_check(before_swap, result, lambda: RowDelta(uniq[have], values, state, versions), uniq, loc, created, sighted)
        if n:
            k.kernel.scatter(self.dim, st.shift, rows, out, cols, self.step, row_dtype=self.spec.dtype)
        return result

    def _torch_update(
        self, uniq: np.ndarray, g: torch.Tensor, base: np.ndarray | None, loc: np.ndarray, have: np.ndarray, dropped: int,
        staleness_aware_lr: bool, before_swap: "Callable[[PushResult, RowDelta | None], None] | None", want_delta: bool,
        created: np.ndarray, sighted: "tuple[np.ndarray, np.ndarray, np.ndarray | None] | None",
    ) -> PushResult:
        """apply_push's update through ps.optim's torch ops (caller holds the lock): the reference,
        and the path of what the row kernel does not cover."""
        # rows in chunk order (one index op per chunk and column, for the gather and the scatter)
        plan = self._store.plan(loc[have])
        if plan.order is not None:
            have = have[plan.order]
        every = have.size == len(uniq) and plan.order is None  # the push's rows, in the push's order
        d = self._store.gather(plan.rows, ["values", "version", *self._state_names], plan)
        versions = d["version"].numpy()
        stale = self._staleness(base, have, versions)
        opt = self.optimizer
        if staleness_aware_lr and _mean_staleness(stale) > 1:
            opt = scaled_lr(opt, 1.0 / _mean_staleness(stale))
        param = d["values"].float() if self.row_dtype != torch.float32 else d["values"]
        state = {k: d[k] for k in self._state_names}
        new_versions = versions + 1
        stored = param
        if have.size:
            step = torch.from_numpy(new_versions).to(torch.float64)[:, None]
            opt.update(param, g if every else g.index_select(0, torch.from_numpy(have)), state, step)
            if self.row_dtype != torch.float32:
                keys = row_keys(self._key, uniq[have], new_versions) if self.row_dtype == torch.bfloat16 else None
                stored = round_rows(param, self.row_dtype, keys)
        result = self._result(have, dropped, stale)

        def delta() -> RowDelta:
            values = stored.float().numpy() if stored.dtype != torch.float32 else stored.numpy()
            return RowDelta(uniq[have], values, {k: v.numpy() for k, v in state.items()}, new_versions)

        self._commit_check(before_swap, result, delta if want_delta else None, uniq, loc, created, sighted)
        if have.size:
            cols: dict[str, torch.Tensor | np.ndarray | int] = {"values": stored, **state, "version": new_versions}
            if self._touches:
                cols["touch"] = self.step
            self._store.scatter(plan.rows, cols, plan)
        return result

    def export_state(self, along: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Live rows of both tiers (ids, values, optimizer state, versions) sorted by virtual slot, and
        the table step (copies); ``along()`` as for DenseTable.export_state. Values are in the row
        dtype (bfloat16 as uint16 bit patterns, see ps.rowdtype.to_storage_array). With rows on
        disk, values and state are :class:`TieredRows` (a frozen copy read block by block; the
        checkpoint writer streams them; ``np.asarray`` materializes one)."""
        with self.lock:
            extra = along() if along is not None else None
            ids, loc = self._index.items()
            order = np.lexsort((ids, slot_of(ids, self.spec.num_slots))) if ids.size else np.zeros(0, np.int64)
            ids, loc = ids[order], loc[order]
            if self._cold is not None and self._cold.live:
                values, versions, state = self._export_tiered(ids, loc)
            else:
                d = self._gather(loc, ["values", "version", *self._state_names])
                values, versions, state = to_storage_array(d["values"]), d["version"].numpy(), {k: d[k].numpy() for k in self._state_names}
            return {"step": self.step, "updates": self.updates, "ids": ids, "values": values, "versions": versions, "state": state, "along": extra}

    def _export_tiered(self, ids: np.ndarray, loc: np.ndarray) -> tuple[Any, np.ndarray, dict[str, Any]]:
        """export_state's (values, versions, state) of a table with cold rows (caller holds the lock):
        resident rows copied, the disk tier's rows held in place (``ColdTier.hold``: read later,
        without the lock), values and state as TieredRows (streamed by checkpoints)."""
        assert self._cold is not None
        res = loc >= 0
        names = ["values", *self._state_names]
        hot = self._store.gather(loc[res], names + ["version"])
        slots = -loc[~res] - 2
        versions = np.empty(len(ids), np.int64)
        versions[res] = hot["version"].numpy()
        versions[~res] = self._cold.meta.gather(slots, ["version"])["version"].numpy()
        hold = self._cold.hold()
        cols = {c.name: c for c in self._payload}
        lazy = {k: TieredRows(k, cols[k].width, cols[k].dtype, res, hot[k], slots, hold) for k in names}
        return lazy["values"], versions, {k: lazy[k] for k in self._state_names}

    def _values_tensor(self, values: Any, n: int) -> torch.Tensor:
        a = np.asarray(values)
        if a.dtype not in (np.float32, np.float16, np.uint16):
            a = a.astype(np.float32)
        return from_storage_array(a.reshape(n, self.dim), self.row_dtype)

    def load_state(self, snap: dict[str, Any]) -> None:
        """Replace every row with ``snap``'s (from export_state; ids must belong to this shard). Rows
        beyond the resident budget go to the disk tier."""
        ids = np.asarray(snap["ids"], np.int64)
        values = self._values_tensor(snap["values"], len(ids))
        self.check_ids(ids)
        with self.lock:
            self._moved()
            self.eviction_epoch += 1  # every row replaced: versions read before name other values
            self._index = new_index(kernel=self._gather_kernel is not None)
            self._store.clear()
            if self._cold is not None:
                if self._cold.held:  # a snapshot still reads its file: leave it that file, start a new one
                    self._cold = None
                else:
                    self._cold.clear()
            self.step = int(snap["step"])
            self.updates = int(snap.get("updates", 0))
            if len(ids):
                self._upsert(ids, values, snap["state"], np.asarray(snap["versions"], np.int64))

    def _upsert(self, ids: np.ndarray, values: torch.Tensor, state: Mapping[str, Any], versions: np.ndarray) -> None:
        """Store rows as given (create the missing ones: resident while the budget has room, then
        in the disk tier). Caller holds the lock."""
        loc = self._lookup(ids)
        new = np.flatnonzero(loc == -1)
        if new.size:
            limit = self._resident_cap()
            hot = new.size if limit < 0 else min(new.size, max(0, limit - self._store.live))
            cold_n = new.size - hot
            need = self._store.alloc_bytes(hot) + self._index.grow_bytes(new.size)
            if cold_n:
                need += self._cold_tier().ram_alloc_bytes(cold_n)
            with self._growth:
                self._reserve(need)  # the budget first
                loc[new[:hot]] = self._store.alloc(hot)
                if cold_n:
                    loc[new[hot:]] = -self._cold_tier().alloc(cold_n) - 2
                self._index.insert(ids[new], loc[new])
        data: dict[str, Any] = {"values": values, "version": np.asarray(versions, np.int64), "id": ids}
        data.update({k: torch.from_numpy(np.ascontiguousarray(state[k], np.float32)) for k in self._state_names})
        res = loc >= 0
        demote_after = not res.all() and self._cold is not None and self._cold.held
        if demote_after:  # a snapshot is reading the disk tier: never overwrite a cold row in place, bring it back
            cold = np.flatnonzero(~res)
            loc[cold] = self._promote(ids[cold], -loc[cold] - 2)
            res = loc >= 0
        if res.all():
            self._store.scatter(loc, {**data, "touch": self.step, "admits": 0} if new.size else {**data, "touch": self.step})
            if demote_after:
                self._trim()
            return
        for part, sel in ((res, loc[res]), (~res, -loc[~res] - 2)):
            if not part.any():
                continue
            pt = torch.from_numpy(np.flatnonzero(part))
            sub = {k: (v.index_select(0, pt) if isinstance(v, torch.Tensor) else v[part]) for k, v in data.items()}
            sub["touch"] = self.step
            if part is res:
                self._store.scatter(sel, sub)
            else:
                assert self._cold is not None
                self._cold.update(sel, sub)

    def apply_delta(self, delta: RowDelta, step: int, evicted: np.ndarray | None = None) -> None:
        """Make rows equal to a primary's (replication): upsert ``delta``, drop ``evicted`` ids, set the step."""
        with self.lock:
            if evicted is not None and evicted.size:
                loc = self._lookup(evicted)
                there = loc != -1
                if there.any():
                    self._drop(evicted[there], loc[there], count=False)
            if delta.ids.size:
                self._upsert(delta.ids, self._values_tensor(delta.values, len(delta.ids)), delta.state, delta.versions)
            self.updates += int(delta.ids.size)
            self.step = step

    def items(self) -> Iterator[tuple[int, int]]:
        """(id, location) pairs of live rows (a snapshot; location >= 0: a resident row, <= -2: cold)."""
        with self.lock:
            ids, loc = self._index.items()
            return zip(ids.tolist(), loc.tolist(), strict=True)


_UNMEASURED = (0, 0, -1)  # a push's staleness (count, sum, max) where none was measured


def _mean_staleness(stats: tuple[int, int, int]) -> float:
    """The mean of a push's staleness (count, sum, max), -1.0 where none was measured (the mean of small
    ints: their exact sum over the count, as np.mean's float64 sum gives)."""
    return stats[1] / stats[0] if stats[0] else -1.0


def _sorted_unique(ids: np.ndarray) -> bool:
    """``ids`` (1-D) strictly increasing: sorted with no duplicates (one vectorised pass)."""
    return ids.ndim == 1 and (ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])))
