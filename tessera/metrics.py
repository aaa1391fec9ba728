"""Prometheus metrics for every Tessera process (``--metrics-port``), through ``prometheus_client``.

* **Every server** built by :func:`tessera.service.build_server` carries a
  :class:`MetricsInterceptor`: requests by method and status code, wire bytes received and sent
  by method, and a latency histogram by method (``server`` label: the server's name, e.g. ``ps0``,
  ``fed``). Recorded whether or not an endpoint is served (a few counter increments per call).
* **Part-specific figures** come from collectors that read, at scrape time, what each part already
  exposes; the domain code knows nothing of Prometheus:

  - :class:`ShardCollector`: a shard's ``Shard.stats()`` (clock, live workers and their clocks,
    clock spread, per-table staleness and version, replicated mutations, role, checkpoints).
  - :class:`TrainerCollector`: the trainer's JSON-lines metrics records (``--metrics-out``; a
    temporary file when only ``--metrics-port`` is given): steps, examples/s, loss, staleness,
    seconds waiting for pulls (the BSP/SSP round waits) and pushes, evaluation metrics.
  - :class:`FedCollector`: a federated server's state: connected clients, rounds done, round
    times and the time spent waiting for clients, bytes up and down, the central evaluation.

:func:`serve_metrics` starts the endpoint (``GET /metrics``) on a daemon thread, behind the same
security as the server it belongs to: over TLS when that server has TLS (mutual TLS too), and with
tokens a scrape needs ``Authorization: Bearer <token>`` of an identity with the ``reader`` (or
``admin``) role (401 without, 403 for another role); it binds 127.0.0.1 unless ``--metrics-host``
is given. At most 4 scrapes at once (503 beyond), 10 s per connection.

Labels follow one convention: ``server`` names the server (``ps0``, ``ps0-bulk``, ``fed``) in every
family that has one; ``identity`` (on ``tessera_rpc_requests_total``) is the caller's identity,
bounded: the first :data:`MAX_IDENTITY_LABELS` identities seen keep their name, later ones count as
``other`` (``anonymous`` on an open server, ``none`` when a call was refused before it had one).
The documented names are :data:`RPC_METRICS`, :data:`SHARD_METRICS`, :data:`TRAINER_METRICS`
and :data:`FED_METRICS`.
"""
from __future__ import annotations

import json
import math
import os
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessera.codec import Packed
from tessera.service.errors import PermissionDeniedError, UnauthenticatedError
from tessera.service.guard import end_call, new_call
from tessera.service.tls import pem_file, read_pem

__all__ = [
    "MAX_IDENTITY_LABELS",
    "METRICS_ROLES",
    "FED_METRICS",
    "RPC_METRICS",
    "SHARD_METRICS",
    "TRAINER_METRICS",
    "FedCollector",
    "MetricsInterceptor",
    "ShardCollector",
    "TrainerCollector",
    "add_metrics_args",
    "serve_metrics",
    "start_from_args",
]

# names as they appear on /metrics (counters end in _total, histograms give _bucket/_sum/_count)
RPC_METRICS = (
    "tessera_rpc_requests_total", "tessera_rpc_received_bytes_total", "tessera_rpc_sent_bytes_total",
    "tessera_rpc_latency_seconds",
)
SHARD_METRICS = (
    "tessera_ps_up_seconds", "tessera_ps_sync_clock", "tessera_ps_workers_live", "tessera_ps_worker_clock",
    "tessera_ps_clock_spread", "tessera_ps_table_version", "tessera_ps_table_staleness_mean",
    "tessera_ps_table_staleness_max", "tessera_ps_table_bytes", "tessera_ps_received_bytes_total", "tessera_ps_sent_bytes_total", "tessera_ps_replicated_total",
    "tessera_ps_backups_lost_total", "tessera_ps_is_primary", "tessera_ps_has_backup", "tessera_ps_checkpoints_total",
    "tessera_ps_leases_expired_total",
)
TRAINER_METRICS = (
    "tessera_train_steps", "tessera_train_examples_per_second", "tessera_train_loss", "tessera_train_staleness",
    "tessera_train_compute_seconds_total", "tessera_train_pull_wait_seconds_total",
    "tessera_train_push_wait_seconds_total", "tessera_train_eval", "tessera_train_done",
)
FED_METRICS = (
    "tessera_fed_clients_connected", "tessera_fed_rounds_total", "tessera_fed_last_round_seconds",
    "tessera_fed_round_seconds_total", "tessera_fed_wait_seconds_total", "tessera_fed_clients_answered",
    "tessera_fed_received_bytes_total", "tessera_fed_sent_bytes_total", "tessera_fed_central_loss",
)

