"""A bulk data plane beside gRPC: the same handlers served over a length-prefixed framed socket.

gRPC stays the control plane (health, metrics, roles, failover discovery, replication); a
server may also serve its data calls with :func:`serve_bulk`, and clients call them through a
:class:`BulkChannel`, whose ``unary_unary`` / ``unary_stream`` / ``stream_stream`` behave like a
``grpc.Channel``'s (errors are :class:`BulkCallError`, a ``grpc.RpcError``). The endpoint uses the
runtime's rules: ``ServerSecurity.check``, TLS / mutual TLS from the same PEM, ``Access.caller``
at the handshake (an unknown token never gets a call in), and per call the same admission as on
gRPC (``Access.interceptor()`` among the ``interceptors``: roles and the identity's limits, shared
with its gRPC calls) and error table, through a context shim that acts like ``grpc.ServicerContext``.

Wire (no pickle). Every frame is ``struct "<IQ"`` (header length, body length), a msgpack header
(a map, at most 64 KiB) and the body (raw bytes, at most ``max_message_bytes``).

* Handshake: the client sends ``{"v": 1, "md": [[key, value], ...]}`` (its metadata, e.g.
  ``["authorization", "Bearer <token>"]``); the server answers ``{"ok": true}``, or a status frame
  (below) and closes.
* A call (one at a time per connection): request frames ``{"m": "/pkg.Service/Method", "t":
  seconds left or nil, "end": bool}`` with one request message each as the body; a unary request is
  one frame with ``end`` true; a stream ends with the frame whose ``end`` is true; a frame with
  ``"none": true`` carries no message (an empty stream is one such frame; a stream may also end with
  one). The first frame may carry ``"md"``: the call's own metadata pairs.
* Replies: ``{"more": true}`` + body per response message, then one status frame ``{"code": "OK" |
  a grpc.StatusCode name, "msg": details, "tm": trailing metadata pairs}``; ``"close": true`` in it
  says the server did not read the whole request stream and closes the connection.
* A frame over the limits or with an unparsable header gets a status frame (RESOURCE_EXHAUSTED /
  INVALID_ARGUMENT naming what was wrong) and the connection is closed; the server serves others.

Threads: one accept thread and one per connection (at most ``max_connections``, of which one identity
holds at most ``max_connections_per_identity``; one more is told
RESOURCE_EXHAUSTED in plaintext, closed at once over TLS: UNAVAILABLE). A connection has
``handshake_timeout_s`` for its whole handshake (TLS, hello, authentication), however it trickles;
a body's memory is allocated as its bytes arrive (4 MiB at once, then at most doubling). A client's
``timeout`` bounds the whole call (every read and write), DEADLINE_EXCEEDED past it. Sockets: TCP_NODELAY, and keepalive probes every second after one idle
second, five unanswered fail the connection (a dead host fails calls within about 6 s).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import msgpack
import numpy as np

from tessera.codec import Packed
from tessera.service import (
    ERROR_CLASS_HEADER,
    BindError,
    ClientSecurity,
    FailedCall,
    ServerSecurity,
    UnauthenticatedError,
    pem_file,
    read_pem,
)
from tessera.service.tokens import TOKEN_HEADER

__all__ = ["MAX_HEADER_BYTES", "BulkCallError", "BulkChannel", "BulkServer", "serve_bulk"]

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10
_PREFIX = struct.Struct("<IQ")
_SMALL = 32 << 10  # bodies up to this are sent in one write with their header
_CODES = {c.name: c for c in grpc.StatusCode}


class _FrameError(Exception):
    """A frame that cannot be read (too big, unparsable): ``code`` says which status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Closed(ConnectionError):
    """The peer closed the connection."""


class BulkCallError(FailedCall):
    """A failed bulk call, shaped like gRPC's: ``code()``, ``details()``, ``trailing_metadata()``."""

    def __str__(self) -> str:
        return f"<BulkCallError {self.code().name}: {self.details()}>"


class _StreamBroken(grpc.RpcError):
    """What a handler's request iterator raises when its connection ends (cancelled or closed)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return str(self.args[0])


# ---------------------------------------------------------------------- frames
def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # keepalive finds a dead peer while nothing is in flight; TCP_USER_TIMEOUT while data sent to it
    # goes unacknowledged (a host gone mid-call: without it, the retransmissions last minutes and the
    # call its whole deadline). Either way about 6 s, like the gRPC channels' keepalive (tessera.rpc).
    for opt, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5), ("TCP_USER_TIMEOUT", 6000)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _bytes(x: Any) -> memoryview:
    """``x``'s bytes (a typed buffer, float32 ..., as its bytes: len() would count its items)."""
    mv = memoryview(x)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _send(sock: socket.socket, header: dict, body: Any = b"", tail: bytes = b"") -> None:
    """One frame (and ``tail``: an already packed frame to send with it). ``body``: a buffer, or a
    codec.Packed message, whose pieces are sent from their own memory (one gathering write; over
    TLS, the small ones joined with the header and each big one on its own)."""
    h = msgpack.packb(header, use_bin_type=True)
    pieces: Sequence[Any]
    if isinstance(body, Packed):
        pieces, n = body, body.nbytes  # (pack counted it)
    else:
        pieces = (_bytes(body if body is not None else b""),)
        n = pieces[0].nbytes
    head = _PREFIX.pack(len(h), n) + h
    if n <= _SMALL:  # (join takes any buffer: no byte view of each piece)
        sock.sendall(b"".join([head, *pieces, tail]))
        return
    views = [_bytes(p) for p in pieces]
    if isinstance(sock, ssl.SSLSocket):  # (no sendmsg)
        small = [head]
        for v in views:
            if v.nbytes > _SMALL:
                sock.sendall(b"".join(small))
                small = []
                sock.sendall(v)
            else:
                small.append(v)
        sock.sendall(b"".join([*small, tail]))
    else:
        _sendmsg_all(sock, [memoryview(head), *views, memoryview(tail)])


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Every byte of ``views``, in order, with gathering writes (sendmsg sends part of them at times).
    A socket timeout bounds the whole, as sendall's does."""
    views = [v for v in views if v.nbytes]
    limit = sock.gettimeout()
    deadline = None if limit is None else time.monotonic() + limit
    while views:
        if deadline is not None:
            _until(sock, deadline)
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0] = views[0][sent:]
                sent = 0


