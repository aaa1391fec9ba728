"""The security flags of every server and client command, and the configs they fill in."""
from __future__ import annotations

from typing import Any, Sequence

from tessera.service.tls import ClientSecurity, ServerSecurity

__all__ = ["add_server_security_args", "add_client_security_args", "server_security_from", "client_security_from"]


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
