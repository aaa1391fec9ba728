"""tessera.bulk over real sockets: the same handlers served by gRPC's ``build_server`` and by
``serve_bulk``; the reference for every result is the gRPC call's (byte-exact), or the bytes the
test computes itself. Auth uses the runtime's ``Access`` with real TLS / mutual TLS certificates."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest

from ps.errors import TableNotFoundError
from ps.wire import ERRORS
from tessera.bulk import (
    _PREFIX,
    _SMALL,
    BulkCallError,
    BulkChannel,
    _pack,
    _recv,
    _send,
    serve_bulk,
)
from tessera.codec import Packed, as_bytes
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

    def packed(self, request: bytes, context: Any) -> Packed:
        return Packed(_pieces(int(bytes(request).decode())))

    def generic(self) -> grpc.GenericRpcHandler:
        uu, us = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        ss, su = grpc.stream_stream_rpc_method_handler, grpc.stream_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SVC, {
            "Echo": uu(self.echo), "Reverse": uu(self.reverse), "Split": us(self.split), "Pipe": ss(self.pipe),
            "Total": su(self.total), "NotFound": uu(self.not_found), "Boom": uu(self.boom), "Sleep": uu(self.sleep),
            "WhoAmI": uu(self.whoami), "Watched": ss(self.watched), "Packed": uu(self.packed),
        })


def _pieces(n: int) -> list[Any]:
    """A message's pieces as codec.pack gives them: small bytes, then big and small typed buffers
    (about ``n`` bytes in all, of odd sizes)."""
    rng = np.random.default_rng(n)
    return [b"head", rng.integers(0, 255, n // 2 + 3, dtype=np.uint8).data, np.arange(7, dtype=np.float32),
            rng.standard_normal(n // 8 + 1).astype(np.float32), b"", b"tail" * 100]


def _joined(pieces: list[Any]) -> bytes:
    return b"".join(memoryview(p).cast("B") for p in pieces)


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


def test_future_sends_now_and_reads_the_reply_on_the_thread_that_asks(pair: Any) -> None:
    """``unary_unary(...).future(request)`` as gRPC's: the request is on its way when it returns (the
    server's handler runs before ``result()`` is asked), and ``result()`` gives the reply, or raises the
    call's error as the blocking call would (reference: the gRPC future's code and details). Several
    futures on one channel hold their own connections; each goes back to the pool when read."""
    h, g, b, _ = pair
    mc = b.unary_unary(_m("Sleep"))
    started = time.monotonic()
    futs = [mc.future(b"0.5", timeout=10) for _ in range(3)]  # three calls in flight at once, no thread here
    time.sleep(0.6)
    assert [bytes(f.result()) for f in futs] == [b"slept"] * 3
    assert time.monotonic() - started < 1.5  # they ran while this thread slept (else 0.6 + 3 x 0.5 s at least)
    want = g.unary_unary(_m("NotFound")).future(b"x", timeout=5)
    got = b.unary_unary(_m("NotFound")).future(b"x", timeout=5)
    with pytest.raises(grpc.RpcError) as ge:
        want.result()
    with pytest.raises(BulkCallError) as be:
        got.result()
    assert (be.value.code(), be.value.details()) == (ge.value.code(), ge.value.details())
    with pytest.raises(BulkCallError) as be:  # a refused send (over the size limit) is raised by result(), as gRPC's
        BulkChannel(b.address, max_message_bytes=4).unary_unary(_m("Echo")).future(b"12345", timeout=5).result()
    assert be.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
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
    """A handler sleeping past the call's timeout: DEADLINE_EXCEEDED at the timeout (0.5 s), not when
    the handler returns (8 s: the bound below is a deadline with room for a loaded machine, not a speed
    check)."""
    _, _, b, _ = pair
    t0 = time.monotonic()
    with pytest.raises(BulkCallError) as be:
        b.unary_unary(_m("Sleep"))(b"8", timeout=0.5)
    assert be.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 4
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
            c.unary_unary(_m("WhoAmI"))(b"", timeout=60)
        assert be.value.code() == grpc.StatusCode.UNAVAILABLE and "TLS" in be.value.details()
        assert time.monotonic() - t0 < 20  # at once, not at the call's 60 s deadline
        assert _wait_for(lambda: bulk.connections == 0)
    finally:
        bulk.stop()


def test_tls_client_to_a_plaintext_server(pair: Any, pki: dict[str, bytes]) -> None:
    """A TLS client to a plaintext endpoint: a fast UNAVAILABLE saying the server does not speak TLS."""
    _, _, _, bulk = pair
    t0 = time.monotonic()
    with BulkChannel(f"127.0.0.1:{bulk.port}", ClientSecurity(tls_ca=pki["ca"])) as c, pytest.raises(BulkCallError) as be:
        c.unary_unary(_m("Echo"))(b"", timeout=60)
    assert be.value.code() == grpc.StatusCode.UNAVAILABLE and "does not speak TLS" in be.value.details()
    assert time.monotonic() - t0 < 20  # at once, not at the call's 60 s deadline


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


# ---------------------------------------------------------------- review findings (regressions)
_HELLO = msgpack.packb({"v": 1, "md": []}, use_bin_type=True)


def _raw_client(port: int) -> socket.socket:
    """A plaintext connection that passed the handshake (no token: the server has none)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(_PREFIX.pack(len(_HELLO), 0) + _HELLO)
    s.recv(1 << 10)  # {"ok": true}
    return s


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_declared_body_pins_memory_only_as_it_arrives() -> None:
    """Four connections each declare a 64 MiB body (the limit) and send ~30 bytes: the server's
    memory (this process's VmRSS) grows by far less than one such body (reference: 4 x 64 MiB if
    the body were allocated at its declared size); then a 9 MiB echo (a grown body: 4, 8, 9 MiB) is byte-exact."""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkmem")
    socks: list[socket.socket] = []
    try:
        before = _rss_mib()
        h = msgpack.packb({"m": _m("Echo"), "end": True}, use_bin_type=True)
        for _ in range(4):
            s = _raw_client(bulk.port)
            s.sendall(_PREFIX.pack(len(h), 64 << 20) + h + b"x" * 8)
            socks.append(s)
        assert _wait_for(lambda: bulk.connections == 4)
        time.sleep(0.5)
        grew = _rss_mib() - before
        assert grew < 32, f"the server's memory grew by {grew:.0f} MiB for 4 bodies of which 8 bytes each arrived"
        data = os.urandom(9 << 20)
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            assert bytes(c.unary_unary(_m("Echo"))(data, timeout=10)) == data
    finally:
        for s in socks:
            s.close()
        bulk.stop()


