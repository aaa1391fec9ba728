"""Clients: TLS / mutual TLS / plaintext channels that put the token on every call, and fail at
once with :class:`TransportSecurityError` when client and server disagree about TLS (instead of
retrying UNAVAILABLE); :func:`wait_for_server` waits (bounded) until a server accepts connections."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import grpc

from tessera.rpc import channel_options
from tessera.service.diagnose import Diagnosis, ServerUnreachableError, diagnose
from tessera.service.errors import ERROR_CLASS_HEADER, TransportSecurityError
from tessera.service.tls import ClientSecurity, read_pem
from tessera.service.tokens import TOKEN_HEADER

__all__ = ["channel_ready", "client_channel", "wait_for_server"]


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.metadata = ((TOKEN_HEADER, f"Bearer {token}"),)

    def _add(self, continuation: Callable, details: Any, request: Any) -> Any:
        details = details._replace(metadata=tuple(details.metadata or ()) + self.metadata) if hasattr(details, "_replace") else _Details(details, self.metadata)
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _add


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: Any, extra: tuple) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.metadata = tuple(d.metadata or ()) + extra
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def client_channel(address: str, security: ClientSecurity | None = None, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when ``security.tls_ca`` is set (mutual with tls_cert/key),
    plaintext otherwise; the token, if any, on every call."""
    sec = security or ClientSecurity()
    opts = list(options if options is not None else channel_options())
    if sec.tls_ca:
        if sec.server_name:
            opts.append(("grpc.ssl_target_name_override", sec.server_name))
        creds = grpc.ssl_channel_credentials(
            root_certificates=read_pem(sec.tls_ca),
            private_key=read_pem(sec.tls_key) if sec.tls_key else None,
            certificate_chain=read_pem(sec.tls_cert) if sec.tls_cert else None,
        )
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    # outermost: it sees the calls' outcomes (a mismatch is known before the token matters)
    channel = grpc.intercept_channel(channel, _MismatchInterceptor(address, sec))
    if sec.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(sec.token))
    return channel


class _MismatchInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Turns a transport failure (UNAVAILABLE without a server's error class) that a probe of the
    server explains as a security mismatch into :class:`TransportSecurityError`. The probe runs
    only after such a failure, at most once per ``every`` seconds per channel."""

    def __init__(self, address: str, security: ClientSecurity, every: float = 5.0) -> None:
        self.address, self.security, self.every = address, security, every
        self._lock = threading.Lock()
        self._at = -1e9
        self._last: Diagnosis | None = None

    def check(self, e: BaseException) -> None:
        if not isinstance(e, grpc.RpcError) or isinstance(e, TransportSecurityError):
            return
        code = e.code() if hasattr(e, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            return
        for key, _ in (e.trailing_metadata() if hasattr(e, "trailing_metadata") else None) or ():
            if key == ERROR_CLASS_HEADER:  # the server itself answered UNAVAILABLE (e.g. a backup)
                return
        with self._lock:
            if time.monotonic() - self._at > self.every:
                self._last = diagnose(self.address, self.security)
                self._at = time.monotonic()
            d = self._last
        if d is not None and d.mismatch:
            raise TransportSecurityError(d.message, self.address) from None

    def _unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        # the blocking path hands back a finished outcome; a .future() call is left alone (not waited on)
        if outcome.done() and not outcome.cancelled():
            self.check(outcome.exception())
        return outcome

    def _stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return _CheckedStream(continuation(details, request), self.check)

    intercept_unary_unary = intercept_stream_unary = _unary
    intercept_unary_stream = intercept_stream_stream = _stream


class _CheckedStream:
    """A response stream whose errors pass through ``check`` first (everything else delegated)."""

    def __init__(self, call: Any, check: Callable[[BaseException], None]) -> None:
        self._call, self._check = call, check

    def __iter__(self) -> "_CheckedStream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            self._check(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


def _poller_state(channel: grpc.Channel) -> Any:
    """gRPC's connectivity-poller state of ``channel`` (grpc/_channel.py; an intercepted channel wraps it)."""
    inner = getattr(channel, "_channel", channel)
    return getattr(inner, "_connectivity_state", getattr(channel, "_connectivity_state", None))


def channel_ready(channel: grpc.Channel, timeout: float) -> bool:
    """True once ``channel`` is READY, False after ``timeout`` seconds. The wait's subscription is
    cancelled either way: a leftover one keeps gRPC's connectivity thread polling the channel, and
    closing the channel under that thread kills it with "Channel closed!" (a stray thread traceback
    after a command's one error line)."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        pass
    finally:
        ready.cancel()
    # the poller notices the cancel at its next turn (<= 0.2 s), unless a subscription made while it
    # polled (a wait repeated on the same channel) asked it to connect again: it then runs one more
    # turn and checks the channel, which dies if the caller closed the channel meanwhile (seen under
    # load). A timed-out wait is followed by a close or another wait: return once it stopped.
    state = _poller_state(channel)
    end = time.monotonic() + 1.0
    while state is not None and getattr(state, "polling", False) and time.monotonic() < end:
        time.sleep(0.01)
    return False


def wait_for_server(
    address: str, security: ClientSecurity | None = None, timeout: float = 60.0,
    on_wait: Callable[[float, Diagnosis], None] | None = None, every: float = 5.0,
) -> None:
    """Block until the server at ``address`` accepts a connection (as a client with ``security``),
    at most ``timeout`` seconds. While it waits, ``on_wait(seconds waited, diagnosis)`` is called
    every ``every`` seconds (e.g. to print "nothing is listening there"). Raises
    :class:`TransportSecurityError` as soon as a probe finds a TLS mismatch, and
    :class:`ServerUnreachableError` (the last diagnosis in its message) at the deadline."""
    channel = client_channel(address, security)
    t0 = time.monotonic()
    deadline = t0 + timeout
    said = t0
    try:
        while True:
            if channel_ready(channel, max(0.05, min(1.0, deadline - time.monotonic()))):
                return
            d = diagnose(address, security, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            if d.mismatch:
                raise TransportSecurityError(d.message, address)
            now = time.monotonic()
            if now >= deadline:
                why = d.message if d.kind != "ok" else "it accepts TCP connections but no gRPC connection was made"
                raise ServerUnreachableError(f"{address} not reachable within {timeout:.3g} s: {why}", d)
            if on_wait is not None and now - said >= every:
                said = now
                on_wait(now - t0, d)
    finally:
        channel.close()
