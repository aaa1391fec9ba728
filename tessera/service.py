"""The service runtime: one way for every Tessera server and client to be on the network.

* **Building a server** (:func:`build_server`): bind ``host:port`` (0 picks one) with TLS or
  mutual TLS or in plaintext, register the service handlers and the standard gRPC health
  service (``grpc.health.v1``, from ``grpcio-health-checking``), return ``(server, port)``.
* **Who may call what** (:class:`Access`): a caller is identified by its bearer token
  (``authorization: Bearer <token>``), or, under mutual TLS without tokens, by its client
  certificate's common name. Each identity has roles; each method admits some roles. A
  server with neither tokens nor client certificates is *open*: every caller is anonymous
  with every role; open is allowed on a loopback address, elsewhere only with an explicit
  ``insecure`` (and the server says so at start). Tokens over plaintext are refused unless
  ``insecure``. Per identity: at most ``max_concurrent`` calls in flight and, if set, a
  request rate (token bucket); both answer RESOURCE_EXHAUSTED. Counters per method and code.
* **The error table** (:class:`ErrorTable`): domain error class <-> gRPC status code, both
  ways, with the message kept.
* **Clients** (:func:`client_channel`): TLS / mutual TLS / plaintext channels that put the
  token on every call. A call that cannot connect because client and server disagree about TLS
  (a plaintext client to a TLS server, a TLS client to a plaintext one, a server certificate the
  client's CA did not sign) fails at once with :class:`TransportSecurityError` naming the likely
  cause, instead of being retried as UNAVAILABLE (:func:`diagnose` probes the server).
  :func:`wait_for_server` waits (bounded) until a server accepts connections, saying why not.
* **Credentials for a cluster** (:func:`make_ca`, :func:`issue_cert`, :func:`write_token_file`):
  a development CA, certificates for named hosts, token files written mode 0600.

Token files: ``identity token [role,role,...]`` per line (``#`` comments), or JSON
``{"identity": "token"}`` / ``{"identity": {"token": ..., "roles": [...]}}``. Only SHA-256
digests of tokens are kept in memory.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import socket
import ssl
import tempfile
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grpc

from tessera.codec import as_bytes
from tessera.rpc import channel_options, server_options
from tessera.security import TOKEN_HEADER, _read, _token_from

__all__ = [
    "ServiceError", "UnauthenticatedError", "PermissionDeniedError", "RateLimitedError", "ConfigError",
    "ErrorTable", "Identities", "load_token_file", "write_token_file", "ServerSecurity", "ClientSecurity", "Caller",
    "Access", "build_server", "client_channel", "make_ca", "issue_cert", "is_loopback", "ANONYMOUS",
    "add_server_security_args", "add_client_security_args", "server_security_from", "client_security_from",
    "FailedCall", "TransportSecurityError", "ServerUnreachableError", "Diagnosis", "diagnose", "wait_for_server", "BindError",
    "UsageError", "serving_when",
]

ANONYMOUS = ""
ERROR_CLASS_HEADER = "tessera-error"  # trailing metadata: the error class a refusal came from


class ServiceError(Exception):
    """Base of the runtime's own errors."""


class UnauthenticatedError(ServiceError):
    """No credentials, or unknown ones (UNAUTHENTICATED)."""


class PermissionDeniedError(ServiceError):
    """Known caller, not allowed to do this (PERMISSION_DENIED)."""


class RateLimitedError(ServiceError):
    """Too many calls of one identity at once or per second (RESOURCE_EXHAUSTED)."""


class ConfigError(ServiceError, ValueError):
    """A server or client set up in a way the runtime refuses (e.g. tokens over plaintext)."""


class UsageError(Exception):
    """A command line that cannot work (e.g. ``--worker-index 3 --num-workers 2``): the ``tessera``
    command prints it as one line and exits 2. Parts' CLIs raise it for what argparse alone
    cannot check (it lives here, not in ``tessera.cli``, so that they need not import the command)."""


class BindError(ServiceError, OSError):
    """A server could not listen on its address (port in use, or not this machine's address)."""


