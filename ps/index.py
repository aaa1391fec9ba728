"""IdIndex: int64 id -> int64 row, an open-addressing hash table whose every operation is
vectorized over numpy arrays (one probe round per array op, not one Python dict probe per id).

Linear probing on a power-of-two table kept at most half full; deletions leave tombstones that
inserts reuse and that a rebuild clears. 12 bytes a slot: an int64 key and an int32 value that
also marks empty and deleted slots. Not thread-safe: the owning table's lock guards it.

The home slot is a *keyed* hash: two rounds of the splitmix64 finalizer, each keyed by a random
64-bit key chosen per index (``secrets.randbits``, so per table and per load). Ids come from the network; with the plain, invertible
mix64 anyone could compute thousands of ids with one home slot and turn every probe into a linear
scan. This hash is only this process's in-memory layout (never sent, never stored: the index is
rebuilt on load), so it need not be stable; the slot hash that places ids on shards
(``ps.partition.slot_of``) is a different one and stays stable.
"""
from __future__ import annotations

import secrets

import numpy as np

from ps.partition import mix64

__all__ = ["IdIndex"]

# One int32 per slot holds the value or a marker (12 bytes a slot with the int64 key, instead of
# 8 + 8 + a state byte): values are rows (>= 0) or a table's negative location codes (the disk
# tier's slots), always above the two markers.
_EMPTY = np.int32(np.iinfo(np.int32).min)
_TOMB = np.int32(np.iinfo(np.int32).min + 1)
VALUE_MIN, VALUE_MAX = int(_TOMB) + 1, int(np.iinfo(np.int32).max)
BYTES_PER_SLOT = 8 + 4  # key, value (or marker)


