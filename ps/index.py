"""The id index: int64 id -> int32 value (a row, or a disk-tier code), one per sparse table.

``HashIndex`` (where the row kernel loaded, ``ps.rowkernel``): open addressing with linear probing in
C, the table at most 70% full (12-byte slots: 17-34 bytes per id). A lookup costs one cache miss
per id, its group's misses overlapped: 36-44 ns per id against the sorted runs' 95-125 on cold
caches, 1M ids (bench/RESULTS.md); an insert is O(1), no run to merge. Each index hashes with its
own random 128-bit key, so ids a caller chose to collide (ids come from the network) cost what
random ones do. Deleted ids leave tombstones, reused by inserts and dropped when the table is
rebuilt (growing, or once tombstones outnumber the live ids).

``SortedIndex`` (the numpy path): sorted arrays searched with ``np.searchsorted``, as a
log-structured merge of two levels: a large ``base`` and a small ``delta`` that new ids are merged
into (one ``np.insert``, O(len(delta))); when the delta grows past an eighth of the base (and past
``MIN_DELTA``), it is merged into the base (O(n), so O(8) copies per id over its life). 12 bytes per
id; O(log n) per lookup, whatever the ids. A key is in at most one run. Deletion marks the value (a
tombstone) in place; inserting a deleted id again revives its entry; tombstones are dropped at the
next merge (a merge is also forced when they outnumber the live ids).

Both answer alike (tests/unit/test_index.py runs every operation on both against a dict). Not
thread-safe: the owning table's lock guards them.
"""
from __future__ import annotations

import secrets

import numpy as np
import torch

from ps import rowkernel
from ps.rowkernel import kept_ptr, ptr
from ps.rowstore import huge_empty

__all__ = ["VALUE_MAX", "VALUE_MIN", "HashIndex", "IdIndex", "SortedIndex", "new_index"]

# The int32 value also marks empty slots and deleted entries; values are rows (>= 0) or a table's
# negative location codes (the disk tier's slots), always above the markers.
_EMPTY, _TOMB = np.int32(np.iinfo(np.int32).min), np.int32(np.iinfo(np.int32).min + 1)
VALUE_MIN, VALUE_MAX = int(_TOMB) + 1, int(np.iinfo(np.int32).max)
MIN_DELTA = 4096  # the delta is merged into the base once it holds more than max(this, base / 8) ids


def _check(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, np.int64)
    if rows.size and (int(rows.min()) < VALUE_MIN or int(rows.max()) > VALUE_MAX):
        raise OverflowError(f"index values must lie in [{VALUE_MIN}, {VALUE_MAX}]")
    return rows


def new_index(kernel: bool = True) -> "IdIndex":
    """A ``HashIndex`` where the row kernel loaded (and ``kernel``), else a ``SortedIndex``."""
    return HashIndex() if kernel and rowkernel.KERNEL is not None else SortedIndex()


_SLOT = np.dtype([("id", np.int64), ("val", np.int32)])  # tk_slot (packed)
_MIN_SLOTS = 1024
_MAX_LOAD = 0.7  # used slots (live and deleted) per slot before the table is rebuilt


