"""``tessera health HOST:PORT``: ask a server's standard gRPC health service (``grpc.health.v1``)
whether it is SERVING; exit 0 if so, 1 if not (or unreachable within ``--timeout``). Meant for
container health checks (the Dockerfile's HEALTHCHECK, compose's ``healthcheck``): it needs no
token (every Tessera server answers health probes without one), only the CA under TLS."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from tessera.service import serving_when  # the runtime owns it; re-exported here

__all__ = ["add_health_command", "check", "serving_when"]


def check(address: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None, server_name: str | None = None) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``, ...) of
    ``service`` at ``address``, or ``UNREACHABLE: <why>``. Blocks at most ``timeout`` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tessera.service import ClientSecurity, client_channel

    security = ClientSecurity(tls_ca or None, tls_cert or None, tls_key or None, None, server_name or None) if tls_ca else None
    channel = client_channel(address, security)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        return f"UNREACHABLE: {getattr(code, 'name', code)}: {e.details() if hasattr(e, 'details') else e}"
    finally:
        channel.close()


def _health(args: argparse.Namespace) -> int:
    status = check(args.address, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key, args.server_name)
    print(f"{args.address}{' ' + args.service if args.service else ''}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1


def add_health_command(sub: Any) -> None:
    """Add ``tessera health`` to the ``tessera`` parser's subcommands."""
    h = sub.add_parser("health", help="ask a server's gRPC health service: exit 0 if SERVING (container health checks)")
    h.add_argument("address", help="HOST:PORT of the server")
    h.add_argument("--service", default="", help="service name to ask about (default '': the whole server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    h.add_argument("--tls-ca", default=None, help="the server serves TLS: trust this CA (PEM)")
    h.add_argument("--tls-cert", default=None, help="mutual TLS: this client certificate")
    h.add_argument("--tls-key", default=None, help="... and its key")
    h.add_argument("--server-name", default=None,
                   help="name to check in the server's certificate (e.g. the service name when probing 127.0.0.1)")
    h.set_defaults(func=_health)


def main(argv: list[str] | None = None) -> int:
    """``python -m tessera.health HOST:PORT [...]``: the same check without loading the whole command
    (no torch import: a probe every few seconds stays cheap)."""
    # plain argparse: the tessera command (tessera.cli) imports this module, not the other way round
    p = argparse.ArgumentParser(prog="python -m tessera.health", description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add_health_command(sub)
    args = p.parse_args(["health", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