# ---------------------------------------------------------------------- errors
class ErrorTable:
    """Domain error class <-> gRPC status code. ``code_of(exc)``: the first class along the
    exception's MRO that has a code (INTERNAL if none); ``error_of(code)``: the class registered
    first for that code (``default`` if none)."""

    def __init__(
        self, codes: Mapping[type[BaseException], grpc.StatusCode], default: type[Exception] = ServiceError,
        family: type[BaseException] = BaseException,
    ) -> None:
        """``family``: the base of the classes a client of this table raises (a runtime error of the
        kernel, e.g. RateLimitedError, comes back as the family's class for its code)."""
        self.family = family
        self.codes = dict(codes)
        self.codes.setdefault(UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED)
        self.codes.setdefault(PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED)
        self.codes.setdefault(RateLimitedError, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.default = default

    def code_of(self, exc: BaseException) -> grpc.StatusCode:
        for cls in type(exc).__mro__:
            if cls in self.codes:
                return self.codes[cls]
        return grpc.StatusCode.INTERNAL

    def error_of(self, code: grpc.StatusCode | None, name: str | None = None) -> type[BaseException]:
        """The class for ``code``; ``name`` (the server's class name, see abort()) picks among the
        classes that share the code (e.g. TaskClosedError and ConfigError: FAILED_PRECONDITION)."""
        if name:
            for cls, c in self.codes.items():
                if cls.__name__ == name and c == code and issubclass(cls, self.family):
                    return cls
        if code is None:
            return self.default
        first = [cls for cls, c in self.codes.items() if c == code and issubclass(cls, self.family)]
        return first[0] if first else self.default

    def abort(self, context: grpc.ServicerContext, exc: BaseException, message: str) -> None:
        """End the call with ``exc``'s code and ``message``; the error's class name travels as
        trailing metadata (``tessera-error``), so the client raises the same class. Raises."""
        code = self.code_of(exc)
        if code != grpc.StatusCode.INTERNAL:
            context.set_trailing_metadata(((ERROR_CLASS_HEADER, type(exc).__name__),))
        context.abort(code, message)

    def exception_of(self, e: grpc.RpcError) -> tuple[type[BaseException], grpc.StatusCode | None, str]:
        """(class, code, details) of a failed call, as the server raised it."""
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        name = None
        trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
        for key, value in trailing or ():
            if key == ERROR_CLASS_HEADER:
                name = value.decode() if isinstance(value, bytes) else value
        return self.error_of(code, name), code, details or ""


# ---------------------------------------------------------------------- identities
def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Identities:
    """identity -> (token digest, roles). ``lookup(token)`` -> identity or None."""

    def __init__(self, tokens: Mapping[str, str], roles: Mapping[str, Iterable[str]] | None = None,
                 default_roles: Iterable[str] = ()) -> None:
        self._by_digest: dict[str, str] = {}
        self.roles: dict[str, frozenset[str]] = {}
        for identity, token in tokens.items():
            if not identity or not token:
                raise ConfigError("identities and tokens must be non-empty")
            if len(token) < 16:
                raise ConfigError(f"identity {identity!r}: token shorter than 16 characters")
            d = _digest(token)
            if d in self._by_digest:
                raise ConfigError(f"identities {self._by_digest[d]!r} and {identity!r} share a token")
            self._by_digest[d] = identity
            self.roles[identity] = frozenset((roles or {}).get(identity, ())) or frozenset(default_roles)

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str | None) -> str | None:
        return self._by_digest.get(_digest(token)) if token else None