_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


def _pack(header: dict) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    return _PREFIX.pack(len(h), 0) + h


_EAGER = 4 << 20  # bodies up to this are allocated at once (a Step of 4096 x 64 rows is ~1.1 MiB); bigger ones grow with what has arrived


def _deadline_passed(e: BaseException) -> bool:
    """A socket timeout or a call's own deadline (no errno): DEADLINE_EXCEEDED. Not the kernel's
    ETIMEDOUT, which Python also raises as TimeoutError: keepalive or TCP_USER_TIMEOUT found the
    peer unreachable (a cut link), a lost connection (UNAVAILABLE, retried like gRPC's)."""
    return isinstance(e, TimeoutError) and e.errno != errno.ETIMEDOUT


def _until(sock: Any, deadline: float | None) -> None:
    """Before one socket operation of a call with a deadline: the time left (TimeoutError once it passed)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(max(1e-3, left))


def _fill(rfile: Any, buf: Any, start: int = 0, sock: Any = None, deadline: float | None = None) -> None:
    """Fill ``buf[start:]`` from ``rfile`` (one raw read at a time, so ``deadline`` bounds the whole)."""
    got = start
    with memoryview(buf) as mv:
        while got < len(mv):
            if deadline is None:
                n = rfile.readinto(mv[got:])  # (reads until full or EOF, in C)
            else:
                _until(sock, deadline)
                n = rfile.readinto1(mv[got:])  # (one raw read: the deadline is checked between reads)
            if not n:
                raise _Closed("connection closed by the peer")
            got += n


def _recv(rfile: Any, max_body: int, sock: Any = None, deadline: float | None = None) -> tuple[dict, Any]:
    """One frame: (header, body: a bytearray, or a memoryview of bytes). Raises _FrameError (limits, bad header), _Closed, OSError
    (TimeoutError when ``deadline``, a time.monotonic() value, passes; ``sock`` is ``rfile``'s socket).
    A body's memory follows the bytes that arrived: a peer that only declares a big body pins 4 MiB."""
    prefix = bytearray(_PREFIX.size)
    _fill(rfile, prefix, 0, sock, deadline)
    hlen, blen = _PREFIX.unpack(prefix)
    if hlen > MAX_HEADER_BYTES:
        raise _FrameError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"frame header of {hlen} bytes is over the limit of {MAX_HEADER_BYTES}"
        )
    if blen > max_body:
        raise _FrameError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"message of {blen} bytes is over the limit of {max_body} bytes (max_message_bytes)",
        )
    small = blen <= _SMALL  # header and body in one read (the body copied out: ~1 us at 32 KiB)
    raw = bytearray(hlen + blen if small else hlen)
    _fill(rfile, raw, 0, sock, deadline)
    try:
        header = msgpack.unpackb(memoryview(raw)[:hlen], raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - any msgpack failure is a bad frame
        raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"unparsable frame header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"frame header is a {type(header).__name__}, not a map")
    if small:
        return header, raw[hlen:]
    if blen <= _EAGER:
        # not zeroed first (a bytearray is: ~80 us per MiB, a tenth of a dense push's receiving)
        view = np.empty(blen, np.uint8).data
        _fill(rfile, view, 0, sock, deadline)
        return header, view
    body = bytearray(min(blen, _EAGER))
    got = 0
    while True:
        _fill(rfile, body, got, sock, deadline)
        got = len(body)
        if got == blen:
            return header, body
        body.extend(bytes(min(blen, 2 * got) - got))  # (no memoryview of body is alive here)


def _metadata(md: Any, what: str) -> tuple[tuple[str, Any], ...]:
    if md is None:
        return ()
    if not isinstance(md, (list, tuple)):
        raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: metadata is not a list of [key, value] pairs")
    out = []
    for item in md:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], (str, bytes))):
            raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: metadata item {item!r} is not [str, str|bytes]")
        out.append((item[0], item[1]))
    return tuple(out)


def _hard_shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw fd, also under TLS: wakes a blocked reader


def _close_after_error(sock: socket.socket, header: dict, wait: float = 1.0) -> None:
    """Send a status frame, then let the peer read it: stop writing, discard what it still sends
    (bounded), close. (Closing with unread input would reset the connection and lose the frame.)"""
    try:
        sock.settimeout(wait)
        sock.sendall(_pack(header))
    except OSError:
        pass
    _linger_close(sock, wait)


def _linger_close(sock: socket.socket, wait: float = 1.0) -> None:
    try:
        sock.settimeout(wait)
        if not isinstance(sock, ssl.SSLSocket):
            sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _status(code: grpc.StatusCode, msg: str, trailing: Iterable[tuple[str, Any]] = (), **extra: Any) -> dict:
    return {"code": code.name, "msg": msg, "tm": [[k, v] for k, v in trailing], **extra}


# ---------------------------------------------------------------------- server
class _Details(grpc.HandlerCallDetails):
    """What an interceptor sees of a call: gRPC's fields, and what the bulk plane knows already:
    ``plane`` ("bulk": the connection's own thread serves it) and the connection's ``auth_context``
    (its client certificate), so ``Access`` admits every call before its handler runs."""

    def __init__(self, method: str, metadata: tuple, auth_context: dict | None = None) -> None:
        self.method = method
        self.invocation_metadata = metadata
        self.plane = "bulk"
        self.auth_context = auth_context if auth_context is not None else {}


class _Abort(Exception):
    """Raised by the context's abort() (gRPC raises a bare Exception likewise)."""


class _Conn:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.rfile: Any = None
        self.alive = True
        self.metadata: tuple = ()
        self.auth: dict[str, list[bytes]] = {}
        self.identity: str | None = None  # once authenticated (an identity's connections are counted)

    def kill(self) -> None:
        self.alive = False
        _hard_shutdown(self.sock)


