"""Shard server model benchmark: the thread-pool sync gRPC server against ``grpc.aio``.

The same shard (``ps.shard.Shard``) and the same servicer handlers (``PSServicer.handlers()``)
are served two ways, each in its own process on loopback:

- ``sync``: ``grpc.server`` with a thread pool, as ``ps.server.build_server`` runs a shard (via
  ``tessera.service.build_server``);
- ``aio``: ``grpc.aio.server`` with the same (synchronous) handlers run in its
  ``migration_thread_pool`` (the servicer blocks in BSP/SSP waits, so its handlers cannot run on
  the event loop itself without a rewrite of every wait).

Workload, from one ``PSClient`` in this process: (a) sparse pull_sparse + push_sparse of 4096
random ids x 64 (adagrad, 100k rows created first), (b) the same bytes by ``PSClient.step``,
(c) dense push + pull of a 4 MiB Adam table, (d) an empty call (DescribeTable: the per-call
floor), (e) a ctr worker's traffic per step (the ctr task's sizes: a 63,361-float Adam table and
5,400 unique ids x 16 of an Adagrad table) as the trainer makes it today, pulls then pushes, the
tables concurrently ("ctr_separate": 4 calls), and (f) the same by ``PSClient.step`` (1 call). Per workload: wall ms per op (min and median over repeats,
variants interleaved), the client's CPU ms per op (this process, both server models) and the
shard process's CPU ms per op (the OS's per-thread CPU time, /proc/PID/task/*/schedstat).

Run (about 30 s on 2 cores)::

    python bench/ps_server_model.py            # prints a table, then one line of JSON
    python bench/ps_server_model.py --quick

JSON keys: ``{model}_{workload}_ms`` (min), ``..._ms_median``, ``{model}_{workload}_cpu_ms`` and
``aio_vs_sync_{workload}`` (aio wall time / sync wall time, min; < 1: aio faster).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKLOADS = ("sparse_pullpush", "sparse_step", "dense_pushpull", "empty", "ctr_separate", "ctr_step")


def serve(model: str) -> None:
    """A shard (1 of 1, one torch thread as ``tessera ps serve`` runs it) served by ``model``."""
    import torch

    torch.set_num_threads(1)
    from ps.config import ShardConfig
    from ps.servicer import PSServicer
    from ps.shard import Shard
    from tessera.rpc import server_options

    shard = Shard(ShardConfig(shard_index=0, num_shards=1))
    handlers = PSServicer(shard).handlers()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if model == "sync":
        server = grpc_server = __import__("grpc").server(ThreadPoolExecutor(max_workers=64), options=server_options(64 << 20))
        server.add_generic_rpc_handlers((handlers,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(port, flush=True)
        stop.wait()
        grpc_server.stop(0)
        return
    import asyncio

    import grpc

    async def main() -> None:
        server = grpc.aio.server(migration_thread_pool=ThreadPoolExecutor(max_workers=64), options=server_options(64 << 20))
        server.add_generic_rpc_handlers((handlers,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far, at nanosecond resolution (Linux schedstat; the
    /proc/PID/stat ticks of 10 ms are too coarse for one op)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def measure(model: str, repeats: int, warmup: int, rows: int) -> dict[str, Any]:
    import numpy as np

    from ps.client import PSClient

    proc = subprocess.Popen([sys.executable, __file__, "--serve", model], stdout=subprocess.PIPE, text=True)
    try:
        addr = f"127.0.0.1:{proc.stdout.readline().strip()}"  # type: ignore[union-attr]
        rng = np.random.default_rng(0)
        with PSClient([addr], timeout=60) as c:
            c.wait_ready()
            c.create_sparse("s", 64, "adagrad", lr=0.01)
            c.pull_sparse("s", np.arange(rows))
            c.create_dense("d", (1 << 20,), "adam", lr=1e-3)
            c.create_dense("ctr_d", (63_361,), "adam", lr=1e-3)
            c.create_sparse("ctr_e", 16, "adagrad", lr=0.01)
            c.pull_sparse("ctr_e", np.arange(rows))
            cg = rng.standard_normal(63_361, dtype=np.float32) * np.float32(1e-3)
            eg = rng.standard_normal((5400, 16), dtype=np.float32) * np.float32(1e-2)
            cprev = [np.sort(rng.choice(rows, 5400, replace=False))]
            pool = ThreadPoolExecutor(max_workers=2)

            def ctr_separate() -> None:
                ids = np.sort(rng.choice(rows, 5400, replace=False))
                f = pool.submit(c.pull_sparse, "ctr_e", ids, return_versions=True)
                c.pull_dense("ctr_d")
                f.result()
                f = pool.submit(c.push_sparse, "ctr_e", cprev[0], eg)
                c.push_dense("ctr_d", cg)
                f.result()
                cprev[0] = ids

            def ctr_step() -> None:
                ids = np.sort(rng.choice(rows, 5400, replace=False))
                c.step(push_dense={"ctr_d": cg}, push_sparse={"ctr_e": (cprev[0], eg)}, pull_dense=["ctr_d"], pull_sparse={"ctr_e": ids})
                cprev[0] = ids
            g = rng.standard_normal((4096, 64), dtype=np.float32) * np.float32(1e-2)
            dg = rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(1e-3)
            prev = [rng.choice(rows, 4096, replace=False)]

            def pullpush() -> None:
                ids = rng.choice(rows, 4096, replace=False)
                c.pull_sparse("s", ids)
                c.push_sparse("s", ids, g)

            def step() -> None:
                ids = rng.choice(rows, 4096, replace=False)
                c.step(push_sparse={"s": (prev[0], g)}, pull_sparse={"s": ids})
                prev[0] = ids

            def dense() -> None:
                c.push_dense("d", dg)
                c.pull_dense("d")

            def empty() -> None:
                c.describe("d")

            fns: dict[str, Callable[[], None]] = {
                "sparse_pullpush": pullpush, "sparse_step": step, "dense_pushpull": dense, "empty": empty,
                "ctr_separate": ctr_separate, "ctr_step": ctr_step,
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            cpu: dict[str, float] = {k: 0.0 for k in fns}
            ccpu: dict[str, float] = {k: 0.0 for k in fns}  # this process: the client
            for _ in range(warmup):
                for f in fns.values():
                    f()
            for _ in range(repeats):
                for k, f in fns.items():
                    c0 = cpu_seconds(proc.pid)
                    p0 = time.process_time()
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
                    ccpu[k] += time.process_time() - p0
                    cpu[k] += cpu_seconds(proc.pid) - c0
            pool.shutdown()
        return {
            k: {"ms": 1e3 * min(v), "ms_median": 1e3 * statistics.median(v), "cpu_ms": 1e3 * cpu[k] / repeats,
                "client_cpu_ms": 1e3 * ccpu[k] / repeats}
            for k, v in times.items()
        }
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few repeats, 20k rows")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per workload and model (default 40, quick 8)")
    ap.add_argument("--serve", choices=("sync", "aio"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    repeats = args.repeats or (8 if args.quick else 40)
    rows = 20_000 if args.quick else 100_000
    t0 = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    for rnd in range(2):  # sync, aio, then aio, sync: drift of the machine's load hits both
        for model in (("sync", "aio") if rnd == 0 else ("aio", "sync")):
            r = measure(model, repeats // 2 or 1, 2, rows)
            for k, v in r.items():
                cur = res.setdefault(model, {}).setdefault(k, {"ms": [], "ms_median": [], "cpu_ms": [], "client_cpu_ms": []})
                for f in ("ms", "ms_median", "cpu_ms", "client_cpu_ms"):
                    cur[f].append(v[f])
    out: dict[str, Any] = {}
    hdr = (f"{'workload':<17} {'sync ms':>8} {'aio ms':>8} {'sync med':>9} {'aio med':>8} {'sync cpu':>9} {'aio cpu':>8} {'aio/sync':>9}"
           f" {'client cpu':>10}")
    lines = [hdr, "-" * len(hdr)]
    for k in WORKLOADS:
        s, a = res["sync"][k], res["aio"][k]
        sm, am = min(s["ms"]), min(a["ms"])
        out.update({
            f"sync_{k}_ms": round(sm, 3), f"aio_{k}_ms": round(am, 3),
            f"sync_{k}_ms_median": round(statistics.mean(s["ms_median"]), 3), f"aio_{k}_ms_median": round(statistics.mean(a["ms_median"]), 3),
            f"sync_{k}_cpu_ms": round(statistics.mean(s["cpu_ms"]), 3), f"aio_{k}_cpu_ms": round(statistics.mean(a["cpu_ms"]), 3),
            f"aio_vs_sync_{k}": round(am / sm, 4),
            f"client_{k}_cpu_ms": round(statistics.mean(s["client_cpu_ms"] + a["client_cpu_ms"]), 3),
        })
        lines.append(f"{k:<17} {sm:>8.2f} {am:>8.2f} {out[f'sync_{k}_ms_median']:>9.2f} {out[f'aio_{k}_ms_median']:>8.2f} "
                     f"{out[f'sync_{k}_cpu_ms']:>9.2f} {out[f'aio_{k}_cpu_ms']:>8.2f} {am / sm:>9.3f} {out[f'client_{k}_cpu_ms']:>10.2f}")
    for model in ("sync", "aio"):
        out[f"{model}_ctr_step_cpu_saving_ms"] = round(out[f"{model}_ctr_separate_cpu_ms"] - out[f"{model}_ctr_step_cpu_ms"], 3)
    out.update({"repeats": repeats, "rows": rows, "quick": args.quick, "cpus": os.cpu_count(), "wall_s": round(time.perf_counter() - t0, 1),
                "loadavg": round(os.getloadavg()[0], 2)})
    print(f"\nShard server model: one shard process, one client; ms per op (min / median), shard CPU ms per op; "
          f"{repeats} repeats per model; {os.cpu_count()} CPUs, load {out['loadavg']}\n")
    print("\n".join(lines) + "\n")
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
