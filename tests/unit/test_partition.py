"""Who owns what: dense ranges and the sparse slot map (pure)."""
from __future__ import annotations

import numpy as np
import pytest

from ps import rowkernel
from ps.partition import SlotMap, dense_range, dense_ranges, slot_of


@pytest.mark.parametrize("numel,shards", [(1, 1), (10, 3), (7, 7), (5, 8), (1_000_003, 4)])
def test_dense_ranges_tile_and_are_even(numel: int, shards: int) -> None:
    ranges = dense_ranges(numel, shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_dense_range_rejects_bad_shard() -> None:
    with pytest.raises(ValueError):
        dense_range(10, 3, 3)


def test_slots_are_stable_and_spread() -> None:
    ids = np.arange(100_000, dtype=np.int64)
    s = slot_of(ids, 4096)
    assert s.min() >= 0 and s.max() < 4096
    np.testing.assert_array_equal(s, slot_of(ids.copy(), 4096))
    counts = np.bincount(SlotMap(4096, 4).shard_of(ids), minlength=4)
    assert counts.min() > 0.95 * 25_000  # sequential ids still spread evenly
    assert slot_of(np.array([-1, 2**63 - 1, -(2**63)]), 7).tolist() == slot_of(np.array([-1, 2**63 - 1, -(2**63)]), 7).tolist()


def test_slot_map_needs_enough_slots() -> None:
    with pytest.raises(ValueError):
        SlotMap(2, 3)


@pytest.mark.skipif(rowkernel.KERNEL is None, reason=f"row kernel not loaded: {rowkernel.UNAVAILABLE}")
def test_the_kernels_shard_of_is_numpys() -> None:
    """Reference: ``SlotMap.shard_of``'s numpy path (splitmix64, slot, then the map). The C pass gives the
    same shard for every id: the int64 extremes, negatives, the default map and an explicit one."""
    rng = np.random.default_rng(3)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64),
                          np.array([0, -1, 1, 2**63 - 1, -(2**63)], np.int64)])
    for m in (SlotMap(4096, 2), SlotMap(4096, 3), SlotMap(7, 5), SlotMap(16, 4, rng.integers(0, 4, 16))):
        np.testing.assert_array_equal(m.shard_of(ids, rowkernel.KERNEL), m.shard_of(ids), strict=True)
        np.testing.assert_array_equal(m.shard_of(ids[::3], rowkernel.KERNEL), m.shard_of(ids[::3]), strict=True)  # a strided view