class _Context:
    """What a handler gets instead of ``grpc.ServicerContext`` (the methods the runtime uses)."""

    def __init__(self, conn: _Conn, metadata: tuple, timeout: float | None) -> None:
        self._conn = conn
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + float(timeout)
        self.done = False
        self.cancelled = False
        self.aborted = False
        self._code: grpc.StatusCode | None = None  # set by abort() / set_code()
        self._details: str | None = None
        self.trailing: tuple = ()
        self._callbacks: list[Callable[[], None]] = []

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return dict(self._conn.auth)

    def peer(self) -> str:
        return self._conn.peer

    def peer_identities(self) -> list[bytes] | None:
        return self._conn.auth.get("x509_common_name") or None

    def peer_identity_key(self) -> str | None:
        return "x509_common_name" if self._conn.auth.get("x509_common_name") else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        if self.done or self.cancelled or not self._conn.alive:
            return False
        return self._deadline is None or time.monotonic() < self._deadline

    def cancel(self) -> None:
        """End the call from any thread: closes the connection (the request iterator raises)."""
        self.cancelled = True
        self._conn.kill()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        if code == grpc.StatusCode.OK:
            log.error("abort() called with StatusCode.OK: answering UNKNOWN")
            code = grpc.StatusCode.UNKNOWN
        self.aborted, self._code, self._details = True, code, details
        raise _Abort(details)

    def abort_with_status(self, status: Any) -> None:
        self.set_trailing_metadata(status.trailing_metadata or ())
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, md: Iterable[tuple[str, Any]]) -> None:
        self.trailing = tuple((k, v) for k, v in md)

    def send_initial_metadata(self, md: Any) -> None:
        pass

    def set_compression(self, compression: Any) -> None:
        pass

    def disable_next_message_compression(self) -> None:
        pass

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._callbacks.append(callback)
        return True

    def finish(self) -> None:
        self.done = True
        for fn in self._callbacks:
            try:
                fn()
            except Exception:
                log.exception("bulk call callback failed")


