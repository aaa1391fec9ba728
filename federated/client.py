"""The client SDK's connection: dial out to the server, receive tasks, fetch their
tensors, run them on the user's :class:`~federated.runtime.Client`, submit answers.

The client opens the connection (it may sit behind NAT): one ``Connect`` stream per
process carries the server's instructions; bulk bytes travel in ``Fetch`` and
``Submit`` calls, chunked. A lost connection is retried with jittered exponential
backoff until ``reconnect_timeout`` passes without success; a ``Shutdown`` from the
server ends :meth:`ClientNode.run` normally. An unknown token is not retried:
:class:`~federated.errors.UnauthenticatedError`.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import grpc

from federated.config import NodeConfig
from federated.errors import (
    ClientFailedError,
    ConfigError,
    FedError,
    InvalidUpdateError,
    ServerUnavailableError,
    TaskClosedError,
    TrainingFailedError,
)
from federated.protocol import EVALUATE, Task
from federated.runtime import Client, ClientRuntime
from federated.wire import ERRORS, answer_chunks, blob_from_chunks, decode_message, task_from_proto
from tessera.rpc import channel_options
from tessera.security import token_metadata
from tessera.service import ClientSecurity, client_channel
from tessera.v1 import fed_pb2 as pb

__all__ = ["Client", "ClientNode", "NodeStats", "start_client", "start_node", "check_outcome", "ERROR_OF"]

log = logging.getLogger(__name__)

_SERVICE = "/tessera.v1.Federated/"
ERROR_OF = ERRORS.error_of  # code (and the server's class name) -> error class
_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
              ("grpc.keepalive_permit_without_calls", 1)]


def _typed(e: grpc.RpcError, what: str) -> FedError:
    found, code, details = ERRORS.exception_of(e)
    cls: type[FedError] = found if issubclass(found, FedError) else FedError
    return cls(f"{what}: {details} ({code.name if code is not None else 'no status'})")


@dataclass
class NodeStats:
    """What a node did (for reports); updated from worker threads under a lock.

    ``tasks``: answers submitted (``failed`` of them carried the Client's error);
    ``contributed``: training answers (fit / secure aggregation) submitted without
    error and accepted; ``rejected``: answers the server refused as invalid; ``late``:
    answers after their round closed; ``errors``: the last few failures as text
    (``"CODE: details"`` for refusals, ``"ExceptionName: message"`` for the Client's).
    """

    tasks: int = 0
    failed: int = 0
    rejected: int = 0
    late: int = 0
    contributed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    connects: int = 0
    errors: list[str] = field(default_factory=list)
    def note(self, err: str) -> None:
        """Keep ``err`` among the last 20 failures."""
        self.errors.append(err)
        del self.errors[:-20]


class ClientNode:
    """One connection to the server hosting one or many clients.

    ``client_ids``: the ids to register (empty: one client named after the token).
    ``runtime`` executes the tasks. :meth:`run` blocks until the server says
    Shutdown (returns; the reason is in :attr:`shutdown_reason`), the node is stopped
    (returns), the token is refused (UnauthenticatedError / PermissionDeniedError) or
    the server stays unreachable for ``config.reconnect_timeout`` seconds
    (ServerUnavailableError). While the server is unreachable it logs a warning every
    few seconds. :attr:`stats` counts what it did.
    """

    def __init__(self, config: NodeConfig, runtime: ClientRuntime, client_ids: Sequence[str] = ()) -> None:
        self.config = config
        self.runtime = runtime
        self.requested_ids = list(client_ids)
        self.client_ids: list[str] = []
        self.stats = NodeStats()
        self.shutdown_reason: str | None = None
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._running: set[str] = set()
        self._call: Any = None
        self._md = token_metadata(config.token)
        self._channel: grpc.Channel | None = None

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """End :meth:`run` from another thread (cancels the stream)."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def _open(self) -> None:
        cfg = self.config
        # gRPC's own reconnect backoff must not outlast ours (it would delay the first connect
        # to a server that is still starting by up to its 2 s maximum)
        backoff = {"grpc.initial_reconnect_backoff_ms": max(10, int(cfg.backoff_min * 1000)),
                   "grpc.max_reconnect_backoff_ms": max(10, int(cfg.backoff_max * 1000))}
        own = backoff.keys() | dict(_KEEPALIVE).keys()  # ours replace the kernel's (no duplicate keys)
        opts = [o for o in channel_options(cfg.max_message_bytes) if o[0] not in own]
        opts += list(backoff.items()) + _KEEPALIVE
        # the kernel's runtime makes the channel (TLS, mutual TLS with a client certificate, or
        # plaintext); the token rides on each call's metadata (self._md)
        sec = ClientSecurity(tls_ca=cfg.root_cert, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key,  # type: ignore[arg-type]
                             server_name=cfg.server_name)  # PEM bytes work as well as paths
        self._channel = client_channel(cfg.address, sec, opts)
        ch = self._channel
        self._connect = ch.stream_stream(_SERVICE + "Connect")
        self._fetch = ch.unary_stream(_SERVICE + "Fetch")
        self._submit = ch.stream_unary(_SERVICE + "Submit")
        self._submit_one = ch.unary_unary(_SERVICE + "SubmitOne")

    def run(self) -> None:
        """Connect and serve tasks until the server says Shutdown or :meth:`stop` is called
        (returns), or the token is refused / the server stays unreachable (raises; see the
        class doc). Blocking; tasks run on ``config.workers`` threads."""
        cfg = self.config
        hello = pb.NodeMessage()
        hello.hello.node = cfg.name
        hello.hello.client_ids.extend(self.requested_ids)
        hello.hello.version = "1"
        hello_raw = hello.SerializeToString()
        self._open()
        assert self._channel is not None
        pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="fedclient")
        backoff = cfg.backoff_min
        give_up_at = time.monotonic() + cfg.reconnect_timeout
        down_since = time.monotonic()  # when the server was last seen (start: never yet)
        noted_at = -1e9
        try:
            while not self._stop.is_set():
                try:
                    self._call = self._connect(iter([hello_raw]), metadata=self._md)
                    with self._stats_lock:
                        self.stats.connects += 1
                    for raw in self._call:
                        msg, _ = decode_message(pb.ServerMessage, raw)
                        body = msg.WhichOneof("body")
                        if body == "welcome":
                            self.client_ids = list(msg.welcome.client_ids)
                            self.connected.set()
                            backoff = cfg.backoff_min
                            give_up_at = None  # type: ignore[assignment]
                            if noted_at > 0:  # we said it was unreachable: say it is back
                                log.warning("connected to %s", cfg.address)
                            noted_at = -1e9
                            log.info("connected to %s as %d client(s)", cfg.address, len(self.client_ids))
                        elif body == "task":
                            task = task_from_proto(msg.task)
                            with self._stats_lock:
                                self._running.add(task.task_id)
                            pool.submit(self._do_task, task)
                        elif body == "cancel":
                            with self._stats_lock:
                                if msg.cancel.task_id in self._running:  # late cancels of finished tasks are moot
                                    self._cancelled.add(msg.cancel.task_id)
                        elif body == "shutdown":
                            self.shutdown_reason = msg.shutdown.reason
                            log.info("server shut down: %s", msg.shutdown.reason)
                            return
                    log.info("server closed the stream; reconnecting")
                except grpc.RpcError as e:
                    if self._stop.is_set():
                        return
                    code = e.code()
                    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        raise _typed(e, f"server {cfg.address} refused this client") from None
                    now = time.monotonic()
                    if self.connected.is_set():
                        down_since = now
                    if now - noted_at >= cfg.note_every:
                        noted_at = now
                        what = e.details() if isinstance(e, grpc.Call) else str(e)
                        log.warning("server %s not reachable for %.0f s (%s: %s); retrying until %.0f s without a "
                                    "connection", cfg.address, now - down_since, code.name if code else "error",
                                    (what or "")[:200], cfg.reconnect_timeout)
                    else:
                        log.info("connection to %s failed (%s); retrying", cfg.address, code.name if code else e)
                self.connected.clear()
                if give_up_at is None:
                    give_up_at = time.monotonic() + cfg.reconnect_timeout
                if time.monotonic() >= give_up_at:
                    raise ServerUnavailableError(
                        f"server {cfg.address} unreachable for {cfg.reconnect_timeout:.0f} s; giving up"
                    )
                delay = min(backoff, max(0.0, give_up_at - time.monotonic())) * (0.5 + random.random() / 2)
                if self._stop.wait(delay):
                    return
                backoff = min(cfg.backoff_max, backoff * 2)
        finally:
            self._call = None
            pool.shutdown(wait=True, cancel_futures=True)
            self._channel.close()

    # ------------------------------------------------------------------ tasks
    def _do_task(self, task: Task) -> None:
        cfg = self.config
        try:
            if task.task_id in self._cancelled:
                return
            tensors: tuple = ()
            received = 0
            if task.inline is not None:
                tensors, received = task.inline.tensors, task.inline.nbytes
            elif task.blob:
                req = pb.FetchRequest(blob=task.blob, client_id=task.client_id, task_id=task.task_id)
                stream = self._fetch(req.SerializeToString(), metadata=self._md, timeout=cfg.rpc_timeout)
                tensors, received = blob_from_chunks(stream, cfg.max_blob_bytes, f"blob {task.blob}")
            answer = self.runtime.handle(task, tensors, received)
            if answer.error:
                with self._stats_lock:
                    self.stats.note(answer.error)
            with self._stats_lock:
                if task.task_id in self._cancelled:
                    self._cancelled.discard(task.task_id)
                    self.stats.late += 1
                    return
            chunks = list(answer_chunks(answer, cfg.chunk_bytes))
            if len(chunks) == 1:  # the common case: a unary call costs less than a stream
                self._submit_one(chunks[0], metadata=self._md, timeout=cfg.rpc_timeout)
            else:
                self._submit(iter(chunks), metadata=self._md, timeout=cfg.rpc_timeout)
            with self._stats_lock:
                self.stats.tasks += 1
                self.stats.failed += bool(answer.error)
                self.stats.contributed += not answer.error and task.kind != EVALUATE
                self.stats.bytes_sent += sum(len(c) for c in chunks)
                self.stats.bytes_received += received
        except grpc.RpcError as e:
            err = _typed(e, f"client {task.client_id}: {task.kind} task {task.task_id}")
            with self._stats_lock:
                self.stats.note(f"{e.code().name}: {e.details()}")
                if isinstance(err, TaskClosedError):
                    self.stats.late += 1
                elif isinstance(err, InvalidUpdateError):
                    self.stats.rejected += 1
            if isinstance(err, (TaskClosedError, ServerUnavailableError)) or self._stop.is_set():
                log.info("%s", err)
            else:
                log.warning("%s", err)
        except Exception:  # noqa: BLE001 - one task's failure must not kill the node
            log.exception("client %s: task %s failed", task.client_id, task.task_id)
        finally:
            with self._stats_lock:
                self._cancelled.discard(task.task_id)
                self._running.discard(task.task_id)


def _ca(root_cert: str | bytes | None, tls_ca: str | bytes | None) -> str | bytes | None:
    if root_cert is not None and tls_ca is not None and root_cert != tls_ca:
        raise ConfigError("give the CA to trust once: tls_ca (root_cert is its older name)")
    return tls_ca if tls_ca is not None else root_cert


def start_node(
    address: str,
    client_fn: Callable[[str], Client],
    client_ids: Sequence[str],
    *,
    keep_clients: bool = False,
    token: str | None = None,
    root_cert: str | bytes | None = None,
    tls_ca: str | bytes | None = None,
    **node_options: Any,
) -> ClientNode:
    """A node hosting many (virtual) clients, made on demand by ``client_fn(client_id)``.
    Call ``.run()`` (blocking) on the result, e.g. in a thread. Used by simulation.
    Security as in :func:`start_client`."""
    cfg = NodeConfig(address=address, token=token, root_cert=_ca(root_cert, tls_ca), **node_options)
    return ClientNode(cfg, ClientRuntime(client_fn, keep_clients=keep_clients), client_ids)


def start_client(
    address: str,
    client: Client,
    *,
    token: str | None = None,
    root_cert: str | bytes | None = None,
    client_id: str | None = None,
    tls_ca: str | bytes | None = None,
    tls_cert: str | bytes | None = None,
    tls_key: str | bytes | None = None,
    **node_options: Any,
) -> NodeStats:
    """Connect ``client`` to the server at ``address`` and serve its tasks until the
    server says it is done. Blocking; returns what this client did (:class:`NodeStats`).

    ``address``: ``"HOST:PORT"`` of the server. ``client``: a
    :class:`~federated.runtime.Client`; a numpy-only Client never imports torch.

    ``token``: this client's credential (sent as ``authorization: Bearer``);
    ``tls_ca`` (or its older name ``root_cert``): PEM file or bytes of the CA that signed
    the server's certificate (None: plaintext); ``tls_cert``/``tls_key``: this client's
    certificate and key, for a server that requires them (mutual TLS); ``client_id``:
    defaults to the token's identity (or the certificate's name, or one the server
    assigns). Further keyword arguments go to :class:`~federated.config.NodeConfig`
    (``reconnect_timeout``, ``workers``, ...). While the server is unreachable a warning
    is logged every few seconds.

    Raises UnauthenticatedError / PermissionDeniedError for a refused token,
    ServerUnavailableError when the server stays unreachable for ``reconnect_timeout``
    seconds, TrainingFailedError when the server ended the run because it failed, and
    ClientFailedError when the server finished but none of this client's training
    tasks succeeded (e.g. its model does not match the server's: the message has the
    last error), so that a client that never contributed does not look successful.
    """
    node_options.setdefault("workers", 2)
    cfg = NodeConfig(address=address, token=token, root_cert=_ca(root_cert, tls_ca), tls_cert=tls_cert, tls_key=tls_key,
                     **node_options)
    node = ClientNode(cfg, ClientRuntime(lambda _cid: client, keep_clients=True), [client_id] if client_id else [])
    node.run()
    check_outcome(node)
    return node.stats


def check_outcome(node: ClientNode) -> None:
    """Raise if a node that ran to the server's Shutdown did not take part usefully:
    TrainingFailedError when the server's reason says training failed, ClientFailedError
    when it had tasks and none of its training answers succeeded."""
    reason = node.shutdown_reason or ""
    st = node.stats
    if st.contributed == 0 and (st.failed or st.rejected):  # its own failure says most: first
        last = st.errors[-1] if st.errors else "unknown"
        who = ", ".join(node.client_ids) or "this client"
        raise ClientFailedError(
            f"{who} never contributed: {st.failed + st.rejected} of its tasks failed or were refused "
            f"(last: {last}); does its model match the server's? Server: {reason or 'no reason given'}"
        )
    if reason.startswith("training failed"):
        raise TrainingFailedError(f"the server ended the run: {reason}")
