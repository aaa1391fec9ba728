"""One shard as a client sees it: ``ShardStub``.

A shard is a primary and its backups (``"HOST:PORT|HOST:PORT"``). The stub holds a channel and the
method stubs (raw bytes in and out; the framing is ``ps.wire``'s) per replica, sends every call to
the current primary with a deadline, retries UNAVAILABLE (and a CANCELLED that the server's
shutdown caused) with jittered backoff (failing over to
whichever replica says it is primary with the highest epoch), and turns any other gRPC error into
the PS's typed error (``ps.errors``, through the two-way table ``ps.wire.ERRORS``) naming the shard.

``PSClient`` (``ps.client``) partitions tables over the shards, fans calls out to their stubs and
reassembles the results; everything about talking to one shard is here.

Thread-safety: a stub may be used by many threads at once (gRPC channels are; the failover state
is a replica index, replaced atomically).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from ps.errors import InternalError, PSError, ShardUnavailableError
from ps.wire import ERRORS
from tessera.bulk import BulkChannel
from tessera.codec import as_bytes
from tessera.service import ClientSecurity, channel_ready, client_channel
from tessera.v1 import ps_pb2 as pb

__all__ = ["SERVICE", "CallPolicy", "ShardStub", "typed_error"]

T = TypeVar("T")

log = logging.getLogger(__name__)

SERVICE = "/tessera.v1.ParameterServer/"

# retried with backoff (and failover): UNAVAILABLE, and CANCELLED, which a PSClient call only ever
# gets from the other side (it never cancels its own calls): a server shutting down cancels the calls
# in flight (a primary killed mid-call), as does a shard aborting a stalled push stream. Retrying is
# safe: pushes carry (client, seq) and are applied at most once; a retried BSP push is "late".
_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})

# a shard that answered: anything but these came from the server (DEADLINE_EXCEEDED may be a cut link)
_NOT_AN_ANSWER = _RETRIED | {grpc.StatusCode.DEADLINE_EXCEEDED}

_UNARY = ("CreateTable", "DescribeTable", "DropTable", "Stats", "PullSparse", "PushSparse", "Join", "Heartbeat", "Checkpoint", "Role", "Step")


@dataclass(frozen=True)
class CallPolicy:
    """Deadlines and retries of every call: ``timeout`` per attempt (s); UNAVAILABLE is retried for
    at most ``retry_timeout`` s (and ``retries`` retries; None: only the time bounds them)."""

    timeout: float = 60.0
    retries: int | None = None
    retry_timeout: float = 30.0


class _Replica:
    """One server of a shard: its channel and method stubs. With ``bulk``, the first call asks the
    server (Role) whether it serves ``tessera.bulk`` too; if so, and one connection to that port
    opens, every data call (all but Role) goes there, with the same security. If the advertised
    bulk port cannot be reached (port mapping, firewall) the calls stay on gRPC for ``BULK_COOLDOWN_S``
    (one warning), then the next call asks again. ``unresolve(gen)`` (after UNAVAILABLE: the server
    may have come back on another port) makes the next call ask again, unless another thread already
    did since generation ``gen``; the bulk channel it leaves is retired, not closed under the calls
    still on it (the two latest retired ones are kept open)."""

    BULK_COOLDOWN_S = 30.0
    _RETIRED_KEPT = 2

    def __init__(
        self, address: str, options: list, interceptors: Sequence[Any], security: ClientSecurity | None, bulk: bool,
    ) -> None:
        self.address = address
        self.channel = client_channel(address, security, options)
        if interceptors:
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        # a request may be a codec.Packed (its pieces, which the bulk channel sends as they are): gRPC joins it
        self._grpc = (
            {m: self.channel.unary_unary(SERVICE + m, request_serializer=as_bytes) for m in _UNARY},
            self.channel.stream_stream(SERVICE + "PushDense", request_serializer=as_bytes),
            self.channel.unary_stream(SERVICE + "PullDense", request_serializer=as_bytes),
        )
        self.unary, self.push_dense, self.pull_dense = dict(self._grpc[0]), self._grpc[1], self._grpc[2]
        # interceptors (a delay, for experiments) act on gRPC calls only: with them, every call stays on gRPC
        self._want_bulk = bulk and not interceptors
        self._security = security
        self._max_message = dict(options).get("grpc.max_send_message_length", 64 << 20)
        self.bulk: BulkChannel | None = None
        self._retired: list[BulkChannel] = []
        self.gen = 0  # bumped by every change of where the calls go
        self._fallback_until = 0.0  # on gRPC until then: the bulk port could not be reached
        self._resolved = not self._want_bulk
        self._lock = threading.Lock()

    def resolve(self, timeout: float) -> None:
        """Switch the data calls to the server's bulk port if it has one and it can be reached (raises
        grpc.RpcError if the server cannot be asked: the caller's retry handles that like any failed call)."""
        if self._resolved and not (self._fallback_until and time.monotonic() >= self._fallback_until):
            return
        with self._lock:
            if self._resolved and not (self._fallback_until and time.monotonic() >= self._fallback_until):
                return
            reply = pb.RoleReply.FromString(self._grpc[0]["Role"](pb.RoleRequest().SerializeToString(), timeout=timeout))
            if reply.bulk_port > 0:
                host = self.address.rsplit(":", 1)[0]
                ch = BulkChannel(f"{host}:{reply.bulk_port}", self._security, max_message_bytes=self._max_message,
                                 liveness=self._grpc_answers)
                try:
                    ch.connect(min(timeout, 5.0))
                except grpc.RpcError as e:
                    ch.close()
                    if not self._fallback_until:
                        log.warning(
                            "%s advertises bulk port %d but %s cannot be reached (%s): its calls go over gRPC; "
                            "trying bulk again every %.0f s", self.address, reply.bulk_port, ch.address,
                            e.details() if hasattr(e, "details") else e, self.BULK_COOLDOWN_S,
                        )
                    self._fallback_until = time.monotonic() + self.BULK_COOLDOWN_S
                    self._resolved = True
                    return
                if self._fallback_until:
                    log.warning("%s: bulk port %d reachable again: data calls over bulk", self.address, reply.bulk_port)
                self.unary.update({m: ch.unary_unary(SERVICE + m) for m in _UNARY if m != "Role"})
                self.pull_dense = ch.unary_stream(SERVICE + "PullDense")
                if ch.full_duplex:  # (over TLS a push stream stays on gRPC: see BulkChannel.full_duplex)
                    self.push_dense = ch.stream_stream(SERVICE + "PushDense")
                self.bulk = ch
                self.gen += 1
            self._fallback_until = 0.0
            self._resolved = True

    def _grpc_answers(self, timeout: float) -> str | None:
        """While a bulk call waits: None if the shard's gRPC channel is (or gets) READY within ``timeout``.
        Its keepalive pings (tessera.rpc) are answered by the shard's gRPC core, so a stopped or frozen
        shard process drops it within seconds: the bulk call then fails as a gRPC call would."""
        return None if channel_ready(self.channel, timeout) else f"its gRPC channel {self.address} is not answering ({timeout:.3g} s)"

    def unresolve(self, gen: int) -> None:
        """After a failed call that used generation ``gen``: ask the server again at the next call
        (nothing if the calls moved since ``gen``, or during a gRPC fallback's cool-down)."""
        with self._lock:
            if gen != self.gen or (self._fallback_until and time.monotonic() < self._fallback_until):
                return
            self.gen += 1
            if self.bulk is not None:
                self.unary, self.push_dense, self.pull_dense = dict(self._grpc[0]), self._grpc[1], self._grpc[2]
                self._retired.append(self.bulk)  # calls in flight may still use it
                self.bulk = None
                while len(self._retired) > self._RETIRED_KEPT:
                    self._retired.pop(0).close()
            self._resolved = not self._want_bulk

    def close(self) -> None:
        self.channel.close()
        for ch in [*self._retired, *([self.bulk] if self.bulk is not None else [])]:
            ch.close()


