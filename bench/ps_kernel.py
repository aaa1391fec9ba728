"""The sparse table's row kernel (issue 32) against today's path and plain torch, in one process.

Workload (the issue's): a 1M x 64 float32 table with row-wise Adagrad, batches of 4,096 Zipf(1.1) ids
(about 1,760 unique rows each). One op = what a shard does for one worker's step of that batch: pull
the batch's unique rows, then push one summed gradient row per unique id (PSClient sums duplicates
before it sends). Variants, interleaved so that load from elsewhere hits them alike:

* ``kernel``: ``SparseTable`` on the row kernel (ps/_rowkernel.c: one compiled pass per request);
* ``numpy``: the same table with ``row_kernel=False`` (today's numpy/torch path, the reference);
* ``torch``: plain torch on one (1M, 64) tensor and a (1M,) accumulator: ``index_select``, the
  row-wise Adagrad update, ``index_copy_`` (one thread: a shard's handler runs on one core);
* ``fbgemm``: FBGEMM's fused CPU table-batched-embedding kernel (``fbgemm-gpu-cpu``, exact row-wise
  Adagrad, forward + backward of the same ids; skipped with the reason where it does not import);
* ``served`` (``--served``): the same table on one shard process (``tessera ps serve`` with no
  transport flag: the default transport), driven by ``PSClient.step`` as a worker does: each op
  pushes the previous batch's summed rows and pulls this batch's unique rows in one call.

Every table starts from the same rows (all 1M created before timing) and the kernel and numpy tables
are checked bit-identical at the end. ``--ab``: also the kernel's C loop against the same loop
compiled by numba (where numba imports), on raw arrays: the tooling choice of the README's
Dependencies section.

``--optimizer adam`` (or ``adamw``, ``ftrl``): the same workload on a table of that optimizer (lazy:
a row's moments and bias correction advance when it is pushed); ``torch`` is then plain torch's
lazy update of that optimizer on whole tensors (as ``ps.optim`` on the gathered rows), and FBGEMM
(row-wise Adagrad only) is skipped.

Run (about 20 s; a minute on a loaded machine): ``python bench/ps_kernel.py`` (``--quick``: 100k rows,
fewer repeats; ``--json-out FILE``). Prints
a table (min and median ms per batch) and, as its last line, one line of JSON with ``kernel_vs_numpy``
(kernel / numpy time, min; < 1 is faster), ``kernel_vs_torch``, and ``kernel_vs_fbgemm`` where FBGEMM ran;
with ``--served`` also ``served_vs_fbgemm`` (goal <= 3) and ``served_vs_kernel``. bench/ps_throughput.py
runs this with ``--served`` and carries those keys in its own JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIM = 64
LR, EPS = 0.01, 1e-8
OPTIMIZERS = {  # the table's optimizer and hyperparameters (--optimizer)
    "rowwise_adagrad": {"lr": LR, "eps": EPS},
    "adam": {"lr": LR, "eps": EPS},
    "adamw": {"lr": LR, "eps": EPS, "weight_decay": 0.01},
    "ftrl": {"lr": LR, "l1": 1e-4, "l2": 1e-4},
}


def batches(rows: int, batch: int, count: int, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids with repeats, unique sorted ids, one summed gradient row per unique id) per batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = (rng.zipf(1.1, batch) - 1) % rows
        g = rng.standard_normal((batch, DIM), dtype=np.float32) * np.float32(1e-2)
        uniq, inv = np.unique(ids, return_inverse=True)
        summed = np.zeros((len(uniq), DIM), np.float32)
        np.add.at(summed, inv, g)
        out.append((ids.astype(np.int64), uniq.astype(np.int64), summed))
    return out


def interleaved(fns: dict[str, Callable[[int], object]], repeats: int, warmup: int) -> dict[str, list[float]]:
    for i in range(warmup):
        for fn in fns.values():
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup, warmup + repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(i)
            times[k].append(time.perf_counter() - t0)
    return times


def table_variants(rows: int, data: list, opt: str = "rowwise_adagrad") -> tuple[dict[str, Callable[[int], object]], Callable[[], None], str]:
    from ps import rowkernel
    from ps.config import InitializerSpec, OptimizerSpec, TableSpec
    from ps.table import SparseTable

    spec = TableSpec("emb", "sparse", dim=DIM, optimizer=OptimizerSpec(opt, OPTIMIZERS[opt]),
                     initializer=InitializerSpec("uniform"), seed=1, num_slots=4096)
    tables = {}
    why = ""
    for name, on in (("kernel", True), ("numpy", False)):
        if on and rowkernel.KERNEL is None:
            why = f"kernel unavailable: {rowkernel.UNAVAILABLE}"
            continue
        t = SparseTable(spec, 0, 1, row_kernel=on)
        if on and t.row_path != "kernel":
            why = f"kernel not used: {t.row_path}"
            t.close()
            continue
        step = 1 << 17
        for lo in range(0, rows, step):  # rows are made by pushes
            ids = np.arange(lo, min(rows, lo + step), dtype=np.int64)
            t.push(ids, np.zeros((len(ids), DIM), np.float32))
        tables[name] = t

    def op(t: SparseTable) -> Callable[[int], object]:
        def run(i: int) -> None:
            _, uniq, summed = data[i]
            t.pull_rows(uniq, checked=True)
            t.push(uniq, summed)
        return run

    def check() -> None:
        if len(tables) < 2:
            return
        a, b = tables["kernel"].export_state(), tables["numpy"].export_state()
        same = np.array_equal(a["values"], b["values"]) and np.array_equal(a["versions"], b["versions"]) and all(
            np.array_equal(a["state"][k], b["state"][k]) for k in a["state"])
        if not same:
            raise SystemExit("bench/ps_kernel.py: error: the kernel's table differs from the numpy path's")

    return {k: op(t) for k, t in tables.items()}, check, why


def torch_variant(rows: int, data: list, opt: str = "rowwise_adagrad") -> Callable[[int], object]:
    import torch

    if opt != "rowwise_adagrad":
        return lazy_torch_variant(rows, data, opt)

    w = torch.rand(rows, DIM) * 0.1
    acc = torch.zeros(rows)

    def run(i: int) -> None:
        _, uniq, summed = data[i]
        idx = torch.from_numpy(uniq)
        w.index_select(0, idx)  # the pull's reply
        g = torch.from_numpy(summed)
        r = w.index_select(0, idx)
        a = acc.index_select(0, idx).add_(g.square().mean(1))
        r.addcmul_(g, a.sqrt().add_(EPS).reciprocal_().mul_(LR)[:, None], value=-1.0)
        w.index_copy_(0, idx, r)
        acc.index_copy_(0, idx, a)
    return run


def lazy_torch_variant(rows: int, data: list, opt: str) -> Callable[[int], object]:
    """Plain torch, one thread: ``index_select`` the rows, their state and per-row step counts,
    ``ps.optim``'s update of ``opt`` on them (per-row steps), ``index_copy_`` them back."""
    import torch

    from ps.config import OptimizerSpec
    from ps.optim import make_optimizer

    o = make_optimizer(opt, OptimizerSpec(opt, OPTIMIZERS[opt]).hparams)
    w = torch.rand(rows, DIM) * 0.1
    state = o.init_state(w)
    steps = torch.zeros(rows, dtype=torch.int64)

    def run(i: int) -> None:
        _, uniq, summed = data[i]
        idx = torch.from_numpy(uniq)
        w.index_select(0, idx)  # the pull's reply
        r = w.index_select(0, idx)
        s = {k: v.index_select(0, idx) for k, v in state.items()}
        st = steps.index_select(0, idx).add_(1)
        o.update(r, torch.from_numpy(summed), s, st.to(torch.float64)[:, None])
        w.index_copy_(0, idx, r)
        for k, v in s.items():
            state[k].index_copy_(0, idx, v)
        steps.index_copy_(0, idx, st)
    return run


