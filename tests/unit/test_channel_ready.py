"""A client's wait for a server leaves no gRPC connectivity thread behind (issue 31 item 9).

``grpc.channel_ready_future`` subscribes to the channel's connectivity; a future that timed out and
was not cancelled keeps gRPC's poller thread ("Thread-N (_run)") watching the channel, and a channel
closed under it kills that thread with "Cannot invoke RPC: Channel closed!": the stray thread report
`tessera worker --ps HOST:PORT` printed after its one error line. Reference: the raw future, which
does leave the poller running (so the test can fail)."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from tessera.service import ServerUnreachableError, channel_ready, client_channel, wait_for_server
from tessera.service.client import _poller_state


def _closed_port() -> str:
    with socket.socket() as s:  # a port nothing listens on (bound, never listening, then released)
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _pollers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith("(_run)")]


def _pollers_gone(within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while _pollers() and time.monotonic() < end:
        time.sleep(0.05)
    return not _pollers()


def test_channel_ready_cancels_its_subscription() -> None:
    assert _pollers_gone(), "a poller from an earlier test"
    address = _closed_port()
    raw = client_channel(address)
    try:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(raw).result(timeout=0.2)
        time.sleep(0.5)
        assert _pollers(), "the raw future's poller should still be running (the reference)"
    finally:
        raw.close()
    assert _pollers_gone()

    ch = client_channel(address)
    try:
        for _ in range(3):  # repeated on one channel, as wait_for_server does: each subscribes anew
            assert channel_ready(ch, 0.2) is False
            # stopped checking the channel when it returns, before the caller can close it (gRPC's own flag)
            assert _poller_state(ch).polling is False
        assert _pollers_gone()
    finally:
        ch.close()


def test_wait_for_server_leaves_no_poller() -> None:
    assert _pollers_gone()
    errors: list[str] = []
    old = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_value}")  # type: ignore[assignment]
    try:
        with pytest.raises(ServerUnreachableError, match="not reachable within"):
            wait_for_server(_closed_port(), timeout=1.5)
        assert _pollers_gone()
    finally:
        threading.excepthook = old
    assert errors == []
