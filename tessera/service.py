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
  token on every call.
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
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import grpc

from tessera.rpc import channel_options, server_options
from tessera.security import TOKEN_HEADER, _read, _token_from

__all__ = [
    "ServiceError", "UnauthenticatedError", "PermissionDeniedError", "RateLimitedError", "ConfigError",
    "ErrorTable", "Identities", "load_token_file", "write_token_file", "ServerSecurity", "ClientSecurity", "Caller",
    "Access", "build_server", "client_channel", "make_ca", "issue_cert", "is_loopback", "ANONYMOUS",
    "add_server_security_args", "add_client_security_args", "server_security_from", "client_security_from",
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
def build_server(
    handlers: Sequence[grpc.GenericRpcHandler], host: str, port: int, security: ServerSecurity,
    max_workers: int = 64, max_message_bytes: int = 64 << 20, service_names: Sequence[str] = (),
    extra_options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[grpc.ServerInterceptor] = (), name: str = "srv",
) -> tuple[grpc.Server, int, Any]:
    """A started server: (server, bound port, health servicer). ``security.check(host)`` runs first."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    security.check(host)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
        interceptors=list(interceptors) or None,
        options=server_options(max_message_bytes) + list(extra_options),
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for svc in ("", *service_names):
        health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    creds = security.credentials()
    bound = server.add_secure_port(bind, creds) if creds is not None else server.add_insecure_port(bind)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
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
    if sec.token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(sec.token))
    return channel


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
