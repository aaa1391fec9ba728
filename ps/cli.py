"""``tessera ps ...``: run a shard, print cluster stats, or try a local cluster."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

from ps.client import PSClient
from tessera.service import (
    ClientSecurity,
    ConfigError,
    add_client_security_args,
    add_server_security_args,
    client_security_from,
    server_security_from,
)
from ps.config import ShardConfig
from ps.shard import ShardStats

__all__ = ["add_ps_commands", "start_local_shards", "stop_processes", "read_first_line"]


def add_ps_commands(sub: Any) -> None:
    ps = sub.add_parser("ps", help="parameter server shards").add_subparsers(dest="ps_command", required=True)

    s = ps.add_parser("serve", help="run one shard server (until SIGTERM)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port (0: pick a free one and print it)")
    s.add_argument("--shard-index", type=int, default=0)
    s.add_argument("--num-shards", type=int, default=1)
    d = ShardConfig()
    s.add_argument(
        "--max-bytes", type=int, default=d.max_bytes,
        help=f"bound on what the tables hold: params, optimizer state, indexes (default {d.max_bytes >> 30} GiB; 0: none)",
    )
    s.add_argument("--max-tables", type=int, default=d.max_tables, help=f"tables per shard (default {d.max_tables})")
    s.add_argument("--max-workers", type=int, default=d.max_workers, help=f"members a shard remembers (default {d.max_workers})")
    s.add_argument("--max-lease", type=float, default=d.max_lease_s, metavar="SECONDS", help=f"longest lease a worker may ask for (default {d.max_lease_s:g})")
    s.add_argument(
        "--forget-after", type=float, default=d.forget_after_s, metavar="SECONDS",
        help="forget a member dead this long (default 0: 10 x --lease)",
    )
    s.add_argument("--chunk-elems", type=int, default=1 << 18, help="dense wire chunk in elements")
    s.add_argument("--threads", type=int, default=64, help="RPC worker threads (BSP/SSP pulls hold one while they wait)")
    s.add_argument("--lease", type=float, default=10.0, help="seconds a silent worker stays in the sync set (default 10)")
    s.add_argument(
        "--torch-threads", type=int, default=1,
        help="intra-op threads for the optimizer math (default 1; 0 keeps torch's default, one per core)",
    )
    s.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    s.add_argument("--checkpoint-dir", default="", help="write checkpoints here (on request, periodically, at SIGTERM)")
    s.add_argument("--checkpoint-every", type=float, default=0.0, metavar="SECONDS", help="periodic checkpoints (0: none)")
    s.add_argument("--checkpoint-keep", type=int, default=3, help="newest checkpoints kept (default 3)")
    s.add_argument("--restore", action="store_true", help="start from the newest valid checkpoint in --checkpoint-dir")
    s.add_argument(
        "--backup-of", default="", metavar="HOST:PORT",
        help="run as the backup of that primary: mirror it, take over when it is gone (clients use --ps PRIMARY|BACKUP)",
    )
    s.add_argument("--advertise", default="", metavar="HOST:PORT", help="backup: the address its primary dials (default --host:port)")
    s.add_argument("--failover", type=float, default=2.0, metavar="SECONDS", help="backup: take over after the primary was unreachable this long")
    s.add_argument(
        "--solo-after", type=float, default=10.0, metavar="SECONDS",
        help="primary: after losing its backup, refuse writes this long (it may re-attach), then go on alone",
    )
    s.add_argument(
        "--push-idle-timeout", type=float, default=30.0, metavar="SECONDS",
        help="abort a push stream that sent no chunk for this long (default 30)",
    )
    s.add_argument(
        "--peer-identity", default="replica",
        help="the identity in --token-file whose token this shard uses to reach its primary/backup (default replica)",
    )
    add_server_security_args(s)
    s.set_defaults(func=_serve)

    c = ps.add_parser("checkpoint", help="checkpoint every shard at one BSP clock (a consistent cut)")
    c.add_argument("--ps", required=True, help="HOST:PORT,... of every shard, in shard order")
    c.add_argument("--at-clock", type=int, default=None, help="BSP clock to cut at (default: the highest reached; -1: now, uncoordinated)")
    c.add_argument("--timeout", type=float, default=120.0)
    add_client_security_args(c)
    c.set_defaults(func=_checkpoint)

    r = ps.add_parser("reshard", help="re-spread one checkpoint of every shard over another number of shards")
    r.add_argument("--from", dest="src", required=True, help="checkpoint directories of shards 0..S-1 (comma-separated, in order)")
    r.add_argument("--to", dest="dst", required=True, help="checkpoint directories of the new shards 0..N-1 (comma-separated)")

    st = ps.add_parser("stats", help="print per-shard tables, sizes and request counts")
    st.add_argument("--ps", required=True, help="HOST:PORT,... of every shard, in shard order")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_client_security_args(st)
    st.set_defaults(func=_stats)

    r.set_defaults(func=_reshard)

    q = ps.add_parser("quickstart", help="start local shards, train a toy table on them, print stats, stop")
    q.add_argument("--shards", type=int, default=2)
    q.add_argument("--steps", type=int, default=200)
    q.set_defaults(func=_quickstart)


def _checkpoint(args: argparse.Namespace) -> int:
    addresses = [a for a in args.ps.split(",") if a]
    with PSClient(addresses, timeout=args.timeout, retries=2, security=client_security_from(args)) as client:
        for i, (path, clock) in enumerate(client.checkpoint(args.at_clock)):
            print(f"shard {i}: {path} (clock {clock})")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from ps.checkpoint import load_latest, reshard, write_checkpoint

    snaps = []
    for d in [x for x in args.src.split(",") if x]:
        snap, path, skipped = load_latest(d)
        for bad, why in skipped:
            print(f"skipped {bad}: {why}", file=sys.stderr)
        if snap is None:
            print(f"no valid checkpoint in {d}", file=sys.stderr)
            return 1
        snaps.append(snap)
    dst = [x for x in args.dst.split(",") if x]
    for d, snap in zip(dst, reshard(snaps, len(dst))):
        print(f"shard {snap.shard_index}/{snap.num_shards}: {write_checkpoint(d, snap)}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import torch

    from ps.server import serve

    if args.torch_threads > 0:
        # torch's default (an OpenMP pool of one thread per core in every shard process) oversubscribes
        # the host as soon as shards or the client share cores; 1 MiB chunks gain little from it anyway
        torch.set_num_threads(args.torch_threads)
    cfg = ShardConfig(
        shard_index=args.shard_index, num_shards=args.num_shards, host=args.host, port=args.port,
        max_bytes=args.max_bytes, chunk_elems=args.chunk_elems, workers=args.threads, lease_s=args.lease,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every_s=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep,
        push_idle_timeout_s=args.push_idle_timeout, backup_of=args.backup_of, advertise=args.advertise,
        max_tables=args.max_tables, max_workers=args.max_workers, max_lease_s=args.max_lease, forget_after_s=args.forget_after,
        failover_s=args.failover, solo_after_s=args.solo_after,
    )
    security = server_security_from(args, default_roles=("worker",))
    peer = ClientSecurity(
        tls_ca=args.tls_ca or args.tls_cert, tls_cert=args.tls_cert if args.tls_ca else None,
        tls_key=args.tls_key if args.tls_ca else None,
        token=(security.tokens or {}).get(args.peer_identity),
    )
    try:
        serve(cfg, ready_file=args.ready_file, restore=args.restore, security=security, peer=peer)
    except ConfigError as e:
        print(f"tessera-ps: {e}", file=sys.stderr)
        return 2
    return 0


def format_stats(stats: list[ShardStats], addresses: list[str]) -> str:
    lines = []
    for addr, s in zip(addresses, stats):
        reqs = ", ".join(f"{k}={v}" for k, v in sorted(s.requests.items())) or "-"
        errs = ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items())) or "-"
        lines.append(
            f"shard {s.shard_index}/{s.num_shards} at {addr}  up {s.uptime_s:.0f}s  in {s.bytes_in / 1e6:.1f} MB  out {s.bytes_out / 1e6:.1f} MB"
        )
        lines.append(f"  requests: {reqs}")
        lines.append(f"  errors:   {errs}")
        if s.workers:
            ws = ", ".join(f"{w.name}@{w.clock}{'' if w.live else ' (gone)'}" for w in s.workers)
            lines.append(f"  workers:  {ws}  (leases expired: {s.leases_expired})")
        lines.append(f"  {'table':<20} {'kind':<7} {'rows':>10} {'elements':>12} {'param MB':>9} {'state MB':>9} {'version':>8} {'evicted':>8}")
        for t in s.tables:
            lines.append(
                f"  {t.name:<20} {t.kind:<7} {t.rows:>10} {t.elements:>12} {t.param_bytes / 1e6:>9.2f} {t.state_bytes / 1e6:>9.2f} {t.version:>8} {t.evicted:>8}"
            )
    return "\n".join(lines)


def _stats(args: argparse.Namespace) -> int:
    addresses = [a for a in args.ps.split(",") if a]
    with PSClient(addresses, timeout=10, retries=2, security=client_security_from(args)) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in stats], indent=2))
    else:
        print(format_stats(stats, addresses))
    return 0


def start_local_shards(num_shards: int, extra_args: tuple[str, ...] = (), timeout: float = 60.0) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``num_shards`` shard processes on free loopback ports; returns (processes, addresses).

    Each child prints its bound port; we wait (with a deadline) for every one.
    """
    procs: list[subprocess.Popen] = []
    addresses: list[str] = []
    try:
        for i in range(num_shards):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tessera.cli", "ps", "serve", "--shard-index", str(i), "--num-shards", str(num_shards), *extra_args],
                    stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            line = read_first_line(p, deadline)
            if "listening on" not in line:
                raise RuntimeError(f"shard failed to start: {line!r}")
            addresses.append(line.split("listening on ")[1].split()[0])
        return procs, addresses
    except BaseException:
        stop_processes(procs)
        raise