disable_created_metrics()  # no *_created series: they double every scrape and nobody graphs them
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, math.inf)

_REQUESTS = Counter(
    "tessera_rpc_requests", "RPCs handled (refused ones too), by server, method, status code and caller identity",
    ["server", "method", "code", "identity"],
)
MAX_IDENTITY_LABELS = 32  # distinct identity label values; later identities are counted as "other"
_identities: set[str] = set()
_identities_lock = threading.Lock()


def _identity_label(info: dict[str, Any] | None) -> str:
    """The bounded ``identity`` label of a call (module doc)."""
    who = (info or {}).get("identity")
    if who is None:
        return "none"
    if who == "":
        return "anonymous"
    with _identities_lock:
        if who in _identities:
            return str(who)
        if len(_identities) < MAX_IDENTITY_LABELS:
            _identities.add(who)
            return str(who)
    return "other"
_MAX_CHILDREN = 4096  # label sets a MetricsInterceptor keeps at hand
_RECEIVED = Counter("tessera_rpc_received_bytes", "request bytes received on the wire, by server and method", ["server", "method"])
_SENT = Counter("tessera_rpc_sent_bytes", "response bytes sent on the wire, by server and method", ["server", "method"])
_LATENCY = Histogram(
    "tessera_rpc_latency_seconds", "RPC handling time (streams: until the last message), by server and method",
    ["server", "method"], buckets=_LATENCY_BUCKETS,
)


