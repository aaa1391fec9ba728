"""The federated error tree. Domain code raises these; the servicer maps each class to
one gRPC status code (``federated.servicer.STATUS_OF``) and the client SDK maps codes
back (``federated.client``)."""
from __future__ import annotations

__all__ = [
    "FedError",
    "ConfigError",
    "InvalidUpdateError",
    "ShapeMismatchError",
    "DtypeError",
    "NonFiniteError",
    "MalformedMessageError",
    "UnauthenticatedError",
    "TLSMismatchError",
    "PermissionDeniedError",
    "UnknownTaskError",
    "TaskClosedError",
    "ResourceExhaustedError",
    "ServerUnavailableError",
    "ClientFailedError",
    "TrainingFailedError",
]


class FedError(Exception):
    """Base of every error federated mode raises."""


class ConfigError(FedError, ValueError):
    """A server/client configuration that cannot work (checked before anything starts)."""


class InvalidUpdateError(FedError):
    """A client's answer is wrong in itself (INVALID_ARGUMENT); it is not aggregated."""


class ShapeMismatchError(InvalidUpdateError):
    """An update's tensor count or shapes do not match the global model."""


class DtypeError(InvalidUpdateError):
    """An update's tensor dtype or encoding is not the one expected."""


class NonFiniteError(InvalidUpdateError):
    """An update holds NaN or Inf."""


class MalformedMessageError(InvalidUpdateError):
    """Bytes that do not decode: truncated data, broken protobuf, missing header."""


class UnauthenticatedError(FedError):
    """No token, or a token the server does not know (UNAUTHENTICATED)."""


class TLSMismatchError(UnauthenticatedError):
    """Client and server disagree about transport security (plaintext vs TLS, a CA that does not
    accept the server's certificate, a server that wants a client certificate): no call can
    succeed, so it is not retried. ``kind`` is the kernel's diagnosis
    (:class:`tessera.service.Diagnosis`), ``address`` the server's."""

    def __init__(self, message: str, kind: str = "", address: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.address = address


class PermissionDeniedError(FedError):
    """A known client acting for a client id or task it does not own (PERMISSION_DENIED)."""


class UnknownTaskError(FedError):
    """A task or blob id the server never issued or already forgot (NOT_FOUND)."""


class TaskClosedError(FedError):
    """An answer that arrived after its round closed (deadline passed or cancelled;
    FAILED_PRECONDITION). Harmless: the client just drops it."""


class ResourceExhaustedError(FedError):
    """The server is at a limit (connections, message size): RESOURCE_EXHAUSTED; retried."""


class ServerUnavailableError(FedError):
    """The server could not be reached within the client's retry budget (UNAVAILABLE)."""


class ClientFailedError(FedError):
    """The user's Client raised while fitting or evaluating; reported to the server."""


class TrainingFailedError(FedError):
    """The server ended the run because training failed (a round could not gather
    enough answers); raised by :func:`~federated.client.start_client` with the server's
    reason, so that a client process does not exit as if all went well."""
