"""ps/rowstore.py RowStore against plain numpy arrays: chunks never move, rows come back as
written, released rows are reused before any new chunk, the byte forecast is what gets allocated.
Also the file backing (the disk tier's chunks)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.rowstore import Column, FileBacking, RamBacking, RowStore, chunk_rows_for, huge_empty

pytestmark = pytest.mark.timeout(60)

COLS = [Column("values", torch.bfloat16, 8), Column("sum", torch.float32, 0), Column("version", torch.int64)]


def _store(chunk_rows: int = 64, first_rows: int = 16, backing=None) -> RowStore:
    return RowStore(COLS, chunk_rows, first_rows=first_rows, backing=backing)


def test_rows_round_trip_in_any_order_across_chunks() -> None:
    rng = np.random.default_rng(0)
    s = _store()
    n = 1000
    rows = s.alloc(n)
    assert rows.tolist() == list(range(n))
    ref_v = torch.randn(n, 8).to(torch.bfloat16)
    ref_s = torch.rand(n)
    ref_ver = torch.from_numpy(rng.integers(0, 100, n))
    # scattered in a random order, in two parts
    perm = rng.permutation(n)
    for part in (perm[:400], perm[400:]):
        s.scatter(rows[part], {"values": ref_v[part], "sum": ref_s[part].numpy(), "version": ref_ver[part]})
    q = rng.integers(0, n, 777)  # duplicates allowed when reading
    got = s.gather(q)
    assert torch.equal(got["values"], ref_v[q]) and torch.equal(got["sum"], ref_s[q]) and torch.equal(got["version"], ref_ver[q])
    assert s.num_chunks == -(-n // 64)
    # scalars fill every given row
    s.scatter(np.array([5, 900, 3]), {"sum": 2.5, "version": 7})
    got = s.gather(np.array([3, 5, 900, 4]), ["sum", "version"])
    assert got["sum"].tolist() == [2.5, 2.5, 2.5, float(ref_s[4])]
    assert got["version"].tolist() == [7, 7, 7, int(ref_ver[4])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scatter_of_rows_by_every_path_equals_numpy_assignment(dtype: torch.dtype) -> None:
    """Rows written through a plan (the table's way: rows in chunk order, numpy's per-row item copy for
    float32 / float16 columns), without one (rows in any order, torch's index path where positions are
    a tensor), in one run of consecutive rows, and scalar fills, then read back. Reference: the same
    writes by plain numpy indexing into one (n, width) array per column."""
    rng = np.random.default_rng(1)
    cols = [Column("values", dtype, 8), Column("state", torch.float32, 8), Column("version", torch.int64), Column("admits", torch.int16)]
    s = RowStore(cols, 64, first_rows=16)
    n = 700
    rows = s.alloc(n)
    ref = {"values": torch.zeros(n, 8, dtype=dtype), "state": torch.zeros(n, 8), "version": torch.zeros(n, dtype=torch.int64),
           "admits": torch.zeros(n, dtype=torch.int16)}
    s.scatter(rows, {k: v.clone() for k, v in ref.items()})  # one run of consecutive rows: slices

    def write(at: np.ndarray, planned: bool) -> None:
        data = {"values": torch.randn(len(at), 8).to(dtype), "state": torch.randn(len(at), 8),
                "version": torch.from_numpy(rng.integers(0, 1 << 40, len(at))), "admits": torch.from_numpy(rng.integers(0, 99, len(at)).astype(np.int16))}
        if planned:
            plan = s.plan(rows[at])
            order = torch.from_numpy(plan.order) if plan.order is not None else torch.arange(len(at))
            s.scatter(plan.rows, {k: v.index_select(0, order) for k, v in data.items()}, plan)
        else:
            s.scatter(rows[at], data)
        for k, v in data.items():
            ref[k][torch.from_numpy(at)] = v

    for i in range(12):
        at = rng.choice(n, int(rng.integers(1, 300)), replace=False)
        write(at if i % 3 else np.sort(at), planned=bool(i % 2))
    write(np.arange(10, 74), planned=False)  # a run across a chunk boundary
    s.scatter(rows[[3, 650, 64]], {"state": 1.5, "version": 9})
    ref["state"][[3, 650, 64]] = 1.5
    ref["version"][[3, 650, 64]] = 9
    q = rng.integers(0, n, 2000)
    got = s.gather(rows[q])
    for k, v in ref.items():
        assert torch.equal(got[k], v[torch.from_numpy(q)]), k


def test_chunks_are_never_moved_once_full_size() -> None:
    s = _store(chunk_rows=64, first_rows=16)
    s.alloc(10)
    assert s.capacity == 16  # chunk 0 starts small (a small table stays small) ...
    s.alloc(30)
    assert s.capacity == 64  # ... and doubles up to a full chunk (the only copy ever made)
    s.alloc(100)
    ptrs = [ch.buf.data_ptr() for ch in s._chunks]
    s.scatter(np.arange(140), {"version": torch.arange(140)})
    for _ in range(20):
        s.alloc(64)
    assert [ch.buf.data_ptr() for ch in s._chunks[: len(ptrs)]] == ptrs  # grown by adding chunks only
    assert s.gather(np.arange(140), ["version"])["version"].tolist() == list(range(140))
    assert s.capacity == s.num_chunks * 64


def test_released_rows_are_reused_before_a_new_chunk_and_bytes_are_forecast() -> None:
    """The forecast is what nbytes grows by: a chunk's buffer as allocated (each column aligned) and
    one free-stack slot (8 bytes) per row of capacity; releasing rows allocates nothing."""
    s = _store(chunk_rows=64, first_rows=64)
    s.alloc(64)
    chunk = sum(-(-64 * c.row_nbytes // 64) * 64 for c in COLS) + 64 * 8
    assert s.nbytes == chunk >= 64 * (s.row_nbytes + 8)
    assert s.grow_bytes(1) == chunk and s.alloc_bytes(1) == chunk
    before = s.nbytes
    s.release(np.array([3, 40, 7]))
    assert s.nbytes == before
    assert s.live == 61 and s.alloc_bytes(3) == 0 and s.alloc_bytes(4) == chunk
    again = s.alloc(3)
    assert sorted(again.tolist()) == [3, 7, 40] and s.num_chunks == 1
    assert s.nbytes == before
    forecast = s.alloc_bytes(100)
    s.alloc(100)
    assert s.nbytes - before == forecast == 2 * chunk
    assert s.all_rows().tolist() == list(range(164))
    before = s.nbytes
    s.release(np.arange(0, 164, 2))
    assert s.nbytes == before
    assert s.all_rows().tolist() == list(range(1, 164, 2))
    s.clear()
    assert s.live == 0 and s.alloc(3).tolist() == [0, 1, 2]


def test_chunk_rows_are_a_power_of_two_near_the_target_bytes() -> None:
    assert chunk_rows_for(512) == 65536  # 32 MiB / 512 B
    assert chunk_rows_for(1 << 20) == 1024  # at least lo
    r = chunk_rows_for(600)
    assert r & (r - 1) == 0 and r * 600 <= 32 << 20 < 2 * r * 600


def test_file_backing_holds_rows_and_gives_pages_back(tmp_path) -> None:
    fb = FileBacking(str(tmp_path))
    s = _store(chunk_rows=4096, first_rows=4096, backing=fb)
    n = 10_000
    rows = s.alloc(n)
    vals = torch.randn(n, 8).to(torch.bfloat16)
    s.scatter(rows, {"values": vals, "sum": torch.arange(n, dtype=torch.float32), "version": 1})
    fb.drop_pages()
    got = s.gather(rows[::-1])
    assert torch.equal(got["values"], vals.flip(0)) and got["sum"][0] == n - 1
    assert fb.file_bytes >= s.capacity * s.row_nbytes
    assert not list(tmp_path.iterdir()), "the tier's file is unlinked at once (nothing is left behind)"
    s.close()


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_big_chunks_and_arrays_are_2mib_aligned_and_get_huge_pages_where_the_kernel_has_them() -> None:
    """A big RAM chunk (and the id index's runs) is its own 2 MiB aligned mapping advised MADV_HUGEPAGE;
    small ones stay plain numpy. Where transparent huge pages are on (``madvise`` or ``always``), writing
    one commits huge pages (the figure ``bench/ps_kernel.py`` gains ~10% from)."""
    small = huge_empty(1000, np.int64)
    assert small.base is None and small.dtype == np.int64  # (plain np.empty)
    chunk = RamBacking().allocate(32 << 20)
    assert chunk.dtype == torch.uint8 and chunk.numel() == 32 << 20 and chunk.data_ptr() % (2 << 20) == 0
    keys = huge_empty(3 << 20, np.int64)
    assert keys.shape == (3 << 20,) and keys.ctypes.data % (2 << 20) == 0
    before = _anon_huge_kib()
    chunk.fill_(7)
    keys[:] = np.arange(len(keys))
    assert int(chunk[-1]) == 7 and int(keys[-1]) == len(keys) - 1
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except OSError:
        mode = "never"
    if mode != "never":
        assert _anon_huge_kib() - before >= 32 << 10  # at least the chunk's 32 MiB
