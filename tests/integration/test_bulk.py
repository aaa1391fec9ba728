"""tessera.bulk over real sockets: the same handlers served by gRPC's ``build_server`` and by
``serve_bulk``; the reference for every result is the gRPC call's (byte-exact), or the bytes the
test computes itself. Auth uses the runtime's ``Access`` with real TLS / mutual TLS certificates."""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from ps.errors import TableNotFoundError
from ps.wire import ERRORS
from tessera.bulk import BulkCallError, BulkChannel, serve_bulk
from tessera.service import (
    Access,
    BindError,
    ClientSecurity,
    ServerSecurity,
    build_server,
    client_channel,
    issue_cert,
    make_ca,
)

SVC = "t.Bulk"
CHUNK = 1 << 20


class Handlers:
    """Echo / transform handlers, and ones that fail, sleep, check auth or get cancelled."""

    def __init__(self, access: Access) -> None:
        self.access = access
        self.watch: list[Any] = []  # contexts of Watch calls in progress
        self.watch_error: list[BaseException] = []
        self.watch_started = threading.Event()
        self.watch_done = threading.Event()

    def echo(self, request: bytes, context: Any) -> bytes:
        return bytes(request)

    def reverse(self, request: bytes, context: Any) -> bytes:
        return bytes(request)[::-1]

    def split(self, request: bytes, context: Any) -> Iterator[bytes]:
        data = bytes(request)
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]

    def pipe(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for r in requests:
            yield bytes(r)[::-1]

    def total(self, requests: Iterator[bytes], context: Any) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    def not_found(self, request: bytes, context: Any) -> bytes:
        ERRORS.abort(context, TableNotFoundError("table 'emb' not found"), "table 'emb' not found")
        return b""

    def boom(self, request: bytes, context: Any) -> bytes:
        raise ValueError("boom: the handler failed")

    def sleep(self, request: bytes, context: Any) -> bytes:
        time.sleep(float(bytes(request).decode()))
        return b"slept"

    def whoami(self, request: bytes, context: Any) -> bytes:
        with self.access.admit("WhoAmI", context) as caller:
            return caller.identity.encode()

    def watched(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        self.watch.append(context)
        self.watch_started.set()
        try:
            for r in requests:
                yield bytes(r)
        except grpc.RpcError as e:
            self.watch_error.append(e)
        finally:
            self.watch_done.set()

    def generic(self) -> grpc.GenericRpcHandler:
        uu, us = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        ss, su = grpc.stream_stream_rpc_method_handler, grpc.stream_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SVC, {
            "Echo": uu(self.echo), "Reverse": uu(self.reverse), "Split": us(self.split), "Pipe": ss(self.pipe),
            "Total": su(self.total), "NotFound": uu(self.not_found), "Boom": uu(self.boom), "Sleep": uu(self.sleep),
            "WhoAmI": uu(self.whoami), "Watched": ss(self.watched),
        })


def _access(sec: ServerSecurity) -> Access:
    return Access(sec, {"WhoAmI": ["worker"]}, ["worker"])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Handlers, grpc.Channel, BulkChannel, Any]]:
    """One open loopback server of each kind, same handlers."""
    sec = ServerSecurity()
    access = _access(sec)
    h = Handlers(access)
    server, port, _ = build_server((h.generic(),), "127.0.0.1", 0, sec)
    bulk = serve_bulk((h.generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkt")
    g = client_channel(f"127.0.0.1:{port}")
    b = BulkChannel(f"127.0.0.1:{bulk.port}")
    yield h, g, b, bulk
    b.close()
    g.close()
    bulk.stop()
    server.stop(0)


def _m(name: str) -> str:
    return f"/{SVC}/{name}"


def test_unary_and_streams_equal_grpc(pair: Any) -> None:
    """Echo, transform, server streaming, bidi and client streaming: byte-exact and equal to gRPC's."""
    _, g, b, _ = pair
    data = os.urandom(3 * CHUNK + 12345)
    for name in ("Echo", "Reverse"):
        want = g.unary_unary(_m(name))(data, timeout=10)
        got = b.unary_unary(_m(name))(data, timeout=10)
        assert bytes(got) == want
    assert bytes(b.unary_unary(_m("Echo"))(b"", timeout=5)) == g.unary_unary(_m("Echo"))(b"", timeout=5) == b""
    want_parts = list(g.unary_stream(_m("Split"))(data, timeout=10))
    got_parts = [bytes(p) for p in b.unary_stream(_m("Split"))(data, timeout=10)]
    assert got_parts == want_parts and b"".join(got_parts) == data
    msgs = [os.urandom(n) for n in (0, 1, 1000, CHUNK)]
    assert [bytes(x) for x in b.stream_stream(_m("Pipe"))(iter(msgs), timeout=10)] == list(
        g.stream_stream(_m("Pipe"))(iter(msgs), timeout=10)
    )
    assert list(b.stream_stream(_m("Pipe"))(iter([]), timeout=5)) == list(g.stream_stream(_m("Pipe"))(iter([]), timeout=5)) == []
    assert bytes(b.stream_unary(_m("Total"))(iter(msgs), timeout=5)) == g.stream_unary(_m("Total"))(iter(msgs), timeout=5)


@pytest.mark.timeout(120)
def test_64_mib_each_way_over_a_stream(pair: Any) -> None:
    """16 x 4 MiB up while the server already sends 16 x 4 MiB back: no deadlock, bytes exact
    (the reference: the reversed messages, computed here)."""
    _, _, b, _ = pair
    msgs = [os.urandom(4 << 20) for _ in range(16)]
    got = b.stream_stream(_m("Pipe"))(iter(msgs), timeout=60)
    n = 0
    for i, r in enumerate(got):
        assert bytes(r) == msgs[i][::-1]
        n += 1
    assert n == 16
    big = os.urandom(64 << 20)  # one message at the limit, each way
    assert bytes(b.unary_unary(_m("Echo"))(big, timeout=60)) == big


def test_eight_threads_share_a_channel(pair: Any) -> None:
    """Concurrent callers on one pooled channel each get their own answer."""
    _, _, b, _ = pair
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for j in range(20):
                data = os.urandom(1000 + 97 * i + j)
                assert bytes(b.unary_unary(_m("Reverse"))(data, timeout=10)) == data[::-1]
                parts = [bytes(p) for p in b.stream_stream(_m("Pipe"))(iter([data, data[:7]]), timeout=10)]
                assert parts == [data[::-1], data[:7][::-1]]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_errors_as_grpc_gives_them(pair: Any) -> None:
    """abort with the error table, a raising handler, an unknown method: same details as the gRPC
    call's, same code for an abort (a raising handler is INTERNAL here, where gRPC says UNKNOWN);
    ErrorTable.exception_of rebuilds the class from the trailing metadata."""
    _, g, b, _ = pair
    for name in ("NotFound", "Boom"):
        with pytest.raises(grpc.RpcError) as ge:
            g.unary_unary(_m(name))(b"x", timeout=5)
        with pytest.raises(BulkCallError) as be:
            b.unary_unary(_m(name))(b"x", timeout=5)
        assert be.value.code() == (ge.value.code() if name == "NotFound" else grpc.StatusCode.INTERNAL)
        assert be.value.details() == ge.value.details()
        assert isinstance(be.value, grpc.RpcError)
    with pytest.raises(BulkCallError) as be:
        b.unary_unary(_m("NotFound"))(b"x", timeout=5)
    assert be.value.code() == grpc.StatusCode.NOT_FOUND
    assert ("tessera-error", "TableNotFoundError") in be.value.trailing_metadata()
    cls, _, details = ERRORS.exception_of(be.value)
    assert cls is TableNotFoundError and details == "table 'emb' not found"
    with pytest.raises(BulkCallError) as be:
        b.unary_unary(_m("Boom"))(b"x", timeout=5)
    assert be.value.code() == grpc.StatusCode.INTERNAL and "boom: the handler failed" in be.value.details()
    with pytest.raises(BulkCallError) as be:
        b.unary_unary("/t.Bulk/Nope")(b"x", timeout=5)
    assert be.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/t.Bulk/Nope" in be.value.details()
    with pytest.raises(BulkCallError) as be:  # a stream to an unknown method: refused, connection dropped cleanly
        list(b.stream_stream("/t.Bulk/Nope")(iter([b"a", b"b"]), timeout=5))
    assert be.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert bytes(b.unary_unary(_m("Echo"))(b"still fine", timeout=5)) == b"still fine"


def test_a_failing_request_iterator_fails_the_call(pair: Any) -> None:
    """The caller's request iterator raising mid-stream: the call fails naming it (gRPC cancels
    such a call); the channel keeps working."""
    _, _, b, _ = pair

    def requests() -> Iterator[bytes]:
        yield b"one"
        raise KeyError("no more requests")

    with pytest.raises(BulkCallError) as be:
        list(b.stream_stream(_m("Pipe"))(requests(), timeout=5))
    assert "KeyError" in be.value.details()
    assert bytes(b.unary_unary(_m("Echo"))(b"fine", timeout=5)) == b"fine"


def test_deadline(pair: Any) -> None:
    """A handler sleeping past the call's timeout: DEADLINE_EXCEEDED at about the timeout."""
    _, _, b, _ = pair
    t0 = time.monotonic()
    with pytest.raises(BulkCallError) as be:
        b.unary_unary(_m("Sleep"))(b"2.0", timeout=0.5)
    assert be.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 1.5
    assert bytes(b.unary_unary(_m("Sleep"))(b"0", timeout=5)) == b"slept"


def test_cancel_from_another_thread_ends_the_request_iterator(pair: Any) -> None:
    """What the shard's idle-stream watchdog does: context.cancel() from another thread makes the
    handler's request iterator raise a grpc.RpcError, and the client's call fails."""
    h, _, b, _ = pair
    release = threading.Event()

    def requests() -> Iterator[bytes]:
        yield b"first"
        release.wait(10)

    stream = b.stream_stream(_m("Watched"))(requests(), timeout=20)
    assert bytes(next(stream)) == b"first"
    assert h.watch_started.wait(5)
    ctx = h.watch[-1]
    assert ctx.is_active()
    ctx.cancel()
    assert h.watch_done.wait(5)
    assert h.watch_error and isinstance(h.watch_error[0], grpc.RpcError)
    assert not ctx.is_active()
    with pytest.raises(BulkCallError) as be:
        next(stream)
    assert be.value.code() == grpc.StatusCode.UNAVAILABLE
    release.set()


def _wait_for(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(scope="module")
def pki() -> dict[str, bytes]:
    ca, ca_key = make_ca()
    cert, key = issue_cert(ca, ca_key, "127.0.0.1", hosts=["127.0.0.1", "localhost"])
    bob, bob_key = issue_cert(ca, ca_key, "bob")
    return {"ca": ca, "cert": cert, "key": key, "bob": bob, "bob_key": bob_key}


def test_tokens_over_tls(pki: dict[str, bytes]) -> None:
    """No or a wrong token: UNAUTHENTICATED at the first call and the connection closed; the right
    token: the handler's Access.admit sees the identity; a plaintext client: a fast UNAVAILABLE."""
    token = "t" * 32
    sec = ServerSecurity(tls_cert=pki["cert"], tls_key=pki["key"], tokens={"alice": token}, roles={"alice": ["worker"]})
    access = _access(sec)
    h = Handlers(access)
    bulk = serve_bulk((h.generic(),), "127.0.0.1", 0, sec, access.caller, name="bulktls")
    addr = f"127.0.0.1:{bulk.port}"
    try:
        for bad in (None, "w" * 32):
            with BulkChannel(addr, ClientSecurity(tls_ca=pki["ca"], token=bad)) as c:
                with pytest.raises(BulkCallError) as be:
                    c.unary_unary(_m("WhoAmI"))(b"", timeout=5)
                assert be.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert ("no token" if bad is None else "unknown token") in be.value.details()
            assert _wait_for(lambda: bulk.connections == 0)
        with BulkChannel(addr, ClientSecurity(tls_ca=pki["ca"], token=token)) as c:
            assert bytes(c.unary_unary(_m("WhoAmI"))(b"", timeout=5)) == b"alice"
            data = os.urandom(2 * CHUNK + 1)
            assert b"".join(bytes(p) for p in c.unary_stream(_m("Split"))(data, timeout=10)) == data
            # request streams stay off TLS connections (two threads on one OpenSSL connection are not safe)
            assert not c.full_duplex
            with pytest.raises(BulkCallError) as be:
                c.stream_stream(_m("Pipe"))(iter([data, b"z"]), timeout=10)
            assert be.value.code() == grpc.StatusCode.UNIMPLEMENTED and "TLS" in be.value.details()
        t0 = time.monotonic()
        with BulkChannel(addr) as c, pytest.raises(BulkCallError) as be:
            c.unary_unary(_m("WhoAmI"))(b"", timeout=5)
        assert be.value.code() == grpc.StatusCode.UNAVAILABLE and "TLS" in be.value.details()
        assert time.monotonic() - t0 < 2.0
        assert _wait_for(lambda: bulk.connections == 0)
    finally:
        bulk.stop()


def test_tls_client_to_a_plaintext_server(pair: Any, pki: dict[str, bytes]) -> None:
    """A TLS client to a plaintext endpoint: a fast UNAVAILABLE saying the server does not speak TLS."""
    _, _, _, bulk = pair
    t0 = time.monotonic()
    with BulkChannel(f"127.0.0.1:{bulk.port}", ClientSecurity(tls_ca=pki["ca"])) as c, pytest.raises(BulkCallError) as be:
        c.unary_unary(_m("Echo"))(b"", timeout=5)
    assert be.value.code() == grpc.StatusCode.UNAVAILABLE and "does not speak TLS" in be.value.details()
    assert time.monotonic() - t0 < 2.0


def test_mutual_tls_identity_from_the_certificate(pki: dict[str, bytes]) -> None:
    """mTLS without tokens: the caller is the client certificate's common name; no client
    certificate: the TLS handshake fails (UNAVAILABLE naming TLS)."""
    sec = ServerSecurity(tls_cert=pki["cert"], tls_key=pki["key"], tls_ca=pki["ca"], default_roles=("worker",))
    access = _access(sec)
    h = Handlers(access)
    bulk = serve_bulk((h.generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkmtls")
    addr = f"127.0.0.1:{bulk.port}"
    try:
        with BulkChannel(addr, ClientSecurity(tls_ca=pki["ca"], tls_cert=pki["bob"], tls_key=pki["bob_key"])) as c:
            assert bytes(c.unary_unary(_m("WhoAmI"))(b"", timeout=5)) == b"bob"
        with BulkChannel(addr, ClientSecurity(tls_ca=pki["ca"])) as c, pytest.raises(BulkCallError) as be:
            c.unary_unary(_m("WhoAmI"))(b"", timeout=5)
        assert be.value.code() == grpc.StatusCode.UNAVAILABLE and "client certificate" in be.value.details()
    finally:
        bulk.stop()


def test_limits_and_garbage() -> None:
    """Over max_connections: RESOURCE_EXHAUSTED; a body over the server's limit: RESOURCE_EXHAUSTED
    naming the limit; garbage instead of a frame: that connection closed; after each, a good client
    is still served."""
    sec = ServerSecurity()
    access = _access(sec)
    h = Handlers(access)
    bulk = serve_bulk((h.generic(),), "127.0.0.1", 0, sec, access.caller, max_message_bytes=1 << 20,
                      max_connections=2, name="bulklim")
    addr = f"127.0.0.1:{bulk.port}"
    try:
        c1, c2, c3 = BulkChannel(addr), BulkChannel(addr), BulkChannel(addr)
        assert bytes(c1.unary_unary(_m("Echo"))(b"1", timeout=5)) == b"1"
        assert bytes(c2.unary_unary(_m("Echo"))(b"2", timeout=5)) == b"2"
        with pytest.raises(BulkCallError) as be:
            c3.unary_unary(_m("Echo"))(b"3", timeout=5)
        assert be.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_connections" in be.value.details()
        c2.close()
        assert _wait_for(lambda: bulk.connections == 1)
        with pytest.raises(BulkCallError) as be:
            c3.unary_unary(_m("Echo"))(os.urandom(2 << 20), timeout=5)
        assert be.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(1 << 20) in be.value.details()
        assert _wait_for(lambda: bulk.connections == 1)
        assert bytes(c3.unary_unary(_m("Echo"))(b"ok", timeout=5)) == b"ok"
        c3.close()
        assert _wait_for(lambda: bulk.connections == 1)
        with socket.create_connection(("127.0.0.1", bulk.port), timeout=5) as s:
            s.sendall(b"\xde\xad\xbe\xef" * 64)
            while s.recv(65536):  # the server answers (an error frame) and closes
                pass
        assert _wait_for(lambda: bulk.connections == 1)
        assert bytes(c1.unary_unary(_m("Echo"))(b"after", timeout=5)) == b"after"
        c1.close()
    finally:
        bulk.stop()


def test_a_taken_port_is_a_bind_error(pair: Any) -> None:
    """A second endpoint on a port in use: BindError naming the address, like build_server's."""
    _, _, _, bulk = pair
    with pytest.raises(BindError) as e:
        serve_bulk((), "127.0.0.1", bulk.port, ServerSecurity(), lambda md, ac: None, name="bulkbind")
    assert f"127.0.0.1:{bulk.port}" in str(e.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("bulkbind")]


def test_stop_ends_every_thread() -> None:
    """stop() closes the listener and every connection, and joins the threads; later calls fail UNAVAILABLE."""
    sec = ServerSecurity()
    access = _access(sec)
    h = Handlers(access)
    bulk = serve_bulk((h.generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkstop")
    chans = [BulkChannel(f"127.0.0.1:{bulk.port}") for _ in range(3)]
    for c in chans:
        assert bytes(c.unary_unary(_m("Echo"))(b"x", timeout=5)) == b"x"
    assert bulk.connections == 3
    assert any(t.name.startswith("bulkstop-") for t in threading.enumerate())
    bulk.stop()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("bulkstop-")]
    with pytest.raises(BulkCallError) as be:
        chans[0].unary_unary(_m("Echo"))(b"x", timeout=5)
    assert be.value.code() == grpc.StatusCode.UNAVAILABLE
    for c in chans:
        c.close()


def test_idle_and_silent_connections_are_closed() -> None:
    """A connection idle past ``idle_timeout_s`` is closed by the server (the client's next call opens
    another); one that never completes its handshake is closed after ``handshake_timeout_s``."""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller,
                      idle_timeout_s=0.5, handshake_timeout_s=0.5, name="bulkidle")
    try:
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            assert bytes(c.unary_unary(_m("Echo"))(b"x", timeout=5)) == b"x"
            assert bulk.connections == 1
            assert _wait_for(lambda: bulk.connections == 0, timeout=5)
            assert bytes(c.unary_unary(_m("Echo"))(b"y", timeout=5)) == b"y"
        silent = socket.create_connection(("127.0.0.1", bulk.port))
        try:
            assert _wait_for(lambda: bulk.connections == 1, timeout=2)
            silent.settimeout(5)
            assert silent.recv(1 << 16) is not None  # (whatever the server says, then EOF)
            assert _wait_for(lambda: bulk.connections == 0, timeout=5)
        finally:
            silent.close()
    finally:
        bulk.stop()
