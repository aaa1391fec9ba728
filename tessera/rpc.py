"""Channel/server options and the retry policy shared by every gRPC component."""
from __future__ import annotations

import random
import time
from typing import Callable, Mapping, TypeVar

import grpc

__all__ = [
    "DEFAULT_MAX_MESSAGE", "server_options", "channel_options", "retry_unavailable", "DelayInterceptor", "status_of",
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
    ]


def status_of(exc: BaseException, table: Mapping[type[BaseException], grpc.StatusCode]) -> grpc.StatusCode:
    """The status code ``table`` gives ``exc``: the first match along its class's MRO; INTERNAL if none."""
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return grpc.StatusCode.INTERNAL


def retry_unavailable(
    fn: Callable[[], T], retries: int = 5, base_delay: float = 0.1, max_delay: float = 2.0, deadline: float | None = None
) -> T:
    """Call ``fn``; on UNAVAILABLE retry with jittered exponential backoff.

    Gives up after ``retries`` retries or when ``deadline`` (time.monotonic())
    would pass; other errors propagate at once.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code != grpc.StatusCode.UNAVAILABLE or attempt >= retries:
                raise
            delay = min(max_delay, base_delay * 2**attempt) * (0.5 + random.random() / 2)
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            attempt += 1


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