class BulkServer:
    """A running bulk endpoint (see :func:`serve_bulk`): ``port``, ``connections``, ``stop()``."""

    def __init__(
        self, handlers: Sequence[grpc.GenericRpcHandler], listener: socket.socket, security: ServerSecurity,
        authenticate: Callable[[Any, Any], Any], max_message_bytes: int, max_connections: int,
        idle_timeout_s: float, handshake_timeout_s: float, name: str, interceptors: Sequence[grpc.ServerInterceptor] = (),
        max_connections_per_identity: int = 0,
    ) -> None:
        self._handlers = tuple(handlers)
        self._interceptors = tuple(interceptors)
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._auth = authenticate
        self._max_body = max_message_bytes
        self._max_conns = max_connections
        # one identity cannot take every connection (thread) of the endpoint: by default an eighth
        self._max_per_identity = max_connections_per_identity or max(4, max_connections // 8)
        self._per_identity: dict[str, int] = {}
        self._idle = idle_timeout_s
        self._hs_timeout = handshake_timeout_s
        self._name = name
        self._ssl = _server_context(security) if security.tls else None
        self._lock = threading.Lock()
        self._conns: dict[threading.Thread, _Conn] = {}
        self._busy = 0
        self._stopping = False
        self._seq = 0
        self.refused = 0  # connections refused at the handshake or over max_connections
        self._accept = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._accept.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- accept
    def _accept_loop(self) -> None:
        last_log = 0.0
        while not self._stopping:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping:
                    return
                # (EMFILE, ENFILE, ENOBUFS, ECONNABORTED ...: passing; the endpoint goes on accepting)
                now = time.monotonic()
                if now - last_log > 5.0:
                    last_log = now
                    log.error("%s: accept failed (%s): retrying", self._name, e)
                time.sleep(0.2)
                continue
            t: threading.Thread | None = None
            try:
                _tune(sock)
                peer = f"ipv4:{addr[0]}:{addr[1]}" if sock.family == socket.AF_INET else f"ipv6:[{addr[0]}]:{addr[1]}"
                with self._lock:
                    full = len(self._conns) >= self._max_conns or self._stopping
                    if not full:
                        self._seq += 1
                        conn = _Conn(sock, peer)
                        t = threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn-{self._seq}", daemon=True)
                        self._conns[t] = conn
                if t is None:  # full
                    self.refused += 1
                    self._refuse_full(sock)
                    continue
                t.start()
            except Exception:
                log.exception("%s: could not start serving a connection", self._name)
                if t is not None:
                    with self._lock:
                        self._conns.pop(t, None)
                with contextlib.suppress(OSError):
                    sock.close()

    def _refuse_full(self, sock: socket.socket) -> None:
        """Refuse a connection over ``max_connections`` without blocking the accept thread: in plaintext
        one non-blocking send of the RESOURCE_EXHAUSTED status frame, then close; over TLS (a handshake
        would block) close at once: that client sees UNAVAILABLE (connection lost during the handshake)."""
        try:
            if self._ssl is None:
                msg = f"the bulk endpoint has {self._max_conns} connections already (max_connections)"
                sock.setblocking(False)
                sock.send(_pack(_status(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)))
                sock.shutdown(socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    sock.recv(1 << 16)  # what already came (the hello): closing with it unread would reset
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    # -- one connection
    def _serve(self, conn: _Conn) -> None:
        me = threading.current_thread()
        try:
            self._serve_conn(conn)
        except Exception:
            log.exception("%s: connection from %s failed", self._name, conn.peer)
        finally:
            conn.alive = False
            with contextlib.suppress(Exception):
                if conn.rfile is not None:
                    conn.rfile.close()
            with contextlib.suppress(OSError):
                conn.sock.close()
            with self._lock:
                self._conns.pop(me, None)
                if conn.identity is not None:
                    n = self._per_identity.get(conn.identity, 1) - 1
                    if n > 0:
                        self._per_identity[conn.identity] = n
                    else:
                        self._per_identity.pop(conn.identity, None)

    def _serve_conn(self, conn: _Conn) -> None:
        # the whole handshake (TLS included) within handshake_timeout_s: a client trickling bytes
        # cannot hold one of the max_connections slots
        timer = threading.Timer(self._hs_timeout, conn.kill)
        timer.daemon = True
        timer.start()
        try:
            if not self._handshake(conn):
                return
        finally:
            timer.cancel()
        if not conn.alive:
            return
        conn.sock.sendall(_pack({"ok": True}))
        self._serve_calls(conn)

    def _handshake(self, conn: _Conn) -> bool:
        """TLS, hello, authentication: True if the connection may call."""
        conn.sock.settimeout(self._hs_timeout)
        if self._ssl is not None:
            try:
                conn.sock = self._ssl.wrap_socket(conn.sock, server_side=True)
            except (OSError, ssl.SSLError) as e:
                log.info("%s: TLS handshake with %s failed: %s", self._name, conn.peer, e)
                return False
            cert = conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None
            conn.auth = {"transport_security_type": [b"ssl"]}
            subject: Any = (cert or {}).get("subject", ())
            cns = [str(v).encode() for rdn in subject for k, v in rdn if k == "commonName"]
            if cns:
                conn.auth["x509_common_name"] = cns
        conn.rfile = conn.sock.makefile("rb", buffering=1 << 16)
        try:
            hello, _ = _recv(conn.rfile, 0)
            if hello.get("v") != 1:
                raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"handshake: unknown protocol version {hello.get('v')!r} (this server speaks 1)")
            conn.metadata = _metadata(hello.get("md"), "handshake")
        except _FrameError as e:
            _close_after_error(conn.sock, _status(e.code, f"handshake: {e}"))
            return False
        except (OSError, _Closed) as e:
            log.info("%s: no handshake from %s: %s", self._name, conn.peer, e)
            return False
        try:
            caller = self._auth(conn.metadata, conn.auth)
        except UnauthenticatedError as e:
            self.refused += 1
            _close_after_error(conn.sock, _status(grpc.StatusCode.UNAUTHENTICATED, str(e), [(ERROR_CLASS_HEADER, type(e).__name__)]))
            return False
        except Exception as e:
            log.exception("%s: authenticating %s failed", self._name, conn.peer)
            _close_after_error(conn.sock, _status(grpc.StatusCode.INTERNAL, f"authentication failed: {type(e).__name__}: {e}"))
            return False
        who = getattr(caller, "identity", None)
        if who:  # a named identity holds at most max_connections_per_identity connections (threads) here
            with self._lock:
                full = self._per_identity.get(who, 0) >= self._max_per_identity
                if not full:
                    self._per_identity[who] = self._per_identity.get(who, 0) + 1
                    conn.identity = who
            if full:
                self.refused += 1
                msg = (f"identity {who!r} has {self._max_per_identity} bulk connections already "
                       "(max_connections_per_identity); close one or use gRPC")
                _close_after_error(conn.sock, _status(grpc.StatusCode.RESOURCE_EXHAUSTED, msg))
                return False
        return True

    def _serve_calls(self, conn: _Conn) -> None:
        while conn.alive and not self._stopping:
            conn.sock.settimeout(self._idle)
            try:
                header, body = _recv(conn.rfile, self._max_body)
            except _FrameError as e:
                _close_after_error(conn.sock, _status(e.code, str(e)))
                return
            except (OSError, _Closed, ValueError) as e:
                if _deadline_passed(e):
                    log.info("%s: %s idle for %.0f s: closed", self._name, conn.peer, self._idle)
                return
            conn.sock.settimeout(None)
            with self._lock:
                self._busy += 1
            try:
                if not self._call(conn, header, body):
                    return
            finally:
                with self._lock:
                    self._busy -= 1

    def _lookup(self, method: str, metadata: tuple, auth_context: dict | None = None) -> Any:
        return self._service(0, _Details(method, metadata, auth_context))

    def _service(self, i: int, details: Any) -> Any:
        """The handler for ``details`` through interceptors i.. (the first is the outermost, as gRPC's)."""
        if i < len(self._interceptors):
            return self._interceptors[i].intercept_service(lambda d: self._service(i + 1, d), details)
        for h in self._handlers:
            handler = h.service(details)
            if handler is not None:
                return handler
        return None

    def _call(self, conn: _Conn, first: dict, body: bytearray) -> bool:
        """Serve one call whose first request frame was read; False when the connection must close."""
        method = first.get("m")
        timeout = first.get("t")
        try:
            if not isinstance(method, str):
                raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"request frame without a method name ('m'): {first!r}"[:300])
            if timeout is not None and not isinstance(timeout, (int, float)):
                raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: deadline 't' is {timeout!r}, not seconds")
            call_md = _metadata(first.get("md"), method)
        except _FrameError as e:
            _close_after_error(conn.sock, _status(e.code, str(e)))
            return False
        state = {"end": bool(first.get("end", True)), "broken": False}
        ctx = _Context(conn, conn.metadata + call_md, timeout)
        try:
            handler = self._lookup(method, ctx.invocation_metadata(), ctx.auth_context())
        except Exception as e:
            log.exception("%s: looking up the handler failed", method)
            return self._finish(conn, ctx, state, _status(grpc.StatusCode.INTERNAL, f"{method}: {type(e).__name__}: {e}"))
        if handler is None:
            return self._finish(conn, ctx, state, _status(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}"))
        deser = handler.request_deserializer
        ser = handler.response_serializer

        def requests() -> Iterator[Any]:
            msg: Any = None if first.get("none") else body
            while True:
                if msg is not None:
                    yield deser(msg) if deser is not None else msg
                if state["end"]:
                    return
                try:
                    conn.sock.settimeout(self._idle)
                    h, msg = _recv(conn.rfile, self._max_body)
                except _FrameError as e:
                    state["broken"] = True
                    conn.alive = False
                    with contextlib.suppress(OSError):
                        _close_after_error(conn.sock, _status(e.code, str(e)))
                    raise _StreamBroken(f"{method}: bad request frame: {e}") from None
                except (OSError, _Closed, ValueError) as e:
                    state["broken"] = True
                    conn.alive = False
                    raise _StreamBroken(f"{method}: request stream broken ({'cancelled' if ctx.cancelled else e})") from None
                finally:
                    with contextlib.suppress(OSError):
                        conn.sock.settimeout(None)
                state["end"] = bool(h.get("end", True))
                if h.get("none"):
                    msg = None

        def out(response: Any) -> Any:
            return ser(response) if ser is not None else response

        try:
            try:
                if handler.request_streaming:
                    request: Any = requests()
                elif first.get("none"):
                    raise _FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: a unary call without a request message")
                else:
                    request = deser(body) if deser is not None else body
                if handler.response_streaming:
                    fn = handler.stream_stream if handler.request_streaming else handler.unary_stream
                    for response in fn(request, ctx):
                        if state["broken"] or not conn.alive:
                            break
                        _send(conn.sock, {"more": True}, out(response))
                    reply = None
                else:
                    fn = handler.stream_unary if handler.request_streaming else handler.unary_unary
                    reply = fn(request, ctx)
            except _Abort:
                reply = None
            except _FrameError as e:
                return self._finish(conn, ctx, state, _status(e.code, str(e)))
            except Exception as e:
                if ctx.aborted:
                    reply = None
                else:
                    if conn.alive:
                        log.exception("%s: %s raised", self._name, method)
                    return self._finish(conn, ctx, state, _status(grpc.StatusCode.INTERNAL, f"Exception calling application: {e}"))
            if not conn.alive or state["broken"]:
                return False
            code = ctx.code() or grpc.StatusCode.OK
            status = _status(code, ctx.details() or "", ctx.trailing)
            if code == grpc.StatusCode.OK and not handler.response_streaming:
                if reply is None:
                    return self._finish(conn, ctx, state, _status(grpc.StatusCode.INTERNAL, f"{method}: the handler returned no reply"))
                body_out = out(reply)
                if not state["end"] and not self._drain(conn, state):
                    status["close"] = True
                _send(conn.sock, {"more": True}, body_out, tail=_pack(status))
                ctx.finish()
                return state["end"] or self._drop(conn)
            return self._finish(conn, ctx, state, status)
        except (OSError, _Closed) as e:
            log.info("%s: %s to %s: connection lost (%s)", self._name, method, conn.peer, e)
            conn.alive = False
            return False
        finally:
            if not ctx.done:
                ctx.finish()

    def _drain(self, conn: _Conn, state: dict, within: float = 1.0, most: int = 1 << 20) -> bool:
        """The handler succeeded before reading its request stream's end (a push that commits at its
        last chunk): read what the client still sends (its end-of-stream frame, as a rule) for at most
        ``within`` seconds and ``most`` body bytes, so the connection can serve its next call. True if
        the stream ended; else the caller closes the connection after its status."""
        deadline = time.monotonic() + within
        seen = 0
        try:
            while not state["end"]:
                left = deadline - time.monotonic()
                if left <= 0 or seen >= most:
                    return False
                header, body = _recv(conn.rfile, min(self._max_body, most - seen), conn.sock, deadline)
                seen += len(body)
                state["end"] = bool(header.get("end", True))
            return True
        except (OSError, _Closed, ValueError, _FrameError):
            state["broken"] = True  # a frame half read: this connection is done
            return False
        finally:
            with contextlib.suppress(OSError):
                conn.sock.settimeout(None)

    def _finish(self, conn: _Conn, ctx: _Context, state: dict, status: dict) -> bool:
        ctx.finish()
        if state["broken"] or not conn.alive:
            return False
        if not state["end"] and status.get("code") == "OK":
            self._drain(conn, state)
            if state["broken"]:
                return False
        if not state["end"]:  # the client is still sending: tell it, and close once it has read this
            status["close"] = True
            _close_after_error(conn.sock, status)
            conn.alive = False
            return False
        conn.sock.sendall(_pack(status))
        return True

    def _drop(self, conn: _Conn) -> bool:
        conn.alive = False
        _linger_close(conn.sock)
        return False

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting, wait up to ``grace`` seconds for calls in flight, close every
        connection and join the threads."""
        self._stopping = True
        _hard_shutdown(self._listener)
        with contextlib.suppress(OSError):
            self._listener.close()
        if grace:
            end = time.monotonic() + grace
            while time.monotonic() < end:
                with self._lock:
                    if not self._busy:
                        break
                time.sleep(0.01)
        with self._lock:
            conns = list(self._conns.items())
        for _, conn in conns:
            conn.kill()
        end = time.monotonic() + 5.0  # one deadline for every thread
        self._accept.join(timeout=5.0)
        for t, _ in conns:
            if t.ident is None:  # never started (its start failed)
                continue
            t.join(timeout=max(0.0, end - time.monotonic()))
            if t.is_alive():
                log.warning("%s: %s still running after stop() (a handler that does not return)", self._name, t.name)


def _server_context(security: ServerSecurity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with pem_file(security.tls_cert) as cert, pem_file(security.tls_key) as key:  # type: ignore[arg-type]
        ctx.load_cert_chain(cert, key)
    if security.mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=read_pem(security.tls_ca).decode())  # type: ignore[arg-type]
    return ctx


def serve_bulk(
    handlers: Sequence[grpc.GenericRpcHandler], host: str, port: int, security: ServerSecurity,
    authenticate: Callable[[Any, Any], Any], *, max_message_bytes: int = 64 << 20, max_connections: int = 256,
    idle_timeout_s: float = 300.0, handshake_timeout_s: float = 5.0, name: str = "bulk",
    interceptors: Sequence[grpc.ServerInterceptor] = (), max_connections_per_identity: int = 0,
) -> BulkServer:
    """Serve ``handlers`` (the ``grpc.GenericRpcHandler``s given to ``build_server``) on
    ``host:port`` (0 picks a port) over the bulk wire (module doc). ``authenticate(metadata,
    auth_context)`` (e.g. ``Access.caller``) runs at each connection's handshake and refuses it by
    raising ``UnauthenticatedError``. ``interceptors``: gRPC server interceptors, applied to every
    call as a gRPC server applies them (e.g. ``tessera.metrics.MetricsInterceptor``, and
    ``Access.interceptor()``: the same admission as the gRPC server's). An identity
    ``authenticate`` names (its result's ``identity``) holds at most ``max_connections_per_identity``
    connections (default max(4, max_connections / 8)); one more is refused RESOURCE_EXHAUSTED at the
    handshake. Raises ``ConfigError`` (``security.check``) or ``BindError``."""
    security.check(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # a restarted server may take its port back while old connections are in TIME_WAIT (on Linux
    # this never lets two listeners share a port; gRPC sets it too)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host.strip("[]"), port))
        listener.listen(128)
    except OSError as e:
        listener.close()
        raise BindError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): the port is in use, or {host} is not an address of "
            "this machine (choose another port, 0 for a free one, or another host)"
        ) from None
    listener.settimeout(0.5)
    return BulkServer(
        handlers, listener, security, authenticate, max_message_bytes, max_connections, idle_timeout_s,
        handshake_timeout_s, name, interceptors, max_connections_per_identity,
    )


# ---------------------------------------------------------------------- client
class _ClientConn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile = sock.makefile("rb", buffering=1 << 16)

    def close(self) -> None:
        _hard_shutdown(self.sock)
        with contextlib.suppress(Exception):
            self.rfile.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def stale(self) -> bool:
        """An idle connection with something to read (EOF, or bytes nobody asked for) is unusable."""
        try:
            if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                return True
            p = select.poll()  # (select.select fails for a descriptor >= 1024)
            p.register(self.sock, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True


def _unavailable(address: str, e: BaseException, tls: bool, during: str, client_cert: bool = True) -> BulkCallError:
    if isinstance(e, ssl.SSLError):
        reason = f"{e.reason or ''} {e}"
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
            likely = "the server does not speak TLS (plaintext): drop the client's tls_ca, or give the server a certificate"
        elif "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason:
            likely = "the server wants a client certificate (mutual TLS): give the client its tls_cert and tls_key"
        elif isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in reason:
            likely = "the server's certificate is not signed by this client's tls_ca, or not valid for this address"
        elif isinstance(e, ssl.SSLEOFError) and not client_cert:
            # (TLS 1.3: the server checks the client's certificate after the client's side of the handshake
            # is done, and may close before its alert is read)
            likely = "the server closed the TLS connection: it may want a client certificate (mutual TLS): give the client its tls_cert and tls_key"
        else:
            likely = "client and server disagree about TLS"
        why = f"TLS handshake with {address} failed ({e}): {likely}"
    elif isinstance(e, (_Closed, ConnectionResetError, BrokenPipeError)) and during == "handshake" and not tls:
        why = (
            f"{address} closed the connection during the handshake: it may speak TLS while this client connects in "
            "plaintext (give the client its tls_ca)"
        )
    elif isinstance(e, ConnectionRefusedError):
        why = f"nothing is listening at {address} (connection refused)"
    else:
        why = f"connection to {address} lost during the {during} ({type(e).__name__}: {e})"
    return BulkCallError(grpc.StatusCode.UNAVAILABLE, why)


def _error(header: dict) -> BulkCallError:
    code = _CODES.get(str(header.get("code")), grpc.StatusCode.UNKNOWN)
    trailing = tuple((str(k), v) for k, v in (header.get("tm") or ()))
    return BulkCallError(code, str(header.get("msg") or ""), trailing)


class BulkChannel:
    """Client of a bulk endpoint: a pool of connections, grpc.Channel-like multi-callables.
    Thread-safe; errors are :class:`BulkCallError` (a ``grpc.RpcError``)."""

    # while a call waits for its reply: every LIVENESS_EVERY_S without a byte, ``liveness(timeout)`` is
    # asked whether the server is still there (a reason string if not): the call is then UNAVAILABLE
    LIVENESS_EVERY_S = 1.0
    LIVENESS_TIMEOUT_S = 3.0

    def __init__(
        self, address: str, security: ClientSecurity | None = None, *, max_message_bytes: int = 64 << 20,
        pool_size: int = 8, connect_timeout: float = 5.0, liveness: Callable[[float], str | None] | None = None,
    ) -> None:
        """``liveness``: TCP keepalive finds a dead host or a cut link, but a stopped or frozen server
        process on a live host keeps its connections open; a caller that can tell (``ps.stub``: the
        shard's gRPC channel, whose keepalive pings the server's gRPC core answers) passes it, and a
        waiting call then fails within seconds instead of at its deadline, as a gRPC call would."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bulk address {address!r} is not HOST:PORT")
        self.address = address
        self._host, self._port = host.strip("[]") or "127.0.0.1", int(port)
        self._sec = security or ClientSecurity()
        self._max_body = max_message_bytes
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._liveness = liveness
        self._lock = threading.Lock()
        self._idle: list[_ClientConn] = []
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        if self._sec.tls_ca:
            ctx = ssl.create_default_context(cadata=read_pem(self._sec.tls_ca).decode())
            if self._sec.tls_cert and self._sec.tls_key:
                with pem_file(self._sec.tls_cert) as c, pem_file(self._sec.tls_key) as k:
                    ctx.load_cert_chain(c, k)
            self._ssl = ctx
        self._hello = _pack({"v": 1, "md": [[TOKEN_HEADER, f"Bearer {self._sec.token}"]] if self._sec.token else []})
        # a request stream is written by its own thread while the caller reads the replies; an OpenSSL
        # connection must not be read and written from two threads at once, so over TLS only calls
        # with one request (unary, unary_stream: one direction at a time) are offered
        self.full_duplex = self._ssl is None

    # -- connections
    def _open(self, timeout: float | None) -> _ClientConn:
        t = self._connect_timeout if timeout is None else max(0.001, min(self._connect_timeout, timeout))
        try:
            sock = socket.create_connection((self._host, self._port), timeout=t)
        except TimeoutError:
            raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"no connection to {self.address} within {t:.3g} s") from None
        except OSError as e:
            raise _unavailable(self.address, e, self._ssl is not None, "connect") from None
        try:
            _tune(sock)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._sec.server_name or self._host)
            conn = _ClientConn(sock)
        except (OSError, ssl.SSLError) as e:
            with contextlib.suppress(OSError):
                sock.close()
            raise _unavailable(self.address, e, self._ssl is not None, "TLS handshake", bool(self._sec.tls_cert)) from None
        try:
            sock.sendall(self._hello)
            header, _ = _recv(conn.rfile, 0)
        except _FrameError as e:
            conn.close()
            raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"{self.address} answered the handshake with a bad frame: {e}") from None
        except (OSError, _Closed, ValueError) as e:
            conn.close()
            if isinstance(e, socket.timeout):
                raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"{self.address}: no handshake answer within {t:.3g} s") from None
            raise _unavailable(self.address, e, self._ssl is not None, "handshake", bool(self._sec.tls_cert)) from None
        if not header.get("ok"):
            conn.close()
            raise _error(header)
        return conn

    def connect(self, timeout: float | None = None) -> None:
        """Open one connection (handshake included) and pool it: raises :class:`BulkCallError`
        (UNAVAILABLE, UNAUTHENTICATED ...) if the endpoint cannot be reached or refuses."""
        self._put(self._get(timeout))

    def _get(self, timeout: float | None) -> _ClientConn:
        with self._lock:
            if self._closed:
                raise BulkCallError(grpc.StatusCode.CANCELLED, f"the bulk channel to {self.address} is closed")
            while self._idle:
                conn = self._idle.pop()
                if not conn.stale():
                    return conn
                conn.close()
        return self._open(timeout)

    def _put(self, conn: _ClientConn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._pool_size:
                conn.sock.settimeout(None)
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> BulkChannel:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls
    def _size_check(self, method: str, body: Any) -> None:
        n = body.nbytes if isinstance(body, Packed) else memoryview(body).nbytes
        if n > self._max_body:
            raise BulkCallError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: request of {n} bytes is over this client's max_message_bytes ({self._max_body})",
            )

    def _replies(self, conn: _ClientConn, method: str, deadline: float | None, timeout: float | None,
                 call: _CallState | None = None) -> Iterator[Any]:
        """Reply bodies, then returns (pooling the connection) or raises; closes it when abandoned."""
        done = False
        try:
            self._await_reply(conn, method, deadline)
            while True:
                try:
                    header, body = _recv(conn.rfile, self._max_body, conn.sock, deadline)
                except _FrameError as e:
                    raise BulkCallError(e.code, f"{method}: reply: {e}") from None
                except (OSError, _Closed, ValueError) as e:
                    if _deadline_passed(e):
                        raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: deadline of {timeout:.3g} s exceeded") from None
                    raise _unavailable(self.address, e, self._ssl is not None, f"call {method}") from None
                if header.get("more"):
                    if deadline is not None and time.monotonic() > deadline:
                        raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: deadline of {timeout:.3g} s exceeded")
                    yield body
                    continue
                done = True
                cancelled = call is not None and not call.finish()
                if header.get("close") or cancelled:
                    conn.close()
                else:
                    self._put(conn)
                if header.get("code") != "OK":
                    raise _error(header)
                return
        finally:
            if not done:
                conn.close()

    def _await_reply(self, conn: _ClientConn, method: str, deadline: float | None) -> None:
        """Until a reply's first bytes arrive (or the deadline, which the read then reports): every
        LIVENESS_EVERY_S of silence, ask ``liveness``; UNAVAILABLE if the server is gone. (Before a
        reply the connection's read buffer is empty: a pooled connection is never stale.)"""
        if self._liveness is None:
            return
        poll = select.poll()
        poll.register(conn.sock, select.POLLIN)
        while not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            wait = self.LIVENESS_EVERY_S if left is None else min(self.LIVENESS_EVERY_S, left)
            if poll.poll(1000 * wait):
                return
            why = self._liveness(self.LIVENESS_TIMEOUT_S if left is None else max(0.001, min(self.LIVENESS_TIMEOUT_S, left)))
            if why:
                raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"{method}: {self.address} stopped answering while the call waited: {why}")

    def _start(self, method: str, timeout: float | None, metadata: Any) -> tuple[_ClientConn, dict, float | None]:
        if timeout is not None and timeout <= 0:
            raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: deadline of {timeout:.3g} s exceeded")
        conn = self._get(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        conn.sock.settimeout(timeout)
        head: dict = {"m": method, "t": timeout, "end": True}
        if metadata:
            head["md"] = [[k, v] for k, v in metadata]
        return conn, head, deadline

    def _request(self, method: str, request: Any, serializer: Any, timeout: float | None,
                 metadata: Any) -> tuple[_ClientConn, float | None]:
        """Send a one-message call's request: (its connection, its deadline); the replies are read next."""
        body = serializer(request) if serializer is not None else request
        self._size_check(method, body)
        conn, head, deadline = self._start(method, timeout, metadata)
        try:
            _until(conn.sock, deadline)
            _send(conn.sock, head, body)
        except OSError as e:
            if _deadline_passed(e):
                conn.close()
                raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: deadline of {timeout:.3g} s exceeded") from None
            # the server may have answered (e.g. a refusal) and closed, or the link is gone: the replies say
        return conn, deadline

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    **_: Any) -> _Unary:
        return _Unary(self, method, request_serializer, response_deserializer)

    def unary_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **_: Any) -> Callable[..., Iterator[Any]]:
        def call(request: Any, timeout: float | None = None, metadata: Any = None, **__: Any) -> Iterator[Any]:
            conn, deadline = self._request(method, request, request_serializer, timeout, metadata)
            state = _CallState(conn)
            return _ReplyStream(self._replies(conn, method, deadline, timeout, state), state, response_deserializer)

        return call

    def stream_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                      **_: Any) -> Callable[..., Iterator[Any]]:
        def call(requests: Iterable[Any], timeout: float | None = None, metadata: Any = None, **__: Any) -> Iterator[Any]:
            if not self.full_duplex:
                raise BulkCallError(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"{method}: request streams are not sent over TLS here (reading and writing one TLS connection from "
                    "two threads at once is not safe): use gRPC for this call",
                )
            conn, head, deadline = self._start(method, timeout, metadata)
            failure: list[BaseException] = []

            def write() -> None:
                h = dict(head)
                h["end"] = False
                try:
                    for request in requests:
                        body = request_serializer(request) if request_serializer is not None else request
                        self._size_check(method, body)
                        _until(conn.sock, deadline)
                        _send(conn.sock, h, body)
                        h = {"m": method, "end": False}
                    h["end"], h["none"] = True, True
                    _until(conn.sock, deadline)
                    conn.sock.sendall(_pack(h))
                except OSError:
                    # (a deadline passed, the server went away or answered and closed): the reader
                    # fails at once, or reads the answer already received, instead of waiting
                    _hard_shutdown(conn.sock)
                except BaseException as e:  # noqa: BLE001 - the request iterator failed: the call fails
                    failure.append(e)
                    conn.close()

            writer = threading.Thread(target=write, name=f"bulk-writer{method}", daemon=True)
            writer.start()
            state = _CallState(conn)
            return _ReplyStream(self._replies(conn, method, deadline, timeout, state), state, response_deserializer, writer, failure)

        return call

    def stream_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     **_: Any) -> Callable[..., Any]:
        ss = self.stream_stream(method, request_serializer, response_deserializer)

        def call(requests: Iterable[Any], timeout: float | None = None, metadata: Any = None, **__: Any) -> Any:
            reply = None
            for reply in ss(requests, timeout=timeout, metadata=metadata):
                pass
            return reply

        return call


