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
from typing import Any, Callable, Mapping, Sequence

import grpc

from federated.config import NodeConfig
from federated.errors import (
    ClientFailedError,
    ConfigError,
    FedError,
    InvalidUpdateError,
    ServerUnavailableError,
    TaskClosedError,
    TLSMismatchError,
    TrainingFailedError,
)
from federated.protocol import EVALUATE, Task
from federated.runtime import Client, ClientRuntime
from federated.wire import ERRORS, answer_chunks, blob_from_chunks, decode_message, task_from_proto
from tessera.rpc import channel_options
from tessera.service import token_metadata
from tessera.service import ClientSecurity, TransportSecurityError, client_channel, diagnose, load_token_file
from tessera.v1 import fed_pb2 as pb

__all__ = ["Client", "ClientNode", "NodeStats", "start_client", "start_node", "check_outcome", "ERROR_OF",
           "SDK_NAMES", "mismatch_message", "token_from_file"]

log = logging.getLogger(__name__)

_SERVICE = "/tessera.v1.Federated/"
ERROR_OF = ERRORS.error_of  # code (and the server's class name) -> error class
_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 10_000),
              ("grpc.keepalive_permit_without_calls", 1)]


# how errors name the client's security settings: the SDK's keyword arguments (the CLI has its
# flags: federated.cli.CLI_NAMES)
SDK_NAMES: Mapping[str, str] = {"tls_ca": "tls_ca=", "tls_cert": "tls_cert=", "tls_key": "tls_key=",
                                "token_file": "token_file=", "identity": "identity="}


def mismatch_message(kind: str, address: str, names: Mapping[str, str] = SDK_NAMES, client_cert: bool = False) -> str:
    """One sentence for a transport-security mismatch found by the kernel's probe (``kind`` of
    :class:`tessera.service.Diagnosis`), naming the settings through ``names`` (:data:`SDK_NAMES`
    or the CLI's flags); "" for a kind it does not know."""
    ca, cert, key = names["tls_ca"], names["tls_cert"], names["tls_key"]
    return {
        "tls_required": f"the server at {address} speaks TLS but this client connects in plaintext: give {ca} "
                        "(the CA that signed the server's certificate)",
        "tls_unsupported": f"the server at {address} does not speak TLS (plaintext) but this client was given {ca}: "
                           f"drop {ca}, or start the server with TLS (--tls-cert/--tls-key)",
        "untrusted": f"the server at {address} speaks TLS, but its certificate is not accepted by the CA given as "
                     f"{ca}: give the CA that signed the server's certificate",
        "name_mismatch": f"the certificate of the server at {address} is not valid for the name this client "
                         "connects by: connect by a name the certificate holds (tessera cert --hosts ...)",
        "client_cert_required": (
            f"the server at {address} refused this client's certificate ({cert}) after the TLS handshake: is it "
            "signed by the CA the server trusts (its --tls-ca)?" if client_cert else
            f"the server at {address} requires a client certificate (mutual TLS): give {cert} and {key} "
            "(tessera cert --clients NAME makes one)"),
    }.get(kind, "")


