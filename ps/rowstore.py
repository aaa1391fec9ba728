"""RowStore: fixed-width rows in fixed-size chunks, with a free list (no doubling, no big copy).

A sparse table's rows (values, optimizer state and per-row metadata) live in *columns*; each
column is a (rows, width) tensor (width 0: one scalar per row). Rows are numbered 0, 1, ...;
row ``r`` lives in chunk ``r >> shift`` at offset ``r & mask``. A chunk is ONE buffer holding
every column's slice for its ``chunk_rows`` rows, allocated when the first row of it is handed
out and never moved afterwards, so growth costs one chunk (no doubling of one big array, no
transient 2x peak while copying it). Only chunk 0 grows by doubling (from ``first_rows`` up to
``chunk_rows``, so that a table of ten rows does not cost a whole chunk); the copy is at most
one chunk.

Buffers come from a :class:`ChunkBacking`: RAM (``torch.empty``: pages are committed by the
kernel as rows are first written, so a chunk only partly filled costs RSS for what it holds) or
a file (:class:`FileBacking`: memory-mapped segments of one unlinked temporary file, the disk
tier of ``ps.tier``).

Rows released (eviction, demotion to the disk tier) go on a free stack and are handed out again
before any fresh row: a table whose row count stays bounded never allocates another chunk. The
free stack has one slot per row of capacity, allocated with the chunks (zeroed pages: they cost
RSS only once rows are released), so releasing rows never allocates: what a store holds
(``nbytes``: its chunk buffers as allocated, alignment included, and the free stack) changes only
when chunks are added, by exactly ``grow_bytes`` (a byte budget asked before growth holds).

Not thread-safe: the owning table's lock guards it. Pure torch/numpy.
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

__all__ = ["Column", "RowPlan", "RowStore", "ChunkBacking", "RamBacking", "huge_empty", "FileBacking", "chunk_rows_for", "limit_heap_retention"]

_ALIGN = 64  # byte alignment of each column inside a chunk buffer


@dataclass(frozen=True)
class Column:
    """One per-row field: ``width`` elements of ``dtype`` per row (0: a scalar per row)."""

    name: str
    dtype: torch.dtype
    width: int = 0

    @property
    def row_nbytes(self) -> int:
        return max(1, self.width) * _itemsize(self.dtype)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()  # (a tensor per call: memory accounting asks on every request)


def chunk_rows_for(row_nbytes: int, chunk_bytes: int = 32 << 20, lo: int = 1024, hi: int = 1 << 20) -> int:
    """Rows per chunk: the power of two that makes a chunk about ``chunk_bytes`` (within [lo, hi])."""
    rows = max(1, chunk_bytes // max(1, row_nbytes))
    p = 1 << (rows.bit_length() - 1)
    return int(min(hi, max(lo, p)))


class ChunkBacking:
    """Where chunk buffers come from. ``allocate(nbytes)`` returns a uint8 tensor of that size."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def drop_pages(self) -> None:
        """Let the kernel drop this backing's pages from the process's resident set (file backing)."""

    def close(self) -> None:
        """Release everything (the store is not used afterwards)."""


