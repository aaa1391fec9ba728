"""IdIndex: int64 id -> int32 value, sorted arrays searched with ``np.searchsorted``.

Two sorted runs, as a log-structured merge of two levels: a large ``base`` and a small ``delta``
that new ids are merged into (one ``np.insert``, O(len(delta))); when the delta grows past an
eighth of the base (and past ``MIN_DELTA``), it is merged into the base (O(n), so O(8) copies per
id over its life). A lookup is a binary search in each run: O(log n) per id, vectorized, and its
cost does not depend on the ids' values (no hash to flood: ids come from the network). 12 bytes
per id, no empty slots (a hash table kept half full takes 24-48). Speed against the vectorized
open-addressing hash this replaced (bench/RESULTS.md): inserts 1.3-2.3x faster on a growing table
(no rebuilds), lookups ~20% faster with warm caches but ~1.6x slower with cold ones (a bisection's
loads depend on each other); a served shard spends the same either way.

A key is in at most one run. Deletion marks the value (a tombstone) in place; inserting a deleted
id again revives its entry; tombstones are dropped at the next merge (a merge is also forced when
they outnumber the live ids). Not thread-safe: the owning table's lock guards it.
"""
from __future__ import annotations

import numpy as np

from ps import rowkernel
from ps.rowstore import huge_empty

__all__ = ["BYTES_PER_ENTRY", "VALUE_MAX", "VALUE_MIN", "IdIndex"]

# The int32 value also marks deleted entries; values are rows (>= 0) or a table's negative
# location codes (the disk tier's slots), always above the marker.
_TOMB = np.int32(np.iinfo(np.int32).min)
VALUE_MIN, VALUE_MAX = int(_TOMB) + 1, int(np.iinfo(np.int32).max)
BYTES_PER_ENTRY = 8 + 4  # key, value
MIN_DELTA = 4096  # the delta is merged into the base once it holds more than max(this, base / 8) ids


class IdIndex:
    """``kernel``: look ids up with the row kernel's batched binary search (``ps.rowkernel``, where it
    loaded; same answers as ``np.searchsorted``, its cache misses overlapped); False: numpy only."""

    def __init__(self, kernel: bool = True) -> None:
        self._kernel = rowkernel.KERNEL if kernel else None
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
        return (len(self._bk) + len(self._dk)) * BYTES_PER_ENTRY

    def grow_bytes(self, extra: int) -> int:
        """Bytes an insert of ``extra`` new ids adds to ``nbytes`` (at most; revived ids add none)."""
        return max(0, extra) * BYTES_PER_ENTRY

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
        ids = np.ascontiguousarray(ids, np.int64)
        if self._kernel is not None:
            out = np.full(len(ids), -1, np.int64)
            # an id is in one run at most: the delta is searched only for the ids the base lacks
            self._kernel.lookup([(self._bk, self._bv), (self._dk, self._dv)], int(_TOMB), ids, out)
            return out
        pb, hb, pd, hd = self._find(ids)
        out = np.full(len(ids), -1, np.int64)
        out[hb] = self._bv[pb[hb]]
        out[hd] = self._dv[pd[hd]]
        out[out == _TOMB] = -1
        return out

    @staticmethod
    def _check(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if rows.size and (int(rows.min()) < VALUE_MIN or int(rows.max()) > VALUE_MAX):
            raise OverflowError(f"index values must lie in [{VALUE_MIN}, {VALUE_MAX}]")
        return rows.astype(np.int32)

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids`` (unique, none present) -> ``rows``."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = self._check(rows)
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
        rows = self._check(rows)
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

    def values(self) -> np.ndarray:
        return self.items()[1]
