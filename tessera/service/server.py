"""Building a server: bind ``host:port`` (0 picks one) with TLS, mutual TLS or plaintext, register
the service handlers and the standard gRPC health service (``grpc.health.v1``), admit every call
through the service's :class:`~tessera.service.guard.Access`, count it for Prometheus; return
``(server, port, health servicer)``."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any, Callable, Sequence

import grpc

from tessera.codec import as_bytes
from tessera.rpc import server_options
from tessera.service.errors import BindError
from tessera.service.guard import Access
from tessera.service.tls import ServerSecurity

__all__ = ["build_server", "serving_when"]


class _JoinPacked(grpc.ServerInterceptor):
    """gRPC's serializer for replies a handler gives as a codec.Packed (its pieces, not joined: what
    tessera.bulk sends as they are): joined into bytes, the one copy. Outermost, so the interceptors
    inside (metrics) see the reply as the handler gave it."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        h = continuation(details)
        if h is None or not (h.unary_unary or h.unary_stream or h.stream_unary or h.stream_stream):
            return h
        ser = h.response_serializer

        def serialize(message: Any) -> Any:
            return as_bytes(ser(message) if ser is not None else message)

        return h._replace(response_serializer=serialize)


_JOIN_PACKED = _JoinPacked()


def build_server(
    handlers: Sequence[grpc.GenericRpcHandler], host: str, port: int, security: ServerSecurity,
    max_workers: int = 64, max_message_bytes: int = 64 << 20, service_names: Sequence[str] = (),
    extra_options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[grpc.ServerInterceptor] = (), name: str = "srv",
    access: Access | None = None,
) -> tuple[grpc.Server, int, Any]:
    """A started server: (server, bound port, health servicer). ``security.check(host)`` runs first.

    ``access``: the service's :class:`Access`, which then admits every call (health included)
    before it takes one of the ``max_workers`` handler threads, and whose ``drain()`` sets this
    server's health NOT_SERVING. Every call is counted by the metrics interceptor (refusals too)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tessera.metrics import MetricsInterceptor

    security.check(host)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
        # then every call is counted (requests, bytes, latency by method and code), refusals too
        interceptors=[_JOIN_PACKED, MetricsInterceptor(name), *([access.interceptor()] if access else []), *interceptors],
        options=server_options(max_message_bytes) + list(extra_options),
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for svc in ("", *service_names):
        health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    if access is not None:
        access.health, access.service_names = health_servicer, ("", *service_names)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    creds = security.credentials()
    try:
        bound = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    except RuntimeError:  # grpcio raises this where a bind fails
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot listen on {bind}: the port is in use, or {host} is not an address of this machine "
            "(choose another --port, --port 0 for a free one, or another --host)"
        )
    server.start()
    return server, bound, health_servicer

def serving_when(
    health: Any, ready: Any, service_names: Any = (), period: float = 0.2, stopping: threading.Event | None = None,
) -> threading.Thread:
    """Report NOT_SERVING on ``health`` (the servicer :func:`tessera.service.build_server` returns)
    for ``""`` and ``service_names`` until ``ready()`` is true, then SERVING (checked every
    ``period`` seconds by a daemon thread, which it returns). E.g. a backup shard: ready once it is
    attached to its primary, so that a compose ``service_healthy`` dependency waits for that."""
    from grpc_health.v1 import health_pb2

    names = ("", *service_names)
    for n in names:
        health.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)

    def wait() -> None:
        while not ready():
            if stopping is not None and stopping.is_set():
                return  # draining: NOT_SERVING stays
            time.sleep(period)
        if stopping is not None and stopping.is_set():
            return
        for n in names:
            health.set(n, health_pb2.HealthCheckResponse.SERVING)

    t = threading.Thread(target=wait, name="health-gate", daemon=True)
    t.start()
    return t