class RamBacking(ChunkBacking):
    """Chunks in RAM, not zeroed: the kernel commits pages as rows are first written (a chunk only
    partly filled costs RSS for what it holds; a big one in 2 MiB steps: ``huge_empty``)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(huge_empty(nbytes, np.uint8))


def huge_empty(n: int, dtype: "np.typing.DTypeLike") -> np.ndarray:
    """``np.empty(n, dtype)``; from ``_HUGE`` bytes up, its own anonymous mapping, 2 MiB aligned and
    advised MADV_HUGEPAGE (random rows and index probes otherwise miss the TLB: -10% on a 1M x 64
    pull + push in process). Unmapped with the last view of it."""
    nbytes = n * np.dtype(dtype).itemsize
    if nbytes < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(n, dtype)
    mm = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # (a kernel without transparent huge pages: 4 KiB pages)
        mm.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mm, np.uint8)
    at = -raw.ctypes.data % _HUGE_PAGE
    return raw[at : at + nbytes].view(dtype)


_HUGE_PAGE = 2 << 20
_HUGE = 4 << 20


_HEAP_TUNED = False


def limit_heap_retention(mmap_threshold: int = 4 << 20, trim_threshold: int = 4 << 20) -> bool:
    """Make glibc malloc hand big freed buffers back to the kernel (process-wide, once).

    By default glibc raises its mmap threshold to the size of every mmapped block freed (up to
    32 MiB): after that, the shard's temporaries of a few MiB to 32 MiB (request ids, pull
    replies, init values, the id index's arrays while it grows) come from the heap and stay
    resident after they are freed. Filling a 2M-row table kept ~870 MiB that way (RSS growth 2.0x
    the rows' bytes instead of 1.14x). A fixed threshold (``M_MMAP_THRESHOLD``) sends every
    block of ``mmap_threshold`` bytes or more to its own mapping, unmapped on free.

    Fixing it also fixes glibc's trim threshold at its default of 128 KiB: every request's
    temporaries under ``mmap_threshold`` (a 4096 x 64 pull's 1 MiB reply, its gathered rows, the
    gRPC message) were handed back to the kernel when freed and faulted in again, page by page, by
    the next request (~520 page faults, ~1 ms of CPU per 4096 x 64 sparse step). ``M_TRIM_THRESHOLD``
    of ``trim_threshold`` keeps at most that much free memory at the top of each malloc arena's heap
    for the next request (a bounded 4 MiB per arena: the gRPC threads use several arenas, and 8 MiB
    grew a tiered shard's RSS over its stated budget in one CI run). Returns whether it was applied
    (False where the C library is not glibc)."""
    global _HEAP_TUNED
    if _HEAP_TUNED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold, m_trim_threshold = -3, -1
        ok = bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold)))
        ok = ok and bool(libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):
        return False
    _HEAP_TUNED = ok
    return ok


class FileBacking(ChunkBacking):
    """Chunks as memory-mapped segments of one temporary file in ``directory`` (unlinked at once:
    the disk space goes back when the process ends, even if it crashes).

    Why mmap and not an embedded key-value store: rows are fixed-width and already numbered, so
    a row's place in the file is arithmetic (no second index, no serialization), and a batch of
    rows is read or written with one vectorized gather/scatter per segment, the same code as the
    RAM tier. Pages the process touched are handed back by :meth:`drop_pages` (``MADV_DONTNEED``
    on a shared file mapping: dirty pages stay in the page cache and reach the file; the
    process's RSS no longer counts them).
    """

    def __init__(self, directory: str | None = None) -> None:
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = tempfile.TemporaryFile(prefix="tessera-tier-", dir=directory or None)  # noqa: SIM115 - lives with the store
        self._fd = self._file.fileno()
        self._size = 0
        self._maps: list[mmap.mmap] = []

    @property
    def file_bytes(self) -> int:
        return self._size

    def allocate(self, nbytes: int) -> torch.Tensor:
        page = mmap.ALLOCATIONGRANULARITY
        nbytes = -(-nbytes // page) * page
        offset = self._size
        os.ftruncate(self._fd, offset + nbytes)  # sparse: disk blocks are taken as rows are written
        self._size = offset + nbytes
        mm = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def drop_pages(self) -> None:
        for mm in self._maps:
            mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # a tensor view is still referenced somewhere: the mapping goes with it
                mm.close()
        self._maps.clear()
        self._file.close()


class RowPlan(NamedTuple):
    """See :meth:`RowStore.plan`."""

    rows: np.ndarray  # the rows in the plan's order (chunk order)
    order: np.ndarray | None  # positions in the caller's rows, in the plan's order (None: the same order)
    groups: list  # (chunk, positions (slice, None: all), offsets in the chunk (slice or tensor)) per chunk


def row_items(a: np.ndarray) -> np.ndarray:
    """A C-contiguous (n, width) array as n opaque items of one row each (same memory). numpy assigns
    rows by an index array ~2x faster this way than as a 2-D array: one copy per row, not per element."""
    return a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)


class _Chunk:
    __slots__ = ("arrays", "buf", "cols", "items", "rows")

    def __init__(self, buf: torch.Tensor, cols: dict[str, torch.Tensor], rows: int) -> None:
        self.buf, self.cols, self.rows = buf, cols, rows
        # numpy views of the same memory, for the scatter (None: a dtype numpy lacks, e.g. bfloat16);
        # ``items``: the same with a column of rows seen as one item per row (row_items)
        self.arrays = {k: (None if v.dtype == torch.bfloat16 else v.numpy()) for k, v in cols.items()}
        self.items = {k: (row_items(a) if a is not None and a.ndim == 2 else a) for k, a in self.arrays.items()}


class RowStore:
    """Rows of ``columns`` in chunks of ``chunk_rows`` (a power of two) rows.

    ``first_rows``: the capacity chunk 0 starts with (it doubles up to ``chunk_rows``);
    ``backing``: where chunk buffers come from (default RAM).
    """

    def __init__(
        self, columns: Sequence[Column], chunk_rows: int, first_rows: int = 256, backing: ChunkBacking | None = None
    ) -> None:
        if chunk_rows < 1 or chunk_rows & (chunk_rows - 1):
            raise ValueError(f"chunk_rows must be a power of two, got {chunk_rows}")
        self.columns = {c.name: c for c in columns}
        self.chunk_rows = chunk_rows
        self.shift = chunk_rows.bit_length() - 1
        self.mask = chunk_rows - 1
        self.first_rows = max(1, min(first_rows, chunk_rows))
        self.backing = backing or RamBacking()
        self._chunks: list[_Chunk] = []
        self._pointers: dict[str, np.ndarray] = {}  # pointers(): made once per chunk list
        self.n_alloc = 0  # rows [0, n_alloc) were handed out at least once
        self.reuse = True  # alloc hands out released rows again (False: only fresh ones)
        self._free = np.zeros(0, np.int64)  # a stack of released rows
        self._n_free = 0

    # ------------------------------------------------------------------ sizes
    @property
    def row_nbytes(self) -> int:
        """Bytes one row takes in its chunk (every column)."""
        return sum(c.row_nbytes for c in self.columns.values())

    @property
    def capacity(self) -> int:
        """Rows the allocated chunks hold."""
        return sum(ch.rows for ch in self._chunks)

    @property
    def live(self) -> int:
        """Rows handed out and not released."""
        return self.n_alloc - self._n_free

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def column_nbytes(self, names: Sequence[str] | None = None) -> int:
        """Bytes the allocated chunks hold for ``names`` (default: every column), each column's
        alignment padding included (every column of every chunk: ``nbytes`` less the free stack)."""
        names = list(self.columns) if names is None else names
        cols = [self.columns[n] for n in names]
        return sum(-(-(ch.rows * c.row_nbytes) // _ALIGN) * _ALIGN for ch in self._chunks for c in cols)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: its chunk buffers as allocated (alignment included) and the free stack."""
        return sum(self._chunk_nbytes(ch.rows) for ch in self._chunks) + self._free.nbytes

    @property
    def free_nbytes(self) -> int:
        """Bytes of the free stack (RAM, whatever the backing)."""
        return int(self._free.nbytes)

    def _chunk_nbytes(self, rows: int) -> int:
        """Bytes a chunk of ``rows`` rows takes from its backing (``_new_chunk``)."""
        return max(self._layout(rows)[0], 1)

    def _layout(self, rows: int) -> tuple[int, list[tuple[Column, int]]]:
        off, out = 0, []
        for c in self.columns.values():
            out.append((c, off))
            off += -(-(rows * c.row_nbytes) // _ALIGN) * _ALIGN
        return off, out

    def _new_chunk(self, rows: int) -> _Chunk:
        buf = self.backing.allocate(self._chunk_nbytes(rows))
        _, layout = self._layout(rows)
        cols = {}
        for c, off in layout:
            v = buf[off : off + rows * c.row_nbytes].view(c.dtype)
            cols[c.name] = v.view(rows, c.width) if c.width else v
        return _Chunk(buf, cols, rows)

    def grow_bytes(self, fresh: int) -> int:
        """Bytes by which ``nbytes`` grows when ``fresh`` rows never used before are handed out (0 if
        they fit): the new chunks' buffers (chunk 0 regrown: the new buffer less the old one) and
        the free stack's slots for the new rows of capacity."""
        chunk_bytes, capacity = self._grown(fresh)
        return chunk_bytes + 8 * (capacity - self.capacity)

    def free_grow_bytes(self, fresh: int) -> int:
        """The free stack's part of ``grow_bytes(fresh)`` (RAM even when the chunks are in a file)."""
        return 8 * (self._grown(fresh)[1] - self.capacity)

    def _grown(self, fresh: int) -> tuple[int, int]:
        """(bytes of chunk buffers added, capacity after) when ``fresh`` unused rows are handed out."""
        need = self.n_alloc + fresh
        have = self.capacity
        if need <= have:
            return 0, have
        cap0, new0 = self._chunk0_growth(need)
        extra = self._chunk_nbytes(new0) - (self._chunk_nbytes(cap0) if cap0 else 0) if new0 > cap0 else 0
        have += new0 - cap0
        if need > have:
            chunks = -(-(need - have) // self.chunk_rows)
            extra += chunks * self._chunk_nbytes(self.chunk_rows)
            have += chunks * self.chunk_rows
        return extra, have

    def alloc_bytes(self, n: int) -> int:
        """Bytes ``alloc(n)`` would allocate (``nbytes`` grows by exactly this much)."""
        return self.grow_bytes(self.fresh_for(n))

    def fresh_for(self, n: int) -> int:
        """Rows never used before that ``alloc(n)`` hands out (the rest come from the free stack)."""
        return max(0, n - (self._n_free if self.reuse else 0))

    def _chunk0_growth(self, need: int) -> tuple[int, int]:
        """(chunk 0's rows now, its rows once ``need`` rows fit): it doubles from ``first_rows`` up to
        ``chunk_rows`` while it is the only chunk (no chunk yet: 0 rows now)."""
        cap0 = self._chunks[0].rows if self._chunks else 0
        if len(self._chunks) > 1 or cap0 >= self.chunk_rows:
            return cap0, cap0
        new0 = max(self.first_rows, cap0)
        while new0 < min(need, self.chunk_rows):
            new0 *= 2
        return cap0, min(new0, self.chunk_rows)

    def _ensure(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap0, new0 = self._chunk0_growth(need)
        if new0 > cap0:
            ch = self._new_chunk(new0)
            if self._chunks:  # chunk 0 regrown: its rows copied over
                for name, v in self._chunks[0].cols.items():
                    ch.cols[name][:cap0] = v
                self._chunks[0] = ch
            else:
                self._chunks.append(ch)
        while self.capacity < need:
            self._chunks.append(self._new_chunk(self.chunk_rows))
        self._pointers = {}
        # one free-stack slot per row of capacity (so release never allocates)
        cap = self.capacity
        if len(self._free) != cap:
            grown = np.zeros(cap, np.int64)  # calloc: pages cost nothing until rows are released
            grown[: self._n_free] = self._free[: self._n_free]
            self._free = grown

    # ------------------------------------------------------------------ rows
    def alloc(self, n: int) -> np.ndarray:
        """``n`` row numbers: released ones first (most recently released first), then fresh ones.
        Their contents are undefined until written. With ``reuse`` False: fresh ones only (released
        rows stay untouched; a snapshot is reading them, see ps.tier.ColdTier.hold)."""
        take = min(n, self._n_free) if self.reuse else 0
        reused = self._free[self._n_free - take : self._n_free][::-1].copy()
        fresh = n - take
        self._ensure(self.n_alloc + fresh)
        self._n_free -= take
        new = np.arange(self.n_alloc, self.n_alloc + fresh, dtype=np.int64)
        self.n_alloc += fresh
        return np.concatenate([reused, new]) if take else new

    def release(self, rows: np.ndarray) -> None:
        """Give ``rows`` back (each live, no duplicates); alloc hands them out again."""
        rows = np.asarray(rows, np.int64)
        need = self._n_free + len(rows)
        assert need <= len(self._free), "more rows released than handed out"
        self._free[self._n_free : need] = rows
        self._n_free = need

    def free_rows(self) -> np.ndarray:
        return self._free[: self._n_free].copy()

    def _groups(self, rows: np.ndarray) -> Iterator[tuple[_Chunk, slice | torch.Tensor | None, slice | torch.Tensor]]:
        """(chunk, positions in ``rows`` (None: all of them), offsets in the chunk) per chunk touched.
        A run of consecutive rows (fresh rows, a whole table) comes as slices: plain copies."""
        n = len(rows)
        if not n:
            return
        first = int(rows[0])
        if int(rows[-1]) - first == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
            pos = 0
            while pos < n:
                r = first + pos
                k, off = r >> self.shift, r & self.mask
                take = min(n - pos, self._chunks[k].rows - off)
                yield self._chunks[k], (None if take == n else slice(pos, pos + take)), slice(off, off + take)
                pos += take
            return
        c = rows >> self.shift
        lo, hi = int(c.min()), int(c.max())
        if lo == hi:
            yield self._chunks[lo], None, torch.from_numpy(rows & self.mask)
            return
        order = np.argsort(c, kind="stable")
        cs = c[order]
        cut = np.flatnonzero(cs[1:] != cs[:-1]) + 1
        starts = np.concatenate([[0], cut])
        stops = np.concatenate([cut, [len(rows)]])
        offs = rows[order] & self.mask
        order_t, offs_t = torch.from_numpy(order), torch.from_numpy(offs)
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            yield self._chunks[int(cs[a])], order_t[a:b], offs_t[a:b]

    def plan(self, rows: np.ndarray) -> RowPlan:
        """How to reach ``rows`` (int64, no duplicates), computed once for a gather and a scatter of the
        same rows: the rows put in chunk order (``plan.order``: positions in ``rows``, None if they
        were in chunk order already; ``plan.rows``: the rows in that order), and per chunk touched the
        contiguous range of positions it serves. Gathering and scattering through a plan reads and
        writes the data in the plan's order: one index op per chunk and column, no second copy to put
        rows back in the caller's order."""
        rows = np.ascontiguousarray(rows, np.int64)
        order = None
        n = len(rows)
        if n > 1:
            c = rows >> self.shift
            if not bool((c[1:] >= c[:-1]).all()):
                order = np.argsort(c, kind="stable")
                rows = rows[order]
        return RowPlan(rows, order, list(self._sorted_groups(rows)))

    def _sorted_groups(self, rows: np.ndarray) -> Iterator[tuple[_Chunk, slice | torch.Tensor | None, slice | torch.Tensor]]:
        """_groups for ``rows`` in chunk order: positions are always slices (or None: all)."""
        n = len(rows)
        if not n:
            return
        if int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
            yield from self._groups(rows)  # one run of consecutive rows: plain copies (slices)
            return
        c = rows >> self.shift
        lo, hi = int(c[0]), int(c[-1])
        if lo == hi:
            yield self._chunks[lo], None, torch.from_numpy(rows & self.mask)
            return
        cut = (np.flatnonzero(c[1:] != c[:-1]) + 1).tolist()
        offs = torch.from_numpy(rows & self.mask)
        for a, b in zip([0, *cut], [*cut, n], strict=True):
            yield self._chunks[int(c[a])], slice(a, b), offs[a:b]

    def gather(
        self, rows: np.ndarray, names: Sequence[str] | None = None, plan: RowPlan | None = None
    ) -> dict[str, torch.Tensor]:
        """Copies of ``names`` (default all columns) for ``rows`` (int64, any order): {name: (n, width) or (n,)}.
        With ``plan`` (``plan(rows)``): in the plan's order (``plan.rows``); ``rows`` is not read."""
        rows = plan.rows if plan is not None else np.ascontiguousarray(rows, np.int64)
        groups: Iterable[tuple[_Chunk, slice | torch.Tensor | None, slice | torch.Tensor]]
        groups = plan.groups if plan is not None else self._groups(rows)
        n = len(rows)
        names = list(self.columns) if names is None else list(names)
        cols = [self.columns[name] for name in names]
        out = {c.name: torch.empty((n, c.width) if c.width else (n,), dtype=c.dtype) for c in cols}
        outs = {k: (None if v.dtype == torch.bfloat16 else v.numpy()) for k, v in out.items()}
        for ch, pos, off in groups:
            at = None if isinstance(off, slice) or not isinstance(pos, slice) else off.numpy()
            for name in names:
                src, dst = ch.cols[name], out[name]
                a, o = ch.arrays[name], outs[name]
                if at is not None and a is not None and o is not None:
                    a.take(at, 0, o[pos])  # into a range of the output (the method: numpy's per-call cost is lowest, many chunks)
                elif isinstance(off, slice):
                    (dst if pos is None else dst[pos]).copy_(src[off])
                elif pos is None:
                    torch.index_select(src, 0, off, out=dst)
                elif isinstance(pos, slice):
                    torch.index_select(src, 0, off, out=dst[pos])  # a contiguous range of the output
                else:
                    dst.index_copy_(0, pos, src.index_select(0, off))  # (index_put_ is ~100x slower)
        return out

    def scatter(
        self, rows: np.ndarray, data: Mapping[str, torch.Tensor | np.ndarray | float | int], plan: RowPlan | None = None
    ) -> None:
        """Write ``data`` ({name: (n, width) / (n,) values, or one scalar for every row}) into ``rows``
        (no duplicates). Values are cast to each column's dtype. With ``plan`` (``plan(rows)``): the
        values are in the plan's order (``plan.rows``); ``rows`` is not read."""
        groups: Iterable[tuple[_Chunk, slice | torch.Tensor | None, slice | torch.Tensor]]
        groups = plan.groups if plan is not None else self._groups(np.ascontiguousarray(rows, np.int64))
        tens: dict[str, torch.Tensor | float | int] = {}
        # the values as _Chunk.items sees them, made once per call (making the row-item views per chunk
        # and column instead took a 3-column scatter of 2048 rows over 8 chunks from 0.15 to 0.23-0.33 ms)
        items: dict[str, np.ndarray] = {}
        for name, v in data.items():
            c = self.columns[name]
            if isinstance(v, (int, float)):
                tens[name] = v
            else:
                t = torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
                t = (t.to(c.dtype) if t.dtype != c.dtype else t).contiguous()
                tens[name] = t
                if t.dtype != torch.bfloat16 and t.dim() == (2 if c.width else 1):
                    items[name] = row_items(t.numpy()) if c.width else t.numpy()
        for ch, pos, off in groups:
            at = None if isinstance(off, slice) else off.numpy()
            for name, v in tens.items():
                dst = ch.cols[name]
                arr = ch.arrays[name]
                if isinstance(v, torch.Tensor):
                    rows_of = ch.items[name]
                    if rows_of is not None and name in items and at is not None and not isinstance(pos, torch.Tensor):
                        # numpy's row copy: ~2x torch's index_copy_ for (n, 64) float32, ~2x again as row items
                        rows_of[at] = items[name] if pos is None else items[name][pos]
                        continue
                    part = v if pos is None else (v[pos] if isinstance(pos, slice) else v.index_select(0, pos))
                    if isinstance(off, slice):
                        dst[off].copy_(part)
                    elif arr is not None:
                        arr[at] = part.numpy()
                    else:
                        dst.index_copy_(0, off, part)
                elif isinstance(off, slice):
                    dst[off].fill_(v)
                elif arr is not None:
                    arr[at] = v
                else:
                    dst.index_fill_(0, off, v)

    def all_rows(self) -> np.ndarray:
        """Every live row (handed out, not released), ascending."""
        if not self._n_free:
            return np.arange(self.n_alloc, dtype=np.int64)
        keep = np.ones(self.n_alloc, bool)
        keep[self._free[: self._n_free]] = False
        return np.flatnonzero(keep).astype(np.int64)

    def clear(self) -> None:
        """Forget every row (chunks stay allocated for reuse; every row handed out is free again)."""
        n = self.n_alloc
        if n > len(self._free):
            self._free = np.zeros(n, np.int64)
        self._free[:n] = np.arange(n - 1, -1, -1, dtype=np.int64)  # alloc hands out row 0 first
        self._n_free = n

    def pointers(self, name: str) -> np.ndarray:
        """Column ``name``'s base address in each chunk (int64, chunk order): what the row kernel
        (``ps.rowkernel``) indexes by ``row >> shift``. Valid until the store grows (``alloc``) or closes."""
        p = self._pointers.get(name)
        if p is None:
            p = self._pointers[name] = np.array([ch.cols[name].data_ptr() for ch in self._chunks], np.int64)
        return p

    def close(self) -> None:
        self._chunks.clear()
        self._pointers = {}
        self.backing.close()
