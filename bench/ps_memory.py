"""PS memory benchmark (issue 18): bytes per sparse row, how fast rows are created, and what the
disk tier costs the hot path.

Every memory figure comes from a fresh child process (``--child``), so RSS growth is this
table's and nothing else's:

(a) ``sparse_bytes_per_row_ratio``: RSS growth of a process that creates N rows (default 2M) of
    dim 64 in a ``SparseTable`` with fp32 Adagrad, over the rows' payload (N x 64 x 4 bytes of
    values + as many of Adagrad state). Baseline measured in the same run: a child that
    allocates and fills exactly the payload as two plain numpy arrays (``raw_bytes_per_row_ratio``,
    ~1.0); ``sparse_vs_raw_ratio`` = table growth / raw growth. Also bf16 rows with row-wise
    Adagrad over the same fp32 payload (``bf16_rowwise_bytes_per_row_ratio``) and the peak RSS
    growth seen while filling over the final one (``*_peak_over_final``, sampled every 10 ms).
(b) ``populate_rows_per_s``: rows created per second by ``SparseTable.push`` of fresh ids (zero gradients) in
    batches of 65536 (zeros initializer; ``populate_uniform_rows_per_s``: the uniform one,
    whose counter-based hash costs more), best (min time) and median of repeats over fresh
    tables, and per CPU second of the process (``populate_rows_per_cpu_s``: what a busy machine's
    other load does not change) (500k rows each). Baseline, interleaved with them: ``raw_fill_rows_per_s``, writing the
    same rows' values and state into two fresh numpy arrays in the same batches (page faults and
    memory bandwidth, nothing else); ``populate_vs_raw_fill`` is the ratio.
(c) ``tier_resident_pull_ratio``: pulls of 4096 random resident ids (a hot set that fits the
    budget) from a table 4x its ``max_resident_bytes`` (disk tier on), over the same pulls from
    the same table all in RAM, interleaved, min and median of repeats. ``tier_cold_pull_rows_per_s``:
    pulls of rows that are on disk (read where they lie: a pull moves nothing).

Run::

    python bench/ps_memory.py            # full: 2M rows (~1-2 minutes on 2 cores)
    python bench/ps_memory.py --quick    # smoke: 100k rows (~15 s)
    python bench/ps_memory.py --json-out bench/out/ps_memory.json

Prints a table and, as its last line, one line of JSON. The measuring processes run torch with
one intra-op thread (``--torch-threads``), both sides of every ratio alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1 << 20
DIM = 64
BATCH = 1 << 16


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    k = int(width * done / max(1, total))
    sys.stderr.write(f"\r[{'#' * k}{'.' * (width - k)}] {done}/{total} {what:<40}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss())
            self.stop.wait(0.01)


# ======================================================================== children (fresh processes)
def child_rows(rows: int, dtype: str, optimizer: str, init: str) -> dict[str, Any]:
    """Fill a SparseTable with ``rows`` fresh ids; RSS growth, peak and time (pushes of BATCH ids: rows
    are made by pushes, pulls only read; a zero gradient, so the rows keep their initial values)."""
    import numpy as np

    from ps.config import InitializerSpec, OptimizerSpec, TableSpec
    from ps.table import SparseTable

    t = SparseTable(TableSpec("e", "sparse", dim=DIM, dtype=dtype, optimizer=OptimizerSpec(optimizer, {}),
                              initializer=InitializerSpec(init)), 0, 1)
    ids = np.random.default_rng(0).permutation(np.arange(rows, dtype=np.int64)) * 7919 + 13
    zeros = np.zeros((BATCH, DIM), np.float32)
    t.push(ids[:16], zeros[:16])  # warm: the first chunk, numpy/torch code paths
    start = _rss()
    s = _Sampler()
    s.start()
    t0, c0 = time.perf_counter(), time.process_time()
    for a in range(16, rows, BATCH):
        b = ids[a : a + BATCH]
        t.push(b, zeros[: len(b)])
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    time.sleep(0.05)
    s.stop.set()
    s.join()
    end = _rss()
    m = t.memory_stats()
    return {"growth": end - start, "peak": max(s.peak, end) - start, "seconds": dt, "cpu": cpu, "rows": rows - 16,
            "held_bytes": m.held_bytes, "index_bytes": m.index_bytes, "metadata_bytes": m.metadata_bytes}


def child_raw(rows: int) -> dict[str, Any]:
    """The baseline: the payload as two plain numpy arrays, filled (values, Adagrad state)."""
    import numpy as np

    start = _rss()
    t0 = time.perf_counter()
    values = np.empty((rows, DIM), np.float32)
    state = np.empty((rows, DIM), np.float32)
    for a in range(0, rows, BATCH):  # the same batches as the table's pulls
        values[a : a + BATCH] = 0.0
        state[a : a + BATCH] = 0.0
    dt = time.perf_counter() - t0
    end = _rss()
    return {"growth": end - start, "seconds": dt, "rows": rows, "check": float(values[-1, 0] + state[-1, 0])}


def child_tier(rows: int, repeats: int) -> dict[str, Any]:
    """Resident-row pull rate with the disk tier on (table 4x the budget) vs all in RAM."""
    import numpy as np

    from ps.config import InitializerSpec, OptimizerSpec, TableSpec
    from ps.table import SparseTable
    from ps.tier import ResidentBudget

    spec = TableSpec("e", "sparse", dim=DIM, optimizer=OptimizerSpec("adagrad", {}), initializer=InitializerSpec("uniform"))
    ram = SparseTable(spec, 0, 1)
    probe = SparseTable(spec, 0, 1)
    row_nbytes = probe._store.row_nbytes
    budget = ResidentBudget(rows // 4 * row_nbytes)
    with tempfile.TemporaryDirectory() as d:
        tier = SparseTable(spec, 0, 1, resident_budget=budget, spill_dir=d)
        ids = np.arange(rows, dtype=np.int64) * 7919 + 13
        zeros = np.zeros((BATCH, DIM), np.float32)
        for a in range(0, rows, BATCH):  # rows are made by pushes (pulls only read)
            b = ids[a : a + BATCH]
            ram.push(b, zeros[: len(b)])
            tier.push(b, zeros[: len(b)])
        # the hot set: an eighth of the ids, drawn at random (scattered over the RAM table's chunks,
        # as a real working set is); pushed once more, so it is resident in the tiered table
        hot = np.random.default_rng(2).choice(ids, rows // 8, replace=False)
        for a in range(0, len(hot), BATCH):
            b = np.unique(hot[a : a + BATCH])
            tier.push(b, zeros[: len(b)])
            ram.push(b, zeros[: len(b)])
        assert tier._lookup(np.unique(hot)).min() >= 0, "the hot set must be resident"
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {"ram": [], "tier": []}
        n = 4096
        for r in range(repeats):
            batch = rng.choice(hot, n, replace=False)
            for name, t in (("ram", ram), ("tier", tier)) if r % 2 == 0 else (("tier", tier), ("ram", ram)):
                t0 = time.perf_counter()
                for _ in range(10):
                    t.pull(batch)
                times[name].append((time.perf_counter() - t0) / 10)
        assert tier.cold_rows >= rows // 2, "the tiered table must hold most rows on disk"
        promoted = tier.promoted
        cold_times = []
        cold_pool = np.setdiff1d(ids, hot)[: rows // 2]  # not hot: mostly demoted since
        for _ in range(max(2, repeats // 2)):
            batch = rng.choice(cold_pool, n, replace=False)
            t0 = time.perf_counter()
            tier.pull(batch)
            cold_times.append(time.perf_counter() - t0)
        m = tier.memory_stats()
        tier.close()
    return {"ram": times["ram"], "tier": times["tier"], "cold": cold_times, "rows_per_pull": n,
            "promoted_during_hot": promoted - 0, "resident_rows": m.resident_rows, "cold_rows": m.cold_rows,
            "disk_bytes": m.disk_bytes, "budget": budget.limit, "resident_bytes": m.values_bytes + m.state_bytes}


THREADS = 1


def _run_child(kind: str, **kw: Any) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps({"kind": kind, "threads": THREADS, **kw})]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"child {kind} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child_main(arg: str) -> int:
    kw = json.loads(arg)
    kind = kw.pop("kind")
    import torch

    torch.set_num_threads(int(kw.pop("threads")))
    children: dict[str, Callable[..., dict[str, Any]]] = {"rows": child_rows, "raw": child_raw, "tier": child_tier}
    fn = children[kind]
    print(json.dumps(fn(**kw)))
    return 0


# ======================================================================== shared with ps_throughput
def memory_figures(rows: int, repeats: int, threads: int | None = None) -> dict[str, Any]:
    """The two issue-18 figures bench/ps_throughput.py reports, each with its baseline, from fresh
    child processes: ``sparse_bytes_per_row_ratio`` (RSS growth of ``rows`` fp32 Adagrad rows of
    dim 64 over their payload; baseline ``raw_bytes_per_row_ratio``: the payload as two numpy
    arrays) and ``populate_rows_per_s`` (rows created per second by pulls of fresh ids, min(rows,
    500k) rows, best and median of ``repeats``; baseline ``raw_fill_rows_per_s``, interleaved)."""
    global THREADS
    if threads is not None:
        THREADS = threads
    payload = rows * DIM * 4 * 2
    raw = _run_child("raw", rows=rows)
    fp32 = _run_child("rows", rows=rows, dtype="float32", optimizer="adagrad", init="zeros")
    n = min(rows, 500_000)
    pops, fills = [], []
    for _ in range(repeats):
        fills.append(_run_child("raw", rows=n)["seconds"])
        pops.append(_run_child("rows", rows=n, dtype="float32", optimizer="adagrad", init="zeros")["seconds"])
    return {
        "sparse_bytes_per_row_ratio": round(fp32["growth"] / payload, 4),
        "raw_bytes_per_row_ratio": round(raw["growth"] / payload, 4),
        "sparse_bytes_per_row_rows": rows,
        "populate_rows_per_s": round(n / min(pops)),
        "populate_rows_per_s_median": round(n / statistics.median(pops)),
        "raw_fill_rows_per_s": round(n / min(fills)),
    }


# ======================================================================== main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 100k rows, fewer repeats")
    ap.add_argument("--rows", type=int, default=None, help="rows of the memory measurement (default 2M, quick 200k)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of each timed measurement (default 3, quick 2)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads in the measuring processes (default 1: on a busy 2-core box two "
                         "OpenMP threads made the same pull swing from 2 to 20 ms)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child_main(args.child)
    global THREADS
    THREADS = args.torch_threads
    rows = args.rows or (100_000 if args.quick else 2_000_000)
    repeats = args.repeats or (2 if args.quick else 3)
    tier_rows = max(60_000 if args.quick else 250_000, rows // 8)
    payload = rows * DIM * 4 * 2  # fp32 values + fp32 Adagrad state
    steps = 3 + repeats + 1
    done = 0
    _progress(done, steps, "raw arrays (baseline)")
    raw_mem = _run_child("raw", rows=rows)
    done += 1
    _progress(done, steps, "fp32 Adagrad table")
    fp32 = _run_child("rows", rows=rows, dtype="float32", optimizer="adagrad", init="zeros")
    done += 1
    _progress(done, steps, "bf16 rows, row-wise Adagrad")
    bf16 = _run_child("rows", rows=rows, dtype="bfloat16", optimizer="rowwise_adagrad", init="zeros")
    done += 1
    # rates: the same number of rows for the table and its baseline, interleaved, fresh processes
    pop_rows = min(rows, 500_000)
    pops, pops_u, raw_fill_s, pops_cpu = [], [], [], []
    for r in range(repeats):
        _progress(done, steps, f"populate repeat {r + 1}/{repeats}")
        raw_fill_s.append(_run_child("raw", rows=pop_rows)["seconds"])
        res = _run_child("rows", rows=pop_rows, dtype="float32", optimizer="adagrad", init="zeros")
        pops.append(res["seconds"])
        pops_cpu.append(res["cpu"])
        pops_u.append(_run_child("rows", rows=pop_rows, dtype="float32", optimizer="adagrad", init="uniform")["seconds"])
        done += 1
    _progress(done, steps, "disk tier: resident vs in-RAM pulls")
    tier = _run_child("tier", rows=tier_rows, repeats=10 * repeats)  # 10 pulls each: cheap, and the box is noisy
    done += 1
    _progress(steps, steps, "done")

    raw_growth = raw_mem["growth"]
    n_pop = pop_rows
    out: dict[str, Any] = {
        "rows": rows, "dim": DIM, "payload_bytes": payload,
        "sparse_bytes_per_row_ratio": round(fp32["growth"] / payload, 4),
        "sparse_bytes_per_row": round(fp32["growth"] / rows, 1),
        "payload_bytes_per_row": DIM * 4 * 2,
        "raw_bytes_per_row_ratio": round(raw_growth / payload, 4),
        "sparse_vs_raw_ratio": round(fp32["growth"] / raw_growth, 4),
        "fp32_peak_over_final": round(fp32["peak"] / fp32["growth"], 4),
        "bf16_rowwise_bytes_per_row_ratio": round(bf16["growth"] / payload, 4),
        "bf16_peak_over_final": round(bf16["peak"] / bf16["growth"], 4),
        "held_bytes_per_row": round(fp32["held_bytes"] / rows, 1),
        "index_bytes_per_row": round(fp32["index_bytes"] / rows, 1),
        "metadata_bytes_per_row": round(fp32["metadata_bytes"] / rows, 1),
        "populate_rows": n_pop,
        "populate_rows_per_s": round(n_pop / min(pops)),
        "populate_rows_per_s_median": round(n_pop / statistics.median(pops)),
        "populate_rows_per_cpu_s": round(n_pop / min(pops_cpu)),
        "populate_uniform_rows_per_s": round(n_pop / min(pops_u)),
        "populate_uniform_rows_per_s_median": round(n_pop / statistics.median(pops_u)),
        "raw_fill_rows_per_s": round(n_pop / min(raw_fill_s)),
        "tier_rows": tier_rows,
        "tier_ram_pull_rows_per_s": round(tier["rows_per_pull"] / min(tier["ram"])),
        "tier_resident_pull_rows_per_s": round(tier["rows_per_pull"] / min(tier["tier"])),
        "tier_resident_pull_ratio": round(min(tier["ram"]) / min(tier["tier"]), 4),
        "tier_resident_pull_ratio_median": round(statistics.median(tier["ram"]) / statistics.median(tier["tier"]), 4),
        "tier_cold_pull_rows_per_s": round(tier["rows_per_pull"] / min(tier["cold"])),
        "tier_cold_rows": tier["cold_rows"], "tier_resident_rows": tier["resident_rows"],
    }
    out["populate_vs_raw_fill"] = round(out["populate_rows_per_s"] / out["raw_fill_rows_per_s"], 4)
    table = [
        ("sparse_bytes_per_row_ratio (fp32 Adagrad, goal <= 1.25)", out["sparse_bytes_per_row_ratio"], f"{out['sparse_bytes_per_row']:.0f} B/row RSS vs {DIM * 8} payload"),
        ("raw numpy arrays (baseline)", out["raw_bytes_per_row_ratio"], f"table/raw {out['sparse_vs_raw_ratio']:.3f}"),
        ("bf16 rows + row-wise Adagrad (goal <= 0.7)", out["bf16_rowwise_bytes_per_row_ratio"], "over the fp32 payload"),
        ("peak / final RSS growth while filling (fp32, bf16)", out["fp32_peak_over_final"], f"{out['bf16_peak_over_final']:.3f}"),
        ("populate_rows_per_s (zeros, goal >= 1M), best", out["populate_rows_per_s"], f"median {out['populate_rows_per_s_median']:,}"),
        ("populate, rows per CPU second (user+sys), best", out["populate_rows_per_cpu_s"], "robust to a busy box"),
        ("populate, uniform initializer, best", out["populate_uniform_rows_per_s"], f"median {out['populate_uniform_rows_per_s_median']:,}"),
        ("raw fill of the same bytes (baseline)", out["raw_fill_rows_per_s"], f"populate/raw {out['populate_vs_raw_fill']:.3f}"),
        ("tier_resident_pull_ratio (goal >= 0.9), best", out["tier_resident_pull_ratio"], f"median {out['tier_resident_pull_ratio_median']:.3f}"),
        ("resident pulls, rows/s: tier / in RAM", out["tier_resident_pull_rows_per_s"], f"{out['tier_ram_pull_rows_per_s']:,}"),
        ("cold pulls (from disk), rows/s", out["tier_cold_pull_rows_per_s"], f"{out['tier_cold_rows']:,} cold / {out['tier_resident_rows']:,} resident"),
    ]
    print(f"\nPS memory, {rows:,} rows x {DIM} (payload {payload / MiB:.0f} MiB fp32 values + Adagrad state)")
    print(f"{'measure':<58} {'value':>12}  note")
    for name, v, note in table:
        print(f"{name:<58} {v:>12,}  {note}" if isinstance(v, int) else f"{name:<58} {v:>12.3f}  {note}")
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
