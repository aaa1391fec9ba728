"""Which shard owns what. Pure functions, no I/O.

Dense: a table of N elements is cut into S near-equal contiguous ranges; the
first N % S shards hold one element more.

Sparse: an int64 id hashes (splitmix64) to one of ``num_slots`` virtual slots;
a slot map assigns slots to shards (default: slot % S). Keeping the slot, not
the shard, as the unit lets a checkpoint be re-spread over a different number
of shards by moving whole slots.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["dense_range", "dense_ranges", "mix64", "slot_of", "SlotMap", "stable_hash"]

_U64 = np.uint64
GOLDEN = _U64(0x9E3779B97F4A7C15)


def dense_range(numel: int, shard: int, num_shards: int) -> tuple[int, int]:
    """[start, stop) of the elements shard ``shard`` of ``num_shards`` holds."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range for {num_shards} shards")
    base, extra = divmod(numel, num_shards)
    start = shard * base + min(shard, extra)
    return start, start + base + (1 if shard < extra else 0)


def dense_ranges(numel: int, num_shards: int) -> list[tuple[int, int]]:
    return [dense_range(numel, i, num_shards) for i in range(num_shards)]


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic): a stable, well-mixed hash."""
    z = np.asarray(x, dtype=_U64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> _U64(30)
        z *= _U64(0xBF58476D1CE4E5B9)
        z ^= z >> _U64(27)
        z *= _U64(0x94D049BB133111EB)
        z ^= z >> _U64(31)
    return z


def stable_hash(name: str) -> int:
    """64-bit FNV-1a of a string: stable across processes (unlike hash())."""
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def slot_of(ids: np.ndarray, num_slots: int) -> np.ndarray:
    """Virtual slot of each int64 id."""
    return (mix64(np.asarray(ids, dtype=np.int64).view(_U64)) % _U64(num_slots)).astype(np.int64)


class SlotMap:
    """slot -> shard. The default spreads slots round-robin (``slot % num_shards``), computed, not
    stored: it holds no array, whatever ``num_slots``. An explicit ``shards`` array (one int64 per
    slot) is kept as given; ``nbytes`` says what the map holds."""

    def __init__(self, num_slots: int, num_shards: int, shards: np.ndarray | None = None) -> None:
        if num_slots < num_shards:
            raise ValueError(f"num_slots ({num_slots}) must be >= num_shards ({num_shards})")
        self.num_slots = num_slots
        self.num_shards = num_shards
        self._shards = None if shards is None else np.asarray(shards, np.int64)
        if self._shards is not None and self._shards.shape != (num_slots,):
            raise ValueError(f"a slot map needs one shard per slot ({num_slots}), got shape {self._shards.shape}")

    @property
    def shards(self) -> np.ndarray:
        """The shard of every slot (built on demand for the default map)."""
        return self._shards if self._shards is not None else np.arange(self.num_slots, dtype=np.int64) % self.num_shards

    @property
    def nbytes(self) -> int:
        return 0 if self._shards is None else int(self._shards.nbytes)

    def shard_of(self, ids: np.ndarray, kernel: Any = None) -> np.ndarray:
        """The shard of each int64 id; ``kernel`` (``ps.rowkernel.KERNEL``, where it loaded): in one C pass."""
        if kernel is not None:
            return kernel.shard_of(np.ascontiguousarray(ids, np.int64), self.num_slots, self._shards, self.num_shards)
        slots = slot_of(ids, self.num_slots)
        return slots % self.num_shards if self._shards is None else self._shards[slots]