def fbgemm_variant(rows: int, data: list) -> tuple[Callable[[int], object] | None, str]:
    try:
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return None, f"fbgemm_gpu does not import: {type(e).__name__}: {str(e)[:120]}"
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR, eps=EPS, pooling_mode=PoolingMode.SUM,  # bags of one id: rows; 5x faster than NONE here
    )
    offs = {len(d[0]): torch.arange(len(d[0]) + 1, dtype=torch.int64) for d in data}

    def run(i: int) -> None:
        ids, _, _ = data[i]
        idx = torch.from_numpy(ids)
        out = emb(idx, offs[len(ids)])
        out.backward(torch.full_like(out, 1e-2))
    return run, ""


def served_variant(rows: int, data: list, opt: str) -> tuple[Callable[[int], object], Callable[[], None]]:
    """(op, stop): one shard process with the same table (rows created before timing), on the
    default transport; an op is one ``PSClient.step`` (push the previous batch, pull this one)."""
    from ps.cli import start_local_shards, stop_processes
    from ps.client import PSClient

    procs, addrs = start_local_shards(1)
    try:
        c = PSClient(addrs, timeout=120)
        c.create_sparse("emb", DIM, opt, **OPTIMIZERS[opt])
        step = 1 << 17
        for lo in range(0, rows, step):
            ids = np.arange(lo, min(rows, lo + step), dtype=np.int64)
            c.push_sparse("emb", ids, np.zeros((len(ids), DIM), np.float32))
    except BaseException:
        stop_processes(procs)
        raise
    prev = [data[0]]

    def run(i: int) -> None:
        _, uniq, _ = data[i]
        _, p_uniq, p_summed = prev[0]
        r = c.step(push_sparse={"emb": (p_uniq, p_summed)}, pull_sparse={"emb": uniq})
        assert r.sparse["emb"][0].shape == (len(uniq), DIM)
        prev[0] = data[i]

    def stop() -> None:
        c.close()
        stop_processes(procs)

    return run, stop


