"""The disk tier of sparse tables (issue 18, ps/tier.py): rows beyond a resident budget live in a
memory-mapped file, the most recently used stay resident, cold rows come back on pull or push,
and nothing a worker sees changes. Reference: the same table without a budget (all in RAM) given
the same requests: every pull and the final state must be bit-identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.table import SparseTable
from ps.tier import ResidentBudget

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Hundreds of small row updates: with two intra-op threads on a busy 2-core box each small
    op waits for the other thread (the 400-step test took 37 s instead of 0.6 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

DIM = 8


def _spec(name: str = "emb", dtype: str = "float32", opt: str = "adagrad", **kw) -> TableSpec:
    return TableSpec(name, "sparse", dim=DIM, dtype=dtype, optimizer=OptimizerSpec(opt, {"lr": 0.1}),
                     initializer=InitializerSpec("uniform"), seed=5, **kw)


def _tiered(budget: ResidentBudget, tmp_path, **kw) -> SparseTable:
    return SparseTable(_spec(**kw), 0, 1, resident_budget=budget, spill_dir=str(tmp_path))


def _same(a: dict, b: dict) -> None:
    for k in ("ids", "values", "versions"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for k in a["state"]:
        np.testing.assert_array_equal(a["state"][k], b["state"][k], err_msg=k)
    assert a["step"] == b["step"]


def _row_nbytes(t: SparseTable) -> int:
    return t._store.row_nbytes


def _fill(t: SparseTable, ids: np.ndarray) -> None:
    """Create rows ``ids`` (pulls are reads: rows are made by pushes; a zero gradient leaves the
    initial values, Adagrad's accumulator at 0 and each row at version 1)."""
    t.push(ids, np.zeros((len(ids), DIM), np.float32))


def test_a_table_4x_its_budget_gives_the_same_answers_as_in_ram(tmp_path) -> None:
    ref = SparseTable(_spec(), 0, 1)
    probe = SparseTable(_spec(), 0, 1)
    budget = ResidentBudget(1000 * _row_nbytes(probe))  # room for 1000 of the 4000 rows
    t = _tiered(budget, tmp_path)
    rng = np.random.default_rng(0)
    for a in range(0, 4000, 500):  # fill: 4x the budget
        ids = np.arange(a, a + 500, dtype=np.int64)
        _fill(t, ids)
        _fill(ref, ids)
        np.testing.assert_array_equal(t.pull(ids)[0], ref.pull(ids)[0])
    assert t.rows == 4000 and t.cold_rows >= 3000 and t.resident_rows <= 1000
    for _ in range(60):  # random traffic: mostly cold rows come back, others go
        ids = rng.integers(0, 4000, size=200)
        got, ver = t.pull(ids)
        want, wver = ref.pull(ids)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ver, wver)
        g = rng.normal(size=(len(ids), DIM)).astype(np.float32)
        assert t.push(ids, g, base_versions=ver) == ref.push(ids, g, base_versions=wver)
        assert t.resident_rows <= 1000, "the budget holds after every request"
    assert t.promoted > 0 and t.demoted > 0
    _same(t.export_state(), ref.export_state())
    m = t.memory_stats()
    assert m.rows == 4000 and m.resident_rows + m.cold_rows == 4000 and m.disk_bytes > 0
    # RAM: resident chunks within the budget plus one chunk; cold rows cost their metadata + index entry
    assert t.resident_bytes() <= budget.limit + t._store.chunk_rows * _row_nbytes(t)


def test_most_recently_used_rows_stay_resident(tmp_path) -> None:
    probe = SparseTable(_spec(), 0, 1)
    budget = ResidentBudget(800 * _row_nbytes(probe))
    t = _tiered(budget, tmp_path)
    for a in range(0, 3000, 100):
        t.pull(np.arange(a, a + 100, dtype=np.int64))
        t.push(np.arange(a, a + 100, dtype=np.int64), np.ones((100, DIM), np.float32))  # the step advances
    hot = {i for i, loc in t.items() if loc >= 0}
    assert set(range(2600, 3000)) <= hot  # the last 400 touched are resident
    assert not hot & set(range(1000))
    # a pull reads cold rows where they lie (nothing moves); a push brings them back, and they then stay
    before = dict(t.items())
    t.pull(np.arange(0, 50, dtype=np.int64))
    assert dict(t.items()) == before
    t.push(np.arange(0, 50, dtype=np.int64), np.ones((50, DIM), np.float32))
    assert {i for i, loc in t.items() if loc >= 0} >= set(range(50))


def test_tables_share_one_shard_budget(tmp_path) -> None:
    probe = SparseTable(_spec(), 0, 1)
    budget = ResidentBudget(1000 * _row_nbytes(probe))
    a, b = _tiered(budget, tmp_path, name="a"), _tiered(budget, tmp_path, name="b")
    for k in range(0, 2000, 250):
        ids = np.arange(k, k + 250, dtype=np.int64)
        _fill(a, ids)
        _fill(b, ids)
    assert a.resident_rows + b.resident_rows <= 1000 + 250  # each keeps within what the other leaves
    assert a.rows == b.rows == 2000