def test_a_trickled_handshake_does_not_hold_a_slot() -> None:
    """max_connections=2, handshake_timeout_s=0.5: two clients trickle a handshake one byte every
    0.2 s (each read is within the timeout); both are closed once the handshake's 0.5 s are over,
    and a good client is served (before the fix they held both slots for good; the 30 s below is a
    deadline for that, not a speed check)."""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller, max_connections=2,
                      handshake_timeout_s=0.5, name="bulkslow")
    stop = threading.Event()
    socks = [socket.create_connection(("127.0.0.1", bulk.port)) for _ in range(2)]

    def trickle() -> None:
        with contextlib.suppress(OSError):
            for s in socks:
                s.sendall(_PREFIX.pack(60000, 0))
            while not stop.wait(0.2):
                for s in socks:
                    s.sendall(b"\x80")

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        assert _wait_for(lambda: bulk.connections == 2, timeout=2)
        t0 = time.monotonic()
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            while True:
                try:
                    assert bytes(c.unary_unary(_m("Echo"))(b"hi", timeout=1)) == b"hi"
                    break
                except BulkCallError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    assert time.monotonic() - t0 < 30, "still refused after 30 s"
                    time.sleep(0.05)
    finally:
        stop.set()
        t.join(5)
        for s in socks:
            s.close()
        bulk.stop()


class _FlakyListener(socket.socket):
    """A listening socket whose next ``accept`` fails like a process out of descriptors."""

    fail = 1

    def accept(self) -> tuple[socket.socket, Any]:
        if self.fail:
            self.fail -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_the_accept_thread_survives_an_accept_error() -> None:
    """accept() failing with EMFILE once: the endpoint logs it, goes on accepting, and serves a client
    afterwards (before the fix the accept thread ended and every later client waited in vain)."""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkemfile")
    old = bulk._listener
    flaky = _FlakyListener(old.family, old.type, fileno=os.dup(old.fileno()))
    flaky.settimeout(0.5)
    bulk._listener = flaky  # the accept loop takes it at its next turn (within 0.5 s)
    try:
        assert _wait_for(lambda: flaky.fail == 0, timeout=3)
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            assert bytes(c.unary_unary(_m("Echo"))(b"after", timeout=3)) == b"after"
        assert bulk._accept.is_alive()
    finally:
        bulk.stop()
        old.close()


