"""Channel/server options shared by every gRPC component, and a delay interceptor for experiments."""
from __future__ import annotations

import time
from typing import TypeVar

import grpc

__all__ = [
    "DEFAULT_MAX_MESSAGE", "server_options", "channel_options", "DelayInterceptor",
]

DEFAULT_MAX_MESSAGE = 64 << 20  # bulk data is chunked well below this

T = TypeVar("T")


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        # clients ping every second to find a dead link fast: allow it
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.enable_retries", 0),  # we retry ourselves: only UNAVAILABLE, with backoff
        # a cut link or a killed host fails the calls on it within ~3 s (UNAVAILABLE, retried or
        # failed over) instead of leaving them to their deadline
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC core (1.5x+) times out a ping already in flight (a BDP probe, which the keepalive
        # then waits behind) by this, default 1 minute: without it a stopped peer holds calls
        # to their deadline (tests/multiproc/test_readme_ps_claims.py). 5 s, not 2: a loaded
        # 2-core CI box must not read a slow ack as a dead peer
        ("grpc.http2.ping_timeout_ms", 5000),
    ]


class DelayInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Adds ``seconds`` before every call leaves this client: a slow network link, emulated in
    software (experiments; for a real link delay use ``tc netem`` in a network namespace)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def _delay(self, continuation, details, request):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = _delay
    intercept_stream_unary = intercept_stream_stream = _delay
