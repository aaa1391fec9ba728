"""The service runtime: one way for every Tessera server and client to be on the network.

One module per idea (each re-exported here):

* :mod:`~tessera.service.errors`: the runtime's errors and the two-way :class:`ErrorTable`
  (domain error class <-> gRPC status code, message kept, class name in trailing metadata).
* :mod:`~tessera.service.tokens`: bearer tokens, token files (roles, pinned worker names,
  certificate identities) and :class:`WorkerNames`.
* :mod:`~tessera.service.tls`: :class:`ServerSecurity` (TLS, mutual TLS, tokens, per-identity
  limits; :meth:`ServerSecurity.check` refuses unsafe setups) and :class:`ClientSecurity`.
* :mod:`~tessera.service.guard`: :class:`Access`, the one admission path of every server (who
  may call what, per-identity shares of the server's threads, waits capped, draining) and
  :func:`guarded_handler`, the one handler wrapper and error path.
* :mod:`~tessera.service.server`: :func:`build_server` -> ``(server, port, health)``,
  :func:`serving_when`.
* :mod:`~tessera.service.client`: :func:`client_channel`, :func:`channel_ready`, :func:`wait_for_server`;
  :mod:`~tessera.service.diagnose`: :func:`diagnose` (why a connection fails).
* :mod:`~tessera.service.certs`: :func:`make_ca`, :func:`issue_cert`;
  :mod:`~tessera.service.args`: the security flags of every command.
"""
from __future__ import annotations

from tessera.service.args import (
    add_client_security_args,
    add_server_security_args,
    client_security_from,
    server_security_from,
)
from tessera.service.certs import issue_cert, make_ca, self_signed_cert
from tessera.service.client import channel_ready, client_channel, wait_for_server
from tessera.service.diagnose import Diagnosis, ServerUnreachableError, diagnose
from tessera.service.errors import (
    ERROR_CLASS_HEADER,
    BindError,
    ConfigError,
    ErrorTable,
    FailedCall,
    PermissionDeniedError,
    RateLimitedError,
    ServerStoppingError,
    ServiceError,
    TransportSecurityError,
    UnauthenticatedError,
    UsageError,
)
from tessera.service.guard import ANONYMOUS, Access, Caller, Limits, Method, guarded_handler
from tessera.service.server import build_server, serving_when
from tessera.service.tls import ClientSecurity, ServerSecurity, is_loopback, pem_file, read_pem
from tessera.service.tokens import (
    TOKEN_HEADER,
    Identities,
    TokenFile,
    WorkerNames,
    load_token_file,
    new_tokens,
    read_token_file,
    token_from,
    token_metadata,
    write_token_file,
)

__all__ = [
    "ServiceError", "UnauthenticatedError", "PermissionDeniedError", "RateLimitedError", "ServerStoppingError", "ConfigError",
    "ErrorTable", "ERROR_CLASS_HEADER", "Identities", "TokenFile", "WorkerNames", "read_token_file", "load_token_file",
    "write_token_file", "new_tokens", "token_metadata", "token_from", "TOKEN_HEADER",
    "ServerSecurity", "ClientSecurity", "Caller", "Access", "Limits", "Method", "guarded_handler",
    "build_server", "channel_ready", "client_channel", "make_ca", "issue_cert", "self_signed_cert", "is_loopback", "read_pem", "pem_file", "ANONYMOUS",
    "add_server_security_args", "add_client_security_args", "server_security_from", "client_security_from",
    "FailedCall", "TransportSecurityError", "ServerUnreachableError", "Diagnosis", "diagnose", "wait_for_server", "BindError",
    "UsageError", "serving_when",
]