def read_first_line(p: subprocess.Popen, deadline: float) -> str:
    """The child's next stdout line, or why there is none (exited / timed out)."""
    import selectors

    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return p.stdout.readline()
            if p.poll() is not None:
                return f"exited with code {p.returncode}"
    return "timed out"


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _quickstart(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    print(f"starting {args.shards} shard processes on loopback ...")
    procs, addresses = start_local_shards(args.shards)
    try:
        print("shards at", ",".join(addresses))
        with PSClient(addresses) as client:
            rng = np.random.default_rng(0)
            # least squares y = X w + b with w dense on the PS (Adam) and a per-id bias in a sparse table (Adagrad)
            true_w = rng.normal(size=256).astype(np.float32)
            client.create_dense("w", (256,), "adam", lr=0.05)
            client.create_sparse("bias", 1, "adagrad", lr=0.5)
            true_b = rng.normal(size=1000).astype(np.float32)
            bar = tqdm(range(args.steps), desc="quickstart", unit="step", mininterval=0.5)
            t0 = time.perf_counter()
            for step in bar:
                X = rng.normal(size=(64, 256)).astype(np.float32)
                ids = rng.integers(0, 1000, size=64)
                y = X @ true_w + true_b[ids]
                w = client.pull_dense("w")
                b = client.pull_sparse("bias", ids)[:, 0]
                err = X @ w + b - y
                client.push_dense("w", X.T @ err / len(y))
                client.push_sparse("bias", ids, (err / len(y))[:, None])
                bar.set_postfix(loss=f"{float(np.mean(err**2)):.4f}", ex_s=f"{(step + 1) * 64 / (time.perf_counter() - t0):.0f}")
            print(format_stats(client.stats(), addresses))
    finally:
        stop_processes(procs)
    return 0
