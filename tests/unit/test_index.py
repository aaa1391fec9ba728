"""ps/index.py's two indexes (HashIndex: C, where the row kernel loaded; SortedIndex: numpy) against
a Python dict, through inserts, deletes, revived ids, merges and rebuilds."""
from __future__ import annotations

import numpy as np
import pytest

from ps import rowkernel
from ps.index import HashIndex, SortedIndex, new_index

needs_kernel = pytest.mark.skipif(rowkernel.KERNEL is None, reason=f"row kernel not loaded: {rowkernel.UNAVAILABLE}")
BOTH = [pytest.param(HashIndex, marks=needs_kernel), SortedIndex]


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_matches_a_dict_under_random_operations(cls: type, seed: int) -> None:
    """Random batches (small ids collide often; every batch inserts only the ids the index lacks, so
    deleted ones come back), random deletes; lookups of present, deleted and absent ids after each."""
    rng = np.random.default_rng(seed)
    idx, ref = cls(), {}
    next_row = 0
    for _ in range(300):
        ids = np.unique(rng.integers(-(2**63), 2**63 - 1, size=int(rng.integers(0, 200)), dtype=np.int64))
        ids = np.concatenate([ids, rng.integers(0, 500, size=50)])  # small ids collide often
        ids = np.unique(ids)
        new = ids[idx.lookup(ids) < 0]
        rows = np.arange(next_row, next_row + len(new))
        next_row += len(new)
        idx.insert(new, rows)
        ref.update(zip(new.tolist(), rows.tolist()))
        if ref and rng.random() < 0.5:
            keys = np.array(list(ref), np.int64)
            gone = rng.choice(keys, size=min(len(keys), int(rng.integers(1, 80))), replace=False)
            idx.delete(gone)
            for g in gone.tolist():
                del ref[g]
        probe = np.concatenate([ids, rng.integers(0, 1000, size=100)])
        want = np.array([ref.get(i, -1) for i in probe.tolist()], np.int64)
        np.testing.assert_array_equal(idx.lookup(probe), want)
        assert len(idx) == len(ref)
    ids, rows = idx.items()
    assert dict(zip(ids.tolist(), rows.tolist())) == ref
    assert sorted(idx.items()[1].tolist()) == sorted(ref.values())


def test_unsorted_batches_merges_and_exact_bytes() -> None:
    """Batches in any order; enough ids to merge the delta into the base several times (MIN_DELTA
    and base / 8); 12 bytes per entry and nothing else."""
    from ps.index import MIN_DELTA

    idx = SortedIndex()
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.arange(20 * MIN_DELTA, dtype=np.int64) * 3 - 7)
    for part in np.array_split(np.arange(len(ids)), 37):
        idx.insert(ids[part], part)
    np.testing.assert_array_equal(idx.lookup(ids[::-1]), np.arange(len(ids))[::-1])
    np.testing.assert_array_equal(idx.lookup(ids + 1), -1)  # neighbours of every id: absent
    assert len(idx) == len(ids) and idx.nbytes == len(ids) * 12 and idx.grow_bytes(5) == 60


def test_deleted_ids_revive_and_tombstones_are_dropped() -> None:
    """A deleted id inserted again gets its new value (its entry revived in place, in the base or the
    delta); deleting most ids forces a merge that gives their bytes back."""
    from ps.index import MIN_DELTA

    idx = SortedIndex()
    n = 4 * MIN_DELTA
    idx.insert(np.arange(n), np.arange(n))  # base
    idx.insert(np.arange(n, n + 10), np.arange(10))  # delta
    idx.delete(np.array([3, n + 2, 10**12]))  # one in each run, one absent (ignored)
    assert len(idx) == n + 8
    np.testing.assert_array_equal(idx.lookup(np.array([3, n + 2, 4])), [-1, -1, 4])
    idx.insert(np.array([n + 2, 3]), np.array([77, 88]))
    np.testing.assert_array_equal(idx.lookup(np.array([3, n + 2])), [88, 77])
    assert len(idx) == n + 10 and idx.nbytes == (n + 10) * 12
    idx.delete(np.arange(n))  # most of it: merged, tombstones dropped
    assert len(idx) == 10 and idx.nbytes == 10 * 12
    ids, vals = idx.items()
    assert dict(zip(ids.tolist(), vals.tolist())) == {n + i: i for i in range(10) if i != 2} | {n + 2: 77}