class IdIndex:
    """``key``: the hash key (default: a fresh random one); tests pass one to reproduce a layout.

    Values are ints in [VALUE_MIN, VALUE_MAX] (int32 but the two markers)."""

    def __init__(self, capacity: int = 1024, key: int | None = None) -> None:
        k = secrets.randbits(128) if key is None else int(key)
        self._k0 = np.uint64(k & 0xFFFFFFFFFFFFFFFF)
        self._k1 = np.uint64((k >> 64) & 0xFFFFFFFFFFFFFFFF)
        self._alloc(max(16, 1 << (max(1, capacity) - 1).bit_length()))
        self.n = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's arrays."""
        return (self.mask + 1) * BYTES_PER_SLOT

    @property
    def used(self) -> np.ndarray:
        """Mask of the slots holding an entry."""
        return self.vals > _TOMB

    def _cap_for(self, extra: int) -> int:
        """Slots after inserting ``extra`` new ids (the current number when no rebuild is due)."""
        cap = self.mask + 1
        if self.n + self.tombs + extra <= cap // 2:
            return cap
        while cap < 2 * (self.n + extra):
            cap *= 2
        return cap

    def grow_bytes(self, extra: int) -> int:
        """Bytes an insert of ``extra`` new ids would add (0 if it fits in the current arrays)."""
        return max(0, self._cap_for(extra) - (self.mask + 1)) * BYTES_PER_SLOT

    def _alloc(self, cap: int) -> None:
        self.keys = np.zeros(cap, np.int64)
        self.vals = np.full(cap, _EMPTY, np.int32)
        self.mask = cap - 1
        self.tombs = 0
        self.epoch = getattr(self, "epoch", -1) + 1  # slots were laid out afresh: insert hints are void

    def __len__(self) -> int:
        return self.n

    def _home(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = mix64(mix64(ids.view(np.uint64) ^ self._k0) + self._k1)
        return (h & np.uint64(self.mask)).astype(np.int64)

    def _find(self, ids: np.ndarray, ends: np.ndarray | None = None) -> np.ndarray:
        """Slot of each id, or -1 where absent. ``ends`` (optional, len(ids)): for each absent id, the
        empty slot its probe stopped at (where an insert of it may start probing)."""
        slot = np.full(len(ids), -1, np.int64)
        h = self._home(ids)
        todo = np.arange(len(ids))
        while todo.size:
            hs = h[todo]
            v = self.vals[hs]
            hit = (v > _TOMB) & (self.keys[hs] == ids[todo])
            slot[todo[hit]] = hs[hit]
            go_on = ~hit & (v != _EMPTY)  # a tombstone or another key: probe further
            if ends is not None:
                gone = v == _EMPTY
                ends[todo[gone]] = hs[gone]
            todo = todo[go_on]
            h[todo] = (hs[go_on] + 1) & self.mask
        return slot

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Value of each id (int64; any order, duplicates allowed), -1 where absent."""
        return self.locate(ids)[0]

    def locate(self, ids: np.ndarray, ends: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """(lookup(ids), start): with ``ends``, ``start`` is an ``insert`` hint for the absent ids: the
        empty slot each one's probe reached (-1 for the present ones), valid while ``epoch`` is
        unchanged (until the table is rebuilt); else None."""
        ids = np.ascontiguousarray(ids, np.int64)
        start = np.full(len(ids), -1, np.int64) if ends else None
        slot = self._find(ids, start)
        out = np.full(len(ids), -1, np.int64)
        have = slot >= 0
        out[have] = self.vals[slot[have]]
        return out, start

    @staticmethod
    def _check(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if rows.size and (int(rows.min()) < VALUE_MIN or int(rows.max()) > VALUE_MAX):
            raise OverflowError(f"index values must lie in [{VALUE_MIN}, {VALUE_MAX}]")
        return rows.astype(np.int32)

    def insert(self, ids: np.ndarray, rows: np.ndarray, start: np.ndarray | None = None, epoch: int = -1) -> None:
        """Add ``ids`` (unique, none present) -> ``rows``. ``start``: where each id's probe may start
        (``locate(..., ends=True)``'s hint for these ids, taken at ``epoch``): the empty slot its lookup
        reached, past every occupied slot of its chain (deletions since only leave tombstones, which
        an insert may skip), so most ids land at once instead of walking their chain again. Ignored
        if the table was rebuilt since (``epoch`` differs) or is rebuilt now."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = self._check(rows)
        if self.n + self.tombs + len(ids) > (self.mask + 1) // 2:
            self._rebuild(self.n + len(ids))
        if start is not None and epoch == self.epoch and len(start) == len(ids) and bool((start >= 0).all()):
            h = np.array(start, np.int64)
        else:
            h = self._home(ids)
        todo = np.arange(len(ids))
        while todo.size:
            hs = h[todo]
            free = self.vals[hs] <= _TOMB
            # ids of this batch that probe the same free slot: each writes its key there, one write
            # wins (reading the slot back tells which); the rest probe on. No sort per round.
            cand = todo[free]
            cs = hs[free]
            self.keys[cs] = ids[cand]
            won = self.keys[cs] == ids[cand]
            slots, winners = cs[won], cand[won]
            self.tombs -= int(np.count_nonzero(self.vals[slots] == _TOMB))
            self.vals[slots] = rows[winners]
            lost = np.ones(len(todo), bool)
            lost[np.flatnonzero(free)[won]] = False
            todo = todo[lost]
            h[todo] = (hs[lost] + 1) & self.mask
        self.n += len(ids)

    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Point ``ids`` (unique, each present) at new ``rows``."""
        slot = self._find(np.ascontiguousarray(ids, np.int64))
        assert (slot >= 0).all(), "assign to an id that is not in the index"
        self.vals[slot] = self._check(rows)

    def delete(self, ids: np.ndarray) -> None:
        """Remove ``ids`` (each present)."""
        slot = self._find(np.ascontiguousarray(ids, np.int64))
        slot = slot[slot >= 0]
        self.vals[slot] = _TOMB
        self.n -= len(slot)
        self.tombs += len(slot)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values (int64)) of every entry, in slot order."""
        used = self.used
        return self.keys[used].copy(), self.vals[used].astype(np.int64)

    def values(self) -> np.ndarray:
        return self.vals[self.used].astype(np.int64)

    def _rebuild(self, need: int) -> None:
        ids, rows = self.items()
        cap = self.mask + 1
        while cap < 2 * need:
            cap *= 2
        self._alloc(cap)
        self.n = 0
        if len(ids):
            self.insert(ids, rows)