class ShardStub:
    """Shard ``index`` at ``spec`` (``"HOST:PORT"`` or ``"PRIMARY|BACKUP"``): calls go to the current primary."""

    def __init__(
        self, index: int, spec: str, options: list, policy: CallPolicy = CallPolicy(), interceptors: Sequence[Any] = (),
        security: ClientSecurity | None = None, bulk: bool = True, watch: Any = None,
    ) -> None:
        self.index = index
        # told of every retried UNAVAILABLE (``watch.unreachable(stub, error)``) and of every answer
        # (``watch.reached(stub)``, also an error reply): ``ps.outages.ShardWatch`` says when a shard
        # becomes unreachable, while it stays so, and when it is back
        self.watch = watch
        self.replicas = [_Replica(a, options, interceptors, security, bulk) for a in spec.split("|") if a]
        if not self.replicas:
            raise ValueError(f"shard {index}: no address in {spec!r}")
        self.policy = policy
        self.cur = 0
        self.label = f"{index} at {spec}"
        self.failovers = 0

    @property
    def address(self) -> str:
        return self.replicas[self.cur].address

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def wait_ready(self, timeout: float) -> None:
        """Block until the current primary accepts connections (ShardUnavailableError after ``timeout``)."""
        if not channel_ready(self.replicas[self.cur].channel, timeout):
            raise ShardUnavailableError(f"shard {self.label} not reachable within {timeout} s")

    # ------------------------------------------------------------------ calls
    def call(self, method: str, request: Any, table: str | None = None) -> bytes:
        """Unary ``method`` (a name in the .proto) with ``request`` (bytes, or a codec.Packed): the reply's bytes.
        Deadline and retries per ``policy``; errors raised typed (naming ``table`` where given)."""
        return self.retry(lambda: self._current().unary[method](request, timeout=self.policy.timeout), table)

    def start(self, method: str, request: Any, table: str | None = None) -> Callable[[], bytes]:
        """``call`` in two halves, for a fan-out with no thread: the request is sent now (one attempt) and
        the function returned waits for its reply, retrying as ``call`` does where that attempt failed."""
        try:
            first = self._current().unary[method].future(request, timeout=self.policy.timeout).result
        except grpc.RpcError:  # the server could not be asked where to send it: the retries begin
            first = None
        return lambda: self.retry(lambda: self._current().unary[method](request, timeout=self.policy.timeout), table, first)

    def _current(self) -> _Replica:
        r = self.replicas[self.cur]
        r.resolve(self.policy.timeout)
        return r

    def push_dense(self, requests: Iterator[Any]) -> Iterator[bytes]:
        """The PushDense stream of the current primary (one attempt; wrap it in ``retry``)."""
        return self._current().push_dense(requests, timeout=self.policy.timeout)

    def pull_dense(self, request: bytes) -> Iterator[bytes]:
        """The PullDense stream of the current primary (one attempt; wrap it in ``retry``)."""
        return self._current().pull_dense(request, timeout=self.policy.timeout)

    def retry(self, attempt: Callable[[], T], table: str | None = None, first: Callable[[], T] | None = None) -> T:
        """``attempt()`` until it does not fail UNAVAILABLE (or CANCELLED by the server), for at most ``policy.retry_timeout`` seconds
        (and ``policy.retries`` retries): jittered exponential backoff, and a failover check between
        attempts where the shard has replicas. Any gRPC error left is raised as the PS's typed error.
        ``first``: the first attempt's outcome, where it was started before (``start``)."""
        deadline = time.monotonic() + self.policy.retry_timeout
        try:
            n = 0
            while True:
                replica = self.replicas[self.cur]
                gen = replica.gen
                try:
                    replica.resolve(self.policy.timeout)
                    gen = replica.gen  # the generation this attempt's calls use
                    this, first = first or attempt, None
                    out = this()
                except grpc.RpcError as e:
                    code = e.code() if hasattr(e, "code") else None
                    if self.watch is not None:
                        if code == grpc.StatusCode.UNAVAILABLE:
                            self.watch.unreachable(self, e)
                        elif code not in _NOT_AN_ANSWER:
                            self.watch.reached(self)
                    if code not in _RETRIED or (self.policy.retries is not None and n >= self.policy.retries):
                        raise
                    # a restarted server may serve bulk on another port: ask again, once per generation
                    # (a fan-out's other calls that failed on the same channel do not thrash it)
                    replica.unresolve(gen)
                    cap = 2.0
                    if len(self.replicas) > 1:
                        before = self.cur
                        if self.failover() and self.cur != before:
                            n += 1
                            continue  # a new primary: try it now
                        cap = 0.5  # a backup may take over any moment: look again soon
                    delay = min(cap, 0.1 * 2**n) * (0.5 + random.random() / 2)
                    if time.monotonic() + delay > deadline:
                        raise
                    time.sleep(delay)
                    n += 1
                else:
                    if self.watch is not None:
                        self.watch.reached(self)
                    return out
        except grpc.RpcError as e:
            raise typed_error(e, self.label, table) from None

    def failover(self, timeout: float = 1.0) -> bool:
        """Point at the replica that says it is primary with the highest epoch; True if one does."""
        best: tuple[int, int] | None = None
        for j, r in enumerate(self.replicas):
            try:
                reply = pb.RoleReply.FromString(r.unary["Role"](pb.RoleRequest().SerializeToString(), timeout=timeout))
            except grpc.RpcError:
                continue
            if reply.role == "primary" and (best is None or reply.epoch > best[1]):
                best = (j, reply.epoch)
        if best is None:
            return False
        if best[0] != self.cur:
            self.cur = best[0]
            self.failovers += 1
        return True


def typed_error(e: grpc.RpcError, address: str, table: str | None = None) -> PSError:
    """The PS error class the status (and the server's tessera-error metadata) names, with the
    server's message, the shard and the code; ``err.code`` is the gRPC status code."""
    found, code, details = ERRORS.exception_of(e)
    cls: type[PSError] = found if issubclass(found, PSError) else InternalError
    if table is not None and f"table {table!r}" not in (details or ""):
        details = f"table {table!r}: {details}"  # e.g. gRPC's own "Received message larger than max"
    err = cls(f"{details} [shard {address}, {code.name if code else 'unknown'}]")
    err.code = code  # type: ignore[attr-defined]
    return err
