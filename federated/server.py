"""Build and run a federated server: gRPC server + registry + round loop."""
from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Callable

import grpc

from federated.config import ServerConfig
from federated.errors import ConfigError
from federated.orchestrator import EvaluateFn, Orchestrator, RoundFailedError, StatusFn
from federated.registry import Registry
from federated.servicer import SERVICE_NAME, FedServicer
from federated.strategy import Strategy, Weights
from tessera import service
from tessera.security import TokenAuthInterceptor, TokenTable

__all__ = ["FedServer", "serve", "server_security"]

log = logging.getLogger(__name__)

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),  # clients ping every 10 s to notice a dead server
]
_HEALTH = "/grpc.health.v1.Health/"


def server_security(config: ServerConfig) -> tuple[service.ServerSecurity, list[str]]:
    """The runtime's view of ``config`` (TLS, mutual TLS, tokens, ``insecure``) and the
    warnings to print at start. Raises ConfigError for what the runtime refuses: tokens
    over plaintext, or an open server (no tokens, no mutual TLS) on a non-loopback
    address, unless ``config.insecure``."""
    sec = service.ServerSecurity(
        tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca,  # type: ignore[arg-type]  # PEM bytes work too
        tokens=config.tokens, insecure=config.insecure,
    )
    try:
        return sec, sec.check(config.host)
    except service.ConfigError as e:
        raise ConfigError(str(e)) from None


class _AuthExceptHealth(grpc.ServerInterceptor):
    """The token check for every call but the gRPC health service's (probes carry no token;
    the health answer reveals nothing but SERVING)."""

    def __init__(self, auth: TokenAuthInterceptor) -> None:
        self.auth = auth

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(_HEALTH):
            return continuation(handler_call_details)
        return self.auth.intercept_service(continuation, handler_call_details)


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
    mutual TLS, and the gRPC health service (``""`` and ``tessera.v1.Federated`` SERVING).
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
        self.tokens = TokenTable(config.tokens) if config.tokens is not None else None
        self.servicer = FedServicer(self.registry, self.tokens, config.chunk_bytes, config.max_nodes,
                                    config.max_calls_per_identity, by_certificate=self.security.mutual)
        # an answer is at most the model in float64 plus extras (SCAFFOLD) plus headers
        self.servicer.max_answer_bytes = 4 * self.orchestrator.model_bytes + (16 << 20)
        self.interceptor = TokenAuthInterceptor(self.tokens) if self.tokens is not None else None
        self._server: grpc.Server | None = None
        self.health: Any = None  # the health servicer, once started
        self.port = 0
        self._stop = threading.Event()

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
            (self.servicer.handlers(),), cfg.host, cfg.port, self.security, max_workers=cfg.max_nodes + 32,
            max_message_bytes=cfg.max_message_bytes, service_names=(SERVICE_NAME,), extra_options=_KEEPALIVE,
            interceptors=[_AuthExceptHealth(self.interceptor)] if self.interceptor is not None else (), name="fed",
        )
        self._server, self.port = server, port
        return port

    def run(self) -> list[dict[str, Any]]:
        """Run the rounds (blocking; calls :meth:`start` if not started). Returns the
        history (one record per round). When the rounds are done and
        ``config.shutdown_clients``, clients are told to exit ("training finished").
        Raises :class:`~federated.orchestrator.RoundFailedError` when a round cannot
        gather ``min_clients`` answers in ``max_retries + 1`` attempts; the clients are
        then told "training failed: ..." with the reason."""
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
            if self.config.shutdown_clients:
                self.registry.shutdown(reason)

    def stop(self, grace: float = 1.0, notify_clients: bool = True) -> None:
        """Stop the round loop and stop serving. ``notify_clients``: tell clients to exit
        (False drops their connections as a crash would: they keep reconnecting)."""
        self._stop.set()
        if notify_clients:
            self.registry.shutdown("server stopping")
        if self.health is not None:
            self.health.enter_graceful_shutdown()  # probes see NOT_SERVING while calls drain
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
    Raises RoundFailedError as :meth:`FedServer.run` does (after stopping)."""
    for warning in server.warnings:
        print(f"tessera-fed: {warning}", file=sys.stderr, flush=True)
    if server.complete:
        print(f"tessera-fed: the run is already complete: checkpoint {server.config.checkpoint} holds all "
              f"{server.config.rounds} rounds; nothing to do (give a larger --rounds to train further)", flush=True)
        return server.history
    port = server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server._stop.set())
    print(f"tessera-fed listening on {server.config.host}:{port}", flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{port}\n")
    try:
        history = server.run()
    finally:
        server.stop(grace=2.0)
        print("tessera-fed stopped", file=sys.stderr, flush=True)
    return history
