"""The ``tessera`` command: one entry point, a subcommand per part."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from federated.cli import add_fed_commands
    from ps.cli import add_ps_commands
    from worker.cli import add_worker_commands

    parser = argparse.ArgumentParser(prog="tessera", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_ps_commands(sub)
    add_worker_commands(sub)
    add_fed_commands(sub)
    c = sub.add_parser("cert", help="make a development CA and certificates for named hosts and clients")
    c.add_argument("--out-dir", required=True)
    c.add_argument("--hosts", default="localhost,127.0.0.1", help="server names (DNS or IP), comma-separated: one certificate each")
    c.add_argument("--clients", default="", help="client identities, comma-separated: one client certificate each (mutual TLS)")
    c.add_argument("--days", type=int, default=365)
    c.set_defaults(func=_cert)
    t = sub.add_parser("tokens", help="write a token file (mode 0600): IDENTITY[:ROLE,ROLE...] ...")
    t.add_argument("identities", nargs="+", help="e.g. admin:admin,worker w0:worker w1:worker backup:replica")
    t.add_argument("--out", required=True)
    t.set_defaults(func=_tokens)
    return parser


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _cert(args: argparse.Namespace) -> int:
    from tessera.service import issue_cert, make_ca

    os.makedirs(args.out_dir, exist_ok=True)
    ca_cert, ca_key = make_ca(days=args.days)
    with open(os.path.join(args.out_dir, "ca.crt"), "wb") as f:
        f.write(ca_cert)
    _write_private(os.path.join(args.out_dir, "ca.key"), ca_key)
    hosts = [h for h in args.hosts.split(",") if h]
    names = [("server", h, hosts) for h in hosts[:1]] + [("client", c, []) for c in args.clients.split(",") if c]
    for kind, name, sans in names:
        cert, key = issue_cert(ca_cert, ca_key, name, sans, days=args.days)
        stem = "server" if kind == "server" else name
        with open(os.path.join(args.out_dir, f"{stem}.crt"), "wb") as f:
            f.write(cert)
        _write_private(os.path.join(args.out_dir, f"{stem}.key"), key)
        print(f"{stem}.crt / {stem}.key: {kind} certificate for {name}{' (' + ', '.join(sans) + ')' if sans else ''}")
    print(f"ca.crt: the CA to trust (--tls-ca); ca.key stays private. Written to {args.out_dir}")
    return 0


def _tokens(args: argparse.Namespace) -> int:
    from tessera.service import write_token_file
    from tessera.security import new_tokens

    spec = [(i.partition(":")[0], [r for r in i.partition(":")[2].split(",") if r]) for i in args.identities]
    tokens = new_tokens(name for name, _ in spec)
    write_token_file(args.out, tokens, {name: roles for name, roles in spec if roles})
    print(f"wrote {len(tokens)} tokens to {args.out} (mode 0600); give each client only its own line")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
