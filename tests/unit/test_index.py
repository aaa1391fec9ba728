"""ps/index.py IdIndex against a Python dict, through inserts, deletes, tombstone reuse and growth."""
from __future__ import annotations

import numpy as np

from ps.index import IdIndex


def test_index_matches_a_dict_under_random_operations() -> None:
    rng = np.random.default_rng(0)
    idx, ref = IdIndex(16), {}
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
    assert sorted(idx.values().tolist()) == sorted(ref.values())


def test_ids_colliding_in_one_batch_get_their_own_slots() -> None:
    idx = IdIndex(16)
    ids = np.arange(10_000, dtype=np.int64)
    idx.insert(ids, ids * 2)
    np.testing.assert_array_equal(idx.lookup(ids[::-1]), ids[::-1] * 2)
    assert idx.used.sum() == 10_000 and idx.nbytes == (idx.mask + 1) * 12


def test_insert_from_the_lookup_hint_matches_a_dict() -> None:
    """``locate(ends=True)`` then ``insert(start=...)`` (the probe resumes where the lookup stopped),
    with deletions between the lookup and the insert (tombstones), a batch that forces a rebuild (the
    hint is then ignored), and a stale epoch."""
    rng = np.random.default_rng(3)
    idx, ref = IdIndex(16), {}
    nxt = 0
    for i in range(200):
        ids = np.unique(np.concatenate([rng.integers(0, 3000, 60), rng.integers(-(2**62), 2**62, 20)]))
        loc, start = idx.locate(ids, ends=True)
        np.testing.assert_array_equal(loc, [ref.get(k, -1) for k in ids.tolist()])
        assert start is not None
        new = loc == -1
        assert (start[new] >= 0).all() and (start[~new] == -1).all()
        if ref and i % 3 == 0:  # deletions between lookup and insert
            gone = rng.choice(np.array(sorted(set(ref) - set(ids.tolist())), np.int64), 10, replace=False)
            idx.delete(gone)
            for g in gone.tolist():
                del ref[g]
        epoch = idx.epoch - (1 if i % 7 == 0 else 0)  # now and then a stale hint
        idx.insert(ids[new], np.arange(nxt, nxt + int(new.sum())), start[new], epoch)
        ref.update(zip(ids[new].tolist(), range(nxt, nxt + int(new.sum()))))
        nxt += int(new.sum())
        probe = np.concatenate([ids, rng.integers(0, 4000, 100)])
        np.testing.assert_array_equal(idx.lookup(probe), [ref.get(k, -1) for k in probe.tolist()])
    assert len(idx) == len(ref) and idx.epoch > 3
    ids, rows = idx.items()
    assert dict(zip(ids.tolist(), rows.tolist())) == ref
