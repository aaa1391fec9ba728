"""Build and run a federated server: gRPC server + registry + round loop."""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Any, Callable

import grpc

from federated.config import DEFAULT_ROLES, ROLES, ServerConfig
from federated.errors import ConfigError
from federated.orchestrator import EvaluateFn, Orchestrator, RoundFailedError, StatusFn
from federated.registry import Registry
from federated.servicer import METHOD_ROLES, SERVICE_NAME, WAITS, FedServicer
from federated.strategy import Strategy, Weights
from tessera import service

__all__ = ["FedServer", "serve", "server_security"]

log = logging.getLogger(__name__)

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),  # clients ping every 10 s to notice a dead server
]
_DRAIN_LINGER_S = 1.0  # after SIGTERM, health says NOT_SERVING this long before the port closes


def server_security(config: ServerConfig) -> tuple[service.ServerSecurity, list[str]]:
    """The runtime's view of ``config`` (TLS, mutual TLS, tokens, ``insecure``) and the
    warnings to print at start. Raises ConfigError for what the runtime refuses: tokens
    over plaintext, or an open server (no tokens, no mutual TLS) on a non-loopback
    address, unless ``config.insecure``."""
    sec = service.ServerSecurity(
        tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca,  # type: ignore[arg-type]  # PEM bytes work too
        tokens=config.tokens, roles=config.roles, certificates=config.certificates, default_roles=DEFAULT_ROLES,
        insecure=config.insecure,
        # a node's Connect stream is a waiting call: an identity may hold as many as it may hold calls
        max_concurrent=config.max_calls_per_identity, max_waiting=config.max_calls_per_identity,
    )
    try:
        return sec, sec.check(config.host)
    except service.ConfigError as e:
        raise ConfigError(str(e)) from None


