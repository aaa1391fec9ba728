"""The runtime's errors and the two-way error table (domain error class <-> gRPC status code)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import grpc

__all__ = [
    "ERROR_CLASS_HEADER", "ServiceError", "UnauthenticatedError", "PermissionDeniedError", "RateLimitedError",
    "ServerStoppingError", "ConfigError", "UsageError", "BindError", "ErrorTable", "FailedCall", "TransportSecurityError",
]

ERROR_CLASS_HEADER = "tessera-error"  # trailing metadata: the error class a refusal came from


class ServiceError(Exception):
    """Base of the runtime's own errors."""


class UnauthenticatedError(ServiceError):
    """No credentials, or unknown ones (UNAUTHENTICATED)."""


class PermissionDeniedError(ServiceError):
    """Known caller, not allowed to do this (PERMISSION_DENIED)."""


class RateLimitedError(ServiceError):
    """Too many calls of one identity at once or per second (RESOURCE_EXHAUSTED)."""


class ServerStoppingError(ServiceError):
    """The server is draining (SIGTERM): new calls are refused and waits end (UNAVAILABLE; clients
    retry another replica or later)."""


class ConfigError(ServiceError, ValueError):
    """A server or client set up in a way the runtime refuses (e.g. tokens over plaintext)."""


class UsageError(Exception):
    """A command line that cannot work (e.g. ``--worker-index 3 --num-workers 2``): the ``tessera``
    command prints it as one line and exits 2. Parts' CLIs raise it for what argparse alone
    cannot check (it lives here, not in ``tessera.cli``, so that they need not import the command)."""


class BindError(ServiceError, OSError):
    """A server could not listen on its address (port in use, or not this machine's address)."""


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
        self.codes.setdefault(ServerStoppingError, grpc.StatusCode.UNAVAILABLE)
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


