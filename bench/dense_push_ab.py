"""A/B of the dense push path between two checkouts: wall time and shard CPU per call, interleaved.

Starts one shard process from each checkout (``--before`` and ``--after``, each put first on the
shard's PYTHONPATH), creates the same dense table on both, and times, alternating between the two
for every call: push_dense, pull_dense and push_dense(return_params=True), per optimizer. Alternating
call by call puts both sides under the same load from elsewhere (on a shared machine the minutes
differ far more than the code does). Per call: wall time (min and median) and the shard process's
CPU time (utime + stime from /proc, Linux; median; 10 ms ticks, so use 64 MiB and >= 10 repeats).
Both shards must end with the same values (checked; printed as max |before - after|).

Run::

    git worktree add /tmp/before <commit>    # or any copy of the older tree
    python bench/dense_push_ab.py --before /tmp/before --after . --mib 64 --repeats 15

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
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.after))
    import numpy as np

    from ps.cli import read_first_line, stop_processes
    from ps.client import PSClient

    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    procs: dict[str, subprocess.Popen] = {}
    addrs: dict[str, str] = {}
    numel = args.mib << 18
    opts = [o for o in args.opts.split(",") if o]
    grad = np.random.default_rng(2).standard_normal(numel, dtype=np.float32) * np.float32(1e-3)
    out = np.empty(numel, np.float32)
    res: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    try:
        for side, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
            p = subprocess.Popen(
                [sys.executable, "-m", "tessera.cli", "ps", "serve", "--shard-index", "0", "--num-shards", "1"],
                stdout=subprocess.PIPE, text=True, env=env,
            )
            procs[side] = p
            line = read_first_line(p, time.monotonic() + 60)
            if "listening on" not in line:
                raise RuntimeError(f"{side} shard failed to start: {line!r}")
            addrs[side] = line.split("listening on ")[1].split()[0]
        clients = {side: PSClient([a], timeout=300) for side, a in addrs.items()}
        for c in clients.values():
            c.wait_ready()
            for o in opts:
                c.create_dense(f"ab_{o}", (numel,), o, lr=1e-3)
        ways = {
            "push": lambda c, n: c.push_dense(n, grad),
            "pull": lambda c, n: c.pull_dense(n, out=out),
            "fused": lambda c, n: c.push_dense(n, grad, return_params=True, out=out),
        }
        for i in range(args.repeats + 1):
            for o in opts:
                for way, fn in ways.items():
                    for side in trees:
                        c0, t0 = _cpu_s(procs[side].pid), time.perf_counter()
                        fn(clients[side], f"ab_{o}")
                        wall, cpu = time.perf_counter() - t0, _cpu_s(procs[side].pid) - c0
                        if i:  # the first round is the warm-up
                            res.setdefault((o, way, side), []).append((wall, cpu))
        diff = max(float(np.abs(clients["before"].pull_dense(f"ab_{o}") - clients["after"].pull_dense(f"ab_{o}")).max()) for o in opts)
        for c in clients.values():
            c.close()
    finally:
        stop_processes(list(procs.values()))
    if diff:
        print(f"the two sides' values differ (max |before - after| = {diff})", file=sys.stderr)
    print(f"\n{args.mib} MiB float32, {args.repeats} calls per way and side (alternating); max |before - after| = {diff}\n")
    print(f"{'opt':6} {'way':6} {'side':7} {'wall ms min':>11} {'wall ms med':>11} {'shard cpu ms med':>16}")
    summary: dict[str, object] = {"mib": args.mib, "repeats": args.repeats, "max_abs_diff": diff}
    for (o, way, side), v in res.items():
        walls, cpus = [x[0] * 1e3 for x in v], [x[1] * 1e3 for x in v]
        w_min, w_med, c_med = min(walls), statistics.median(walls), statistics.median(cpus)
        print(f"{o:6} {way:6} {side:7} {w_min:11.1f} {w_med:11.1f} {c_med:16.1f}")
        key = f"{o}_{way}_{side}"
        summary.update({f"{key}_wall_ms_min": round(w_min, 2), f"{key}_wall_ms_median": round(w_med, 2), f"{key}_shard_cpu_ms_median": round(c_med, 1)})
    print(json.dumps(summary, sort_keys=True))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
