"""Transport security: who a server is (TLS), who may reach it (mutual TLS, tokens), and how a
client reaches a server. PEM arguments are file names or PEM text/bytes."""
from __future__ import annotations

import contextlib
import ipaddress
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import grpc

from tessera.service.errors import ConfigError
from tessera.service.tokens import TokenFile, load_token_file, read_token_file

__all__ = ["ServerSecurity", "ClientSecurity", "is_loopback", "read_pem", "pem_file"]


def read_pem(path_or_pem: str | bytes) -> bytes:
    """PEM bytes from a file name, PEM text or PEM bytes."""
    if isinstance(path_or_pem, bytes):
        return path_or_pem
    if path_or_pem.lstrip().startswith("-----BEGIN"):
        return path_or_pem.encode()
    with open(path_or_pem, "rb") as f:
        return f.read()


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
    roles; an identity without roles gets ``default_roles``; ``workers``: worker names pinned per
    identity; ``certificates``: identities named by their client certificate (mutual TLS) whose
    roles ``roles`` gives. ``insecure``: allow plaintext with tokens, or an open server on a
    non-loopback address. ``max_concurrent``/``max_waiting``/``rate``: per-identity limits
    (:class:`tessera.service.Access`)."""

    tls_cert: str | bytes | None = None  # PEM file name, or PEM bytes
    tls_key: str | bytes | None = None
    tls_ca: str | bytes | None = None
    tokens: Mapping[str, str] | None = None
    roles: Mapping[str, Sequence[str]] = field(default_factory=dict)
    default_roles: tuple[str, ...] = ()
    insecure: bool = False
    max_concurrent: int = 16  # calls in flight per identity (admitted before a server thread is taken)
    max_waiting: int = 8  # of which calls that may wait (BSP/SSP pulls, push streams, ...: the service's ``waits``)
    rate: float = 0.0  # calls per second per identity (token bucket, burst = 2 s worth); 0: no limit
    # token file extras: worker names pinned per identity, identities named by their certificate (token '-')
    workers: Mapping[str, Sequence[str]] = field(default_factory=dict)
    certificates: frozenset[str] = frozenset()

    @classmethod
    def from_files(
        cls, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
        token_file: str | None = None, insecure: bool = False, default_roles: Sequence[str] = (), **kw: Any,
    ) -> "ServerSecurity":
        tf = read_token_file(token_file) if token_file else TokenFile()
        # a file of certificate identities only (every token '-'): no bearer tokens, roles by certificate
        tokens = tf.tokens if token_file and (tf.tokens or not tf.certificates) else None
        return cls(
            tls_cert or None, tls_key or None, tls_ca or None, tokens, tf.roles, tuple(default_roles), insecure,
            workers=tf.workers, certificates=tf.certificates, **kw,
        )

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
        if self.certificates and not self.mutual:
            raise ConfigError(
                f"the token file names certificate identities ({', '.join(sorted(self.certificates))}: token '-'), "
                "which need mutual TLS: give --tls-ca"
            )
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
        pair = [(read_pem(self.tls_key), read_pem(self.tls_cert))]  # type: ignore[arg-type]
        if self.mutual:
            return grpc.ssl_server_credentials(pair, root_certificates=read_pem(self.tls_ca), require_client_auth=True)  # type: ignore[arg-type]
        return grpc.ssl_server_credentials(pair)

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



@contextlib.contextmanager
def pem_file(pem: str | bytes) -> Iterator[str]:
    """A file name holding ``pem`` (ssl loads client certificates from files only)."""
    if isinstance(pem, str) and not pem.lstrip().startswith("-----BEGIN"):
        yield pem
        return
    fd, path = tempfile.mkstemp(suffix=".pem")  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(read_pem(pem))
        yield path
    finally:
        os.unlink(path)
