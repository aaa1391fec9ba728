"""Build and run a shard server."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

import grpc

from ps.checkpoint import load_latest
from ps.config import ShardConfig
from ps.replication import BackupFollower
from ps.servicer import METHOD_ROLES, ROLES, SERVICE_NAME, WAITS, PSServicer
from ps.shard import PRIMARY, Shard
from tessera import service
from tessera.bulk import BulkServer, serve_bulk
from tessera.service import Access, ClientSecurity, Limits, ServerSecurity, serving_when

__all__ = ["build_server", "restore_latest", "serve"]

log = logging.getLogger(__name__)

# SIGTERM's drain (see serve)
DRAIN_NOTICE_S = 2.0
DRAIN_GRACE_S = 2.0


def build_server(
    config: ShardConfig, restore: bool = False, security: ServerSecurity | None = None, peer: ClientSecurity | None = None,
) -> tuple[grpc.Server, int, Shard]:
    """A started gRPC server for one shard: (server, bound port, shard), built by the kernel's
    service runtime (TLS / mutual TLS, tokens and roles, per-identity limits, gRPC health).

    Binds ``config.host:config.port`` (port 0 picks a free port). Stop it with
    ``server.stop(grace)``. ``restore``: load the newest valid checkpoint in
    ``config.checkpoint_dir`` first (corrupt or truncated ones are reported and skipped).
    ``security``: who may call (default: open, which the runtime allows on loopback only);
    ``peer``: how this shard reaches its primary or backup (replication).

    With ``config.bulk_port`` >= 0 the same handlers are also served by ``tessera.bulk`` (same
    security, same per-call admission); the shard's Role reply advertises that port, and
    ``shard.close()`` stops it.
    """
    return _build(config, restore, security, peer)[:3]


def _build(
    config: ShardConfig, restore: bool, security: ServerSecurity | None, peer: ClientSecurity | None,
) -> tuple[grpc.Server, int, Shard, BulkServer | None, Access]:
    security = security or ServerSecurity()
    security.check(config.host)  # before anything starts
    shard = Shard(config)
    if restore:
        restore_latest(shard)
    # one admission path for both planes: per-identity shares of the handler threads, waits capped
    # (a replica, the shard's own peer, is not capped per identity: the primary forwards every concurrent mutation)
    # a wait ends by 3 x the longest lease (180 s by default): a dead worker leaves the BSP set by then
    limits = Limits(peer_roles=frozenset({"replica"}), max_wait_s=max(60.0, 3 * config.max_lease_s))
    access = Access(security, METHOD_ROLES, ROLES, waits=WAITS, pool=config.workers, limits=limits)
    servicer = PSServicer(shard, access, peer)
    _protect_live_workers(shard, access)
    bulk = None
    with contextlib.ExitStack() as undo:  # a failure stops what was started
        undo.callback(shard.close)
        server, port, health = service.build_server(
            (servicer.handlers(),), config.host, config.port, security, max_workers=config.workers,
            max_message_bytes=config.max_message_bytes, service_names=(SERVICE_NAME,), name=f"ps{config.shard_index}",
            access=access,
        )
        undo.callback(server.stop, None)
        if config.bulk_port >= 0:
            from tessera.metrics import MetricsInterceptor  # (prometheus_client: loaded where a server is built, as the runtime does)

            bulk = serve_bulk(
                (servicer.handlers(),), config.host, config.bulk_port, security, servicer.access.caller,
                max_message_bytes=config.max_message_bytes, max_connections=config.workers * 4, name=f"ps{config.shard_index}-bulk",
                # counted like the gRPC server's calls (requests, bytes, latency by method and code), as server "psN-bulk"
                interceptors=[MetricsInterceptor(f"ps{config.shard_index}-bulk"), access.interceptor()],
            )
            servicer.bulk_port = bulk.port
            shard.on_close.append(bulk.stop)
        undo.pop_all()
    if config.backup_of:
        follower = BackupFollower(shard, config.advertise or f"{config.host}:{port}", security=peer).start()
        shard.on_close.append(follower.stop)
        # health says SERVING only once the primary has installed its state here (or this backup took
        # over): a compose `service_healthy` dependency on a backup waits for a usable replica
        serving_when(health, lambda: shard.installed.is_set() or shard.role == PRIMARY, (SERVICE_NAME,), stopping=access.stopping)
    return server, port, shard, bulk, access


def _protect_live_workers(shard: Shard, access: Access, every: float = 1.0) -> None:
    """Keep the identities of the shard's live workers protected (Access.protect: a few handler
    threads each that no other identity may take), refreshed every ``every`` seconds until the
    shard closes."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            try:
                bound = shard.names.bindings()
                owners = {access.worker_names.owner(w) or bound.get(w) for w in shard.membership.live()}
                access.protect(o for o in owners if o)
            except Exception:  # noqa: BLE001 - a missed refresh keeps the previous set
                log.exception("shard %d: refreshing the protected identities failed", shard.config.shard_index)

    threading.Thread(target=loop, name=f"ps{shard.config.shard_index}-protect", daemon=True).start()
    shard.on_close.append(stop.set)


