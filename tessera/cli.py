"""The ``tessera`` command: one entry point, a subcommand per part."""
from __future__ import annotations

import argparse
import logging
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