def test_cancel_after_the_end_leaves_the_pooled_connection_alone(pair: Any) -> None:
    """A finished stream's cancel() does nothing (False): the next call, on the same pooled
    connection, gets all its replies (reference: the bytes sent). A cancel before the end: the
    iterator raises CANCELLED, as gRPC's."""
    _, _, b, _ = pair
    a = b.unary_stream(_m("Split"))(b"x" * 10, timeout=5)
    assert [bytes(r) for r in a] == [b"x" * 10] and a.code() == grpc.StatusCode.OK
    nxt = b.unary_stream(_m("Split"))(b"y" * 10, timeout=5)  # on a's pooled connection
    assert a.cancel() is False
    assert [bytes(r) for r in nxt] == [b"y" * 10]
    big = b.unary_stream(_m("Split"))(b"z" * (3 * CHUNK), timeout=5)
    assert bytes(next(big)) == b"z" * CHUNK
    assert big.cancel() is True
    with pytest.raises(BulkCallError) as be:
        next(big)
    assert be.value.code() == grpc.StatusCode.CANCELLED and big.code() == grpc.StatusCode.CANCELLED


def test_pooled_connections_are_reused_with_descriptors_over_1024(pair: Any) -> None:
    """With 1100 more descriptors open (the channel's sockets get numbers >= 1024, where select()
    fails), 20 sequential calls use one connection (before the fix: a new one per call)."""
    _, _, _, bulk = pair
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 2048")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        c = BulkChannel(f"127.0.0.1:{bulk.port}")
        opened = [0]
        real = c._open

        def counted(timeout: float | None) -> Any:
            opened[0] += 1
            conn = real(timeout)
            assert conn.sock.fileno() >= 1024
            return conn

        c._open = counted  # type: ignore[method-assign]
        for i in range(20):
            assert bytes(c.unary_unary(_m("Echo"))(str(i).encode(), timeout=5)) == str(i).encode()
        c.close()
        assert opened[0] == 1
    finally:
        for fd in fds:
            os.close(fd)
        if soft < 2048:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_timeout_bounds_the_whole_call_not_each_read() -> None:
    """A server that answers a reply's 8 body bytes one every 0.3 s (each read is quick): a call
    with timeout=1.0 fails DEADLINE_EXCEEDED, not before its 1 s (before the fix: 2.4 s, then OK: the
    code tells the two apart without a bound on how long a loaded machine takes)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()

    def fake() -> None:
        s, _ = ls.accept()
        with s, s.makefile("rb") as f:
            def frame() -> None:
                hl, bl = _PREFIX.unpack(f.read(_PREFIX.size))
                f.read(hl)
                f.read(bl)
            frame()
            s.sendall(_pack({"ok": True}))
            frame()
            h = msgpack.packb({"more": True}, use_bin_type=True)
            s.sendall(_PREFIX.pack(len(h), 8) + h)
            with contextlib.suppress(OSError):
                for _ in range(8):
                    time.sleep(0.3)
                    s.sendall(b"x")
                s.sendall(_pack({"code": "OK", "msg": "", "tm": []}))

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        with BulkChannel(f"127.0.0.1:{ls.getsockname()[1]}") as c:
            t0 = time.monotonic()
            with pytest.raises(BulkCallError) as be:
                c.unary_unary(_m("Echo"))(b"hi", timeout=1.0)
            took = time.monotonic() - t0
        assert be.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert took > 0.9, took
    finally:
        t.join(5)
        ls.close()


def test_a_failed_thread_start_leaks_no_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a connection's thread fails twice (max_connections=2): no slot stays taken, a client
    is then served, and stop() returns without error."""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller, max_connections=2,
                      name="bulktstart")
    real = threading.Thread.start
    fail = [2]

    def start(self: threading.Thread) -> None:
        if self.name.startswith("bulktstart-conn") and fail[0]:
            fail[0] -= 1
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        for _ in range(2):
            socket.create_connection(("127.0.0.1", bulk.port)).close()
        assert _wait_for(lambda: fail[0] == 0, timeout=3)
        assert _wait_for(lambda: bulk.connections == 0, timeout=3)
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            assert bytes(c.unary_unary(_m("Echo"))(b"ok", timeout=3)) == b"ok"
    finally:
        bulk.stop()


