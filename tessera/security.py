"""Bearer tokens (the service runtime, ``tessera.service``, builds TLS and channels on them).

Each client presents ``authorization: Bearer <token>`` metadata on every call.
:class:`TokenAuthInterceptor` refuses calls without a known token with UNAUTHENTICATED
before any handler runs; handlers ask :func:`identity_of` whose token it was. The server
keeps only SHA-256 digests of tokens. :func:`self_signed_cert` makes a throwaway
certificate (tests, local trials; ``tessera.service.make_ca`` for a cluster).

A token file is ``identity token`` per line (``#`` comments), or a JSON object
``{"identity": "token", ...}``; ``tessera.service.write_token_file`` writes one (mode 0600).
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

import grpc

from tessera.service.tokens import TOKEN_HEADER, new_tokens, token_from, token_metadata

__all__ = [
    "TOKEN_HEADER",
    "TokenTable",
    "load_tokens",
    "new_tokens",
    "token_metadata",
    "identity_of",
    "TokenAuthInterceptor",
    "self_signed_cert",
]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """identity <-> token, stored as digests. ``lookup(token)`` -> identity or None."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        """``tokens``: identity -> token. Raises ValueError for empty or duplicate tokens."""
        self._by_digest: dict[str, str] = {}
        for identity, token in tokens.items():
            if not identity or not token:
                raise ValueError("identities and tokens must be non-empty")
            d = _digest(token)
            if d in self._by_digest:
                raise ValueError(f"identities {self._by_digest[d]!r} and {identity!r} share a token")
            self._by_digest[d] = identity

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str | None) -> str | None:
        if not token:
            return None
        return self._by_digest.get(_digest(token))


def load_tokens(path: str) -> dict[str, str]:
    """Read a token file (see the module doc) -> {identity: token}."""
    text = open(path, encoding="utf-8").read()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: expected a JSON object of identity -> token strings")
        return dict(data)
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'identity token'")
        out[parts[0]] = parts[1]
    return out


def identity_of(metadata: Iterable[Any] | None, table: TokenTable | None) -> str | None:
    """The identity whose token is in ``metadata`` (None when auth is off or none matches)."""
    return None if table is None else table.lookup(token_from(metadata))


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose token is missing or unknown with UNAUTHENTICATED."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table
        self.refused = 0

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or self.table.lookup(token_from(handler_call_details.invocation_metadata)) is not None:
            return handler
        self.refused += 1
        has = token_from(handler_call_details.invocation_metadata) is not None
        msg = "unknown client token" if has else f"no client token ('{TOKEN_HEADER}: Bearer <token>' metadata)"

        def deny_unary(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
            yield b""  # pragma: no cover - abort raised

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)


def self_signed_cert(hostnames: Sequence[str] = ("localhost", "127.0.0.1"), days: int = 30) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of a fresh self-signed EC P-256 certificate
    valid for ``hostnames`` (DNS names or IP addresses). For tests and local trials."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostnames[0])])
    sans: list[x509.GeneralName] = []
    for h in hostnames:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
