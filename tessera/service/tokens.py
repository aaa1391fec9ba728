"""Identities: bearer tokens, token files, and the worker names an identity may use.

A caller presents ``authorization: Bearer <token>`` on every call; the server keeps only SHA-256
digests of tokens. A token file is one identity per line (``#`` comments)::

    identity  token  [roles]  [workers=NAME,PREFIX*,...]

``token`` ``-``: a certificate identity (mutual TLS): a client certificate whose common name is
``identity`` gets the line's roles. ``roles``: a comma list (``-``: the server's default roles).
``workers=``: the worker names this identity may use (``gpu-*``: every name starting ``gpu-``);
a pinned name belongs to its identity alone (:class:`WorkerNames`). Or JSON:
``{"identity": "token"}`` / ``{"identity": {"token": ... | null, "roles": [...], "workers": [...]}}``.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from tessera.service.errors import ConfigError

__all__ = [
    "TOKEN_HEADER", "Identities", "TokenFile", "WorkerNames", "read_token_file", "load_token_file", "write_token_file",
    "new_tokens", "token_metadata", "token_from",
]

TOKEN_HEADER = "authorization"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_tokens(identities: Iterable[str]) -> dict[str, str]:
    """A fresh random 256-bit token per identity (hex: never starts with '-', so ``--token T`` parses)."""
    return {i: secrets.token_hex(32) for i in identities}


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (empty without one)."""
    return ((TOKEN_HEADER, f"Bearer {token}"),) if token else ()


def token_from(metadata: Iterable[Any] | None) -> str | None:
    """The bearer token in call ``metadata`` (None without one)."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == TOKEN_HEADER:
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            return value[7:] if value.startswith("Bearer ") else value
    return None


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


@dataclass(frozen=True)
class TokenFile:
    """A parsed token file: ``tokens`` (token identities only), ``roles`` (identities that list
    roles), ``workers`` (pinned worker names / ``PREFIX*`` patterns), ``certificates``
    (identities with token ``-``: named by their client certificate's common name)."""

    tokens: dict[str, str] = field(default_factory=dict)
    roles: dict[str, list[str]] = field(default_factory=dict)
    workers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    certificates: frozenset[str] = frozenset()


def _patterns(where: str, identity: str, names: Any) -> tuple[str, ...]:
    if isinstance(names, str):
        names = names.split(",")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: identity {identity!r}: workers must be names (NAME or PREFIX*)")
    out = tuple(n.strip() for n in names if n.strip())
    for n in out:
        if "*" in n[:-1] or n == "*":
            raise ConfigError(f"{where}: identity {identity!r}: worker pattern {n!r}: '*' only at the end of a prefix")
    return out


def read_token_file(path: str) -> TokenFile:
    """Parse a token file (module doc). Raises ConfigError naming the line that is wrong."""
    text = open(path, encoding="utf-8").read()
    tf = TokenFile()
    certs: set[str] = set()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        for identity, v in data.items():
            if isinstance(v, str):
                tf.tokens[identity] = v
                continue
            if not isinstance(v, dict) or not isinstance(v.get("token"), (str, type(None))):
                raise ConfigError(f"{path}: identity {identity!r}: expected a token string or {{'token', 'roles', 'workers'}}")
            if v.get("token") is None:
                certs.add(identity)
            else:
                tf.tokens[identity] = v["token"]
            if "roles" in v:
                tf.roles[identity] = [str(r) for r in v["roles"]]
            if "workers" in v:
                tf.workers[identity] = _patterns(path, identity, v["workers"])
        return TokenFile(tf.tokens, tf.roles, tf.workers, frozenset(certs))
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{path}:{n}"
        if len(parts) < 2 or any("=" not in p for p in parts[3:]) or "=" in parts[0] or "=" in parts[1]:
            raise ConfigError(f"{where}: expected 'identity token [role,role,...] [workers=NAME,PREFIX*,...]'")
        identity, token = parts[0], parts[1]
        if identity in tf.tokens or identity in certs:
            raise ConfigError(f"{where}: identity {identity!r} appears twice")
        if token == "-":
            certs.add(identity)
        else:
            tf.tokens[identity] = token
        rest = parts[2:]
        if rest and "=" not in rest[0]:
            if rest[0] != "-":
                tf.roles[identity] = [r for r in rest[0].split(",") if r]
            rest = rest[1:]
        for opt in rest:
            key, _, value = opt.partition("=")
            if key != "workers":
                raise ConfigError(f"{where}: unknown option {key!r} (known: workers=)")
            tf.workers[identity] = _patterns(where, identity, value)
    return TokenFile(tf.tokens, tf.roles, tf.workers, frozenset(certs))


def load_token_file(path: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Read a token file -> ({identity: token}, {identity: roles}) (see :func:`read_token_file`)."""
    tf = read_token_file(path)
    return tf.tokens, tf.roles


def write_token_file(
    path: str, tokens: Mapping[str, str | None], roles: Mapping[str, Sequence[str]] | None = None,
    workers: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Write a token file readable by its owner only (created 0600; an existing file is made
    0600 before anything is written; a symlink is refused). A token None: a certificate identity."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1
            for identity, token in tokens.items():
                r = ",".join((roles or {}).get(identity, ())) or "-"
                w = ",".join((workers or {}).get(identity, ()))
                line = f"{identity} {token or '-'} {r}{' workers=' + w if w else ''}"
                f.write((line[:-2] if line.endswith(" -") else line) + "\n")
    finally:
        if fd >= 0:
            os.close(fd)


class WorkerNames:
    """Which identity may use which worker name, from the token file's ``workers=`` pins.

    ``owner(name)``: the identity whose pattern matches ``name`` (an exact name beats a prefix, a
    longer prefix a shorter), None if nobody pinned it. ``allows(identity, name)``: False if the
    name is pinned by another identity, or ``identity`` has pins and none matches. Names nobody
    pinned, used by identities without pins: bound first-come by the server (not decided here)."""

    def __init__(self, pins: Mapping[str, Sequence[str]] | None = None) -> None:
        self.pins = {i: tuple(p) for i, p in (pins or {}).items() if p}
        self._exact: dict[str, str] = {}
        self._prefixes: list[tuple[str, str]] = []  # (prefix, identity), longest first
        for identity, patterns in self.pins.items():
            for p in patterns:
                if p.endswith("*"):
                    self._prefixes.append((p[:-1], identity))
                else:
                    self._exact[p] = identity
        self._prefixes.sort(key=lambda t: -len(t[0]))

    def owner(self, name: str) -> str | None:
        if name in self._exact:
            return self._exact[name]
        for prefix, identity in self._prefixes:
            if name.startswith(prefix):
                return identity
        return None

    def pinned(self, identity: str) -> bool:
        return identity in self.pins

    def allows(self, identity: str, name: str) -> bool:
        owner = self.owner(name)
        if owner is not None:
            return owner == identity
        return not self.pinned(identity)