# ---------------------------------------------------------------------- every server
def _code_of(context: Any, failed: bool) -> str:
    code = None
    try:
        code = context.code()  # set by abort() / set_code()
    except Exception:  # noqa: BLE001 - an older grpcio without ServicerContext.code()
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc stores the cygrpc integer in some versions
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return "UNKNOWN" if failed else "OK"


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every call of a server: requests by method and code, wire bytes in and out, latency.

    ``server``: the value of the ``server`` label (the runtime passes the server's name). Wire bytes
    are measured at the (de)serializers, so they are what crossed the network, framing aside.
    Thread-safe (prometheus_client's metrics are)."""

    def __init__(self, server: str) -> None:
        self.server = server
        # each label set's children, looked up once (prometheus_client's labels() takes a lock and
        # builds a key per call): a served method's, and (method, code, identity) for the counts.
        # Bounded: methods are the served ones, codes gRPC's, identities MAX_IDENTITY_LABELS + 3 (and _MAX_CHILDREN in all)
        self._children: dict[Any, Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= _MAX_CHILDREN:
                self._children.clear()
            child = self._children[key] = metric.labels(self.server, *labels)
        return child

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1] or handler_call_details.method
        received = self._child(_RECEIVED, method)
        sent = self._child(_SENT, method)
        latency = self._child(_LATENCY, method)
        child = self._child

        def deserialize(data: bytes) -> Any:
            received.inc(len(data))
            return handler.request_deserializer(data) if handler.request_deserializer else data

        def serialize(message: Any) -> bytes:
            data = handler.response_serializer(message) if handler.response_serializer else message
            sent.inc(data.nbytes if isinstance(data, Packed) else len(data))  # (Packed: tessera.bulk sends its pieces)
            return data

        def finish(t0: float, context: Any, failed: bool, info: dict[str, Any]) -> None:
            latency.observe(time.perf_counter() - t0)
            child(_REQUESTS, method, _code_of(context, failed), _identity_label(info)).inc()

        def unary(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            def run(request: Any, context: Any) -> Any:
                t0, failed = time.perf_counter(), True
                info, token = new_call()  # the admission inside fills in the caller's identity
                try:
                    out = behavior(request, context)
                    failed = False
                    return out
                finally:
                    finish(t0, context, failed, info)
                    end_call(token)
            return run

        def streaming(behavior: Callable[[Any, Any], Iterator[Any]]) -> Callable[[Any, Any], Iterator[Any]]:
            def run(request: Any, context: Any) -> Iterator[Any]:
                t0, failed = time.perf_counter(), True
                info, token = new_call()
                try:
                    yield from behavior(request, context)
                    failed = False
                finally:
                    finish(t0, context, failed, info)
                    end_call(token)
            return run

        if handler.unary_unary:
            wrap, fn, make = unary, handler.unary_unary, grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream:
            wrap, fn, make = streaming, handler.unary_stream, grpc.unary_stream_rpc_method_handler
        elif handler.stream_unary:
            wrap, fn, make = unary, handler.stream_unary, grpc.stream_unary_rpc_method_handler
        elif handler.stream_stream:
            wrap, fn, make = streaming, handler.stream_stream, grpc.stream_stream_rpc_method_handler
        else:
            return handler
        return make(wrap(fn), request_deserializer=deserialize, response_serializer=serialize)


# ---------------------------------------------------------------------- part-specific collectors
class ShardCollector(Collector):
    """A shard's figures, read from ``shard.stats()`` (``ps.shard.ShardStats``) at each scrape.

    Staleness: ``tessera_ps_clock_spread`` is the fastest live worker's clock minus the slowest's
    (in steps); ``tessera_ps_table_staleness_mean/max`` are the staleness of applied updates, in
    table versions, as the shard measured it. Replication lag of a pair: the primary's
    ``tessera_ps_replicated_total`` minus its backup's (both count the mutations they applied)."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard

    def collect(self) -> Iterable[Metric]:
        s = self.shard.stats()
        shard = f"ps{s.shard_index}"  # the ``server`` label, as the RPC families name this shard

        def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["server", *(labels or {})])
            g.add_metric([shard, *(labels or {}).values()], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["server"])
            c.add_metric([shard], value)
            return c

        live = [w for w in s.workers if w.live]
        yield gauge("tessera_ps_up_seconds", "seconds since the shard started", s.uptime_s)
        yield gauge("tessera_ps_sync_clock", "BSP clock every table of the shard has applied", s.sync_clock)
        yield gauge("tessera_ps_workers_live", "workers holding a live lease", len(live))
        wc = GaugeMetricFamily("tessera_ps_worker_clock", "each worker's clock (steps it finished)", labels=["server", "worker", "live"])
        for w in s.workers:
            wc.add_metric([shard, w.name, str(w.live).lower()], w.clock)
        yield wc
        spread = (max(w.clock for w in live) - min(w.clock for w in live)) if live else 0
        yield gauge("tessera_ps_clock_spread", "fastest minus slowest live worker's clock (staleness in steps)", spread)
        version = GaugeMetricFamily("tessera_ps_table_version", "updates applied to the table", labels=["server", "table"])
        st_mean = GaugeMetricFamily("tessera_ps_table_staleness_mean", "mean staleness of applied updates (versions)", labels=["server", "table"])
        st_max = GaugeMetricFamily("tessera_ps_table_staleness_max", "largest staleness of an applied update (versions)", labels=["server", "table"])
        nbytes = GaugeMetricFamily("tessera_ps_table_bytes", "bytes held by the table's slice", labels=["server", "table", "kind"])
        for t in s.tables:
            version.add_metric([shard, t.name], t.version)
            st_mean.add_metric([shard, t.name], t.mean_staleness)
            st_max.add_metric([shard, t.name], t.max_staleness)
            nbytes.add_metric([shard, t.name, "param"], t.param_bytes)
            nbytes.add_metric([shard, t.name, "state"], t.state_bytes)
        yield from (version, st_mean, st_max, nbytes)
        # (requests by method and code: tessera_rpc_requests_total, counted once by the runtime)
        yield counter("tessera_ps_received_bytes", "tensor bytes received by the shard", s.bytes_in)
        yield counter("tessera_ps_sent_bytes", "tensor bytes sent by the shard", s.bytes_out)
        yield counter("tessera_ps_replicated", "mutations replicated (primary: sent to its backup; backup: applied)", s.replicated)
        yield counter("tessera_ps_backups_lost", "times the primary lost its backup", s.backups_lost)
        yield gauge("tessera_ps_is_primary", "1 while the shard serves as primary, 0 as a backup", float(s.role == "primary"))
        yield gauge("tessera_ps_has_backup", "1 while a primary has an attached backup", float(bool(s.backup)))
        yield counter("tessera_ps_checkpoints", "checkpoints written", s.checkpoints)
        yield counter("tessera_ps_leases_expired", "worker leases that expired", s.leases_expired)


class TrainerCollector(Collector):
    """A trainer's figures, read from its JSON-lines metrics records (``path``, appended by the
    trainer: ``kind`` = step / eval / summary) at each scrape; only the lines added since the last
    scrape are read. Labels: ``worker`` (the trainer's name), ``mode``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()
        self._workers: dict[tuple[str, str], dict[str, Any]] = {}

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            key = (str(rec.get("worker", "")), str(rec.get("mode", "")))
            w = self._workers.setdefault(key, {"steps": 0, "compute": 0.0, "pull": 0.0, "push": 0.0, "eval": {}, "done": 0})
            kind = rec.get("kind")
            if kind == "step":
                w["steps"] = rec.get("step", w["steps"])
                w["eps"] = rec.get("examples_per_s", 0.0)
                w["loss"] = rec.get("loss", math.nan)
                w["staleness"] = rec.get("staleness", 0.0)
                w["compute"] += rec.get("compute_s", 0.0)
                w["pull"] += rec.get("pull_wait_s", 0.0)
                w["push"] += rec.get("push_wait_s", 0.0)
            elif kind == "eval":
                w["eval"].update({k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and k not in ("step", "time", "elapsed")})
            elif kind == "summary":
                w["done"] = 1
                w["steps"] = rec.get("final_clock", w["steps"])
                if rec.get("examples_per_s"):
                    w["eps"] = rec["examples_per_s"]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            self._read()
            workers = {k: dict(v, eval=dict(v["eval"])) for k, v in self._workers.items()}
        labels = ["worker", "mode"]

        def family(cls: Any, name: str, doc: str, field: str) -> Metric:
            m = cls(name, doc, labels=labels)
            for key, w in workers.items():
                if field in w:
                    m.add_metric(list(key), float(w[field]))
            return m

        yield family(GaugeMetricFamily, "tessera_train_steps", "the trainer's clock (steps done)", "steps")
        yield family(GaugeMetricFamily, "tessera_train_examples_per_second", "examples/s over the last logged window", "eps")
        yield family(GaugeMetricFamily, "tessera_train_loss", "mean training loss over the last logged window", "loss")
        yield family(GaugeMetricFamily, "tessera_train_staleness", "mean staleness of recent pushes (versions)", "staleness")
        yield family(CounterMetricFamily, "tessera_train_compute_seconds", "seconds computing", "compute")
        yield family(CounterMetricFamily, "tessera_train_pull_wait_seconds", "seconds waiting for pulls (BSP/SSP round waits)", "pull")
        yield family(CounterMetricFamily, "tessera_train_push_wait_seconds", "seconds waiting for pushes", "push")
        ev = GaugeMetricFamily("tessera_train_eval", "the latest evaluation, by metric", labels=[*labels, "metric"])
        for key, w in workers.items():
            for name, value in sorted(w["eval"].items()):
                ev.add_metric([*key, name], float(value))
        yield ev
        yield family(GaugeMetricFamily, "tessera_train_done", "1 once the trainer wrote its summary", "done")


class FedCollector(Collector):
    """A federated server's figures, read from its registry (connected clients) and round history
    (``FedServer.registry.num_connected``, ``FedServer.history``) at each scrape."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        connected = self.server.registry.num_connected
        history = list(self.server.history)
        g = GaugeMetricFamily("tessera_fed_clients_connected", "clients connected now", value=float(connected() if callable(connected) else connected))
        yield g
        yield CounterMetricFamily("tessera_fed_rounds", "rounds completed", value=len(history))
        last = history[-1] if history else {}
        yield GaugeMetricFamily("tessera_fed_last_round_seconds", "the last round's time (waiting included)", value=float(last.get("round_s", 0.0)))
        yield CounterMetricFamily("tessera_fed_round_seconds", "time of every round", value=sum(float(r.get("round_s", 0.0)) for r in history))
        yield CounterMetricFamily("tessera_fed_wait_seconds", "time rounds waited for clients", value=sum(float(r.get("wait_s", 0.0)) for r in history))
        yield GaugeMetricFamily("tessera_fed_clients_answered", "clients that answered the last round", value=float(last.get("answered", 0) or 0))
        yield CounterMetricFamily("tessera_fed_received_bytes", "update bytes clients sent", value=sum(float(r.get("bytes_up", 0)) for r in history))
        yield CounterMetricFamily("tessera_fed_sent_bytes", "bytes sent to clients", value=sum(float(r.get("bytes_down", 0)) for r in history))
        loss = GaugeMetricFamily("tessera_fed_central_loss", "the last central evaluation's loss")
        if "central_loss" in last:
            loss.add_metric([], float(last["central_loss"]))
        yield loss


# ---------------------------------------------------------------------- the endpoint
METRICS_ROLES = frozenset({"reader", "admin"})  # who may scrape a server that has identities
MAX_SCRAPES = 4  # scrapes served at once; more are answered 503 at once
_served: dict[int, Any] = {}


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics``: the default registry in Prometheus text, for callers its Access admits."""

    timeout = 10.0  # seconds per connection (a slow client cannot hold a scrape slot longer)
    server: _MetricsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._reply(404, b"only /metrics here\n")
            return
        access = self.server.access
        if access is not None:
            auth: dict[str, list[bytes]] = {}
            if isinstance(self.connection, ssl.SSLSocket):
                subject: Any = (self.connection.getpeercert() or {}).get("subject", ())
                cns = [str(v).encode() for rdn in subject for k, v in rdn if k == "commonName"]
                if cns:
                    auth["x509_common_name"] = cns
            try:
                caller = access.caller([("authorization", self.headers.get("Authorization", ""))], auth)
                access.authorize("Metrics", caller)
            except UnauthenticatedError as e:
                self._reply(401, f"{e}\n".encode(), [("WWW-Authenticate", 'Bearer realm="tessera metrics"')])
                return
            except PermissionDeniedError as e:
                self._reply(403, f"{e}\n".encode())
                return
        self._reply(200, generate_latest(self.server.registry), [("Content-Type", CONTENT_TYPE_LATEST)])

    def _reply(self, code: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not worth a log line
        pass


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None, access: Any, registry: Any) -> None:
        self.tls, self.access, self.registry = tls, access, registry
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:  # full: a short 503 without a thread (plaintext), or just closed (TLS: no handshake here)
                if self.tls is None:
                    request.setblocking(False)
                    request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if self.tls is not None:  # the handshake in this connection's thread, bounded by its timeout
                request.settimeout(_Handler.timeout)
                try:
                    request = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def serve_metrics(port: int, host: str = "127.0.0.1", collectors: Iterable[Collector] = (), security: Any = None) -> int:
    """Serve ``GET /metrics`` on ``host:port`` (0: a free port) from a daemon thread, with
    ``collectors`` registered on the default registry (which holds the RPC metrics). Returns the
    bound port. Raises OSError if the port cannot be bound.

    ``security`` (the server's ``tessera.service.ServerSecurity``): TLS as the server has it
    (client certificates required under mutual TLS), and for a server with identities only
    callers with the ``reader`` or ``admin`` role (bearer token, or certificate); None or an
    open server: plain HTTP for anyone who can reach ``host``."""
    from tessera.service import Access

    for c in collectors:
        REGISTRY.register(c)
    tls = access = None
    if security is not None:
        if security.tls:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            with pem_file(security.tls_cert) as cert, pem_file(security.tls_key) as key:
                tls.load_cert_chain(cert, key)
            if security.mutual:
                tls.verify_mode = ssl.CERT_REQUIRED
                tls.load_verify_locations(cadata=read_pem(security.tls_ca).decode())
        if not security.open:
            access = Access(security, {"Metrics": METRICS_ROLES}, METRICS_ROLES)
    server = _MetricsServer((host.strip("[]"), port), tls, access, REGISTRY)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = int(server.server_address[1])
    _served[bound] = server
    return bound


def add_metrics_args(p: Any) -> None:
    """``--metrics-port`` (0: no endpoint) and ``--metrics-host`` on a command."""
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port (GET /metrics; 0: no endpoint); over TLS when the "
                        "server has TLS, for a token (or certificate) with the reader or admin role when it has identities")
    p.add_argument("--metrics-host", default=None,
                   help="address of the metrics endpoint (default 127.0.0.1: give it, e.g. 0.0.0.0, for a Prometheus elsewhere)")


def start_from_args(args: Any, collectors: Iterable[Collector] = (), what: str = "tessera", security: Any = None) -> int:
    """Start the endpoint if ``args.metrics_port`` (prints ``WHAT metrics on HOST:PORT``, with
    ``(https, token)`` / ``(https)`` when secured); ``security``: the server's, see
    :func:`serve_metrics`. Returns the bound port, or 0 when off."""
    port = int(getattr(args, "metrics_port", 0) or 0)
    if port <= 0:
        return 0
    host = getattr(args, "metrics_host", None) or "127.0.0.1"  # loopback unless asked
    bound = serve_metrics(port, host, collectors, security)
    how = ""
    if security is not None and (security.tls or not security.open):
        how = " (" + ", ".join(x for x, on in (("https", security.tls), ("reader token or certificate", not security.open)) if on) + ")"
    print(f"{what} metrics on {host}:{bound}{how}", flush=True)
    return bound


def metrics_file(args: Any, prefix: str = "tessera-metrics-") -> str:
    """The trainer's metrics records file: ``args.metrics_out``, or a fresh temporary file removed
    when the process exits."""
    if getattr(args, "metrics_out", None):
        return str(args.metrics_out)
    import atexit
    import contextlib
    import tempfile

    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
    os.close(fd)

    def remove() -> None:
        with contextlib.suppress(OSError):
            os.remove(path)

    atexit.register(remove)  # ours, not the user's: gone when the process ends
    return path
