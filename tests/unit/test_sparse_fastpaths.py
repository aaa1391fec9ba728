"""Fast paths of the sparse shard step (issue 15, third pass) against the general paths they skip.

* A push of exactly the ids a recent pull found (what a worker does: it pushes the rows it pulled)
  reuses the pull's row locations (no ownership hash, no index lookup). Reference: the same table
  with that memory switched off, given the same requests, also while rows are evicted (LRU), demoted
  to and promoted from the disk tier between the pull and the push: every reply and the final state
  bit-identical.
* ``RowStore.plan``: gathering and scattering rows in chunk order against the plain per-row paths.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.rowstore import Column, RowStore
from ps.table import SparseTable
from ps.tier import ResidentBudget

pytestmark = pytest.mark.timeout(120)

DIM = 8


class _NoRecall(SparseTable):
    """The reference: every push validates its ids and looks them up in the index."""

    def _recall(self, ids):
        return None


def _spec(opt: str, dtype: str = "float32", **kw) -> TableSpec:
    hp = {"lr": 0.1} if opt != "ftrl" else {"lr": 0.1, "l1": 0.01}
    return TableSpec("emb", "sparse", dim=DIM, dtype=dtype, optimizer=OptimizerSpec(opt, hp),
                     initializer=InitializerSpec("uniform"), seed=3, num_slots=64, **kw)


def _same_state(a: SparseTable, b: SparseTable) -> None:
    x, y = a.export_state(), b.export_state()
    for k in ("ids", "values", "versions"):
        np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=k)
    for k in x["state"]:
        np.testing.assert_array_equal(np.asarray(x["state"][k]), np.asarray(y["state"][k]), err_msg=k)
    assert x["step"] == y["step"]


def _traffic(fast: SparseTable, ref: SparseTable, steps: int, vocab: int, seed: int, prefill: bool = False) -> int:
    """Two workers, each pushing at step t the sorted unique ids it pulled at step t-1 (with the pull's
    versions as base versions), then pulling its next ids. Returns how many pushes used a remembered pull.
    ``prefill``: first push every id of the vocabulary once (pulls only read: a pull remembers rows
    only where every one of them exists)."""
    rng = np.random.default_rng(seed)
    if prefill:
        for t in (fast, ref):
            t.push(np.arange(vocab, dtype=np.int64), np.zeros((vocab, DIM), np.float32))
    prev: list[tuple[np.ndarray, np.ndarray] | None] = [None, None]
    hits = 0
    for _ in range(steps):
        for w in range(2):
            if prev[w] is not None:
                ids, ver = prev[w]
                g = rng.normal(size=(len(ids), DIM)).astype(np.float32)
                hits += fast._recall(ids) is not None
                assert fast.push(ids, g, base_versions=ver) == ref.push(ids, g, base_versions=ver)
            ids = np.unique(rng.integers(0, vocab, size=int(rng.integers(1, 120))))
            got, ver = fast.pull(ids)
            want, wver = ref.pull(ids)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(ver, wver)
            prev[w] = (ids, ver)
    _same_state(fast, ref)
    return hits


@pytest.mark.parametrize("opt", ["adagrad", "adam", "rowwise_adagrad", "ftrl"])
def test_push_of_pulled_ids_matches_the_lookup_path(opt: str) -> None:
    fast, ref = SparseTable(_spec(opt), 0, 1), _NoRecall(_spec(opt), 0, 1)
    hits = _traffic(fast, ref, 40, 3000, 0, prefill=True)
    assert hits == 2 * 40 - 2  # every push after the first pulls: the rows had not moved


def test_remembered_rows_that_were_evicted_are_looked_up_again() -> None:
    """LRU eviction (max_rows) drops rows between a worker's pull and its push: the push must see
    them gone (and make them again from their initial values), exactly as the lookup path does;
    then random traffic of two workers near the cap."""
    spec = _spec("adagrad", eviction=EvictionSpec(max_rows=150))
    fast, ref = SparseTable(spec, 0, 1), _NoRecall(spec, 0, 1)
    mine, other = np.arange(100, dtype=np.int64), np.arange(100, 200, dtype=np.int64)
    g = np.ones((100, DIM), np.float32)
    for t in (fast, ref):
        t.push(mine, g)
    got, ver = fast.pull(mine)  # every row there: remembered
    assert fast._recall(mine) is not None
    np.testing.assert_array_equal(got, ref.pull(mine)[0])
    for t in (fast, ref):
        t.push(other, g)  # another worker's new rows evict 50 of mine
    assert fast.evicted == ref.evicted == 50
    assert fast.push(mine, g, base_versions=ver) == ref.push(mine, g, base_versions=ver)
    _same_state(fast, ref)
    _traffic(fast, ref, 40, 200, 1)
    assert fast.evicted == ref.evicted > 50 and fast.dropped == ref.dropped == 0


def test_remembered_rows_demoted_to_disk_and_back(tmp_path) -> None:
    """A resident budget of 100 rows: pulls demote rows another worker pulled and will push; the push
    brings them back from the disk tier, as without the remembered locations."""
    probe = SparseTable(_spec("adagrad", "bfloat16"), 0, 1)
    nbytes = probe._store.row_nbytes
    fast = SparseTable(_spec("adagrad", "bfloat16"), 0, 1, resident_budget=ResidentBudget(100 * nbytes), spill_dir=str(tmp_path / "a"))
    ref = _NoRecall(_spec("adagrad", "bfloat16"), 0, 1, resident_budget=ResidentBudget(100 * nbytes), spill_dir=str(tmp_path / "b"))
    _traffic(fast, ref, 30, 500, 2)
    assert fast.demoted > 0 and fast.promoted > 0 and fast.promoted == ref.promoted


def test_a_remembered_pull_still_validates_the_gradient() -> None:
    """Skipping the ownership check never skips the shape and finiteness checks (state unchanged)."""
    from ps.errors import NonFiniteError, ShapeMismatchError

    t = SparseTable(_spec("adagrad"), 0, 1)
    ids = np.arange(10, dtype=np.int64)
    t.push(ids, np.zeros((10, DIM), np.float32))
    t.pull(ids)
    before = t.export_state()
    g = np.ones((10, DIM), np.float32)
    g[3, 1] = np.nan
    with pytest.raises(NonFiniteError):
        t.push(ids, g)
    with pytest.raises(ShapeMismatchError):
        t.push(ids, np.ones((10, DIM + 1), np.float32))
    after = t.export_state()
    np.testing.assert_array_equal(before["values"], after["values"])
    np.testing.assert_array_equal(before["versions"], after["versions"])


def test_rowstore_plan_gathers_and_scatters_like_the_row_paths() -> None:
    """Rows over several chunks (64 rows each), in random order, with a run of consecutive rows."""
    cols = [Column("values", torch.float32, 4), Column("version", torch.int64), Column("flag", torch.int16)]
    a, b = RowStore(cols, 64, first_rows=16), RowStore(cols, 64, first_rows=16)
    rows = a.alloc(500)
    b.alloc(500)
    init = {"values": torch.arange(2000, dtype=torch.float32).reshape(500, 4), "version": np.arange(500), "flag": 7}
    a.scatter(rows, init)
    b.scatter(rows, init)
    rng = np.random.default_rng(0)
    for pick in (rng.choice(500, 170, replace=False), np.arange(100, 300), rng.choice(40, 20, replace=False),
                 np.concatenate([np.arange(300, 380), rng.choice(200, 50, replace=False)]), np.zeros(0, np.int64)):
        pick = pick.astype(np.int64)
        plan = a.plan(pick)
        order = np.arange(len(pick)) if plan.order is None else plan.order
        np.testing.assert_array_equal(plan.rows, pick[order])
        assert (np.diff(plan.rows >> a.shift) >= 0).all()
        want = b.gather(pick)
        got = a.gather(plan.rows, plan=plan)
        for k in want:
            torch.testing.assert_close(got[k], want[k][torch.from_numpy(order)], rtol=0, atol=0)
        new = {"values": torch.randn(len(pick), 4), "version": rng.integers(0, 99, len(pick)), "flag": 3}
        b.scatter(pick, new)
        a.scatter(plan.rows, {"values": new["values"][torch.from_numpy(order)], "version": new["version"][order], "flag": 3}, plan)
        everything = np.arange(500)
        for k, v in a.gather(everything).items():
            torch.testing.assert_close(v, b.gather(everything)[k], rtol=0, atol=0)
