"""tessera ps ...: run a shard, checkpoint or reshard a cluster, print cluster stats, or try a local cluster."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ps.config import ShardConfig
from tessera.argtypes import address_arg, shard_list_arg
from ps.errors import (DeadlineExceededError, InvalidArgumentError, PermissionDeniedError, PSError, ShardUnavailableError,
                       TableExistsError, UnauthenticatedError)
from tessera.service import (ClientSecurity, ConfigError, Diagnosis, ServerUnreachableError, UsageError,
                             add_client_security_args, add_server_security_args, client_security_from, server_security_from,
                             wait_for_server)

if TYPE_CHECKING:  # the PS client loads torch: imported where used, so the parser is built without it
    from ps.client import PSClient
    from ps.shard import ShardStats

__all__ = ["add_ps_commands", "check_shards", "explain_error", "format_stats", "is_internal_table", "read_first_line",
           "start_local_shards", "stop_processes", "wait_for_shards"]


def add_ps_commands(sub: Any) -> None:
    ps = sub.add_parser("ps", help="parameter server shards").add_subparsers(dest="ps_command", required=True)

    s = ps.add_parser("serve", help="run one shard server (until SIGTERM)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port (0: pick a free one and print it)")
    s.add_argument(
        "--bulk-port", type=int, default=0, metavar="PORT",
        help="also serve the data calls over tessera's bulk transport on this port (default 0: a free one; -1: off); "
        "clients find it through the shard and use it instead of gRPC for pulls, pushes and steps",
    )
    s.add_argument("--shard-index", type=int, default=0, help="which shard this is, 0..num-shards-1 (workers list shards in this order in --ps)")
    s.add_argument("--num-shards", type=int, default=1, help="how many shards the cluster has (every shard and --ps must agree)")
    d = ShardConfig()
    s.add_argument(
        "--max-bytes", type=int, default=d.max_bytes,
        help=f"bound on what the tables hold: params, optimizer state, indexes (default {d.max_bytes >> 30} GiB; 0: none)",
    )
    s.add_argument(
        "--max-resident-bytes", type=int, default=0, metavar="BYTES",
        help="RAM the sparse tables' rows may take on this shard; the least recently used rows beyond it "
             "live in memory-mapped files under --spill-dir (0: every row in RAM)",
    )
    s.add_argument("--spill-dir", default="", help="directory for the disk tier's files (default: the system temp dir)")
    s.add_argument("--max-tables", type=int, default=d.max_tables, help=f"tables per shard (default {d.max_tables})")
    s.add_argument("--max-workers", type=int, default=d.max_workers, help=f"members a shard remembers (default {d.max_workers})")
    s.add_argument("--max-lease", type=float, default=d.max_lease_s, metavar="SECONDS", help=f"longest lease a worker may ask for (default {d.max_lease_s:g})")
    s.add_argument(
        "--forget-after", type=float, default=d.forget_after_s, metavar="SECONDS",
        help="forget a member dead this long (default 0: 10 x --lease)",
    )
    s.add_argument("--chunk-elems", type=int, default=1 << 18, help="dense wire chunk in elements (float32: 4 bytes each)")
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
        "--backup-of", default="", metavar="HOST:PORT", type=address_arg("--backup-of", allow_empty=True),
        help="run as the backup of that primary: mirror it, take over when it is gone (clients use --ps PRIMARY|BACKUP)",
    )
    s.add_argument("--advertise", default="", metavar="HOST:PORT", type=address_arg("--advertise", allow_empty=True), help="backup: the address its primary dials (default --host:port)")
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
    from tessera.metrics import add_metrics_args

    add_metrics_args(s)
    s.set_defaults(func=_serve)

    c = ps.add_parser("checkpoint", help="checkpoint every shard at one BSP clock (a consistent cut)")
    c.add_argument("--ps", required=True, type=shard_list_arg(), help="HOST:PORT,... of every shard, in shard order")
    c.add_argument("--at-clock", type=int, default=None, help="BSP clock to cut at (default: the highest reached; -1: now, uncoordinated)")
    c.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS", help="deadline of each shard's checkpoint call")
    add_client_security_args(c)
    c.set_defaults(func=_checkpoint)

    r = ps.add_parser("reshard", help="re-spread one checkpoint of every shard over another number of shards")
    r.add_argument("--from", dest="src", required=True, help="checkpoint directories of shards 0..S-1 (comma-separated, in order)")
    r.add_argument("--to", dest="dst", required=True, help="checkpoint directories of the new shards 0..N-1 (comma-separated)")

    st = ps.add_parser("stats", help="print per-shard tables, sizes and request counts")
    st.add_argument("--ps", required=True, type=shard_list_arg(),
                    help="HOST:PORT,... of every shard, in shard order; PRIMARY|BACKUP for a replicated shard")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table (every table and counter, as the shards report them)")
    st.add_argument(
        "--all", action="store_true",
        help="also show internal tables (e.g. PREFIX/ready, the mark worker 0 sets when the tables are seeded) and raw error counts",
    )
    st.add_argument("--wait", type=float, default=30.0, metavar="SECONDS", help="how long to wait for a shard that is not reachable (yet)")
    add_client_security_args(st)
    st.set_defaults(func=_stats)

    r.set_defaults(func=_reshard)

    q = ps.add_parser("quickstart", help="start local shards, train a toy table on them, print stats, stop")
    q.add_argument("--shards", type=int, default=2, help="shard processes to start on loopback")
    q.add_argument("--steps", type=int, default=200, help="training steps of the toy least-squares model")
    q.set_defaults(func=_quickstart)


def _checkpoint(args: argparse.Namespace) -> int:
    from ps.client import PSClient

    addresses = [a for a in args.ps.split(",") if a]
    security = client_security_from(args)
    wait_for_shards(addresses, security, timeout=10.0, say=lambda text: print(f"tessera ps checkpoint: {text}", file=sys.stderr))
    with PSClient(addresses, timeout=args.timeout, retries=2, security=security) as client:
        check_shards(client, addresses)
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
    import ctypes
    import ctypes.util

    import torch

    from ps.server import serve

    # cap glibc's malloc arenas at 2 (its default is 8 per core). Each handler thread that frees a request's
    # buffers into an arena of its own keeps that memory out of the others' reach, so a shard with 64 handler
    # threads held tens of MiB more than its tables (--max-bytes and --max-resident-bytes count table bytes).
    # No-op where the C library is not glibc.
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    if args.torch_threads > 0:
        # torch's default (an OpenMP pool of one thread per core in every shard process) oversubscribes
        # the host as soon as shards or the client share cores; 1 MiB chunks gain little from it anyway
        torch.set_num_threads(args.torch_threads)
    cfg = ShardConfig(
        shard_index=args.shard_index, num_shards=args.num_shards, host=args.host, port=args.port, bulk_port=args.bulk_port,
        max_bytes=args.max_bytes, chunk_elems=args.chunk_elems, workers=args.threads, lease_s=args.lease,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every_s=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep,
        push_idle_timeout_s=args.push_idle_timeout, backup_of=args.backup_of, advertise=args.advertise,
        max_tables=args.max_tables, max_workers=args.max_workers, max_lease_s=args.max_lease, forget_after_s=args.forget_after,
        failover_s=args.failover, solo_after_s=args.solo_after,
        max_resident_bytes=args.max_resident_bytes, spill_dir=args.spill_dir,
    )
    security = server_security_from(args, default_roles=("worker",))
    peer = ClientSecurity(
        tls_ca=args.tls_ca or args.tls_cert, tls_cert=args.tls_cert if args.tls_ca else None,
        tls_key=args.tls_key if args.tls_ca else None,
        token=(security.tokens or {}).get(args.peer_identity),
    )
    on_shard = _watch_shard_metrics(args, security) if args.metrics_port else None
    try:
        serve(cfg, ready_file=args.ready_file, restore=args.restore, security=security, peer=peer, on_shard=on_shard)
    except ConfigError as e:
        print(f"tessera-ps: {e}", file=sys.stderr)
        return 2
    return 0


def _watch_shard_metrics(args: argparse.Namespace, security: Any) -> Callable[[Any], None]:
    """--metrics-port: serve Prometheus metrics behind the shard's own security (TLS as the shard
    has it; with tokens, a reader or admin token); returns what registers the shard's own figures
    (ShardCollector over Shard.stats()) once ps.server has built the shard."""
    from prometheus_client import REGISTRY

    from tessera.metrics import ShardCollector, start_from_args

    start_from_args(args, what="tessera-ps", security=security)
    return lambda shard: REGISTRY.register(ShardCollector(shard))


def is_internal_table(name: str) -> bool:
    """Tables the trainer keeps for itself (``PREFIX/ready``: worker 0's mark that the model's
    tables are created and seeded); ``tessera ps stats`` hides them unless ``--all``."""
    return name.endswith(("/ready", "/clock"))


def replication_lines(s: ShardStats, members: dict[str, ShardStats | str] | None = None) -> list[str]:
    """What ``tessera ps stats`` says of a shard's replication: its role and epoch, whether a backup
    is attached (replication is synchronous: an attached backup took every update the primary
    acknowledged, so attached means in sync), and for ``members`` (the other servers of a
    replicated ``--ps`` entry, each its own stats or why it could not be asked) their role and
    whether the primary holds them as its backup."""
    head = f"  replication: {s.role}, epoch {s.epoch}"
    if s.role == "backup":  # asked directly
        head += f", mirrors {s.backup_of}"
    elif s.backup:
        head += f"; backup {s.backup} attached, in sync (every acknowledged update is on both)"
    else:
        head += "; no backup attached"
    if s.backups_lost:
        head += f"; backups lost: {s.backups_lost}"
    lines = [head]
    for addr, m in (members or {}).items():
        if isinstance(m, str):
            lines.append(f"  member {addr}: not reachable ({m})")
        elif m.role == "backup":
            state = "attached, in sync" if s.backup == addr else "not attached (attaching, or its primary lost it)"
            lines.append(f"  member {addr}: backup of {m.backup_of}, epoch {m.epoch}, {state}")
        else:
            lines.append(f"  member {addr}: primary, epoch {m.epoch}" + ("" if m.epoch >= s.epoch else " (stale: a newer primary took over)"))
    return lines


def format_stats(stats: list[ShardStats], addresses: list[str], show_all: bool = True,
                 members: list[dict[str, ShardStats | str]] | None = None) -> str:
    """The stats of every shard as a text table. ``show_all=False`` hides internal tables. (A
    DescribeTable that finds no table, as workers polling for worker 0's tables get, is not an
    error on the shard, so a healthy run shows none.) ``members``: per shard, the stats of the
    other servers of a replicated entry (:func:`replication_lines`)."""
    lines = []
    for i, (addr, s) in enumerate(zip(addresses, stats, strict=True)):
        reqs = ", ".join(f"{k}={v}" for k, v in sorted(s.requests.items())) or "-"
        errs = ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items())) or "-"
        lines.append(
            f"shard {s.shard_index}/{s.num_shards} at {addr}  up {s.uptime_s:.0f}s  in {s.bytes_in / 1e6:.1f} MB  out {s.bytes_out / 1e6:.1f} MB"
        )
        lines.extend(replication_lines(s, members[i] if members else None))
        lines.append(f"  requests: {reqs}")
        lines.append(f"  errors:   {errs}")
        if s.workers:
            ws = ", ".join(f"{w.name}@{w.clock}{'' if w.live else ' (gone)'}" for w in s.workers)
            lines.append(f"  workers:  {ws}  (name@clock; leases expired: {s.leases_expired})")
        lines.append(f"  {'table':<20} {'kind':<7} {'rows':>10} {'elements':>12} {'param MB':>9} {'state MB':>9} {'version':>8} {'evicted':>8}")
        for t in s.tables:
            if not show_all and is_internal_table(t.name):
                continue
            lines.append(
                f"  {t.name:<20} {t.kind:<7} {t.rows:>10} {t.elements:>12} {t.param_bytes / 1e6:>9.2f} {t.state_bytes / 1e6:>9.2f} {t.version:>8} {t.evicted:>8}"
            )
            if t.kind == "sparse" and t.row_dtype:
                lines.append(
                    f"    memory: {t.row_dtype} rows, {t.bytes_per_row:.1f} B/row held (payload {t.payload_bytes_per_row}), "
                    f"index {t.index_bytes / 1e6:.2f} MB, metadata {t.metadata_bytes / 1e6:.2f} MB, held {t.held_bytes / 1e6:.2f} MB; "
                    f"resident {t.resident_rows} rows, cold {t.cold_rows} rows, disk {t.disk_bytes / 1e6:.2f} MB"
                )
                lines.append(f"    pushes: {t.row_path}")
    lines.append("version: updates applied to the table (staleness counts these versions, not steps)")
    lines.append("memory: B/row held = RAM the table holds per live row, every overhead included; payload = values + optimizer state")
    return "\n".join(lines)


def _stats(args: argparse.Namespace) -> int:
    from ps.client import PSClient

    addresses = [a for a in args.ps.split(",") if a]
    security = client_security_from(args)
    wait_for_shards(addresses, security, timeout=args.wait, say=lambda text: print(f"tessera ps stats: {text}", file=sys.stderr))
    with PSClient(addresses, timeout=10, retries=2, security=security) as client:
        stats = check_shards(client, addresses)
    members = [_members(spec, s, security) for spec, s in zip(addresses, stats, strict=True)]
    if args.json:
        print(json.dumps([{**dataclasses.asdict(s), "members": {a: m if isinstance(m, str) else dataclasses.asdict(m)
                                                                 for a, m in ms.items()}}
                          for s, ms in zip(stats, members, strict=True)], indent=2))
    else:
        print(format_stats(stats, addresses, show_all=args.all, members=members))
    return 0


def _members(spec: str, answered: ShardStats, security: ClientSecurity | None) -> dict[str, ShardStats | str]:
    """Each server of a replicated ``--ps`` entry ``A|B``, asked on its own (Stats is answered by
    a backup too): its stats, or why it could not be asked. {} for a single server."""
    from ps.client import PSClient

    replicas = [a for a in spec.split("|") if a]
    out: dict[str, ShardStats | str] = {}
    if len(replicas) < 2:
        return out
    for a in replicas:
        try:
            with PSClient([a], timeout=5, retries=1, retry_timeout=5, security=security) as one:
                out[a] = one.stats()[0]
        except PSError as e:
            out[a] = " ".join(str(e).split())[:200]
    return out


def wait_for_shards(
    addresses: list[str], security: ClientSecurity | None, timeout: float,
    say: Callable[[str], None] | None = None, every: float = 5.0,
) -> None:
    """Wait until every shard (any replica of ``"A|B"``) accepts connections, at most ``timeout``
    seconds for each; ``say(text)`` is called every ``every`` seconds while one is not reachable.
    Raises the kernel's TransportSecurityError at once on a TLS mismatch, ServerUnreachableError
    (naming the shard and why) at the deadline."""
    for i, spec in enumerate(addresses):
        replicas = [a for a in spec.split("|") if a]
        t0 = time.monotonic()
        deadline, said = t0 + timeout, t0
        while True:
            last: ServerUnreachableError | None = None
            for a in replicas:
                def on_wait(waited: float, d: Diagnosis, a: str = a, i: int = i) -> None:
                    if say is not None:
                        say(f"waiting for shard {i} at {a} ({waited:.0f} s of {timeout:g}): {d.message}")

                try:
                    left = max(0.1, deadline - time.monotonic())
                    if len(replicas) == 1:
                        wait_for_server(a, security, timeout=left, on_wait=on_wait, every=every)
                    else:  # any replica will do: look at each in turn
                        wait_for_server(a, security, timeout=min(left, 1.0))
                    last = None
                    break
                except ServerUnreachableError as e:
                    last = e
            if last is None:
                break
            d = last.diagnosis
            now = time.monotonic()
            if now >= deadline:
                why = d.message if d is not None and d.kind != "ok" else "it accepts TCP connections but no gRPC connection was made"
                raise ServerUnreachableError(f"shard {i} ({spec}) not reachable within {timeout:.3g} s: {why}", d) from None
            if say is not None and len(replicas) > 1 and now - said >= every:
                said = now
                say(f"waiting for shard {i} at {spec} ({now - t0:.0f} s of {timeout:g}): none of its servers answers"
                    + (f"; {replicas[-1]}: {d.message}" if d is not None else ""))


def check_shards(client: PSClient, addresses: list[str]) -> list[ShardStats]:
    """Refuse (UsageError) a ``--ps`` list that does not match the shards: shard k must be at
    position k, and the list must name every shard. Returns the shards' stats."""
    stats = client.stats()
    n = len(addresses)
    for i, st in enumerate(stats):
        if st.num_shards != n or st.shard_index != i:
            raise UsageError(
                f"--ps lists {n} shard{'s' if n != 1 else ''}, but position {i} ({addresses[i]}) is shard "
                f"{st.shard_index} of {st.num_shards}: list all {st.num_shards} shards in shard order "
                f"(the shard started with --shard-index k at position k)"
            )
    return stats