class _Unary:
    """A unary multi-callable, as gRPC's: ``call(request, timeout=...)`` answers the reply;
    ``future(request, timeout=...)`` sends the request now and reads the reply on the thread that asks
    for ``result()``, so a caller can send to several servers before waiting for any, with no thread.
    The call's errors (also a failed send) are raised by ``result()``; ask for it once."""

    def __init__(self, channel: BulkChannel, method: str, serializer: Any, deserializer: Any) -> None:
        self._channel, self._method, self._ser, self._deser = channel, method, serializer, deserializer

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any) -> Any:
        return self.future(request, timeout, metadata).result()

    def future(self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any) -> _Reply:
        ch, method = self._channel, self._method
        try:
            conn, deadline = ch._request(method, request, self._ser, timeout, metadata)
        except BulkCallError as e:
            return _Reply(e)
        return _Reply(lambda: ch._replies(conn, method, deadline, timeout), self._deser)


class _Reply:
    """A unary call whose request is sent: ``result()`` reads its reply (or raises its error)."""

    def __init__(self, replies: Callable[[], Iterator[Any]] | BulkCallError, deserializer: Any = None) -> None:
        self._replies, self._deser = replies, deserializer

    def result(self, timeout: float | None = None) -> Any:  # (the call's own deadline bounds it)
        if isinstance(self._replies, BulkCallError):
            raise self._replies
        reply = None
        for reply in self._replies():
            pass
        return self._deser(reply) if self._deser is not None else reply


