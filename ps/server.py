"""Build and run a shard server."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures

import grpc

from ps.checkpoint import load_latest
from ps.config import ShardConfig
from ps.replication import BackupFollower
from ps.servicer import PSServicer
from ps.shard import Shard
from tessera.rpc import server_options

__all__ = ["build_server", "serve", "restore_latest"]

log = logging.getLogger(__name__)


def build_server(config: ShardConfig, restore: bool = False) -> tuple[grpc.Server, int, Shard]:
    """A started gRPC server for one shard: (server, bound port, shard).

    Binds ``config.host:config.port`` (port 0 picks a free port). Stop it with
    ``server.stop(grace)``. ``restore``: load the newest valid checkpoint in
    ``config.checkpoint_dir`` first (corrupt or truncated ones are reported and skipped).
    """
    shard = Shard(config)
    if restore:
        restore_latest(shard)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=f"ps{config.shard_index}"),
        options=server_options(config.max_message_bytes),
    )
    server.add_generic_rpc_handlers((PSServicer(shard).handlers(),))
    host = f"[{config.host}]" if ":" in config.host else config.host
    port = server.add_insecure_port(f"{host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    server.start()
    if config.backup_of:
        follower = BackupFollower(shard, config.advertise or f"{config.host}:{port}").start()
        shard.on_close.append(follower.stop)
    return server, port, shard


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


def serve(config: ShardConfig, ready_file: str | None = None, restore: bool = False) -> None:
    """Run until SIGTERM/SIGINT. Prints one line ``tessera-ps listening on HOST:PORT`` when ready.

    With a checkpoint directory, SIGTERM writes a final checkpoint after the calls in flight end."""
    server, port, shard = build_server(config, restore)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    line = f"tessera-ps listening on {config.host}:{port} shard {config.shard_index}/{config.num_shards}"
    print(line, flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{port}\n")
    stop.wait()
    server.stop(grace=2).wait()
    if config.checkpoint_dir:
        try:
            print(f"tessera-ps: final checkpoint {shard.save_checkpoint()}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the previous checkpoint stays valid
            print(f"tessera-ps: final checkpoint failed: {e}", file=sys.stderr, flush=True)
    shard.close()
    print("tessera-ps stopped", file=sys.stderr, flush=True)
