"""GPU worker benchmark (issue 16): how close does a PS worker get to a model whose rows all live on its device?

A CTR step: ``--fields`` id fields x ``--batch`` examples, ``--dim``-wide rows, Zipf(``--zipf``) ids over a
table of R rows (``--rows``, one run per R), an MLP (fields*dim -> 256 -> 64 -> 1), BCE loss; Adagrad on the
rows, Adam on the MLP. Three ways, measured in the same run:

- ``ceiling``: every row on the device (a (R, dim) tensor and its Adagrad accumulator; the batch's unique rows
  looked up as a leaf and updated in place): no PS, no host work.
- ``ps``: the rows on 2 real shards (gRPC on loopback, this process's threads), a ``PSEmbedding`` pulling the
  batch's unique rows every step, pushing their gradients; cache off.
- ``ps+cache``: the same with ``EmbCache`` (``--cache-frac`` of R rows on the device, ``--mode`` rule, K =
  ``--staleness``).

Steps run one after the other (no prefetch overlap), so the time splits cleanly: ``pull`` (ids to the PS and
rows back, host gather), ``h2d`` (rows to the device: with the cache, its lookup and assembly), ``compute``
(forward, backward, MLP optimizer step, synchronised), ``push`` (row gradients to the host and to the PS).
Each of ``--repeats`` blocks of ``--steps`` steps (after ``--warmup`` steps) gives a mean step time; the table
shows the min and median over blocks. ``gpu_ratio``: examples/s of ps+cache over the ceiling (at the first R);
``gpu_ratio_nocache`` the same without the cache; ``cache_hit_rate``: ids served from the device table, per
lookup, in the timed blocks.

Sync mode (the cache's conditional pulls, untimed, ``--sync-steps``): the per-lookup hit rate and the rows
that crossed the wire with the cache on over off, once with every field trained (each step pushes every row
it read: the cache can serve only rows nobody pushed since it pulled them) and once with half of the fields
looked up under no_grad (frozen features, read and never pushed). JSON: ``sync_hit_rate``/``sync_rows_ratio``
(all trained) and ``sync_*_frozenN``.

``--e2e-steps N`` (0: skip) also runs ``tessera worker --task ctr`` end to end against 2 ``tessera ps serve``
processes, with and without ``--emb-cache-rows``, and reports the worker's examples/s.

CPU now: ``python bench/gpu_worker.py --device cpu`` (small defaults). GPU: ``--device cuda`` (defaults 1M and
10M rows, 4096 x 26 ids, 64-dim rows). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ps import PSClient, SyncPolicy
from ps.config import ShardConfig
from ps.server import build_server
from worker.binding import PSEmbedding
from worker.emb_cache import EmbCache

PARTS = ("pull", "h2d", "compute", "push")


class Zipf:
    """Ids with P(rank r) ~ 1/r^s over R rows, ranks scattered over the id space by a fixed permutation."""

    def __init__(self, rows: int, s: float, seed: int) -> None:
        w = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
        self.cdf = np.cumsum(w / w.sum())
        self.perm = np.random.default_rng(seed).permutation(rows).astype(np.int64)
        self.rng = np.random.default_rng(seed + 1)

    def draw(self, shape: tuple[int, ...]) -> np.ndarray:
        r = np.minimum(np.searchsorted(self.cdf, self.rng.random(shape)), len(self.cdf) - 1)
        return self.perm[r]


def mlp(fields: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(fields * dim, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def interleaved_blocks(ways: dict[str, Any], args: argparse.Namespace, warm: Any = None) -> dict[str, list[dict[str, float]]]:
    """Warm every way up, then ``repeats`` rounds of one block of ``steps`` steps per way (interleaved, so
    a noisy neighbour hits them alike); per block the mean step time and its parts (s)."""
    for step in ways.values():
        for _ in range(args.warmup):
            step({p: 0.0 for p in PARTS})
    if warm is not None:
        warm()
    out: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, step in ways.items():
            parts = {p: 0.0 for p in PARTS}
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(parts)
            wall = time.perf_counter() - t0
            out[way].append({"step": wall / args.steps, **{p: v / args.steps for p, v in parts.items()}})
    return out


def ceiling(R: int, args: argparse.Namespace, dev: torch.device) -> Any:
    """Every row on the device: a (R, dim) table with its Adagrad accumulator; per step the batch's unique
    rows as a leaf (as PSEmbedding looks them up), and Adagrad on those rows in place (the shards' update)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(R, args.dim, generator=g) * 0.01).to(dev)
    acc = torch.full((R, args.dim), 0.1, device=dev)
    head = mlp(args.fields, args.dim).to(dev)
    opt_d = torch.optim.Adam(head.parameters(), lr=1e-3)
    zipf = Zipf(R, args.zipf, 0)

    def step(parts: dict[str, float]) -> None:
        ids = torch.from_numpy(zipf.draw((args.batch, args.fields))).to(dev)
        y = (torch.rand(args.batch, device=dev) < 0.3).float()
        t0 = time.perf_counter()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        leaf = weight[uniq].requires_grad_(True)
        loss = F.binary_cross_entropy_with_logits(head(F.embedding(inverse, leaf).flatten(1)).squeeze(1), y)
        opt_d.zero_grad()
        loss.backward()
        opt_d.step()
        with torch.no_grad():
            grad = leaf.grad
            a = acc[uniq].add_(grad * grad)
            acc[uniq] = a
            weight[uniq] = leaf - 0.05 * grad / (a.sqrt() + 1e-10)
        sync(dev)
        parts["compute"] += time.perf_counter() - t0

    return step


def through_ps(
    R: int, args: argparse.Namespace, dev: torch.device, client: PSClient, cache_rows: int, tag: str,
    mode: str | None = None, frozen: int = 0,
) -> tuple[Any, EmbCache | None]:
    """One PS way's step (see the module doc). ``mode``: the cache's rule (default ``--mode``); ``frozen``:
    the last ``frozen`` fields are looked up under no_grad (read, never pushed: frozen features)."""
    client.worker = "bench"
    emb = PSEmbedding(f"gpu{R}{tag}/emb", args.dim, optimizer="adagrad", lr=0.05, initial_accumulator=0.1)
    emb.client = client
    client.create_sparse(emb.table, emb.dim, optimizer=emb.optimizer, init=emb.init)
    cache = EmbCache(cache_rows, args.dim, mode or args.mode, args.staleness, dev) if cache_rows else None
    emb.cache = cache
    head = mlp(args.fields, args.dim).to(dev)
    opt_d = torch.optim.Adam(head.parameters(), lr=1e-3)
    zipf = Zipf(R, args.zipf, 0)
    clock = [0]

    def step(parts: dict[str, float]) -> None:
        ids = torch.from_numpy(zipf.draw((args.batch, args.fields)))
        y = (torch.rand(args.batch, device=dev) < 0.3).float()
        t = clock[0]
        fz = None
        if frozen:  # frozen features: fetched (through the cache) and looked up, no gradient
            ids, fids = ids[:, : args.fields - frozen], ids[:, args.fields - frozen :]
            emb.prefetched(emb.fetch(fids, SyncPolicy(clock=t)))
            with torch.no_grad():
                fz = emb(fids.to(dev))
        t0 = time.perf_counter()
        r = emb.fetch(ids, SyncPolicy(clock=t))
        t1 = time.perf_counter()
        emb.prefetched(r)
        ids_dev = ids.to(dev, non_blocking=True)
        out = emb(ids_dev)  # without the cache: the H2D copy of the rows happens here
        if fz is not None:
            out = torch.cat([out, fz], dim=1)
        sync(dev)
        t2 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(head(out.flatten(1)).squeeze(1), y)
        opt_d.zero_grad()
        loss.backward()
        opt_d.step()
        g = emb.gradients()
        sync(dev)
        t3 = time.perf_counter()
        assert g is not None
        client.push_sparse(g.table, g.ids, g.grads, g.base_versions)
        t4 = time.perf_counter()
        if cache is not None:
            s = cache.stats.seconds
            pulled, assembled = s["pull"] - last[0], s["lookup"] + s["assemble"] - last[1]
            last[0], last[1] = s["pull"], s["lookup"] + s["assemble"]
            other = (t1 - t0) - pulled - assembled  # np.unique etc. on the host
            parts["pull"] += pulled + other
            parts["h2d"] += assembled + (t2 - t1)
        else:
            parts["pull"] += t1 - t0
            parts["h2d"] += t2 - t1
        parts["compute"] += t3 - t2
        parts["push"] += t4 - t3
        clock[0] += 1

    last = [0.0, 0.0]
    return step, cache


def sync_wire(R: int, args: argparse.Namespace, dev: torch.device, addresses: list[str], frozen: int) -> dict[str, float]:
    """Sync-mode cache (conditional pulls), untimed: ``--sync-steps`` steps after ``--warmup``, cache on and
    off on the same ids. Returns the per-lookup hit rate and rows over the wire (cache on / off)."""
    wire = {}
    hit = 0.0
    for rows in (0, max(1, int(R * args.cache_frac))):
        with PSClient(addresses, timeout=120) as c:
            step, cache = through_ps(R, args, dev, c, rows, f"sync{frozen}{'on' if rows else 'off'}", mode="sync", frozen=frozen)
            parts = {p: 0.0 for p in PARTS}
            for _ in range(args.warmup):
                step(parts)
            table = next(iter(c.rows_pulled))
            before = c.rows_pulled[table]
            snap = (cache.stats.lookups, cache.stats.hits) if cache is not None else (0, 0)
            for _ in range(args.sync_steps):
                step(parts)
            wire[rows > 0] = c.rows_pulled[table] - before
            if cache is not None:
                hit = (cache.stats.hits - snap[1]) / max(1, cache.stats.lookups - snap[0])
    return {"hit_rate": hit, "rows_ratio": wire[True] / max(1, wire[False]), "rows_on": wire[True], "rows_off": wire[False]}


def e2e(args: argparse.Namespace, R: int, cache_rows: int) -> float:
    """``tessera worker --task ctr`` against 2 ``tessera ps serve`` processes: the worker's examples/s."""
    from ps.cli import start_local_shards, stop_processes

    procs, addresses = start_local_shards(2)
    try:
        cmd = [sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", "ctr",
               "--task-opt", f"vocab={R}", "--task-opt", f"dim={args.dim}", "--mode", args.mode,
               "--staleness", str(args.staleness), "--steps", str(args.e2e_steps), "--batch-size", str(args.batch),
               "--device", args.device, "--no-progress", "--eval-every", "0"]
        if args.threads:  # as in-process: 2 intra-op threads on a loaded 2-core box run 5-10x slower
            cmd += ["--torch-threads", str(args.threads)]
        if cache_rows:
            cmd += ["--emb-cache-rows", str(cache_rows), "--emb-cache-staleness", str(args.staleness)]
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
        m = re.search(r"([\d,]+) examples/s", p.stderr)
        if p.returncode or not m:
            raise RuntimeError(f"tessera worker failed ({p.returncode}): {p.stderr[-2000:]}")
        return float(m.group(1).replace(",", ""))
    finally:
        stop_processes(procs, grace=3.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=None, help="comma-separated table sizes (default: cuda 1M,10M; cpu 100k)")
    ap.add_argument("--batch", type=int, default=None, help="examples per step (default: cuda 4096; cpu 256)")
    ap.add_argument("--fields", type=int, default=26)
    ap.add_argument("--dim", type=int, default=None, help="row width (default: cuda 64; cpu 16)")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--cache-frac", type=float, default=0.01, help="cache rows as a share of the table's rows")
    ap.add_argument("--mode", default="ssp", choices=["sync", "ssp", "async"], help="the cache's refresh rule")
    ap.add_argument("--staleness", type=int, default=8, help="K")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing (the cache fills)")
    ap.add_argument("--sync-steps", type=int, default=20, help="steps of the (untimed) sync-mode wire count (0: skip)")
    ap.add_argument("--e2e-steps", type=int, default=0, help="also run tessera worker end to end for this many steps")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20k rows, 64 examples, 2 blocks of 3 steps")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: cpu 1, as a loaded 2-core box needs; cuda: torch's)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.batch, args.steps, args.repeats, args.warmup = args.rows or "20000", args.batch or 64, 3, 2, 3
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rows = [int(float(r)) for r in (args.rows or ("1e6,1e7" if cuda else "1e5")).split(",")]
    args.batch = args.batch or (4096 if cuda else 256)
    args.dim = args.dim or (64 if cuda else 16)
    args.threads = args.threads if args.threads is not None else (0 if cuda else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    servers = []
    addresses = []
    for i in range(2):
        server, port, _ = build_server(ShardConfig(shard_index=i, num_shards=2))
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    t_start = time.time()
    results: dict[int, dict[str, Any]] = {}
    sync_rows: dict[str, dict[str, float]] = {}
    try:
        for R in rows:
            with PSClient(addresses, timeout=120) as c_off, PSClient(addresses, timeout=120) as c_on:
                off, _ = through_ps(R, args, dev, c_off, 0, "off")
                on, cache = through_ps(R, args, dev, c_on, max(1, int(R * args.cache_frac)), "on")
                assert cache is not None
                ways = {"ceiling": ceiling(R, args, dev), "ps": off, "ps+cache": on}
                st = cache.stats
                snap: list[int] = []

                def warm(st: Any = st, snap: list[int] = snap) -> None:
                    snap.extend([st.lookups, st.hits, st.rows, st.row_hits])

                blocks = interleaved_blocks(ways, args, warm=warm)
                del ways
            results[R] = {**blocks, "hit_rate": (st.hits - snap[1]) / max(1, st.lookups - snap[0]),
                          "row_hit_rate": (st.row_hits - snap[3]) / max(1, st.rows - snap[2])}
            if cuda:
                torch.cuda.empty_cache()
        if args.sync_steps:  # all fields trained (a step pushes every row it read), then half of them frozen
            for frozen in (0, args.fields // 2):
                sync_rows[f"frozen{frozen}"] = sync_wire(rows[0], args, dev, addresses, frozen)
    finally:
        for s in servers:
            s.stop(0)
    e2e_eps = {}
    if args.e2e_steps:
        R = rows[0]
        e2e_eps = {"off": e2e(args, R, 0), "on": e2e(args, R, max(1, int(R * args.cache_frac)))}

    def med(bs: list[dict[str, float]], k: str) -> float:
        return statistics.median(b[k] for b in bs)

    print(f"\n{args.device}: {args.fields} fields x {args.batch} examples, dim {args.dim}, Zipf({args.zipf}), "
          f"cache {args.cache_frac:.0%} of rows, {args.mode} K={args.staleness}; step ms (min / median of {args.repeats} blocks of {args.steps})")
    print(f"| rows | way | step ms min | step ms median | examples/s | vs ceiling | {' | '.join(PARTS)} |")
    print("|" + " --- |" * (6 + len(PARTS)))
    summary: dict[str, Any] = {}
    for R, r in results.items():
        ceil_eps = args.batch / med(r["ceiling"], "step")
        for way in ("ceiling", "ps", "ps+cache"):
            bs = r[way]
            eps = args.batch / med(bs, "step")
            parts = " | ".join(f"{1e3 * med(bs, p):.2f}" for p in PARTS)
            print(f"| {R:,} | {way} | {1e3 * min(b['step'] for b in bs):.2f} | {1e3 * med(bs, 'step'):.2f} | {eps:,.0f} | {eps / ceil_eps:.3f} | {parts} |")
            summary[f"{way}_eps_{R}"] = round(eps, 1)
            summary[f"{way}_ms_{R}"] = {p: round(1e3 * med(bs, p), 3) for p in ("step", *PARTS)}
        summary[f"cache_hit_rate_{R}"] = round(r["hit_rate"], 4)
        summary[f"cache_row_hit_rate_{R}"] = round(r["row_hit_rate"], 4)
    R0 = rows[0]
    if sync_rows:
        print(f"\nsync mode, cache on vs off ({R0:,} rows, {args.sync_steps} steps after {args.warmup}, conditional pulls)")
        print("| fields frozen (read, not pushed) | hit rate (lookups) | rows over the wire on / off | ratio |")
        print("| --- | --- | --- | --- |")
        for k, v in sync_rows.items():
            print(f"| {k[6:]} of {args.fields} | {v['hit_rate']:.3f} | {v['rows_on']:,} / {v['rows_off']:,} | {v['rows_ratio']:.3f} |")
            summary[f"sync_hit_rate_{k}"] = round(v["hit_rate"], 4)
            summary[f"sync_rows_ratio_{k}"] = round(v["rows_ratio"], 4)
    c0 = summary[f"ceiling_eps_{R0}"]
    out = {
        "device": args.device, "rows": rows, "batch": args.batch, "fields": args.fields, "dim": args.dim,
        "mode": args.mode, "staleness": args.staleness, "cache_frac": args.cache_frac,
        "gpu_ratio": round(summary[f"ps+cache_eps_{R0}"] / c0, 4),
        "gpu_ratio_nocache": round(summary[f"ps_eps_{R0}"] / c0, 4),
        "cache_hit_rate": summary[f"cache_hit_rate_{R0}"],
        "sync_hit_rate": summary.get("sync_hit_rate_frozen0"), "sync_rows_ratio": summary.get("sync_rows_ratio_frozen0"),
        "e2e_eps": e2e_eps, "seconds": round(time.time() - t_start, 1), "quick": args.quick,
        "load": list(os.getloadavg()), **summary,
    }
    if e2e_eps:
        print(f"\ntessera worker end to end ({R0:,} rows, 2 shard processes): {e2e_eps['off']:,.0f} examples/s cache off, "
              f"{e2e_eps['on']:,.0f} cache on")
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
