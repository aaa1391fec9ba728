"""Shard CPU per step, in process (no gRPC): where a shard's milliseconds go.

Two workloads on one ``ps.shard.Shard`` (one torch thread, as ``tessera ps serve`` runs it):

- ``ctr``: shard 0 of 2 for the ctr task as one worker drives it (``worker/tasks/ctr.py``'s data:
  256 examples x 26 Zipf id fields per step, ~2,700 unique ids on this shard, about half of them
  new rows; a 63,361-float Adam dense table, half of it here; Adagrad rows of dim 16). Each step
  is one ``Step`` of the trainer's shape: push the dense gradient and the previous step's rows,
  pull the dense slice and this step's rows (async).
- ``sparse``: the ``bench/ps_throughput.py`` sparse step on one shard: push 4096 rows x 64 (the
  rows pulled last step), pull 4096 others, of a 100k-row Adagrad table.

Each is run through ``Shard.step`` (the domain: validation, index, row store, optimizer, locks)
and through the servicer's ``Step`` handler as gRPC calls it (``PSServicer.handlers()``: admission,
decode, the domain, encode), on pre-built request bytes. Per workload and path: the calling
thread's CPU time per step (``time.thread_time``: min / median) and the process's minor page faults
per step; then, for ``ctr`` through ``Shard.step``, the time inside the main functions (inclusive,
nested: a breakdown, not a sum).

Run (about 20 s)::

    python bench/ps_shard_cpu.py          # table, then one line of JSON
    python bench/ps_shard_cpu.py --steps 60

To compare two trees, run each tree's copy of this file (``PYTHONPATH`` = that tree).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (module, class or None, function): inclusive thread CPU inside each, for the ctr breakdown
BREAKDOWN = [
    ("ps.shard", "Shard", "_stage"), ("ps.shard", "Shard", "commit_dense"), ("ps.table", "SparseTable", "prepare_push"),
    ("ps.table", "SparseTable", "check_ids"), ("ps.table", "SparseTable", "apply_push"), ("ps.table", "SparseTable", "pull_rows"),
    ("ps.table", "SparseTable", "_make_resident"), ("ps.table", None, "init_rows"), ("ps.index", "HashIndex", "lookup"), ("ps.index", "HashIndex", "insert"),
    ("ps.rowstore", "RowStore", "gather"), ("ps.rowstore", "RowStore", "scatter"), ("ps.optim", "Adagrad", "update"),
]


class _Ctx:
    """What a handler reads from a gRPC context (an open server: no peer identity)."""

    def time_remaining(self) -> float:
        return 60.0

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def auth_context(self) -> dict:
        return {}

    def peer_identities(self) -> None:
        return None

    def set_trailing_metadata(self, md: Any) -> None:
        pass

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(details)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time(fn: Callable[[int], None], first: int, n: int) -> dict[str, float]:
    ts = []
    f0 = _faults()
    for s in range(first, first + n):
        t0 = time.thread_time()
        fn(s)
        ts.append(time.thread_time() - t0)
    return {"ms_min": 1e3 * min(ts), "ms_median": 1e3 * statistics.median(ts), "ms_mean": 1e3 * statistics.fmean(ts),
            "faults": (_faults() - f0) / n}


def run(steps: int, warmup: int) -> dict[str, Any]:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from ps.config import InitializerSpec, OptimizerSpec, ShardConfig, TableSpec
    from ps.partition import SlotMap
    from ps.servicer import PSServicer
    from ps.shard import (
        PULL_DENSE,
        PULL_SPARSE,
        PUSH_DENSE,
        PUSH_SPARSE,
        Shard,
        StepPart,
    )
    from ps.wire import frame
    from tessera.codec import byte_view
    from tessera.v1 import ps_pb2 as pb
    from worker.tasks.ctr import CTRData

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    total = 1 + 2 * (warmup + steps)  # ids for both paths: each path replays fresh steps (new rows)

    # ------------------------------------------------------------------ ctr
    S = 2
    shard = Shard(ShardConfig(shard_index=0, num_shards=S))
    shard.create_table(TableSpec("ctr/dense", "dense", shape=(63_361,), optimizer=OptimizerSpec("adam", {"lr": 1e-3})))
    shard.create_table(TableSpec("ctr/emb", "sparse", dim=16, optimizer=OptimizerSpec("adagrad", {"lr": 0.05, "initial_accumulator": 0.1}),
                                 initializer=InitializerSpec("normal", {"std": 0.01})))  # as worker.binding.PSEmbedding
    slots, data = SlotMap(4096, S), CTRData()

    def ids_for(step: int) -> Any:
        u = np.unique(data.global_batch(step, 512).ids.numpy()[:256].reshape(-1))
        return u[slots.shard_of(u) == 0]

    ids = [ids_for(s) for s in range(total)]
    dg = rng.standard_normal(shard.dense("ctr/dense").length, dtype=np.float32) * np.float32(1e-3)
    gs = [rng.standard_normal((len(x), 16), dtype=np.float32) * np.float32(1e-2) for x in ids]
    shard.step([StepPart("ctr/emb", PULL_SPARSE, ids=ids[0])])

    def ctr_parts(s: int) -> list:
        return [StepPart("ctr/dense", PUSH_DENSE, seq=2 * s, values=dg),
                StepPart("ctr/emb", PUSH_SPARSE, seq=2 * s + 1, values=gs[s - 1], ids=ids[s - 1]),
                StepPart("ctr/dense", PULL_DENSE), StepPart("ctr/emb", PULL_SPARSE, ids=ids[s])]

    def ctr_shard(s: int) -> None:
        shard.step(ctr_parts(s), worker="", client="c")

    for s in range(1, 1 + warmup):
        ctr_shard(s)
    acc: dict[str, float] = {}
    saved = []
    import importlib

    for mod, cls, fn in BREAKDOWN:  # inclusive thread CPU per function (nested calls count in both)
        owner = importlib.import_module(mod) if cls is None else getattr(importlib.import_module(mod), cls)
        f = getattr(owner, fn)
        saved.append((owner, fn, f))

        def wrapped(*a: Any, _f: Callable = f, _k: str = fn if cls is None else f"{cls}.{fn}", **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _f(*a, **k)
            finally:
                acc[_k] = acc.get(_k, 0.0) + time.thread_time() - t0

        setattr(owner, fn, wrapped)
    _time(ctr_shard, 1 + warmup, steps // 4)  # the breakdown: a quarter of the steps, timed separately
    for owner, fn, f in saved:
        setattr(owner, fn, f)
    out["ctr_breakdown_ms"] = {k: round(1e3 * v / (steps // 4), 3) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    first = 1 + warmup + steps // 4
    out["ctr_shard_step"] = _time(ctr_shard, first, steps - steps // 4)
    out["ctr_ids_per_step"] = round(statistics.fmean(len(x) for x in ids[first : first + steps]), 1)

    svc = PSServicer(shard)
    handlers = svc.handlers()
    step_fn = next(h for k, h in handlers._method_handlers.items() if k.endswith("/Step")).unary_unary  # type: ignore[attr-defined]
    ctx = _Ctx()

    def request(parts: list[tuple[Any, list]]) -> bytes:
        head = pb.StepRequest(worker="w0", client="c", dtype="float32")
        at, pieces = 0, []
        for p, bulk in parts:
            for name, x in bulk:
                setattr(p, name, at)
                pieces.append(x)
                at += x.nbytes
            head.parts.append(p)
        return frame(head, data=b"".join(byte_view(x) for x in pieces))

    def ctr_raw(s: int) -> bytes:
        return request([
            (pb.StepPart(table="ctr/dense", op=pb.STEP_OP_PUSH_DENSE, seq=2 * s, count=len(dg)), [("data_at", dg)]),
            (pb.StepPart(table="ctr/emb", op=pb.STEP_OP_PUSH_SPARSE, seq=2 * s + 1, count=len(ids[s - 1]), dim=16, base_at=-1),
             [("ids_at", ids[s - 1]), ("data_at", gs[s - 1])]),
            (pb.StepPart(table="ctr/dense", op=pb.STEP_OP_PULL_DENSE), []),
            (pb.StepPart(table="ctr/emb", op=pb.STEP_OP_PULL_SPARSE, count=len(ids[s])), [("ids_at", ids[s])]),
        ])

    first = 1 + warmup + steps
    raws = {s: ctr_raw(s) for s in range(first, first + steps)}
    shard.step([StepPart("ctr/emb", PULL_SPARSE, ids=ids[first - 1])])  # the first push's rows, pulled
    out["ctr_servicer_step"] = _time(lambda s: step_fn(raws[s], ctx), first, steps)
    out["ctr_table_rows"] = shard.sparse("ctr/emb").rows
    shard.close()

    # ------------------------------------------------------------------ sparse 4096 x 64
    shard = Shard(ShardConfig(shard_index=0, num_shards=1))
    shard.create_table(TableSpec("s", "sparse", dim=64, optimizer=OptimizerSpec("adagrad", {"lr": 0.01})))
    rows = 100_000
    shard.sparse("s").push(np.arange(rows), np.zeros((rows, 64), np.float32))  # rows are made by pushes
    handlers = PSServicer(shard).handlers()
    step_fn = next(h for k, h in handlers._method_handlers.items() if k.endswith("/Step")).unary_unary  # type: ignore[attr-defined]
    g = rng.standard_normal((4096, 64), dtype=np.float32) * np.float32(1e-2)
    sids = [np.sort(rng.choice(rows, 4096, replace=False)) for _ in range(total)]

    def sparse_raw(s: int) -> bytes:
        return request([
            (pb.StepPart(table="s", op=pb.STEP_OP_PUSH_SPARSE, seq=s, count=4096, dim=64, base_at=-1), [("ids_at", sids[s - 1]), ("data_at", g)]),
            (pb.StepPart(table="s", op=pb.STEP_OP_PULL_SPARSE, count=4096), [("ids_at", sids[s])]),
        ])

    def sparse_shard(s: int) -> None:
        shard.step([StepPart("s", PUSH_SPARSE, seq=s, values=g, ids=sids[s - 1]), StepPart("s", PULL_SPARSE, ids=sids[s])], client="c")

    shard.step([StepPart("s", PULL_SPARSE, ids=sids[0])])
    for s in range(1, 1 + warmup):
        sparse_shard(s)
    out["sparse_shard_step"] = _time(sparse_shard, 1 + warmup, steps)
    first = 1 + warmup + steps
    raws = {s: sparse_raw(s) for s in range(first, first + steps)}
    shard.step([StepPart("s", PULL_SPARSE, ids=sids[first - 1])])
    out["sparse_servicer_step"] = _time(lambda s: step_fn(raws[s], ctx), first, steps)
    shard.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="timed steps per workload and path (default 120)")
    ap.add_argument("--warmup", type=int, default=20, help="steps before timing (default 20)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    r = run(args.steps, args.warmup)
    print(f"\nShard CPU per step in process, one torch thread ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}); "
          f"ctr: {r['ctr_ids_per_step']:.0f} ids per step on this shard, {r['ctr_table_rows']:,} rows at the end\n")
    print(f"{'workload / path':<24} {'CPU ms min':>10} {'median':>8} {'mean':>8} {'faults/step':>11}")
    for k in ("ctr_shard_step", "ctr_servicer_step", "sparse_shard_step", "sparse_servicer_step"):
        v = r[k]
        print(f"{k:<24} {v['ms_min']:>10.3f} {v['ms_median']:>8.3f} {v['ms_mean']:>8.3f} {v['faults']:>11.1f}")
    print("\nctr through Shard.step, inclusive CPU ms per step inside (nested: not a sum):")
    for k, v in r["ctr_breakdown_ms"].items():
        print(f"  {k:<28} {v:>7.3f}")
    flat = {f"{k}_{f}": round(v[f], 3) for k, v in r.items() if isinstance(v, dict) and "ms_min" in v for f in v}
    flat.update({"ctr_ids_per_step": r["ctr_ids_per_step"], "ctr_table_rows": r["ctr_table_rows"], "steps": args.steps,
                 "wall_s": round(time.perf_counter() - t0, 1), "loadavg": round(os.getloadavg()[0], 2)})
    print("\n" + json.dumps(flat, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