def restore_latest(shard: Shard) -> str | None:
    """Load the newest valid checkpoint of ``shard.config.checkpoint_dir`` into ``shard``; its path, or None."""
    root = shard.config.checkpoint_dir
    if not root:
        raise ValueError("--restore needs --checkpoint-dir")
    snap, path, skipped = load_latest(root)
    for bad, why in skipped:
        log.warning("skipped checkpoint %s: %s", bad, why)
        print(f"tessera-ps: skipped checkpoint {bad}: {why}", file=sys.stderr, flush=True)
    if snap is None:
        print(f"tessera-ps: no valid checkpoint in {root}; starting empty", file=sys.stderr, flush=True)
        return None
    shard.restore(snap)
    print(f"tessera-ps: restored {path} (sync clock {snap.sync_clock}, {len(snap.tables)} tables)", file=sys.stderr, flush=True)
    return path


def serve(
    config: ShardConfig, ready_file: str | None = None, restore: bool = False, security: ServerSecurity | None = None,
    peer: ClientSecurity | None = None, on_shard: Callable[[Shard], None] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT. Prints one line ``tessera-ps listening on HOST:PORT`` when ready.
    ``on_shard(shard)`` runs once the shard is built and served (e.g. registers its metrics).

    Draining on SIGTERM: the health service says NOT_SERVING at once, new calls are refused
    (UNAVAILABLE, "... the server is stopping") and every BSP/SSP wait ends the same way, for
    ``DRAIN_NOTICE_S``; then the calls in flight get ``DRAIN_GRACE_S`` to finish; then, with a
    checkpoint directory, a final checkpoint (every acknowledged update is in it) and the process
    exits (about 4 s plus the checkpoint)."""
    security = security or ServerSecurity()
    for warning in security.check(config.host):
        print(f"tessera-ps: {warning}", file=sys.stderr, flush=True)
    server, port, shard, bulk, access = _build(config, restore, security, peer)
    if on_shard is not None:
        on_shard(shard)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    line = f"tessera-ps listening on {config.host}:{port} shard {config.shard_index}/{config.num_shards}"
    if bulk is not None:
        line += f" bulk {bulk.port}"
    print(line, flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{port}\n")
    stop.wait()
    access.drain(f"shard {config.shard_index} received SIGTERM")  # health NOT_SERVING, new calls UNAVAILABLE
    shard.stop_waits()  # waiting pulls end now (UNAVAILABLE): they would hold the exit for their whole wait
    print("tessera-ps: draining (health NOT_SERVING, new calls refused, waits ended)", file=sys.stderr, flush=True)
    time.sleep(DRAIN_NOTICE_S)
    server.stop(grace=DRAIN_GRACE_S).wait()
    if bulk is not None:
        bulk.stop(grace=DRAIN_GRACE_S)  # the calls in flight end first: the final checkpoint has every applied push
    if config.checkpoint_dir:
        try:
            print(f"tessera-ps: final checkpoint {shard.save_checkpoint()}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the previous checkpoint stays valid
            print(f"tessera-ps: final checkpoint failed: {e}", file=sys.stderr, flush=True)
    shard.close()
    print("tessera-ps stopped", file=sys.stderr, flush=True)
