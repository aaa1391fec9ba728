"""Which identity may use which worker name.

A worker name is what BSP rounds, SSP clocks and leases count; an identity (a bearer token's
name, or a client certificate's subject) is who calls. This module decides who may speak for a
name:

- **Pinned by configuration**: the server's token file may pin the names (or name prefixes) an
  identity may use (``workers=w0,gpu-*``; parsed by the service runtime, ``tessera.service``,
  and handed in here as ``pins``). A pinned name belongs to the identity it is pinned to, whoever
  calls first; an identity with pins may use only the names they match.
- **First come** where nothing is pinned: an unpinned name is bound to the first identity
  without pins that claims it (a Join, a Heartbeat or a push), at most ``max_names`` bindings.
  So on a server without pins, a worker token can take ``w0`` before the real worker 0 starts;
  pin the names to close that.
- **Open servers** (identity ``""``: no tokens, no client certificates) check nothing.

Reads never bind: ``check`` says whether a caller owns a name and changes nothing; ``claim``
(writes and joins only) binds a free name.

Plain Python, thread-safe.
"""
from __future__ import annotations

import threading
from typing import Protocol

from ps.errors import PermissionDeniedError, ResourceExhaustedError

__all__ = ["WorkerNames", "Pins", "OPEN"]

OPEN = ""  # the identity of every caller of an open server: may use any name, binds none


class Pins(Protocol):
    """Names pinned to identities by configuration (``tessera.service.WorkerNames`` is one)."""

    def owner(self, name: str) -> str | None:
        """The identity ``name`` is pinned to (None: unpinned)."""

    def allows(self, identity: str, name: str) -> bool:
        """False if ``name`` is pinned to another identity, or ``identity`` has pins that do not match it."""

    def pinned(self, identity: str) -> bool:
        """Whether ``identity`` has pins."""


class WorkerNames:
    """Worker name -> the identity that may use it: pinned (``pins``), else bound by first claim.

    ``max_names``: most first-come bindings kept (a new one beyond is ResourceExhaustedError)."""

    def __init__(self, pins: Pins | None = None, max_names: int = 65536) -> None:
        self.pins = pins  # None: nothing pinned
        self.max_names = max_names
        self._lock = threading.Lock()
        self._bound: dict[str, str] = {}  # unpinned name -> the identity that claimed it first

    def check(self, identity: str, name: str) -> bool:
        """Whether ``identity`` owns ``name`` now (pinned or bound to it; on an open server: always).
        False: the name is free (``claim`` would bind it). Raises PermissionDeniedError if it belongs
        to another identity, or ``identity`` has pins that do not match it. Changes nothing."""
        if identity == OPEN:
            return True
        with self._lock:
            return self._check(identity, name)

    def _check(self, identity: str, name: str) -> bool:
        pins = self.pins
        if pins is not None and (pins.owner(name) is not None or pins.pinned(identity)):
            if pins.allows(identity, name):
                return True
            owner = pins.owner(name)
            raise PermissionDeniedError(
                f"worker name {name!r} is pinned to identity {owner!r}, not {identity!r} (the server's token file)"
                if owner is not None and owner != identity else
                f"identity {identity!r} may use only the worker names the server's token file pins to it, not {name!r}"
            )
        owner = self._bound.get(name)
        if owner is None:
            return False
        if owner != identity:
            raise PermissionDeniedError(f"worker name {name!r} belongs to identity {owner!r}, not {identity!r}")
        return True

    def claim(self, identity: str, name: str) -> None:
        """``identity`` uses ``name`` to write or join: as ``check``, and a free name is bound to it
        (first come). Raises ResourceExhaustedError beyond ``max_names`` bindings. An empty name or an
        open server: nothing to do."""
        if not name or identity == OPEN:
            return
        with self._lock:
            if self._check(identity, name):
                return
            if len(self._bound) >= self.max_names:
                raise ResourceExhaustedError(f"worker {name!r}: the shard knows {self.max_names} worker names already")
            self._bound[name] = identity

    def bindings(self) -> dict[str, str]:
        """The first-come bindings (name -> identity): a copy."""
        with self._lock:
            return dict(self._bound)