class _CallState:
    """One streaming call's end, shared by its reply reader and ``cancel()`` (which may be another thread)."""

    def __init__(self, conn: _ClientConn) -> None:
        self.conn = conn
        self.finished = False
        self.cancelled = False
        self._lock = threading.Lock()

    def finish(self) -> bool:
        """The reader got the status (before pooling the connection): False if the call was cancelled."""
        with self._lock:
            self.finished = True
            return not self.cancelled

    def cancel(self) -> bool:
        """Close the connection unless the call already finished (it may serve another call now)."""
        with self._lock:
            if self.finished or self.cancelled:
                return False
            self.cancelled = True
        self.conn.close()
        return True


class _ReplyStream:
    """The iterator a streaming call returns (also ``cancel()``, like a gRPC call)."""

    def __init__(self, replies: Iterator[Any], call: _CallState, deser: Any, writer: threading.Thread | None = None,
                 failure: list[BaseException] | None = None) -> None:
        self._replies, self._call, self._deser = replies, call, deser
        self._writer, self._failure = writer, (failure if failure is not None else [])
        self._code: grpc.StatusCode | None = None

    def __iter__(self) -> _ReplyStream:
        return self

    def __next__(self) -> Any:
        if self._call.cancelled:
            self._code = grpc.StatusCode.CANCELLED
            raise BulkCallError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        try:
            body = next(self._replies)
        except StopIteration:
            self._code = grpc.StatusCode.OK
            raise
        except BulkCallError as e:
            if self._call.cancelled:  # (cancel() closed the connection under this read)
                self._code = grpc.StatusCode.CANCELLED
                raise BulkCallError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!") from None
            # (the writer records a failed request iterator before it closes the connection)
            if self._failure and e.code() == grpc.StatusCode.UNAVAILABLE:
                f = self._failure[0]
                raise BulkCallError(grpc.StatusCode.UNKNOWN, f"the request iterator raised {type(f).__name__}: {f}") from f
            self._code = e.code()
            raise
        return self._deser(body) if self._deser is not None else body

    def cancel(self) -> bool:
        """Abandon the call: its connection is closed (the server's handler sees it end); after the
        call finished, nothing (its connection may carry another call by now). True if it cancelled."""
        if not self._call.cancel():
            return False
        with contextlib.suppress(Exception):
            self._replies.close()  # type: ignore[attr-defined]
        return True

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def __del__(self) -> None:
        if self._code is None:  # abandoned before its status: the connection cannot be reused
            self._call.cancel()

    def is_active(self) -> bool:
        return self._code is None