def token_from_file(token_file: str, identity: str | None = None, names: Mapping[str, str] = SDK_NAMES) -> str:
    """The token of ``identity`` in a token file as ``tessera fed tokens`` (or ``tessera tokens``)
    writes it (``identity token [roles]`` per line, or JSON), read by the kernel's parser
    (:func:`tessera.service.load_token_file`, the one the server uses). ``identity`` None: the
    file's only identity. Raises :class:`~federated.errors.ConfigError` naming the settings
    through ``names`` (``token_file=``/``identity=``, or the CLI's flags)."""
    tf, ident = names["token_file"], names["identity"]
    try:
        tokens, _ = load_token_file(token_file)
    except FileNotFoundError:
        raise ConfigError(f"{tf} {token_file!r}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{tf} {token_file!r}: {e.strerror or e}") from None
    except ValueError as e:  # the kernel's ConfigError: a malformed line
        raise ConfigError(f"{tf}: {e}") from None
    if identity is None:
        if len(tokens) != 1:
            raise ConfigError(f"{tf} {token_file!r} holds {len(tokens)} identities: say which one with {ident}")
        return next(iter(tokens.values()))
    if identity not in tokens:
        raise ConfigError(f"{tf} {token_file!r} has no identity {identity!r} ({ident})")
    return tokens[identity]


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
    (ServerUnavailableError). While the server is unreachable it says so every
    ``config.note_every`` seconds through ``say(line)`` (default: a logged warning), and once
    when it is back. A transport-security mismatch raises TLSMismatchError at once, its message
    naming the settings through ``names`` (:data:`SDK_NAMES` unless the CLI's). :attr:`stats`
    counts what it did.
    """

    def __init__(self, config: NodeConfig, runtime: ClientRuntime, client_ids: Sequence[str] = (),
                 say: Callable[[str], None] | None = None, names: Mapping[str, str] = SDK_NAMES) -> None:
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
        self._say = say or (lambda line: log.warning("%s", line))
        self._names = names
        # the kernel's runtime makes the channel (TLS, mutual TLS with a client certificate, or
        # plaintext); the token rides on each call's metadata (self._md)
        self._security = ClientSecurity(tls_ca=config.root_cert, tls_cert=config.tls_cert, tls_key=config.tls_key,  # type: ignore[arg-type]
                                        server_name=config.server_name)  # PEM bytes work as well as paths

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
        self._channel = client_channel(cfg.address, self._security, opts)
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
                                self._say(f"connected to {cfg.address}")
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
                except TransportSecurityError as e:  # no call can ever succeed: say why, in our own words
                    raise self._mismatch(e) from None
                except grpc.RpcError as e:
                    if self._stop.is_set():
                        return
                    code = e.code()
                    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        raise _typed(e, f"server {cfg.address} refused this client") from None
                    now = time.monotonic()
                    if self.connected.is_set():
                        down_since = now
                    if now - noted_at >= cfg.note_every * 0.98:  # a wake-up a hair early still says it
                        noted_at = now
                        what = " ".join(str(e.details() if isinstance(e, grpc.Call) else e).split())[:200]
                        self._say(f"server {cfg.address} not reachable for {now - down_since:.0f} s "
                                  f"({code.name if code else 'error'}: {what}); retrying until "
                                  f"{cfg.reconnect_timeout:.0f} s without a connection")
                    else:
                        log.info("connection to %s failed (%s); retrying", cfg.address, code.name if code else e)
                self.connected.clear()
                if give_up_at is None:
                    give_up_at = time.monotonic() + cfg.reconnect_timeout
                if time.monotonic() >= give_up_at:
                    raise ServerUnavailableError(
                        f"server {cfg.address} unreachable for {cfg.reconnect_timeout:.0f} s; giving up"
                    )
                now = time.monotonic()
                delay = min(backoff, max(0.0, give_up_at - now)) * (0.5 + random.random() / 2)
                if noted_at > 0:  # saying it every note_every s: try again when the next line is due
                    delay = min(delay, max(0.0, noted_at + cfg.note_every - now))
                if self._stop.wait(delay):
                    return
                backoff = min(cfg.backoff_max, backoff * 2)
        finally:
            self._call = None
            pool.shutdown(wait=True, cancel_futures=True)
            self._channel.close()

    def _mismatch(self, e: TransportSecurityError) -> TLSMismatchError:
        """The kernel found a TLS mismatch (its message names the CLI's flags): probe again for its
        kind and say it with this node's names."""
        d = diagnose(self.config.address, self._security)
        text = mismatch_message(d.kind, self.config.address, self._names, client_cert=self.config.tls_cert is not None)
        return TLSMismatchError(text or e.message, d.kind if text else "", self.config.address)

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
        raise ConfigError("give the CA to trust once: tls_ca= (root_cert= is its older name)")
    return tls_ca if tls_ca is not None else root_cert


def _token(token: str | None, token_file: str | None, identity: str | None) -> str | None:
    if token_file is None:
        if identity is not None:
            raise ConfigError("identity= picks a line of token_file=: give token_file= too (or token=)")
        return token
    if token is not None:
        raise ConfigError("give token= or token_file=, not both")
    return token_from_file(token_file, identity)


def start_node(
    address: str,
    client_fn: Callable[[str], Client],
    client_ids: Sequence[str],
    *,
    keep_clients: bool = False,
    token: str | None = None,
    root_cert: str | bytes | None = None,
    tls_ca: str | bytes | None = None,
    token_file: str | None = None,
    identity: str | None = None,
    **node_options: Any,
) -> ClientNode:
    """A node hosting many (virtual) clients, made on demand by ``client_fn(client_id)``.
    Call ``.run()`` (blocking) on the result, e.g. in a thread. Used by simulation.
    Security as in :func:`start_client`."""
    cfg = NodeConfig(address=address, token=_token(token, token_file, identity), root_cert=_ca(root_cert, tls_ca),
                     **node_options)
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
    token_file: str | None = None,
    identity: str | None = None,
    say: Callable[[str], None] | None = None,
    **node_options: Any,
) -> NodeStats:
    """Connect ``client`` to the server at ``address`` and serve its tasks until the
    server says it is done. Blocking; returns what this client did (:class:`NodeStats`).

    ``address``: ``"HOST:PORT"`` of the server. ``client``: a
    :class:`~federated.runtime.Client`; a numpy-only Client never imports torch.

    ``token``: this client's credential (sent as ``authorization: Bearer``), or
    ``token_file`` + ``identity``: that identity's token from the file ``tessera fed tokens``
    writes (``identity`` may be left out when the file holds one identity; read once, here);
    ``tls_ca`` (or its older name ``root_cert``): PEM file or bytes of the CA that signed
    the server's certificate (None: plaintext); ``tls_cert``/``tls_key``: this client's
    certificate and key, for a server that requires them (mutual TLS); ``client_id``:
    defaults to the token's identity (or the certificate's name, or one the server
    assigns). Further keyword arguments go to :class:`~federated.config.NodeConfig`
    (``reconnect_timeout``, ``workers``, ...). While the server is unreachable
    ``say(line)`` is called every 5 s (``note_every``; default: a logged warning).

    Errors name these keyword arguments (``tls_ca=``, ``token_file=``, ...). Raises
    ConfigError for a bad setting (no such token file, no such identity in it, ``token``
    and ``token_file`` both given), TLSMismatchError (an UnauthenticatedError) at once when
    client and server disagree about TLS, UnauthenticatedError / PermissionDeniedError for a refused token,
    ServerUnavailableError when the server stays unreachable for ``reconnect_timeout``
    seconds, TrainingFailedError when the server ended the run because it failed, and
    ClientFailedError when the server finished but none of this client's training
    tasks succeeded (e.g. its model does not match the server's: the message has the
    last error), so that a client that never contributed does not look successful.
    """
    node_options.setdefault("workers", 2)
    cfg = NodeConfig(address=address, token=_token(token, token_file, identity), root_cert=_ca(root_cert, tls_ca),
                     tls_cert=tls_cert, tls_key=tls_key, **node_options)
    node = ClientNode(cfg, ClientRuntime(lambda _cid: client, keep_clients=True), [client_id] if client_id else [],
                      say=say)
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
