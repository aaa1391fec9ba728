"""Exports (checkpoints) of a tiered sparse table read the disk tier in place: export_state holds
the table's lock only to list the rows and copy the resident ones; the cold rows are read later
from the tier's file itself (no copy of the file), which a hold keeps from being overwritten while
the table goes on serving (demotions go to fresh slots, a backup's update of a cold row brings it
back first, load_state and close leave the held file to the reader). Reference: np.asarray of an
export taken at the same moment from an all-in-RAM table given the same requests."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from ps.config import InitializerSpec, OptimizerSpec, TableSpec
from ps.rowstore import FileBacking
from ps.table import RowDelta, SparseTable, TieredRows
from ps.tier import ResidentBudget

pytestmark = pytest.mark.timeout(60)
DIM = 8


@pytest.fixture(autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_file_copies(monkeypatch):
    """Every disk-tier file made while the test runs: the table's own, and any copy of it (freezing the
    file by copying it, the old way, makes a second one)."""
    made: list[FileBacking] = []
    init = FileBacking.__init__

    def counted(self: FileBacking, *a, **kw) -> None:
        made.append(self)
        init(self, *a, **kw)

    monkeypatch.setattr(FileBacking, "__init__", counted)
    return made


class _SpyLock:
    """The table's lock, recording which threads take it."""

    def __init__(self) -> None:
        self._lock, self.takers = threading.Lock(), set()

    def acquire(self, *a, **kw) -> bool:
        self.takers.add(threading.get_ident())
        return self._lock.acquire(*a, **kw)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "_SpyLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _spec() -> TableSpec:
    return TableSpec("emb", "sparse", dim=DIM, optimizer=OptimizerSpec("adagrad", {"lr": 0.1}),
                     initializer=InitializerSpec("uniform"), seed=5)


def _pair(tmp_path, resident_rows: int = 500) -> tuple[SparseTable, SparseTable]:
    row_nbytes = SparseTable(_spec(), 0, 1)._store.row_nbytes
    t = SparseTable(_spec(), 0, 1, resident_budget=ResidentBudget(resident_rows * row_nbytes), spill_dir=str(tmp_path))
    return t, SparseTable(_spec(), 0, 1)


def _fill(tabs, ids) -> None:
    for tab in tabs:
        tab.push(ids, np.zeros((len(ids), DIM), np.float32))  # rows are made by pushes (pulls only read)
        tab.push(ids[::2], np.ones((len(ids[::2]), DIM), np.float32))


def _check(snap, want) -> None:
    np.testing.assert_array_equal(snap["ids"], want["ids"])
    np.testing.assert_array_equal(np.asarray(snap["values"]), want["values"])
    np.testing.assert_array_equal(np.asarray(snap["state"]["sum"]), want["state"]["sum"])
    np.testing.assert_array_equal(snap["versions"], want["versions"])


def test_reading_an_export_while_the_table_churns_neither_copies_the_file_nor_takes_the_lock(tmp_path, no_file_copies) -> None:
    t, ref = _pair(tmp_path)
    ids = np.arange(4000, dtype=np.int64)
    _fill((t, ref), ids)
    snap, want = t.export_state(), ref.export_state()
    assert isinstance(snap["values"], TieredRows) and t.cold_rows > 3000
    disk0 = t.memory_stats().disk_bytes

    TieredRows.BLOCK_ROWS, saved = 300, TieredRows.BLOCK_ROWS
    got: list[np.ndarray] = []
    t.lock = spy = _SpyLock()
    step = threading.Event()
    done = threading.Event()

    def reader() -> None:  # the checkpoint writer: one block at a time, the table churning between blocks
        for b in snap["values"].blocks():
            got.append(b)
            step.set()
            done.wait(0.01)
        step.set()

    th = threading.Thread(target=reader)
    try:
        th.start()
        rng = np.random.default_rng(0)
        while th.is_alive():  # cold rows come back (their slots freed), others go to disk, values change
            b = np.unique(rng.integers(0, 6000, 700))
            t.pull(b)
            t.push(b, np.full((len(b), DIM), 2.0, np.float32))
            step.wait(1)
            step.clear()
        th.join()
    finally:
        TieredRows.BLOCK_ROWS = saved
        done.set()
    assert len(got) > 5
    assert th.ident not in spy.takers and spy.takers, "the export's reader took the table's lock"
    np.testing.assert_array_equal(np.concatenate(got), want["values"])
    _check(snap, want)
    grown = t.memory_stats().disk_bytes
    # while held, freed slots were not reused: the file grew; once the export is gone they are
    del snap, got
    gc.collect()
    for _ in range(5):
        b = np.unique(np.random.default_rng(1).integers(0, 6000, 700))
        t.pull(b)
        t.push(b, np.full((len(b), DIM), 2.0, np.float32))
    assert t._cold is not None and not t._cold.held
    assert t.memory_stats().disk_bytes == grown >= disk0
    assert len(no_file_copies) == 1, "the disk tier's file was copied"


def test_a_backup_update_load_state_and_close_leave_a_held_export_intact(tmp_path, no_file_copies) -> None:
    t, ref = _pair(tmp_path)
    ids = np.arange(3000, dtype=np.int64)
    _fill((t, ref), ids)
    snap, want = t.export_state(), ref.export_state()
    cold_ids = np.array([i for i, loc in t.items() if loc <= -2][:200], np.int64)
    assert cold_ids.size == 200
    # a backup's update of cold rows (apply_delta) must not write them in place
    vals = np.full((200, DIM), 9.0, np.float32)
    delta = RowDelta(cold_ids, vals, {"sum": np.full((200, DIM), 5.0, np.float32)}, np.full(200, 77, np.int64))
    t.apply_delta(delta, t.step)
    np.testing.assert_array_equal(t.pull(cold_ids)[0], vals)
    _check(snap, want)
    assert len(no_file_copies) == 1, "the disk tier's file was copied"
    # load_state (a restore) while the export is read: the export keeps its file
    t.load_state(ref.export_state())
    _check(snap, want)
    # close while held: the reader still reads
    snap2, want2 = t.export_state(), ref.export_state()
    assert len(no_file_copies) == 2, "the disk tier's file was copied"  # the restored rows' new file, no copy
    t.close()
    _check(snap2, want2)
    _check(snap, want)
