"""The federated gRPC servicer: decode, call the Registry, encode, map errors to status codes.

Requests arrive as raw bytes and are decoded here (not by gRPC), so malformed input
becomes INVALID_ARGUMENT with a message and bulk tensor bytes are read in place.
"""
from __future__ import annotations

import collections
import functools
import inspect
import logging
import queue
import threading
from typing import Any, Callable, Iterator

import grpc

from federated.errors import (
    MalformedMessageError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from federated.protocol import Task
from federated.registry import Cancel, Registry, Shutdown
from federated.wire import ERRORS, answer_from_chunks, blob_chunks, decode_message, task_to_proto
from tessera.security import TokenTable, identity_of
from tessera.v1 import fed_pb2 as pb

__all__ = ["FedServicer", "STATUS_OF", "SERVICE_NAME"]

log = logging.getLogger(__name__)

SERVICE_NAME = "tessera.v1.Federated"

STATUS_OF = ERRORS.codes

_END = object()


class FedServicer:
    """Handlers take (request bytes or iterator of bytes, context) and return bytes.

    ``max_answer_bytes`` bounds one Submit (set by the server from the model size).
    Counters (``requests``, ``errors``, ``bytes_in``, ``bytes_out``) are for stats.
    """

    def __init__(self, registry: Registry, tokens: TokenTable | None = None, chunk_bytes: int = 1 << 20,
                 max_nodes: int = 256, max_calls_per_identity: int = 64, by_certificate: bool = False) -> None:
        self.registry = registry
        # mutual TLS without tokens: a caller is named by its client certificate's common name
        self.by_certificate = by_certificate
        self.max_nodes = max_nodes
        self.max_calls_per_identity = max_calls_per_identity
        self._open_calls: dict[str, int] = {}  # identity -> calls open now
        self.nodes = 0
        self.tokens = tokens
        self.chunk_bytes = chunk_bytes
        self.max_answer_bytes = 1 << 30
        self.requests: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def _identity(self, context: grpc.ServicerContext) -> str | None:
        if self.tokens is None:
            if not self.by_certificate:
                return None
            names = (context.auth_context() or {}).get("x509_common_name") or []
            if not names:  # the TLS handshake demands a certificate; this guards a server built otherwise
                raise UnauthenticatedError("no client certificate")
            name = names[0]
            return name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        who = identity_of(context.invocation_metadata(), self.tokens)
        if who is None:  # the interceptor refuses these first; this guards a server built without it
            raise UnauthenticatedError("unknown client token")
        return who

    def _fail(self, method: str, context: grpc.ServicerContext, exc: BaseException) -> None:
        code = ERRORS.code_of(exc)
        with self._count_lock:
            self.errors[code.name] += 1
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", method)
            msg = f"{method}: internal error: {type(exc).__name__}: {exc}"
        else:
            log.info("%s refused (%s): %s", method, code.name, exc)
            msg = str(exc)
        ERRORS.abort(context, exc, msg)

    def _count(self, name: str) -> None:
        with self._count_lock:
            self.requests[name] += 1

    def _enter(self, context: grpc.ServicerContext) -> str | None:
        """Admit a call against its identity's quota of open calls (each holds a server
        thread). Anonymous calls (no token table) are not counted: there are no
        identities to tell apart, only the server-wide limits."""
        identity = self._identity(context)
        if identity is not None:
            with self._count_lock:
                n = self._open_calls.get(identity, 0)
                if n >= self.max_calls_per_identity:
                    raise ResourceExhaustedError(
                        f"identity {identity!r} has {n} calls open; its limit is {self.max_calls_per_identity} "
                        "(max_calls_per_identity); retry later"
                    )
                self._open_calls[identity] = n + 1
        return identity

    def _leave(self, identity: str | None) -> None:
        if identity is not None:
            with self._count_lock:
                n = self._open_calls.get(identity, 0) - 1
                if n > 0:
                    self._open_calls[identity] = n
                else:
                    self._open_calls.pop(identity, None)

    def handlers(self) -> grpc.GenericRpcHandler:
        """The gRPC handlers of ``tessera.v1.Federated`` (raw bytes in and out; each method
        runs inside the error translator: a federated error becomes its status code)."""
        def guard(name: str, fn: Callable) -> Callable:
            if inspect.isgeneratorfunction(fn):

                @functools.wraps(fn)
                def gen(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
                    self._count(name)
                    admitted: list[str | None] = []
                    try:
                        admitted.append(self._enter(context))
                        yield from fn(request, context)
                    except grpc.RpcError:
                        with self._count_lock:
                            self.errors["CANCELLED"] += 1
                    except Exception as e:  # noqa: BLE001 - translated to a status
                        if not context.is_active():
                            return
                        self._fail(name, context, e)
                    finally:
                        for who in admitted:
                            self._leave(who)

                return gen

            @functools.wraps(fn)
            def unary(request: Any, context: grpc.ServicerContext) -> bytes:
                self._count(name)
                admitted: list[str | None] = []
                try:
                    admitted.append(self._enter(context))
                    return fn(request, context)
                except grpc.RpcError:
                    raise
                except Exception as e:  # noqa: BLE001
                    self._fail(name, context, e)
                    raise  # unreachable: abort raises
                finally:
                    for who in admitted:
                        self._leave(who)

            return unary

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Connect": grpc.stream_stream_rpc_method_handler(guard("Connect", self.Connect)),
                "Fetch": grpc.unary_stream_rpc_method_handler(guard("Fetch", self.Fetch)),
                "Submit": grpc.stream_unary_rpc_method_handler(guard("Submit", self.Submit)),
                "SubmitOne": grpc.unary_unary_rpc_method_handler(guard("SubmitOne", self.SubmitOne)),
            },
        )

    # ------------------------------------------------------------------ Connect
    def Connect(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """One node's long-lived stream: reads its Hello, registers its client ids, then sends
        Welcome, tasks, cancels and finally Shutdown. RESOURCE_EXHAUSTED past ``max_nodes``."""
        identity = self._identity(context)
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
        finally:
            self.registry.disconnect(node)

    # ------------------------------------------------------------------ Fetch
    def Fetch(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A task's blob in chunks, for the client (and identity) the task was issued to only."""
        identity = self._identity(context)
        self._in(len(raw))
        req, _ = decode_message(pb.FetchRequest, raw)
        blob = self.registry.fetch(identity, req.blob, req.client_id, req.task_id)
        for chunk in blob_chunks(blob, self.chunk_bytes):
            yield self._out(chunk)

    # ------------------------------------------------------------------ Submit
    def Submit(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """A chunked answer; its header is checked (task, client, identity) before data is read."""
        identity = self._identity(context)

        def counted() -> Iterator[bytes]:
            for raw in request_iterator:
                self._in(len(raw))
                yield raw

        answer = answer_from_chunks(counted(), self.max_answer_bytes, self._owner_check(identity))
        self.registry.submit(identity, answer)
        return self._out(pb.SubmitReply(accepted=True).SerializeToString())

    def SubmitOne(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """An answer that fits one message (the common case), checked as :meth:`Submit` does."""
        identity = self._identity(context)
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