def test_checkpoint_of_both_tiers_loads_into_any_table(tmp_path) -> None:
    probe = SparseTable(_spec(dtype="bfloat16"), 0, 1)
    budget = ResidentBudget(300 * _row_nbytes(probe))
    t = _tiered(budget, tmp_path / "a", dtype="bfloat16")
    ids = np.arange(1200, dtype=np.int64)
    _fill(t, ids)
    t.push(ids[::3], np.ones((400, DIM), np.float32))
    snap = t.export_state()
    assert len(snap["ids"]) == 1200 and t.cold_rows > 0
    plain = SparseTable(_spec(dtype="bfloat16"), 0, 1)  # all in RAM
    plain.load_state(snap)
    _same(plain.export_state(), snap)
    other = _tiered(ResidentBudget(300 * _row_nbytes(probe)), tmp_path / "b", dtype="bfloat16")
    other.load_state(snap)  # rows beyond the budget go straight to the disk tier
    assert other.resident_rows <= 300 and other.cold_rows >= 900
    _same(other.export_state(), snap)
    np.testing.assert_array_equal(other.pull(ids)[0], plain.pull(ids)[0])


def test_eviction_counts_rows_of_both_tiers_and_frees_their_room(tmp_path) -> None:
    probe = SparseTable(_spec(), 0, 1)
    budget = ResidentBudget(200 * _row_nbytes(probe))
    t = _tiered(budget, tmp_path, eviction=EvictionSpec(max_rows=600))
    for a in range(0, 3000, 100):
        ids = np.arange(a, a + 100, dtype=np.int64)
        t.pull(ids)
        t.push(ids, np.ones((100, DIM), np.float32))
        assert t.rows <= 600
    assert t.evicted == 2400
    assert {i for i, _ in t.items()} == set(range(2400, 3000))  # LRU over both tiers
    assert t.cold_rows + t.resident_rows == 600
    # the freed slots and rows were reused: the cold tier's file stopped growing
    assert t.memory_stats().disk_bytes <= 2 * t._cold.payload.chunk_rows * t._cold.payload.row_nbytes


def test_replicated_rows_land_in_a_tiered_backup(tmp_path) -> None:
    """apply_delta (a backup following its primary) into a table with a budget: the backup's rows
    equal the primary's (reference: the primary's export)."""
    primary = SparseTable(_spec(), 0, 1)
    deltas = []
    ids = np.arange(900, dtype=np.int64)
    primary.push(ids, np.zeros((900, DIM), np.float32))
    primary.track_evictions = True
    for k in range(3):
        p = primary.prepare_push(ids[k::3], np.full((300, DIM), 0.5, np.float32))
        primary.apply_push(p, before_swap=lambda r, d: deltas.append((d, r.version)))
    probe = SparseTable(_spec(), 0, 1)
    backup = _tiered(ResidentBudget(200 * _row_nbytes(probe)), tmp_path)
    backup.load_state({**primary.export_state(), "values": primary.export_state()["values"]})
    for d, step in deltas:  # re-applying is idempotent: the rows are set, not updated
        backup.apply_delta(d, step)
    _same(backup.export_state(), primary.export_state())


def test_export_of_a_tiered_table_is_a_frozen_stream(tmp_path) -> None:
    """With rows on disk, export_state does not materialize the table: values and state are
    TieredRows (resident rows copied, the disk tier cloned on disk), read block by block. Pushes
    after the export do not change it. Reference: np.asarray of an export taken at the same moment
    from an all-in-RAM table given the same requests."""
    from ps.table import TieredRows

    probe = SparseTable(_spec(), 0, 1)
    ref = SparseTable(_spec(), 0, 1)
    t = _tiered(ResidentBudget(500 * _row_nbytes(probe)), tmp_path)
    ids = np.arange(3000, dtype=np.int64)
    for tab in (t, ref):
        _fill(tab, ids)
        tab.push(ids[::2], np.ones((1500, DIM), np.float32))
    snap, want = t.export_state(), ref.export_state()
    assert isinstance(snap["values"], TieredRows) and isinstance(snap["state"]["sum"], TieredRows)
    for tab in (t, ref):  # the live table moves on (rows come back, others go, values change)
        tab.pull(ids[:1000])
        tab.push(ids[:1000], np.full((1000, DIM), 3.0, np.float32))
    TieredRows.BLOCK_ROWS, saved = 700, TieredRows.BLOCK_ROWS  # several blocks, mixed tiers in each
    try:
        blocks = list(snap["values"].blocks())
    finally:
        TieredRows.BLOCK_ROWS = saved
    assert len(blocks) == 5
    np.testing.assert_array_equal(np.concatenate(blocks), want["values"])
    np.testing.assert_array_equal(np.asarray(snap["state"]["sum"]), want["state"]["sum"])
    np.testing.assert_array_equal(snap["versions"], want["versions"])
