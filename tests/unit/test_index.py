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
