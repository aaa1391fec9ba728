"""Sparse tables skip the sort and the scatter-add for ids that are sorted and unique already (what
PSClient sends). Reference: the general path (np.unique, index_add, index_select) on a twin table
fed the same ids in a shuffled order with duplicates split; results must be identical."""
from __future__ import annotations

import numpy as np

from ps.config import InitializerSpec, OptimizerSpec, TableSpec
from ps.table import SparseTable


def _sparse() -> SparseTable:
    spec = TableSpec("s", "sparse", dim=4, optimizer=OptimizerSpec("adagrad", {"lr": 0.1}),
                     initializer=InitializerSpec("uniform"))
    return SparseTable(spec, 0, 1)


def test_sorted_unique_ids_give_what_the_general_path_gives() -> None:
    rng = np.random.default_rng(0)
    fast, general = _sparse(), _sparse()
    ids = np.unique(rng.integers(-1000, 10**12, 300)).astype(np.int64)
    perm = rng.permutation(len(ids))
    np.testing.assert_array_equal(fast.pull(ids)[0], general.pull(ids[perm])[0][np.argsort(perm)])  # created rows
    for _ in range(3):
        g = rng.normal(size=(len(ids), 4)).astype(np.float32)
        base = rng.integers(0, 3, len(ids)).astype(np.int64)
        fast.push(ids, g, base)
        # the same gradient, shuffled and with each row split into two halves of the same id
        dup = np.concatenate([ids[perm], ids[perm]])
        general.push(dup, np.concatenate([g[perm] / 2, g[perm] / 2]), np.concatenate([base[perm], base[perm]]))
        fv, fver = fast.pull(ids)
        gv, gver = general.pull(ids[perm])
        np.testing.assert_allclose(fv, gv[np.argsort(perm)], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(fver, gver[np.argsort(perm)])
    # a pull's result is the caller's own (not a view of the table): writing to it changes nothing
    v, _ = fast.pull(ids)
    v[:] = 7.0
    assert not np.any(fast.pull(ids)[0] == 7.0)


def test_rows_a_push_creates_take_the_initial_values_a_pull_computed() -> None:
    """Reference: a twin table that never pulled, so every created row's initial values are computed
    at the push. The rows (bit for bit) and versions must be identical, whichever of the last pulls
    computed an id's values and whether some ids were never pulled; the kept values stay bounded."""
    rng = np.random.default_rng(1)
    for init in (InitializerSpec("normal", {"mean": 0.0, "std": 0.5}), InitializerSpec("uniform")):
        spec = TableSpec("s", "sparse", dim=5, optimizer=OptimizerSpec("sgd", {"lr": 0.1}), initializer=init)
        pulled, fresh = SparseTable(spec, 0, 1), SparseTable(spec, 0, 1)
        batches = [np.unique(rng.integers(0, 10**9, 200)).astype(np.int64) for _ in range(3)]
        for b in batches:
            pulled.pull(b)
        ids = np.unique(np.concatenate([batches[0][:50], batches[2][:50], rng.integers(0, 10**9, 40)]))  # 40 never pulled
        g = rng.normal(size=(len(ids), 5)).astype(np.float32)
        pulled.push(ids, g)
        fresh.push(ids, g)
        (pv, pver), (fv, fver) = pulled.pull(ids), fresh.pull(ids)
        assert np.array_equal(pv.view(np.int32), fv.view(np.int32)) and np.array_equal(pver, fver)
        for _ in range(10):  # bounded: at most FRESH_PULLS pulls, FRESH_BYTES in all
            pulled.pull(np.unique(rng.integers(0, 10**9, 500)).astype(np.int64))
        assert len(pulled._fresh) <= SparseTable.FRESH_PULLS
        assert sum(r.nbytes for _, r in pulled._fresh) <= SparseTable.FRESH_BYTES
