"""CountMinSketch: approximate sighting counts of int64 ids in fixed memory (admission).

A sparse table with admission counts how often it saw each id it has no row for. Counting in a
dict grows with every distinct id a request names (1M unseen ids cost ~160 MiB); this sketch holds
``depth x width`` uint32 counters whatever the ids, and every operation is vectorized over numpy
arrays. It never under-counts an id it was told about (short of ``forget``/aging, below); it may
over-count when ids share counters (conservative update keeps that small), which only admits a
row a little early.

Aging (TinyLFU's reset): once ``width x 10`` sightings were added, every counter is halved, so
counts from long ago fade and the noise of one-off ids never piles up.

Hashing is keyed by random 64-bit keys per row (``secrets.randbits``): which ids share counters
cannot be chosen from outside. Not thread-safe: the owning table's lock guards it.
"""
from __future__ import annotations

import secrets

import numpy as np

from ps.partition import mix64

__all__ = ["CountMinSketch"]

_MAX = np.iinfo(np.uint32).max


class CountMinSketch:
    def __init__(self, depth: int = 4, width: int = 1 << 17, key: int | None = None) -> None:
        if depth < 1 or width < 16 or width & (width - 1):
            raise ValueError(f"depth must be >= 1 and width a power of two >= 16, got {depth} x {width}")
        rng = np.random.default_rng(secrets.randbits(64) if key is None else key)
        self.keys = rng.integers(0, 2**64 - 1, size=depth, dtype=np.uint64, endpoint=True)
        self.width = width
        self.counters = np.zeros((depth, width), np.uint32)
        self.added = 0
        self.reset_every = 10 * width

    @property
    def nbytes(self) -> int:
        return int(self.counters.nbytes)

    @staticmethod
    def bytes_for(depth: int = 4, width: int = 1 << 17) -> int:
        return depth * width * 4

    def _cols(self, ids: np.ndarray) -> np.ndarray:
        """(depth, n) column of each id in each row."""
        u = np.ascontiguousarray(ids, np.int64).view(np.uint64)
        return (mix64(u[None, :] ^ self.keys[:, None]) & np.uint64(self.width - 1)).astype(np.int64)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Sightings of each id (int64; >= the true count since the last aging)."""
        if not len(ids):
            return np.zeros(0, np.int64)
        return np.take_along_axis(self.counters, self._cols(ids), axis=1).min(axis=0).astype(np.int64)

    def add(self, ids: np.ndarray, estimate: np.ndarray | None = None) -> None:
        """One more sighting of each of ``ids`` (unique). ``estimate``: their estimate() if known."""
        if not len(ids):
            return
        cols = self._cols(ids)
        est = self.estimate(ids) if estimate is None else np.asarray(estimate, np.int64)
        want = np.minimum(est + 1, _MAX).astype(np.uint32)
        for r in range(cols.shape[0]):  # conservative update: raise only the counters below est + 1
            np.maximum.at(self.counters[r], cols[r], want)
        self.added += len(ids)
        if self.added >= self.reset_every:
            self.counters >>= 1
            self.added //= 2