class HashIndex:
    """The C hash table (``ps/_rowkernel.c``: ``tk_hash_*``). The row kernel must have loaded."""

    def __init__(self) -> None:
        kernel = rowkernel.KERNEL
        assert kernel is not None, "HashIndex needs the row kernel (new_index falls back to SortedIndex)"
        self._k = kernel
        self._key = np.frombuffer(secrets.token_bytes(16), np.uint64).copy()
        self._slots = np.zeros(0, _SLOT)
        self.n = 0  # live entries
        self.dead = 0  # tombstones in the table

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def _size_for(self, live: int) -> int:
        """Slots for ``live`` entries: a power of two, at most half full after a rebuild."""
        return max(_MIN_SLOTS, 1 << (2 * live - 1).bit_length()) if live else 0

    def grow_bytes(self, extra: int) -> int:
        """Bytes an insert of ``extra`` new ids adds to ``nbytes`` (at most)."""
        if self.n + self.dead + max(0, extra) <= _MAX_LOAD * len(self._slots):
            return 0
        return max(0, self._size_for(self.n + max(0, extra)) * _SLOT.itemsize - self.nbytes)

    def _rebuild(self, live: int) -> None:
        """A new table sized for ``live`` entries holding the live ones (tombstones dropped)."""
        old = self._slots
        self._slots = huge_empty(self._size_for(live), _SLOT)  # (probed at random: huge pages)
        self._slots["val"] = _EMPTY
        if len(old) and self.n:
            self._k.hash_move(ptr(old), len(old), kept_ptr(self._slots), self._mask, kept_ptr(self._key))
        self.dead = 0

    @property
    def _mask(self) -> int:
        return len(self._slots) - 1

    def _call(self, fn: object, ids: np.ndarray, vals: np.ndarray | None) -> int:
        scratch = np.empty(len(ids), np.int64)
        return fn(  # type: ignore[operator]
            kept_ptr(self._slots), self._mask, kept_ptr(self._key), ptr(ids), ptr(vals), len(ids), ptr(scratch),
        )

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Value of each id (int64; any order, duplicates allowed), -1 where absent."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(len(ids), np.int64)
        if len(ids):
            self._k.hash_lookup(kept_ptr(self._slots), self._mask, kept_ptr(self._key), ptr(ids), len(ids), ptr(out))
        return out

    def lookup_rows(
        self, ids: np.ndarray, row_bytes: int, shift: int, values: np.ndarray, versions: np.ndarray, out: torch.Tensor,
        out_versions: np.ndarray,
    ) -> tuple[np.ndarray, bool, bool]:
        """``lookup(ids)`` (int64, contiguous) and, if every id has a row (a value >= 0), their ``row_bytes``-byte
        values and versions copied into ``out`` and ``out_versions`` from a row store's chunk pointer tables
        (``values``, ``versions``; chunks of ``1 << shift`` rows), in one C call: (the values, whether every
        row was copied, whether ``ids`` are strictly increasing)."""
        at = np.empty(len(ids), np.int64)
        increasing = np.zeros(1, np.int64)
        got = self._k.hash_gather(
            kept_ptr(self._slots), self._mask, kept_ptr(self._key), ptr(ids), len(ids), ptr(at), row_bytes, shift,
            (1 << shift) - 1, kept_ptr(values), kept_ptr(versions), out.data_ptr(), ptr(out_versions), ptr(increasing),
        )
        return at, got == len(ids), bool(increasing[0])

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids`` (unique, none present) -> ``rows``."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(_check(rows))
        if not len(ids):
            return
        if self.n + self.dead + len(ids) > _MAX_LOAD * len(self._slots):
            self._rebuild(self.n + len(ids))
        fresh = self._call(self._k.hash_insert, ids, rows)
        self.n += len(ids)
        self.dead -= len(ids) - fresh

    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Point ``ids`` (unique, each present) at new ``rows``."""
        ids = np.ascontiguousarray(ids, np.int64)
        found = self._call(self._k.hash_set, ids, np.ascontiguousarray(_check(rows)))
        assert found == len(ids), "assign to an id that is not in the index"

    def delete(self, ids: np.ndarray) -> None:
        """Remove ``ids`` (those present; absent ones are ignored)."""
        gone = self._call(self._k.hash_set, np.ascontiguousarray(ids, np.int64), None)
        self.n -= gone
        self.dead += gone
        if self.dead > max(MIN_DELTA, self.n):  # mostly tombstones: give the memory back
            self._rebuild(self.n)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values (int64)) of every entry, in no particular order."""
        v = self._slots["val"]
        live = (v != _EMPTY) & (v != _TOMB)
        return self._slots["id"][live], v[live].astype(np.int64)


