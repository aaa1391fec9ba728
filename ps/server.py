"""Build and run a shard server."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures

import grpc

from ps.config import ShardConfig
from ps.servicer import PSServicer
from ps.shard import Shard
from tessera.rpc import server_options

__all__ = ["build_server", "serve"]

log = logging.getLogger(__name__)


def build_server(config: ShardConfig) -> tuple[grpc.Server, int, Shard]:
    """A started gRPC server for one shard: (server, bound port, shard).

    Binds ``config.host:config.port`` (port 0 picks a free port). Stop it with
    ``server.stop(grace)``.
    """
    shard = Shard(config)
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
    return server, port, shard


def serve(config: ShardConfig, ready_file: str | None = None) -> None:
    """Run until SIGTERM/SIGINT. Prints one line ``tessera-ps listening on HOST:PORT`` when ready."""
    server, port, shard = build_server(config)
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
    shard.close()
    print("tessera-ps stopped", file=sys.stderr, flush=True)