def ab_numba(rows: int, data: list, repeats: int) -> dict[str, object]:
    """The row-wise Adagrad push loop in C (the built kernel, via ctypes) and in numba, on raw arrays."""
    import ctypes

    try:
        import numba
    except ImportError as e:
        return {"ab": f"skipped: numba does not import ({e})"}
    from ps import rowkernel

    if rowkernel.KERNEL is None:
        return {"ab": f"skipped: kernel unavailable ({rowkernel.UNAVAILABLE})"}

    @numba.njit(nogil=True, cache=False, fastmath=False)
    def nb_push(rows_, grad, values, acc, version, lr, eps):  # pragma: no cover - compiled
        dim = values.shape[1]
        for i in range(rows_.shape[0]):
            r = rows_[i]
            s = np.float32(0.0)
            for d in range(dim):
                s += grad[i, d] * grad[i, d]
            a = acc[r] + s / np.float32(dim)
            acc[r] = a
            scale = np.float32(lr) / (np.sqrt(a) + np.float32(eps))
            for d in range(dim):
                values[r, d] -= grad[i, d] * scale
            version[r] += 1

    # each its own arrays: the second of two variants on one batch's rows would find them in cache
    arrays = {k: (np.random.default_rng(0).random((rows, DIM), dtype=np.float32), np.zeros(rows, np.float32), np.zeros(rows, np.int64))
              for k in ("c", "numba")}
    values, acc, version = arrays["numba"]
    t0 = time.perf_counter()
    nb_push(data[0][1], data[0][2], values, acc, version, LR, EPS)
    compile_s = time.perf_counter() - t0
    import torch

    k = rowkernel.KERNEL
    shift = 40  # one chunk: the whole array
    cv, ca, cver = arrays["c"]
    cols = {"values": np.array([cv.ctypes.data], np.int64), "version": np.array([cver.ctypes.data], np.int64),
            "s1": np.array([ca.ctypes.data], np.int64)}
    del ctypes
    fns = {
        "c_ctypes": lambda i: k.push("rowwise_adagrad", {"lr": LR, "eps": EPS}, DIM, shift, data[i][1], torch.from_numpy(data[i][2]), None, cols, 0),
        "numba": lambda i: nb_push(data[i][1], data[i][2], values, acc, version, LR, EPS),
    }
    t = interleaved(fns, repeats, 3)
    return {"ab": {k2: {"min_ms": round(min(v) * 1e3, 4), "median_ms": round(statistics.median(v) * 1e3, 4)} for k2, v in t.items()},
            "numba_compile_s": round(compile_s, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k rows, fewer repeats (a smoke run)")
    ap.add_argument("--ab", action="store_true", help="also the C kernel against numba (where numba imports)")
    ap.add_argument("--served", action="store_true", help="also the same table on one shard process (default transport), by PSClient.step")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad", help="the table's optimizer (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--json-out", default="", help="also write the final JSON line to this file")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a shard's handler: one core per request
    rows = 100_000 if args.quick else 1_000_000
    repeats = args.repeats or (20 if args.quick else 150)
    warmup = 5
    data = batches(rows, 4096, warmup + repeats)
    fns, check, why = table_variants(rows, data, args.optimizer)
    fns["torch"] = torch_variant(rows, data, args.optimizer)
    fb, fb_why = fbgemm_variant(rows, data) if args.optimizer == "rowwise_adagrad" else (None, f"FBGEMM's kernel is row-wise Adagrad, the table {args.optimizer}")
    if fb is not None:
        fns["fbgemm"] = fb
    stop_served = None
    if args.served:
        fns["served"], stop_served = served_variant(rows, data, args.optimizer)
    try:
        t = interleaved(fns, repeats, warmup)
    finally:
        if stop_served is not None:
            stop_served()
    check()
    uniq = statistics.mean(len(d[1]) for d in data)
    print(f"{'variant':<10} {'min ms':>9} {'median ms':>10}   ({rows} x {DIM} fp32, {args.optimizer}, 4096 Zipf(1.1) ids, ~{uniq:.0f} unique, pull + push)")
    for k, v in t.items():
        print(f"{k:<10} {min(v) * 1e3:9.3f} {statistics.median(v) * 1e3:10.3f}")
    out: dict[str, object] = {k: {"min_ms": round(min(v) * 1e3, 4), "median_ms": round(statistics.median(v) * 1e3, 4)} for k, v in t.items()}
    out["unique_rows_per_batch"] = round(uniq, 1)
    out["optimizer"] = args.optimizer
    if why:
        out["kernel"] = why
    if "kernel" in t:
        out["kernel_vs_numpy"] = round(min(t["kernel"]) / min(t["numpy"]), 4)
        out["kernel_vs_numpy_median"] = round(statistics.median(t["kernel"]) / statistics.median(t["numpy"]), 4)
        out["kernel_vs_torch"] = round(min(t["kernel"]) / min(t["torch"]), 4)
        if "fbgemm" in t:
            out["kernel_vs_fbgemm"] = round(min(t["kernel"]) / min(t["fbgemm"]), 4)
            out["kernel_vs_fbgemm_median"] = round(statistics.median(t["kernel"]) / statistics.median(t["fbgemm"]), 4)
        if "served" in t:
            out["served_vs_kernel"] = round(min(t["served"]) / min(t["kernel"]), 4)
    if "served" in t and "fbgemm" in t:
        out["served_vs_fbgemm"] = round(min(t["served"]) / min(t["fbgemm"]), 4)
        out["served_vs_fbgemm_median"] = round(statistics.median(t["served"]) / statistics.median(t["fbgemm"]), 4)
    if fb is None:
        out["fbgemm"] = f"skipped: {fb_why}"
    if args.ab:
        out.update(ab_numba(rows, data, repeats))
    line = json.dumps(out)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
