"""The federated gRPC servicer: decode, call the Registry, encode, map errors to status codes.

Requests arrive as raw bytes and are decoded here (not by gRPC), so malformed input
becomes INVALID_ARGUMENT with a message and bulk tensor bytes are read in place.
Admission (who may call, per-identity shares of the server's threads, draining) and the
handler wrapper with its error path are the kernel's (``tessera.service.Access`` and
``guarded_handler``), as for the PS: this module declares its methods' roles and waits.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any, Callable, Iterator

import grpc

from federated.config import ROLES
from federated.errors import MalformedMessageError, ResourceExhaustedError
from federated.protocol import Task
from federated.registry import Cancel, Registry, Shutdown, Stopping
from federated.wire import ERRORS, answer_from_chunks, blob_chunks, decode_message, task_to_proto
from tessera.service import ANONYMOUS, Access, Caller, Method, ServerSecurity, ServerStoppingError, guarded_handler
from tessera.v1 import fed_pb2 as pb

__all__ = ["FedServicer", "STATUS_OF", "SERVICE_NAME", "ROLES", "METHOD_ROLES", "WAITS"]

log = logging.getLogger(__name__)

SERVICE_NAME = "tessera.v1.Federated"

STATUS_OF = ERRORS.codes

# who may call what: a client's calls need the client role (a token file line without roles gets
# it); reader and admin identities may scrape /metrics only (ROLES: federated.config)
METHOD_ROLES: dict[str, frozenset[str]] = {m: frozenset({"client"}) for m in ("Connect", "Fetch", "Submit", "SubmitOne")}
# calls that hold a server thread for long: a node's Connect stream, and an upload the client feeds
WAITS = frozenset({"Connect", "Submit"})

_END = object()


class FedServicer:
    """Handlers take (request bytes or iterator of bytes, context, caller) and return bytes;
    :meth:`handlers` serves them through ``access`` (build the server with the same one).

    ``max_nodes`` bounds the Connect streams open at once (each holds a server thread).
    ``max_answer_bytes`` bounds one Submit (set by the server from the model size).
    Counters (``requests``, ``errors``, ``bytes_in``, ``bytes_out``) are for stats.
    """

    def __init__(self, registry: Registry, access: Access | None = None, chunk_bytes: int = 1 << 20, max_nodes: int = 256) -> None:
        self.registry = registry
        self.access = access or Access(ServerSecurity(), METHOD_ROLES, ROLES, waits=WAITS)
        self.max_nodes = max_nodes
        self.nodes = 0
        self.chunk_bytes = chunk_bytes
        self.max_answer_bytes = 1 << 30
        self.requests: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self._count_lock = threading.Lock()

    def handlers(self) -> grpc.GenericRpcHandler:
        """The gRPC handlers of ``tessera.v1.Federated`` (raw bytes in and out), each inside the
        kernel's error path: a federated error becomes its status code."""
        return guarded_handler(
            SERVICE_NAME,
            {
                "Connect": Method(self.Connect, request_stream=True, response_stream=True),
                "Fetch": Method(self.Fetch, response_stream=True),
                "Submit": Method(self.Submit, request_stream=True),
                "SubmitOne": Method(self.SubmitOne),
            },
            self.access, ERRORS, before=self._count, on_error=self._error,
        )

    def _count(self, method: str, caller: Caller) -> None:
        with self._count_lock:
            self.requests[method] += 1

    def _error(self, method: str, code: grpc.StatusCode) -> None:
        with self._count_lock:
            self.errors[code.name] += 1

    @staticmethod
    def _identity(caller: Caller) -> str | None:
        """The registry's name for the caller: None on an open server (nobody to tell apart)."""
        return None if caller.identity == ANONYMOUS else caller.identity

    # ------------------------------------------------------------------ Connect
    def Connect(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        """One node's long-lived stream: reads its Hello, registers its client ids, then sends
        Welcome, tasks, cancels and finally Shutdown. RESOURCE_EXHAUSTED past ``max_nodes``;
        UNAVAILABLE ("the server is stopping") when the server drains: the node reconnects."""
        identity = self._identity(caller)
        # each stream holds a server thread for its lifetime: past the limit, refuse (the client
        # retries with backoff) rather than let streams take the threads Fetch and Submit need
        with self._count_lock:
            if self.nodes >= self.max_nodes:
                raise ResourceExhaustedError(f"server holds its limit of {self.max_nodes} client connections; retry later")
            self.nodes += 1
        try:
            yield from self._connect(identity, request_iterator, context)
        finally:
            with self._count_lock:
                self.nodes -= 1

    def _connect(self, identity: str | None, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        raw = next(request_iterator, None)
        if raw is None:
            raise MalformedMessageError("Connect: stream ended before Hello")
        msg, _ = decode_message(pb.NodeMessage, raw)
        if msg.WhichOneof("body") != "hello":
            raise MalformedMessageError("Connect: the first message must be Hello")
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        node = self.registry.connect(identity, list(msg.hello.client_ids), q.put, msg.hello.node)
        context.add_callback(lambda: q.put(_END))
        try:
            welcome = pb.ServerMessage()
            welcome.welcome.client_ids.extend(node.client_ids)
            welcome.welcome.server = SERVICE_NAME
            yield self._out(welcome.SerializeToString())
            while True:
                ev = q.get()
                if ev is _END:
                    return
                if isinstance(ev, Task):
                    yield self._out(task_to_proto(ev).SerializeToString())
                elif isinstance(ev, Cancel):
                    m = pb.ServerMessage()
                    m.cancel.task_id, m.cancel.reason = ev.task_id, ev.reason
                    yield self._out(m.SerializeToString())
                elif isinstance(ev, Shutdown):
                    m = pb.ServerMessage()
                    m.shutdown.reason = ev.reason
                    yield self._out(m.SerializeToString())
                    return
                elif isinstance(ev, Stopping):
                    raise ServerStoppingError(f"Connect: {ev.reason}: the server is stopping")
        finally:
            self.registry.disconnect(node)

    # ------------------------------------------------------------------ Fetch
    def Fetch(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        """A task's blob in chunks, for the client (and identity) the task was issued to only."""
        identity = self._identity(caller)
        self._in(len(raw))
        req, _ = decode_message(pb.FetchRequest, raw)
        blob = self.registry.fetch(identity, req.blob, req.client_id, req.task_id)
        for chunk in blob_chunks(blob, self.chunk_bytes):
            yield self._out(chunk)

    # ------------------------------------------------------------------ Submit
    def Submit(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext, caller: Caller) -> bytes:
        """A chunked answer; its header is checked (task, client, identity) before data is read."""
        identity = self._identity(caller)

        def counted() -> Iterator[bytes]:
            for raw in request_iterator:
                self._in(len(raw))
                yield raw

        answer = answer_from_chunks(counted(), self.max_answer_bytes, self._owner_check(identity))
        self.registry.submit(identity, answer)
        return self._out(pb.SubmitReply(accepted=True).SerializeToString())

    def SubmitOne(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        """An answer that fits one message (the common case), checked as :meth:`Submit` does."""
        identity = self._identity(caller)
        self._in(len(raw))
        answer = answer_from_chunks(iter([raw]), self.max_answer_bytes, self._owner_check(identity))
        self.registry.submit(identity, answer)
        return self._out(pb.SubmitReply(accepted=True).SerializeToString())

    def _owner_check(self, identity: str | None) -> Callable[[str, str], None]:
        """Checks a Submit's header (task id, client id) before its data is read."""
        return lambda task_id, client_id: self.registry.check_answer(identity, task_id, client_id)

    def _in(self, n: int) -> None:
        with self._count_lock:
            self.bytes_in += n

    def _out(self, data: bytes) -> bytes:
        with self._count_lock:
            self.bytes_out += len(data)
        return data

