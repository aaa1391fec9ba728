"""Values every command line shares, parsed one way for all: server addresses (``HOST:PORT``, and
the PS's shard lists ``HOST:PORT|HOST:PORT,HOST:PORT``: shards in order, ``|`` between the replicas
of one shard) and ``KEY=VALUE`` options (``--task-opt``, ``--strategy-param``).

A malformed address (``localhost5999``, ``host:``, ``host:99999``) is refused at once, naming the
flag, instead of being retried until a timeout: worker and peer ``--ps``, ``ps stats``/``checkpoint``
``--ps``, ``ps serve --backup-of/--advertise``, ``fed client --server``. Pure: no gRPC, no sockets,
no part of tessera (a name is not resolved here; an unreachable host is the caller's to find).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Sequence

__all__ = ["AddressError", "parse_address", "parse_shard_list", "address_arg", "shard_list_arg", "parse_key_values",
           "KEY_VALUE_HELP"]


class AddressError(ValueError):
    """A malformed address; the message names the flag (or parameter) and the bad text."""


def parse_address(text: str, flag: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``. HOST: a name or IPv4 address, or an IPv6 address in
    brackets (``[::1]:5000``); PORT: 1..65535. Raises :class:`AddressError` naming ``flag``."""
    item = text.strip()
    host, sep, port = item.rpartition(":")
    if not sep:
        raise AddressError(f"{flag}: {text!r} is not HOST:PORT (no ':PORT'; e.g. 127.0.0.1:5000)")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise AddressError(f"{flag}: {text!r}: an IPv6 host goes in brackets, e.g. [::1]:5000")
        host = host[1:-1]
    elif ":" in host:
        raise AddressError(f"{flag}: {text!r}: put an IPv6 host in brackets, e.g. [::1]:5000")
    if not host or any(c.isspace() or c in "/|," for c in host):
        raise AddressError(f"{flag}: {text!r} has no valid host before ':{port}' (e.g. 127.0.0.1:{port or 5000})")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressError(f"{flag}: {text!r}: the port must be a number 1..65535, got {port!r}")
    return host, int(port)


def parse_shard_list(text: str, flag: str = "--ps") -> list[list[str]]:
    """``"A|B,C"`` -> ``[["A", "B"], ["C"]]``: the shards in order, each a list of its replicas'
    ``HOST:PORT`` (checked by :func:`parse_address`). Empty items between commas are refused too
    (a shard left out would shift every later shard's index)."""
    shards = [s.strip() for s in text.split(",")]
    if not text.strip():
        raise AddressError(f"{flag}: no address given (HOST:PORT,... of every shard)")
    out = []
    for i, spec in enumerate(shards):
        if not spec:
            raise AddressError(f"{flag}: {text!r}: shard {i} is empty (a stray ','?)")
        replicas = [r.strip() for r in spec.split("|")]
        for r in replicas:
            if not r:
                raise AddressError(f"{flag}: {text!r}: shard {i} ({spec!r}) has an empty replica (a stray '|'?)")
            parse_address(r, f"{flag}: shard {i}")
        out.append(replicas)
    return out


def address_arg(flag: str, allow_empty: bool = False) -> Callable[[str], str]:
    """An argparse ``type=`` for one ``HOST:PORT``: returns the text stripped; a malformed one is
    argparse's one-line usage error (exit 2). ``allow_empty``: ``""`` passes (an optional address
    whose default is ``""``; argparse runs ``type`` on string defaults too)."""
    def check(text: str) -> str:
        if allow_empty and not text.strip():
            return ""
        try:
            parse_address(text, flag)
        except AddressError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None
        return text.strip()

    check.__name__ = "HOST:PORT"  # argparse names the type in some messages
    return check


def shard_list_arg(flag: str = "--ps", allow_empty: bool = False) -> Callable[[str], str]:
    """An argparse ``type=`` for a shard list (:func:`parse_shard_list`): returns the text with
    blanks removed, so that callers may go on splitting it on ``,`` and ``|``. ``allow_empty``:
    ``""`` passes (an optional list, e.g. ``tessera peer --ps`` outside hybrid mode)."""
    def check(text: str) -> str:
        if allow_empty and not text.strip():
            return ""
        try:
            shards = parse_shard_list(text, flag)
        except AddressError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None
        return ",".join("|".join(r) for r in shards)

    check.__name__ = "HOST:PORT list"
    return check


# what parse_key_values does with a value, as --help says it (README: "--task-opt")
KEY_VALUE_HELP = ("VALUE is parsed as JSON when it is JSON: 3 int, 0.5 or 1e-3 float, true/false bool, null None, "
                  "[1,2] list, {\"a\":1} dict, \"7\" the string 7; anything else is the string as written (abc, True)")


def parse_key_values(items: Sequence[str], flag: str = "--task-opt") -> dict[str, Any]:
    """``["k=v", ...]`` (a repeatable ``flag``) -> dict. The value is split at the first ``=``;
    one that parses as JSON becomes that value (``3`` int, ``0.5``/``1e-3`` float, ``true``/``false``
    bool, ``null`` None, ``[1, 2]`` list, ``{"a": 1}`` dict, ``"7"`` the string ``7``), any other
    stays the string as written (``abc``, ``True``, ``a=b``, empty). ValueError names the flag and
    the bad item (no ``=``, or no key)."""
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out