class FedServer:
    """A federated server. ``start()`` binds and serves; ``run()`` runs the rounds
    (blocking) and then tells the clients to exit; ``stop()`` ends everything.

    ``initial_weights``: the global model as a non-empty list of float numpy arrays
    (any shapes; clients receive and return arrays of the same shapes and dtypes),
    replaced by the checkpoint's when ``config.checkpoint`` names an existing file.
    ``evaluate_fn(weights) -> (loss, {metric: value})``: central evaluation after every
    round (see :data:`federated.orchestrator.EvaluateFn`; None: none). ``on_round(record)``:
    called with each round's record (a dict: ``round``, ``answered``, ``sampled``,
    ``round_s``, ``central_loss``, ``central_metrics``, ``bytes_up``, ...) once it is in
    :attr:`history`. ``on_status(line)``: one-line notes while waiting for clients and
    when a round is retried (default: logged).

    Bad combinations (robust strategy with secure aggregation, tokens over plaintext
    without ``insecure``, ...) raise ConfigError here, before anything binds. The server
    is built by the kernel's service runtime (``tessera.service.build_server``): TLS or
    mutual TLS, the gRPC health service (``""`` and ``tessera.v1.Federated`` SERVING), and
    one admission path (``tessera.service.Access``, as the PS's): a token's identity (or a
    client certificate's name) with its roles (``config.roles``; ``client`` when it lists
    none: only clients may join), per-identity shares of the server's threads
    (``max_calls_per_identity``), and draining (:meth:`drain`). Prometheus metrics go through
    the same security: ``tessera.metrics.serve_metrics(port, host, [FedCollector(server)],
    security=server.security)`` (as ``tessera fed server --metrics-port`` does) serves them over
    TLS when the server has TLS and, when it has identities, to ``reader``/``admin`` ones only.
    """

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        initial_weights: Weights,
        evaluate_fn: EvaluateFn | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        on_status: StatusFn | None = None,
    ) -> None:
        self.config = config
        self.security, self.warnings = server_security(config)  # refuse unsafe setups first
        self.registry = Registry(config.max_clients, config.max_clients_per_identity, config.max_num_examples)
        self.orchestrator = Orchestrator(config, strategy, self.registry, initial_weights, evaluate_fn, on_round,
                                         on_status)
        self.pool = config.max_nodes + 32  # every Connect stream holds a thread; Fetch and Submit need some too
        try:
            self.access = service.Access(self.security, METHOD_ROLES, ROLES, waits=WAITS, pool=self.pool)
        except service.ConfigError as e:  # e.g. a token shorter than 16 characters
            raise ConfigError(str(e)) from None
        self.servicer = FedServicer(self.registry, self.access, config.chunk_bytes, config.max_nodes)
        # an answer is at most the model in float64 plus extras (SCAFFOLD) plus headers
        self.servicer.max_answer_bytes = 4 * self.orchestrator.model_bytes + (16 << 20)
        self._server: grpc.Server | None = None
        self.health: Any = None  # the health servicer, once started
        self.port = 0
        self._stop = threading.Event()
        self.draining_since: float | None = None  # time.monotonic() of drain()

    @property
    def complete(self) -> bool:
        """Whether every round is done already (e.g. resumed from a finished run's checkpoint)."""
        return self.orchestrator.round >= self.config.rounds

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Bind ``config.host:config.port`` (0: a free port) and serve. Returns the port."""
        cfg = self.config
        server, port, self.health = service.build_server(  # security checked in __init__ already
            (self.servicer.handlers(),), cfg.host, cfg.port, self.security, max_workers=self.pool,
            max_message_bytes=cfg.max_message_bytes, service_names=(SERVICE_NAME,), extra_options=_KEEPALIVE,
            access=self.access, name="fed",
        )
        self._server, self.port = server, port
        return port

    def run(self) -> list[dict[str, Any]]:
        """Run the rounds (blocking; calls :meth:`start` if not started). Returns the
        history (one record per round). When the rounds are done and
        ``config.shutdown_clients``, clients are told to exit ("training finished").
        Raises :class:`~federated.orchestrator.RoundFailedError` when a round cannot
        gather ``min_clients`` answers in ``max_retries + 1`` attempts; the clients are
        then told "training failed: ..." with the reason. Stopped (:meth:`stop`,
        :meth:`drain`), it writes the checkpoint of the last completed round once more (the
        final one) and returns."""
        if self._server is None:
            self.start()
        reason = "training finished"
        try:
            return self.orchestrator.run(self._stop)
        except RoundFailedError as e:
            reason = f"training failed: {e}"
            raise
        finally:
            if self._stop.is_set():
                reason = "server stopping"
                self.orchestrator.checkpoint()
            if self.config.shutdown_clients and self.draining_since is None:  # a drain told the nodes already
                self.registry.shutdown(reason)

    def drain(self, reason: str = "SIGTERM") -> None:
        """Start stopping, at once (idempotent; call it from any thread but a signal handler's:
        it takes the registry's lock): health NOT_SERVING for every service, new calls refused
        UNAVAILABLE ("<reason>: the server is stopping"), every node's Connect stream ended
        with that UNAVAILABLE (nodes reconnect with backoff: to this server restarted from its
        checkpoint, or another), tasks in flight failed, and the round loop stopped (``run``
        then writes the final checkpoint and returns)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
        self.access.drain(reason)
        self._stop.set()
        self.registry.shutdown(reason, stopping=True)

    def stop(self, grace: float = 1.0, notify_clients: bool = True) -> None:
        """Stop the round loop and stop serving. ``notify_clients``: tell clients to exit
        (False drops their connections as a crash would: they keep reconnecting)."""
        self._stop.set()
        if notify_clients and self.draining_since is None:
            self.registry.shutdown("server stopping")
        if not self.access.stopping.is_set():
            self.access.drain("server stopping")  # probes see NOT_SERVING while calls end
        if self._server is not None:
            self._server.stop(grace).wait()

    @property
    def history(self) -> list[dict[str, Any]]:
        """The round records so far (see ``on_round``), including resumed ones."""
        return self.orchestrator.history

    @property
    def weights(self) -> Weights:
        """The current global weights (list of numpy arrays; do not modify)."""
        return self.orchestrator.weights


def serve(server: FedServer, ready_file: str | None = None) -> list[dict[str, Any]]:
    """Run ``server`` until its rounds are done or SIGTERM/SIGINT (blocking). Prints one
    line ``tessera-fed listening on HOST:PORT`` when ready. A server whose checkpoint
    already holds every round does not listen: it says so and returns the history.
    Raises RoundFailedError as :meth:`FedServer.run` does (after stopping).

    SIGTERM/SIGINT drain the server (:meth:`FedServer.drain`: health NOT_SERVING at once,
    new calls and the nodes' streams UNAVAILABLE "the server is stopping"), write the final
    checkpoint, keep answering health for ``_DRAIN_LINGER_S`` and exit within a few seconds."""
    for warning in server.warnings:
        print(f"tessera-fed: {warning}", file=sys.stderr, flush=True)
    if server.complete:
        print(f"tessera-fed: the run is already complete: checkpoint {server.config.checkpoint} holds all "
              f"{server.config.rounds} rounds; nothing to do (give a larger --rounds to train further)", flush=True)
        return server.history
    port = server.start()
    # the handler only sets an event: draining takes locks the interrupted main thread may hold
    requested = threading.Event()
    signame: list[str] = []

    def drain_when_asked() -> None:
        requested.wait()
        server.drain(signame[0] if signame else "SIGTERM")

    threading.Thread(target=drain_when_asked, name="fed-drain", daemon=True).start()

    def on_signal(signum: int, _frame: Any) -> None:
        signame.append(signal.Signals(signum).name)
        requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(f"tessera-fed listening on {server.config.host}:{port}", flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{port}\n")
    try:
        history = server.run()
    finally:
        if server.draining_since is not None:  # let probes see NOT_SERVING before the port closes
            time.sleep(max(0.0, server.draining_since + _DRAIN_LINGER_S - time.monotonic()))
        server.stop(grace=2.0)
        print("tessera-fed stopped", file=sys.stderr, flush=True)
    return history
