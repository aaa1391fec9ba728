"""A/B of the dense push path between two checkouts: wall time and shard CPU per call, interleaved.

Starts one shard process from each checkout (``--before`` and ``--after``, each put first on the
shard's PYTHONPATH), creates the same dense table on both, and times, alternating between the two
for every call: push_dense, pull_dense and push_dense(return_params=True), per optimizer (which side
goes first flips every round). Alternating call by call puts both sides under the same load from
elsewhere (on a shared machine the minutes differ far more than the code does). Per call: wall
time (min and median) and the shard process's CPU time (utime + stime from /proc, Linux; median;
10 ms ticks, so use 64 MiB and >= 10 repeats).
Both sides must end with the same values (checked; printed as max |before - after|).

``--shards N`` starts N shard processes per side (the table split over them; the CPU column is
then the sum over a side's shards). ``--echo`` also times, in the same alternation, the raw gRPC
bidi-stream echo of the same bytes (bench/ps_throughput.py's ``grpc_stream``, its own server
process) and torch's fused Adam on the same tensor in this process, and prints per side the
ratios bench/ps_throughput.py reports, for the fused way (push_dense(return_params=True)):
``dense_sgd_ratio`` = echo time / SGD fused time and ``adam_limit_ratio`` = (echo time + fused
Adam time) / Adam fused time, from the minimum times and from the medians.

Run::

    git worktree add /tmp/before <commit>    # or any copy of the older tree
    python bench/dense_push_ab.py --before /tmp/before --after . --mib 64 --repeats 15
    python bench/dense_push_ab.py --before /tmp/before --ways fused --echo --shards 2

Each side's shards run with the side's tree as their working directory (``python -m`` puts the
working directory first on sys.path: started from a checkout, both sides would run that checkout).

It prints a table and, as its last line, one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the older checkout (its root)")
    ap.add_argument("--after", default=os.path.dirname(HERE), help="the newer checkout (default: this one)")
    ap.add_argument("--mib", type=int, default=64, help="dense table size in MiB of float32 (default 64)")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per way and side, after one warm-up (default 15)")
    ap.add_argument("--opts", default="adam,sgd", help="optimizers, comma separated (default adam,sgd)")
    ap.add_argument("--ways", default="push,pull,fused", help="calls timed, comma separated (default push,pull,fused)")
    ap.add_argument("--shards", type=int, default=1, help="shard processes per side (default 1)")
    ap.add_argument("--echo", action="store_true", help="also time the raw gRPC echo and torch's fused Adam; print the ratios")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.after))
    import numpy as np

    from ps.cli import read_first_line, stop_processes
    from ps.client import PSClient

    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    procs: dict[str, list[subprocess.Popen]] = {}
    addrs: dict[str, list[str]] = {}
    echo_procs: list[subprocess.Popen] = []
    echo = None
    numel = args.mib << 18
    opts = [o for o in args.opts.split(",") if o]
    grad = np.random.default_rng(2).standard_normal(numel, dtype=np.float32) * np.float32(1e-3)
    out = np.empty(numel, np.float32)
    res: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    try:
        for side, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
            for i in range(args.shards):
                p = subprocess.Popen(
                    [sys.executable, "-m", "tessera.cli", "ps", "serve", "--shard-index", str(i), "--num-shards", str(args.shards)],
                    stdout=subprocess.PIPE, text=True, env=env, cwd=tree,  # `-m` puts the cwd first on sys.path
                )
                procs.setdefault(side, []).append(p)
                line = read_first_line(p, time.monotonic() + 60)
                if "listening on" not in line:
                    raise RuntimeError(f"{side} shard failed to start: {line!r}")
                addrs.setdefault(side, []).append(line.split("listening on ")[1].split()[0])
        clients = {side: PSClient(a, timeout=300) for side, a in addrs.items()}
        if args.echo:
            sys.path.insert(0, HERE)
            import ps_throughput

            echo = ps_throughput.StreamEcho(ps_throughput.spawn_echo("grpc", echo_procs), numel * 4)
            adam_ms = min(ps_throughput.bench_adam_math(numel, args.repeats, 1).times) * 1e3
        for c in clients.values():
            c.wait_ready()
            for o in opts:
                c.create_dense(f"ab_{o}", (numel,), o, lr=1e-3)
        all_ways = {
            "push": lambda c, n: c.push_dense(n, grad),
            "pull": lambda c, n: c.pull_dense(n, out=out),
            "fused": lambda c, n: c.push_dense(n, grad, return_params=True, out=out),
        }
        ways = {w: all_ways[w] for w in args.ways.split(",") if w}
        echo_t: list[float] = []
        sides = list(trees)
        for i in range(args.repeats + 1):
            for o in opts:
                for way, fn in ways.items():
                    for side in (sides if i % 2 else sides[::-1]):  # ABBA: neither side always goes first
                        c0, t0 = sum(_cpu_s(p.pid) for p in procs[side]), time.perf_counter()
                        fn(clients[side], f"ab_{o}")
                        wall, cpu = time.perf_counter() - t0, sum(_cpu_s(p.pid) for p in procs[side]) - c0
                        if i:  # the first round is the warm-up
                            res.setdefault((o, way, side), []).append((wall, cpu))
                    if echo is not None:
                        t0 = time.perf_counter()
                        echo()
                        if i:
                            echo_t.append(time.perf_counter() - t0)
        diff = max(float(np.abs(clients["before"].pull_dense(f"ab_{o}") - clients["after"].pull_dense(f"ab_{o}")).max()) for o in opts)
        for c in clients.values():
            c.close()
    finally:
        if echo is not None:
            echo.close()
        stop_processes([p for ps_ in procs.values() for p in ps_] + echo_procs)
    if diff:
        print(f"the two sides' values differ (max |before - after| = {diff})", file=sys.stderr)
    print(f"\n{args.mib} MiB float32, {args.shards} shard(s) per side, {args.repeats} calls per way and side (alternating); "
          f"max |before - after| = {diff}\n")
    print(f"{'opt':6} {'way':6} {'side':7} {'wall ms min':>11} {'wall ms med':>11} {'shard cpu ms med':>16}")
    summary: dict[str, object] = {"mib": args.mib, "repeats": args.repeats, "shards": args.shards, "max_abs_diff": diff}
    for (o, way, side), v in res.items():
        walls, cpus = [x[0] * 1e3 for x in v], [x[1] * 1e3 for x in v]
        w_min, w_med, c_med = min(walls), statistics.median(walls), statistics.median(cpus)
        print(f"{o:6} {way:6} {side:7} {w_min:11.1f} {w_med:11.1f} {c_med:16.1f}")
        key = f"{o}_{way}_{side}"
        summary.update({f"{key}_wall_ms_min": round(w_min, 2), f"{key}_wall_ms_median": round(w_med, 2), f"{key}_shard_cpu_ms_median": round(c_med, 1)})
    if echo_t:
        e_min, e_med = min(echo_t) * 1e3, statistics.median(echo_t) * 1e3
        print(f"\nraw gRPC stream echo of the same bytes: {e_min:.1f} ms min, {e_med:.1f} ms median; torch fused Adam {adam_ms:.1f} ms")
        summary.update({"echo_wall_ms_min": round(e_min, 2), "echo_wall_ms_median": round(e_med, 2), "torch_fused_adam_ms": round(adam_ms, 2)})
        for side in trees:
            for o, label in (("sgd", "dense_sgd_ratio"), ("adam", "adam_limit_ratio")):
                got = res.get((o, "fused", side))
                if not got:
                    continue
                walls = [x[0] * 1e3 for x in got]
                extra = adam_ms if o == "adam" else 0.0
                r_min, r_med = (e_min + extra) / min(walls), (e_med + extra) / statistics.median(walls)
                print(f"{side:7} {label} (fused) {r_min:.3f} from the minimum times, {r_med:.3f} from the medians")
                summary.update({f"{side}_{label}": round(r_min, 4), f"{side}_{label}_median": round(r_med, 4)})
    print(json.dumps(summary, sort_keys=True))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