def load_token_file(path: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Read a token file -> ({identity: token}, {identity: roles})."""
    text = open(path, encoding="utf-8").read()
    tokens: dict[str, str] = {}
    roles: dict[str, list[str]] = {}
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        for identity, v in data.items():
            if isinstance(v, str):
                tokens[identity] = v
            elif isinstance(v, dict) and isinstance(v.get("token"), str):
                tokens[identity] = v["token"]
                roles[identity] = [str(r) for r in v.get("roles", [])]
            else:
                raise ConfigError(f"{path}: identity {identity!r}: expected a token string or {{'token', 'roles'}}")
        return tokens, roles
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ConfigError(f"{path}:{n}: expected 'identity token [role,role,...]'")
        tokens[parts[0]] = parts[1]
        if len(parts) == 3:
            roles[parts[0]] = [r for r in parts[2].split(",") if r]
    return tokens, roles


def write_token_file(path: str, tokens: Mapping[str, str], roles: Mapping[str, Sequence[str]] | None = None) -> None:
    """Write a token file readable by its owner only (created 0600; an existing file is made
    0600 before anything is written; a symlink is refused)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1
            for identity, token in tokens.items():
                r = ",".join((roles or {}).get(identity, ()))
                f.write(f"{identity} {token}{' ' + r if r else ''}\n")
    finally:
        if fd >= 0:
            os.close(fd)


# ---------------------------------------------------------------------- server security
def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSecurity:
    """How a server is reached and who may call it.

    ``tls_cert``/``tls_key``: serve TLS (PEM files); ``tls_ca``: also require client certificates
    signed by this CA (mutual TLS). ``tokens``/``roles``: identities (bearer tokens) and their
    roles; an identity without roles gets ``default_roles``. ``insecure``: allow plaintext with
    tokens, or an open server on a non-loopback address."""

    tls_cert: str | bytes | None = None  # PEM file name, or PEM bytes
    tls_key: str | bytes | None = None
    tls_ca: str | bytes | None = None
    tokens: Mapping[str, str] | None = None
    roles: Mapping[str, Sequence[str]] = field(default_factory=dict)
    default_roles: tuple[str, ...] = ()
    insecure: bool = False
    max_concurrent: int = 64  # calls in flight per identity
    rate: float = 0.0  # calls per second per identity (token bucket, burst = 2 s worth); 0: no limit

    @classmethod
    def from_files(
        cls, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
        token_file: str | None = None, insecure: bool = False, default_roles: Sequence[str] = (), **kw: Any,
    ) -> "ServerSecurity":
        tokens, roles = load_token_file(token_file) if token_file else (None, {})
        return cls(tls_cert or None, tls_key or None, tls_ca or None, tokens, roles, tuple(default_roles), insecure, **kw)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mutual(self) -> bool:
        return self.tls_ca is not None

    @property
    def open(self) -> bool:
        return self.tokens is None and not self.mutual

    def check(self, host: str) -> list[str]:
        """Refuse unsafe setups (ConfigError); returns the warnings to print at start."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
        if self.mutual and not self.tls:
            raise ConfigError("mutual TLS (--tls-ca) needs the server's own --tls-cert and --tls-key")
        warnings = []
        if self.tokens is not None and not self.tls:
            if not self.insecure:
                raise ConfigError(
                    "tokens over plaintext would travel readable by anyone on the network: give --tls-cert/--tls-key, "
                    "or --insecure for a loopback experiment"
                )
            warnings.append("INSECURE: tokens travel in plaintext (--insecure)")
        if self.open:
            if not is_loopback(host) and not self.insecure:
                raise ConfigError(
                    f"an open server (no --token-file, no --tls-ca) on {host} would let anyone who can reach it do anything: "
                    "give --token-file (with TLS) or --tls-ca, or --insecure to accept that"
                )
            warnings.append(f"OPEN: no authentication on {host} (anyone who can reach it has every role)")
        elif not self.tls:
            warnings.append("INSECURE: plaintext (--insecure)")
        return warnings

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        pair = [(_read(self.tls_key), _read(self.tls_cert))]  # type: ignore[arg-type]
        if self.mutual:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.tls_ca), require_client_auth=True)  # type: ignore[arg-type]
        return grpc.ssl_server_credentials(pair)


@dataclass(frozen=True)
class Caller:
    identity: str
    roles: frozenset[str]

    def has(self, role: str) -> bool:
        return role in self.roles


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at = tokens, at


class Access:
    """Authentication, authorization and per-identity limits for one service.

    ``method_roles``: method name -> the roles that may call it (a method not listed may be
    called by nobody but ``admin``). ``all_roles``: every role of the service (an open server's
    anonymous caller has them all). Thread-safe."""

    def __init__(self, security: ServerSecurity, method_roles: Mapping[str, Iterable[str]], all_roles: Iterable[str]) -> None:
        self.security = security
        self.method_roles = {m: frozenset(r) for m, r in method_roles.items()}
        self.all_roles = frozenset(all_roles)
        self.identities = (
            Identities(security.tokens, security.roles, security.default_roles) if security.tokens is not None else None
        )
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._buckets: dict[str, _Bucket] = {}
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, outcome code name)

    def caller(self, metadata: Iterable[Any] | None, auth_context: Mapping[str, Any] | None = None) -> Caller:
        """Who is calling (UnauthenticatedError if nobody we know)."""
        if self.identities is not None:
            token = _token_from(metadata)
            identity = self.identities.lookup(token)
            if identity is None:
                raise UnauthenticatedError(
                    "unknown token" if token else f"no token ('{TOKEN_HEADER}: Bearer <token>' metadata)"
                )
            return Caller(identity, self.identities.roles[identity])
        if self.security.mutual:
            names = (auth_context or {}).get("x509_common_name") or []
            if not names:
                raise UnauthenticatedError("no client certificate")
            identity = names[0].decode() if isinstance(names[0], bytes) else str(names[0])
            roles = frozenset(self.security.roles.get(identity, ())) or frozenset(self.security.default_roles)
            return Caller(identity, roles)
        return Caller(ANONYMOUS, self.all_roles)

    def authorize(self, method: str, caller: Caller) -> None:
        allowed = self.method_roles.get(method, frozenset({"admin"}))
        if not (caller.roles & allowed):
            raise PermissionDeniedError(
                f"{method}: identity {caller.identity!r} (roles {sorted(caller.roles) or 'none'}) may not call it; "
                f"it needs one of {sorted(allowed)}"
            )

    @contextlib.contextmanager
    def admit(self, method: str, context: grpc.ServicerContext) -> Iterator[Caller]:
        """Authenticate, authorize and count one call; holds a concurrency slot of its identity."""
        caller = self.caller(context.invocation_metadata(), context.auth_context())
        self.authorize(method, caller)
        s = self.security
        if caller.identity == ANONYMOUS:  # an open server: no identities to tell apart, no per-identity limits
            yield caller
            return
        with self._lock:
            if self._in_flight[caller.identity] >= s.max_concurrent:
                raise RateLimitedError(
                    f"{method}: identity {caller.identity!r} has {s.max_concurrent} calls in flight already (the limit)"
                )
            if s.rate > 0:
                now = time.monotonic()
                b = self._buckets.setdefault(caller.identity, _Bucket(2 * s.rate, now))
                b.tokens = min(2 * s.rate, b.tokens + (now - b.at) * s.rate)
                b.at = now
                if b.tokens < 1:
                    raise RateLimitedError(f"{method}: identity {caller.identity!r} is over {s.rate:g} calls per second")
                b.tokens -= 1
            self._in_flight[caller.identity] += 1
        try:
            yield caller
        finally:
            with self._lock:
                self._in_flight[caller.identity] -= 1
                if not self._in_flight[caller.identity]:
                    del self._in_flight[caller.identity]

    def count(self, method: str, code: grpc.StatusCode) -> None:
        with self._lock:
            self.counts[(method, code.name)] += 1


# ---------------------------------------------------------------------- servers
class _JoinPacked(grpc.ServerInterceptor):
    """gRPC's serializer for replies a handler gives as a codec.Packed (its pieces, not joined: what
    tessera.bulk sends as they are): joined into bytes, the one copy. Outermost, so the interceptors
    inside (metrics) see the reply as the handler gave it."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        h = continuation(details)
        if h is None or not (h.unary_unary or h.unary_stream or h.stream_unary or h.stream_stream):
            return h
        ser = h.response_serializer

        def serialize(message: Any) -> Any:
            return as_bytes(ser(message) if ser is not None else message)

        return h._replace(response_serializer=serialize)