def test_a_typed_buffer_is_sent_by_its_bytes(pair: Any) -> None:
    """A float32 array as the request (10 items, 40 bytes): the server gets its 40 bytes (reference:
    ``tobytes()``); the frame's length was the item count before the fix."""
    _, _, b, _ = pair
    arr = np.arange(10, dtype=np.float32)
    assert bytes(b.unary_unary(_m("Echo"))(arr, timeout=5)) == arr.tobytes()


def test_both_ends_give_up_on_a_silent_peer_within_seconds() -> None:
    """A host gone mid-call must fail the call in seconds, not at its deadline or after minutes of TCP
    retransmissions: both ends' sockets have keepalive (1 s idle, 1 s apart, 5 probes) and
    TCP_USER_TIMEOUT 6 s (unacknowledged data). (The compose netns test kills a primary's host for
    real: its workers go on within seconds over the backup.)"""
    sec = ServerSecurity()
    access = _access(sec)
    bulk = serve_bulk((Handlers(access).generic(),), "127.0.0.1", 0, sec, access.caller, name="bulkka")
    try:
        with BulkChannel(f"127.0.0.1:{bulk.port}") as c:
            c.unary_unary(_m("Echo"))(b"x", timeout=5)
            client_sock = c._idle[0].sock
            with bulk._lock:
                server_sock = next(iter(bulk._conns.values())).sock
            for sock in (client_sock, server_sock):
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 5
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
    finally:
        bulk.stop()


def _no_join(monkeypatch: pytest.MonkeyPatch) -> None:
    def join(self: Packed) -> bytes:
        raise AssertionError("a Packed message was joined (copied) on its way over bulk")

    monkeypatch.setattr(Packed, "join", join)


@pytest.mark.parametrize("n", [100, 3 << 20])
def test_a_packed_message_goes_over_bulk_as_its_pieces(pair: Any, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A codec.Packed request, and a Packed reply from the handler: bulk sends the pieces without
    joining them (Packed.join raises here), gRPC joins them (the stub's serializer, the server's
    outermost interceptor). Reference: the pieces' bytes joined by the test; both transports give them."""
    _, g, b, _ = pair
    want = _joined(_pieces(n))
    with monkeypatch.context() as m:
        _no_join(m)
        assert bytes(b.unary_unary(_m("Echo"))(Packed(_pieces(n)), timeout=10)) == want
        assert bytes(b.unary_unary(_m("Packed"))(str(n).encode(), timeout=10)) == want
    assert g.unary_unary(_m("Echo"), request_serializer=as_bytes)(Packed(_pieces(n)), timeout=10) == want
    assert g.unary_unary(_m("Packed"))(str(n).encode(), timeout=10) == want


def test_a_packed_body_sent_in_parts_arrives_whole() -> None:
    """Over a socket whose buffers hold far less than the message (sendmsg then sends part of its
    pieces each time), a reader that takes it in small reads gets every byte in order (reference:
    the pieces joined), and the frame's length is the pieces' bytes; the body is a buffer, not zeroed first."""
    a, c = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        pieces = _pieces(3 << 20) + [np.ones(3, np.int64)] * 700  # more pieces than one sendmsg takes; under 4 MiB
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(_recv(c.makefile("rb", buffering=1 << 12), 64 << 20)))
        reader.start()
        _send(a, {"x": 1}, Packed(pieces))
        reader.join(10)
        header, body = got[0]
        assert header == {"x": 1} and bytes(body) == _joined(pieces) and len(body) > _SMALL
        assert isinstance(body, memoryview)  # read into np.empty's memory, not a zero-filled bytearray
    finally:
        a.close()
        c.close()


def test_a_socket_timeout_bounds_a_packed_send_as_a_whole() -> None:
    """A TCP peer that reads 64 KiB every 0.1 s: sending 64 MiB of pieces with a 0.5 s socket
    timeout fails with a TimeoutError within about that time (reference: sendall's bound), not after
    a fresh 0.5 s for each partial write (each one makes progress: that would take ~100 s)."""
    lsn = socket.create_server(("127.0.0.1", 0))
    lsn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    a = socket.socket()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # small buffers: each write takes a little
    a.connect(lsn.getsockname())
    c, _ = lsn.accept()
    lsn.close()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            c.recv(64 << 10)

    reader = threading.Thread(target=trickle)
    try:
        a.settimeout(0.5)
        reader.start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            _send(a, {}, Packed([np.zeros(1 << 20, np.uint8).data] * 64))
        assert time.monotonic() - t0 < 30  # a deadline for the ~100 s of per-write timeouts, not a speed check
    finally:
        stop.set()
        reader.join(5)
        a.close()
        c.close()