def test_a_big_base_stays_on_2mib_aligned_memory_after_a_merge_that_drops_tombstones() -> None:
    """The base run of a big index (the one probed at random: ``huge_empty``) is 2 MiB aligned, also
    when the merge that made it dropped tombstones; the lookups still answer."""
    idx = SortedIndex()
    ids = np.arange(1_500_000, dtype=np.int64) * 3
    idx.insert(ids, np.arange(len(ids)))
    assert idx._bk.ctypes.data % (2 << 20) == 0
    idx.delete(ids[:800_000])  # mostly tombstones: merged at once
    assert idx.dead == 0 and len(idx._bk) == 700_000 and idx._bk.ctypes.data % (2 << 20) == 0
    np.testing.assert_array_equal(idx.lookup(ids[799_998:800_002]), [-1, -1, 800_000, 800_001])


@needs_kernel
def test_the_hash_table_grows_stays_at_most_70_percent_full_and_gives_memory_back() -> None:
    """Growth by doubling keeps every answer; ``grow_bytes`` says what an insert adds before it does;
    deleted slots are reused; deleting most ids rebuilds the table smaller; a big table sits on
    2 MiB aligned memory (probed at random: ``huge_empty``)."""
    idx = HashIndex()
    assert idx.nbytes == 0 and idx.grow_bytes(1) == 1024 * 12
    ids = np.random.default_rng(3).permutation(np.arange(600_000, dtype=np.int64) * 7 - 3)
    for part in np.array_split(np.arange(len(ids)), 29):
        before, promised = idx.nbytes, idx.grow_bytes(len(part))
        idx.insert(ids[part], part)
        assert idx.nbytes - before == promised
        assert idx.n + idx.dead <= 0.7 * len(idx._slots)
    np.testing.assert_array_equal(idx.lookup(ids[::-1]), np.arange(len(ids))[::-1])
    np.testing.assert_array_equal(idx.lookup(ids + 1), -1)
    assert idx._slots.ctypes.data % (2 << 20) == 0 and idx.nbytes == (1 << 20) * 12
    idx.delete(ids[:1000])
    size = len(idx._slots)
    idx.insert(ids[:1000], np.arange(1000) + 5)  # the deleted slots again: no growth
    assert len(idx._slots) == size and idx.dead == 0
    np.testing.assert_array_equal(idx.lookup(ids[:3]), [5, 6, 7])
    idx.delete(ids[:500_000])  # mostly tombstones: rebuilt for the live ids
    assert len(idx) == 100_000 and idx.dead == 0 and len(idx._slots) == 1 << 18
    np.testing.assert_array_equal(idx.lookup(ids[499_999:500_002]), [-1, 500_000, 500_001])
    idx.assign(ids[-2:], np.array([-9, 11]))
    np.testing.assert_array_equal(idx.lookup(ids[-2:]), [-9, 11])


@needs_kernel
def test_two_hash_indexes_put_the_same_ids_in_different_slots() -> None:
    """Each index draws its own hash key: ids chosen to share a home slot in one index (found by
    looking at its table) are spread in another (the reason a caller cannot flood the index)."""
    a, b = HashIndex(), HashIndex()
    ids = np.arange(700, dtype=np.int64)
    for idx in (a, b):
        idx.insert(ids, ids)
    assert (a._slots["id"] != b._slots["id"]).any()


def test_new_index_is_the_hash_table_where_the_kernel_loaded() -> None:
    assert isinstance(new_index(), HashIndex if rowkernel.KERNEL is not None else SortedIndex)
    assert isinstance(new_index(kernel=False), SortedIndex)