class SortedIndex:
    """Sorted runs searched by numpy (the path where the row kernel is not loaded)."""

    def __init__(self) -> None:
        self._bk = np.empty(0, np.int64)  # base: sorted keys, their values
        self._bv = np.empty(0, np.int32)
        self._dk = np.empty(0, np.int64)  # delta: the same, small
        self._dv = np.empty(0, np.int32)
        self.n = 0  # live entries
        self.dead = 0  # tombstones still in the arrays

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return (len(self._bk) + len(self._dk)) * _ENTRY

    def grow_bytes(self, extra: int) -> int:
        """Bytes an insert of ``extra`` new ids adds to ``nbytes`` (at most; revived ids add none)."""
        return max(0, extra) * _ENTRY

    @staticmethod
    def _search(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position of each id in ``keys`` or an arbitrary in-range one, whether it is there)."""
        if not len(keys):
            return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
        pos = np.searchsorted(keys, ids)
        pos[pos == len(keys)] = 0
        return pos, keys[pos] == ids

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(base position, in base, delta position, in delta) of each id, tombstones included."""
        pb, hb = self._search(self._bk, ids)
        pd, hd = self._search(self._dk, ids)
        return pb, hb, pd, hd

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Value of each id (int64; any order, duplicates allowed), -1 where absent."""
        pb, hb, pd, hd = self._find(np.ascontiguousarray(ids, np.int64))
        out = np.full(len(ids), -1, np.int64)
        out[hb] = self._bv[pb[hb]]
        out[hd] = self._dv[pd[hd]]
        out[out == _TOMB] = -1
        return out

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids`` (unique, none present) -> ``rows``."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = _check(rows).astype(np.int32)
        if not len(ids):
            return
        if self.dead:  # ids deleted earlier come back to life in place
            pb, hb, pd, hd = self._find(ids)
            self._bv[pb[hb]] = rows[hb]
            self._dv[pd[hd]] = rows[hd]
            back = hb | hd
            self.dead -= int(np.count_nonzero(back))
            self.n += int(np.count_nonzero(back))
            ids, rows = ids[~back], rows[~back]
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            order = np.argsort(ids)
            ids, rows = ids[order], rows[order]
        at = np.searchsorted(self._dk, ids)
        self._dk = np.insert(self._dk, at, ids)
        self._dv = np.insert(self._dv, at, rows)
        self.n += len(ids)
        if len(self._dk) > max(MIN_DELTA, len(self._bk) // 8):
            self._merge()

    def _merge(self) -> None:
        """The delta into the base, tombstones dropped."""
        bk, bv, dk, dv = self._bk, self._bv, self._dk, self._dv
        if self.dead:
            lb, ld = bv != _TOMB, dv != _TOMB
            bk, bv, dk, dv = bk[lb], bv[lb], dk[ld], dv[ld]
            self.dead = 0
        at = np.searchsorted(bk, dk) + np.arange(len(dk))  # the delta's places in the merge
        base = np.ones(len(bk) + len(dk), bool)
        base[at] = False
        keys, vals = huge_empty(len(base), np.int64), huge_empty(len(base), np.int32)  # (probed at random: huge pages)
        keys[at], vals[at], keys[base], vals[base] = dk, dv, bk, bv
        self._bk, self._bv = keys, vals
        self._dk, self._dv = np.empty(0, np.int64), np.empty(0, np.int32)

    def _slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(base positions, mask, delta positions, mask) of ``ids``' live entries."""
        pb, hb, pd, hd = self._find(np.ascontiguousarray(ids, np.int64))
        hb[hb] = self._bv[pb[hb]] != _TOMB
        hd[hd] = self._dv[pd[hd]] != _TOMB
        return pb, hb, pd, hd

    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Point ``ids`` (unique, each present) at new ``rows``."""
        rows = _check(rows).astype(np.int32)
        pb, hb, pd, hd = self._slots(ids)
        assert bool((hb | hd).all()), "assign to an id that is not in the index"
        self._bv[pb[hb]] = rows[hb]
        self._dv[pd[hd]] = rows[hd]

    def delete(self, ids: np.ndarray) -> None:
        """Remove ``ids`` (those present; absent ones are ignored)."""
        pb, hb, pd, hd = self._slots(ids)
        self._bv[pb[hb]] = _TOMB
        self._dv[pd[hd]] = _TOMB
        gone = int(np.count_nonzero(hb)) + int(np.count_nonzero(hd))
        self.n -= gone
        self.dead += gone
        if self.dead > max(MIN_DELTA, self.n):  # mostly tombstones: give the memory back
            self._merge()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values (int64)) of every entry, ids ascending within each run (base, then delta)."""
        keys = np.concatenate([self._bk, self._dk])
        vals = np.concatenate([self._bv, self._dv])
        live = vals != _TOMB
        return keys[live], vals[live].astype(np.int64)


_ENTRY = 8 + 4  # a SortedIndex's bytes per id: key, value
IdIndex = HashIndex | SortedIndex