_JOIN_PACKED = _JoinPacked()


def build_server(
    handlers: Sequence[grpc.GenericRpcHandler], host: str, port: int, security: ServerSecurity,
    max_workers: int = 64, max_message_bytes: int = 64 << 20, service_names: Sequence[str] = (),
    extra_options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[grpc.ServerInterceptor] = (), name: str = "srv",
) -> tuple[grpc.Server, int, Any]:
    """A started server: (server, bound port, health servicer). ``security.check(host)`` runs first."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from tessera.metrics import MetricsInterceptor

    security.check(host)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
        # then every call is counted (requests, bytes, latency by method and code), refusals too
        interceptors=[_JOIN_PACKED, MetricsInterceptor(name), *interceptors],
        options=server_options(max_message_bytes) + list(extra_options),
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for svc in ("", *service_names):
        health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    creds = security.credentials()
    try:
        bound = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    except RuntimeError:  # grpcio raises this where a bind fails
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot listen on {bind}: the port is in use, or {host} is not an address of this machine "
            "(choose another --port, --port 0 for a free one, or another --host)"
        )
    server.start()
    return server, bound, health_servicer


# ---------------------------------------------------------------------- clients
@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: ``tls_ca`` (trust this CA: TLS), ``tls_cert``/``tls_key``
    (its own certificate: mutual TLS), ``token`` (sent on every call), ``server_name`` (the name
    to check in the server's certificate, when the address is not in it)."""

    tls_ca: str | bytes | None = None  # PEM file name, or PEM bytes
    tls_cert: str | bytes | None = None
    tls_key: str | bytes | None = None
    token: str | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                   token_file: str | None = None, identity: str | None = None, token: str | None = None,
                   server_name: str | None = None) -> "ClientSecurity":
        """``token_file`` + ``identity``: that identity's token from a token file (the file's only
        identity if ``identity`` is None)."""
        if token_file:
            tokens, _ = load_token_file(token_file)
            if identity is None:
                if len(tokens) != 1:
                    raise ConfigError(f"{token_file} holds {len(tokens)} identities: say which one (--identity)")
                identity = next(iter(tokens))
            if identity not in tokens:
                raise ConfigError(f"{token_file}: no identity {identity!r}")
            token = tokens[identity]
        return cls(tls_ca or None, tls_cert or None, tls_key or None, token or None, server_name or None)


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.metadata = ((TOKEN_HEADER, f"Bearer {token}"),)

    def _add(self, continuation: Callable, details: Any, request: Any) -> Any:
        details = details._replace(metadata=tuple(details.metadata or ()) + self.metadata) if hasattr(details, "_replace") else _Details(details, self.metadata)
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _add


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: Any, extra: tuple) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.metadata = tuple(d.metadata or ()) + extra
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def client_channel(address: str, security: ClientSecurity | None = None, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to ``address``: TLS when ``security.tls_ca`` is set (mutual with tls_cert/key),
    plaintext otherwise; the token, if any, on every call."""
    sec = security or ClientSecurity()
    opts = list(options if options is not None else channel_options())
    if sec.tls_ca:
        if sec.server_name:
            opts.append(("grpc.ssl_target_name_override", sec.server_name))
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(sec.tls_ca),
            private_key=_read(sec.tls_key) if sec.tls_key else None,
            certificate_chain=_read(sec.tls_cert) if sec.tls_cert else None,
        )
        channel = grpc.secure_channel(address, creds, options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    # outermost: it sees the calls' outcomes (a mismatch is known before the token matters)
    channel = grpc.intercept_channel(channel, _MismatchInterceptor(address, sec))
    if sec.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(sec.token))
    return channel


# ---------------------------------------------------------------------- why a connection fails
class FailedCall(grpc.RpcError, grpc.Call):
    """A call that failed without a gRPC call object behind it (a refused transport, the bulk
    transport's calls), shaped like gRPC's: ``code()``, ``details()``, ``trailing_metadata()``; so
    code that handles ``grpc.RpcError`` handles it unchanged."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def __str__(self) -> str:
        return self._details


class TransportSecurityError(FailedCall, ServiceError):
    """Client and server disagree about transport security, so no call can ever succeed: a
    plaintext client to a TLS server (forgot ``--tls-ca``), a TLS client to a plaintext server,
    a server certificate the client's CA does not accept, a server that wants a client
    certificate. Calls on a :func:`client_channel` raise it at once instead of retrying
    UNAVAILABLE; as a gRPC error its code is UNAUTHENTICATED (clients map it to their
    ``UnauthenticatedError``, which nobody retries) and its details name the likely cause."""

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, message)
        self.message = message
        self.address = address


class ServerUnreachableError(ServiceError, TimeoutError):
    """:func:`wait_for_server` gave up: no connection within its timeout (the message says why;
    ``diagnosis`` is the last probe's finding)."""

    def __init__(self, message: str, diagnosis: "Diagnosis | None" = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


@dataclass(frozen=True)
class Diagnosis:
    """What a probe of a server found. ``kind``: ``ok`` (a TLS/plaintext handshake as the client
    would do it works), ``refused`` (nothing listening), ``unreachable`` (no answer, or the name
    does not resolve), or a security mismatch: ``tls_required``, ``tls_unsupported``,
    ``untrusted``, ``name_mismatch``, ``client_cert_required``. ``message``: one sentence with
    what to do."""

    kind: str
    message: str

    @property
    def mismatch(self) -> bool:
        """True for a transport-security mismatch (retrying cannot help)."""
        return self.kind in ("tls_required", "tls_unsupported", "untrusted", "name_mismatch", "client_cert_required")


def _host_port(address: str) -> tuple[str, int] | None:
    a = address.split("///", 1)[-1]
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if a.startswith(scheme):
            a = a[len(scheme):]
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "localhost", int(port)


@contextlib.contextmanager
def _pem_file(pem: str | bytes) -> Iterator[str]:
    """A file name holding ``pem`` (ssl loads client certificates from files only)."""
    if isinstance(pem, str) and not pem.lstrip().startswith("-----BEGIN"):
        yield pem
        return
    fd, path = tempfile.mkstemp(suffix=".pem")  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_read(pem))
        yield path
    finally:
        os.unlink(path)


def diagnose(address: str, security: ClientSecurity | None = None, timeout: float = 2.0) -> Diagnosis:
    """Probe ``address`` the way a client with ``security`` would connect (TCP, then a TLS
    handshake) and say why a gRPC connection fails, if it can tell. Takes at most about
    2 x ``timeout`` seconds; never raises."""
    sec = security or ClientSecurity()
    hp = _host_port(address)
    if hp is None:
        return Diagnosis("unreachable", f"{address!r} is not HOST:PORT")
    host, port = hp
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return Diagnosis("refused", f"nothing is listening at {address} (connection refused)")
    except socket.gaierror as e:
        return Diagnosis("unreachable", f"cannot resolve {host!r}: {e.strerror}")
    except OSError as e:
        return Diagnosis("unreachable", f"no connection to {address}: {e.strerror or e}")
    tls_flags = "--tls-cert/--tls-key"
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.set_alpn_protocols(["h2"])
        name = sec.server_name or host
        if sec.tls_ca:
            ctx.load_verify_locations(cadata=_read(sec.tls_ca).decode())
        else:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        with contextlib.ExitStack() as stack:
            if sec.tls_ca and sec.tls_cert and sec.tls_key:
                ctx.load_cert_chain(stack.enter_context(_pem_file(sec.tls_cert)), stack.enter_context(_pem_file(sec.tls_key)))
            try:
                tls = ctx.wrap_socket(sock, server_hostname=name)
            except ssl.SSLCertVerificationError as e:
                why = e.verify_message or str(e)
                if "hostname" in why.lower() or "ip address mismatch" in why.lower():
                    return Diagnosis(
                        "name_mismatch",
                        f"the certificate of the server at {address} is not valid for the name {name!r} ({why}): "
                        "connect by a name the certificate holds (tessera cert --hosts ...)",
                    )
                return Diagnosis(
                    "untrusted",
                    f"the server at {address} speaks TLS, but its certificate is not accepted by the CA given "
                    f"(--tls-ca): {why}; give the CA that signed the server's certificate",
                )
            except ssl.SSLError as e:
                reason = e.reason or ""
                if "CERTIFICATE_REQUIRED" in reason or ("HANDSHAKE_FAILURE" in reason and sec.tls_ca):
                    return _client_cert_required(address, tls_flags)
                if "ALERT" in reason and not sec.tls_ca:
                    return _tls_required(address)
                if sec.tls_ca:
                    return _tls_unsupported(address)
                return Diagnosis("ok", f"the server at {address} answers in plaintext, as this client speaks")
            except OSError:  # reset or closed during the handshake: not a TLS server
                if sec.tls_ca:
                    return _tls_unsupported(address)
                return Diagnosis("ok", f"the server at {address} answers in plaintext, as this client speaks")
            sock = tls
            if not sec.tls_ca:
                return _tls_required(address)
            # TLS 1.3: a server that requires a client certificate says so after the handshake
            # (an alert, or it just closes); a server that accepted us waits for our HTTP/2 preface
            tls.settimeout(min(timeout, 0.5))
            try:
                closed = tls.recv(1) == b""
            except ssl.SSLError as e:
                closed = "CERTIFICATE_REQUIRED" in (e.reason or "") or "ALERT" in (e.reason or "")
            except (ConnectionError, socket.timeout):
                closed = False
            if closed:
                if sec.tls_cert:
                    return Diagnosis(
                        "client_cert_required",
                        f"the server at {address} refused this client's certificate after the TLS handshake: "
                        "is it signed by the CA the server trusts (its --tls-ca)?",
                    )
                return _client_cert_required(address, tls_flags)
            return Diagnosis("ok", f"the server at {address} speaks TLS with a certificate the CA given accepts")
    except (ssl.SSLError, OSError, ValueError) as e:  # e.g. an unreadable CA file
        return Diagnosis("unknown", f"could not probe {address}: {e}")
    finally:
        sock.close()


def _tls_required(address: str) -> Diagnosis:
    return Diagnosis(
        "tls_required",
        f"the server at {address} speaks TLS but this client connects in plaintext: "
        "give the CA that signed its certificate (--tls-ca CA.crt; formerly --root-cert)",
    )


def _tls_unsupported(address: str) -> Diagnosis:
    return Diagnosis(
        "tls_unsupported",
        f"the server at {address} does not speak TLS (plaintext) but this client uses TLS (--tls-ca): "
        "drop --tls-ca, or start the server with --tls-cert/--tls-key",
    )


def _client_cert_required(address: str, flags: str) -> Diagnosis:
    return Diagnosis(
        "client_cert_required",
        f"the server at {address} requires a client certificate (mutual TLS): give this client's {flags} "
        "(tessera cert --clients NAME makes one)",
    )


class _MismatchInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Turns a transport failure (UNAVAILABLE without a server's error class) that a probe of the
    server explains as a security mismatch into :class:`TransportSecurityError`. The probe runs
    only after such a failure, at most once per ``every`` seconds per channel."""

    def __init__(self, address: str, security: ClientSecurity, every: float = 5.0) -> None:
        self.address, self.security, self.every = address, security, every
        self._lock = threading.Lock()
        self._at = -1e9
        self._last: Diagnosis | None = None

    def check(self, e: BaseException) -> None:
        if not isinstance(e, grpc.RpcError) or isinstance(e, TransportSecurityError):
            return
        code = e.code() if hasattr(e, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            return
        for key, _ in (e.trailing_metadata() if hasattr(e, "trailing_metadata") else None) or ():
            if key == ERROR_CLASS_HEADER:  # the server itself answered UNAVAILABLE (e.g. a backup)
                return
        with self._lock:
            if time.monotonic() - self._at > self.every:
                self._last = diagnose(self.address, self.security)
                self._at = time.monotonic()
            d = self._last
        if d is not None and d.mismatch:
            raise TransportSecurityError(d.message, self.address) from None

    def _unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        # the blocking path hands back a finished outcome; a .future() call is left alone (not waited on)
        if outcome.done() and not outcome.cancelled():
            self.check(outcome.exception())
        return outcome

    def _stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return _CheckedStream(continuation(details, request), self.check)

    intercept_unary_unary = intercept_stream_unary = _unary
    intercept_unary_stream = intercept_stream_stream = _stream


class _CheckedStream:
    """A response stream whose errors pass through ``check`` first (everything else delegated)."""

    def __init__(self, call: Any, check: Callable[[BaseException], None]) -> None:
        self._call, self._check = call, check

    def __iter__(self) -> "_CheckedStream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            self._check(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


def wait_for_server(
    address: str, security: ClientSecurity | None = None, timeout: float = 60.0,
    on_wait: Callable[[float, Diagnosis], None] | None = None, every: float = 5.0,
) -> None:
    """Block until the server at ``address`` accepts a connection (as a client with ``security``),
    at most ``timeout`` seconds. While it waits, ``on_wait(seconds waited, diagnosis)`` is called
    every ``every`` seconds (e.g. to print "nothing is listening there"). Raises
    :class:`TransportSecurityError` as soon as a probe finds a TLS mismatch, and
    :class:`ServerUnreachableError` (the last diagnosis in its message) at the deadline."""
    channel = client_channel(address, security)
    t0 = time.monotonic()
    deadline = t0 + timeout
    said = t0
    try:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                return
            except grpc.FutureTimeoutError:
                pass
            d = diagnose(address, security, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            if d.mismatch:
                raise TransportSecurityError(d.message, address)
            now = time.monotonic()
            if now >= deadline:
                why = d.message if d.kind != "ok" else "it accepts TCP connections but no gRPC connection was made"
                raise ServerUnreachableError(f"{address} not reachable within {timeout:.3g} s: {why}", d)
            if on_wait is not None and now - said >= every:
                said = now
                on_wait(now - t0, d)
    finally:
        channel.close()


# ---------------------------------------------------------------------- certificates
def _name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(cert: Any, key: Any) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization

    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def make_ca(name: str = "tessera dev CA", days: int = 365) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new EC P-256 certificate authority (for a development cluster)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name)).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def issue_cert(ca_cert: bytes, ca_key: bytes, name: str, hosts: Sequence[str] = (), days: int = 365) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for ``name`` (the common name: a host, or a client identity),
    signed by the CA, valid for ``hosts`` (DNS names or IPs; ``name`` too) as server and client."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys([name, *hosts]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    )
    return _pem(cert, key)


# ---------------------------------------------------------------------- command-line flags
def add_server_security_args(p: Any) -> None:
    """``--tls-cert/--tls-key/--tls-ca/--token-file/--insecure`` on a server command."""
    p.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="... and this private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--token-file", default=None, help="identities, tokens and roles ('identity token role,role' per line)")
    p.add_argument(
        "--insecure", action="store_true",
        help="allow tokens over plaintext, or no authentication on a non-loopback address (experiments only)",
    )


def add_client_security_args(p: Any) -> None:
    """``--tls-ca/--tls-cert/--tls-key/--token-file/--identity`` on a client command."""
    p.add_argument("--tls-ca", default=None, help="trust servers signed by this CA (TLS)")
    p.add_argument("--tls-cert", default=None, help="present this client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="... with this private key")
    p.add_argument("--token-file", default=None, help="a token file holding this client's token")
    p.add_argument("--identity", default=None, help="which identity of --token-file to use (default: its only one)")


def server_security_from(args: Any, default_roles: Sequence[str] = ()) -> ServerSecurity:
    return ServerSecurity.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.token_file, args.insecure, default_roles)


def client_security_from(args: Any) -> ClientSecurity:
    return ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.token_file, args.identity)


def serving_when(health: Any, ready: Any, service_names: Any = (), period: float = 0.2) -> threading.Thread:
    """Report NOT_SERVING on ``health`` (the servicer :func:`tessera.service.build_server` returns)
    for ``""`` and ``service_names`` until ``ready()`` is true, then SERVING (checked every
    ``period`` seconds by a daemon thread, which it returns). E.g. a backup shard: ready once it is
    attached to its primary, so that a compose ``service_healthy`` dependency waits for that."""
    from grpc_health.v1 import health_pb2

    names = ("", *service_names)
    for n in names:
        health.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)

    def wait() -> None:
        while not ready():
            time.sleep(period)
        for n in names:
            health.set(n, health_pb2.HealthCheckResponse.SERVING)

    t = threading.Thread(target=wait, name="health-gate", daemon=True)
    t.start()
    return t