def explain_error(exc: BaseException) -> tuple[str, int] | None:
    """One line and an exit code for a PS error a user can cause (None: not a PS error)."""
    if not isinstance(exc, PSError):
        return None
    msg = str(exc)
    if isinstance(exc, ShardUnavailableError):
        return f"{msg}: is every shard running at the address --ps gives, in shard order? (--retry-timeout waits longer)", 1
    if isinstance(exc, UnauthenticatedError):
        if "TLS" in msg or "certificate" in msg:
            return msg, 2
        return f"{msg}: give a token the shards know (--token-file FILE --identity NAME)", 2
    if isinstance(exc, PermissionDeniedError):
        return f"{msg} (roles are the token file's third column; worker 0 creates the tables, so it needs admin,worker)", 2
    if isinstance(exc, TableExistsError):
        return f"{msg}: these shards hold a table of that name with another spec (another task or model?): use fresh shards", 2
    if isinstance(exc, InvalidArgumentError) and "client assumes" in msg:
        return f"{msg}: --ps must list every shard, in shard order", 2
    if isinstance(exc, DeadlineExceededError):
        return f"{msg}: a wait for the other workers (sync/ssp) or a shard took too long; are all workers running?", 1
    return msg, 1


def start_local_shards(
    num_shards: int, extra_args: tuple[str, ...] = (), timeout: float = 60.0, command: Sequence[str] | None = None,
) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``num_shards`` shard processes on free loopback ports; returns (processes, addresses).

    Each child prints its bound port; we wait (with a deadline) for every one. ``command``: the
    program before ``ps serve`` (default this Python's ``-m tessera.cli``).
    """
    procs: list[subprocess.Popen] = []
    addresses: list[str] = []
    try:
        for i in range(num_shards):
            procs.append(
                subprocess.Popen(
                    [*(command or (sys.executable, "-m", "tessera.cli")), "ps", "serve", "--shard-index", str(i), "--num-shards", str(num_shards), *extra_args],
                    stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            line = read_first_line(p, deadline)
            for _ in range(8):  # lines before it (a shard with --metrics-port says where its metrics are first)
                if "listening on" in line or not line.endswith("\n"):
                    break
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

    from ps.client import PSClient

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
            print(format_stats(client.stats(), addresses, show_all=False))
    finally:
        stop_processes(procs)
    return 0
