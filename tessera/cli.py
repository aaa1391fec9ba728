"""The tessera command: one entry point, a subcommand per part (ps, worker, demo, experiment, fed, cert, tokens, health).

Errors a user can cause are one line on stderr saying what to do next, not a traceback:
exit 2 when the command line or the setup is wrong (fix it and run again), 1 when something
failed while running. ``--debug`` (anywhere on the line) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Sequence

from tessera.argtypes import KEY_VALUE_HELP, parse_key_values  # the parts' CLIs take them from here too

__all__ = ["main", "build_parser", "HelpFormatter", "Parser", "UsageError", "explain_error", "parse_key_values", "KEY_VALUE_HELP"]  # noqa: F822 (UsageError: lazy, see __getattr__)


def __getattr__(name: str) -> Any:
    # UsageError lives in tessera.service (parts raise it); importing this module must not load grpc
    # before main() has decided on gRPC's log verbosity
    if name == "UsageError":
        from tessera.service import UsageError

        return UsageError
    raise AttributeError(f"module 'tessera.cli' has no attribute {name!r}")




def _shows_nothing(default: Any) -> bool:
    """A default not worth a "(default: ...)": none, a flag that is off, an empty text or list."""
    return default is None or default is False or default is argparse.SUPPRESS or (isinstance(default, (str, list)) and not default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, unless its help text states it already or there
    is nothing to show (no default, a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "%(default)" in text or "(default" in text or _shows_nothing(action.default):
            return text
        return f"{text} (default: %(default)s)"

    def _format_text(self, text: str) -> str:
        # a description taken from a module docstring (tessera peer's): its reST markup is noise here
        import re

        return super()._format_text(re.sub(r":(?:func|class|mod|meth|attr):`~?([^`]*)`", r"\1", text).replace("``", ""))


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` for a command whose description is laid out by hand."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (with where to look) and whose help
    shows defaults; subcommands inherit both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's signature: NoReturn
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


# each part's CLI may explain its own errors: exc -> (one line, exit code), or None
_EXPLAINERS: list[Callable[[BaseException], tuple[str, int] | None]] = []


def build_parser() -> argparse.ArgumentParser:
    from federated.cli import add_fed_commands
    from ps.cli import add_ps_commands
    from worker.cli import add_worker_commands
    from worker.peer.cli import add_peer_commands
    from worker.peer.planner import add_plan_command

    from federated.cli import explain_error as explain_fed
    from ps.cli import explain_error as explain_ps
    from worker.cli import explain_error as explain_worker

    parser = Parser(
        prog="tessera", description=(__doc__ or "").split("\n")[0],
        epilog="Errors are one line; --debug (anywhere) shows the traceback. Exit 2: fix the command line or "
        "setup; 1: failed while running.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also after the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_ps_commands(sub)
    add_worker_commands(sub)
    add_peer_commands(sub)
    add_plan_command(sub)
    add_fed_commands(sub)
    c = sub.add_parser("cert", help="make a development CA and certificates for named hosts and clients")
    c.add_argument("--out-dir", required=True, help="directory for ca.crt, ca.key, server.crt/key and CLIENT.crt/key")
    c.add_argument("--hosts", default="localhost,127.0.0.1", help="server names (DNS or IP), comma-separated: one server certificate valid for all")
    c.add_argument("--clients", default="", help="client identities, comma-separated: one client certificate each (mutual TLS)")
    c.add_argument("--days", type=int, default=365, help="validity of the CA and the certificates in days")
    c.set_defaults(func=_cert)
    t = sub.add_parser("tokens", help="write a token file (mode 0600): IDENTITY[:ROLE,ROLE...] ...")
    t.add_argument("identities", nargs="+", help="IDENTITY[:ROLE,ROLE...], e.g. admin:admin,worker w0:worker w1:worker backup:replica")
    t.add_argument("--out", required=True, help="the token file to write (mode 0600; give each client only its own line)")
    t.set_defaults(func=_tokens)
    from tessera.health import add_health_command

    add_health_command(sub)
    _finish(parser)
    _EXPLAINERS[:] = [explain_ps, explain_worker, explain_fed]
    return parser


def _finish(parser: argparse.ArgumentParser) -> None:
    """Every subcommand, wherever its parser was built (``tessera peer``'s in worker/peer/cli.py):
    its one-line help as its description, its name for error messages, and a ``--help`` that shows
    every option's default (an option without help text gets one saying just its default)."""
    if parser.formatter_class is argparse.RawDescriptionHelpFormatter:
        parser.formatter_class = RawDescriptionHelpFormatter
    elif not (isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class, HelpFormatter)):
        parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, p in action.choices.items():
                if not p.description and helps.get(name):
                    p.description = helps[name]
                _finish(p)
            return
        if action.help is None and action.option_strings and not _shows_nothing(action.default):
            action.help = "(default: %(default)s)"  # argparse leaves an option without help text bare
    parser.set_defaults(_prog=parser.prog)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that ``args`` went through (``tessera peer``: peer's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
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
    from tessera.service import new_tokens

    spec = [(i.partition(":")[0], [r for r in i.partition(":")[2].split(",") if r]) for i in args.identities]
    tokens = new_tokens(name for name, _ in spec)
    write_token_file(args.out, tokens, {name: roles for name, roles in spec if roles})
    print(f"wrote {len(tokens)} tokens to {args.out} (mode 0600); give each client only its own line")
    return 0


def explain_error(exc: BaseException) -> tuple[str, int]:
    """(one line saying what went wrong and what to do, exit code) for an error of a command."""
    from tessera.service import BindError, ConfigError, ServerUnreachableError, TransportSecurityError, UsageError

    for explain in _EXPLAINERS:
        found = explain(exc)
        if found is not None:
            return found
    if isinstance(exc, UsageError):
        return str(exc), 2
    if isinstance(exc, TransportSecurityError):
        return str(exc), 2
    if isinstance(exc, ServerUnreachableError):
        return f"{exc}; is the server running at that address?", 1
    if isinstance(exc, (ConfigError, BindError)):
        return str(exc), 2
    if isinstance(exc, FileNotFoundError):
        return f"no such file or directory: {exc.filename}", 2
    if isinstance(exc, PermissionError):
        return f"not allowed to read or write {exc.filename}: {exc.strerror}", 2
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename} is a directory, a file was expected", 2
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror}", 1
    if isinstance(exc, ValueError):
        return f"{exc}", 2
    return f"{type(exc).__name__}: {exc} (--debug shows the traceback)", 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tessera`` command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:cut] or os.environ.get("TESSERA_DEBUG", "") not in ("", "0")
    argv = [a for i, a in enumerate(argv) if not (i < cut and a == "--debug")]
    if not debug:
        # gRPC core's own log lines (a failed handshake, a failed bind) would come before our one
        # line saying the same with what to do; --debug (or GRPC_VERBOSITY set by the user) shows them
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # say it as the subcommand that was given them, so that "see: ..." names its --help
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # `kill -USR1 PID`: every thread's stack to stderr, and it runs on (a process that seems stuck);
    # not where stderr has no file descriptor (main() called in a process that captures it)
    with contextlib.suppress(AttributeError, OSError):  # (io.UnsupportedOperation is an OSError)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    prog = getattr(args, "_prog", "tessera")
    ended = _quiet_background_threads(prog, debug)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - every error a user can cause ends here as one line
        if debug:
            raise
        message, code = explain_error(e)
        message = " ".join(message.split())  # one line, whatever the error carried
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return code
    finally:
        ended.set()


def _quiet_background_threads(prog: str, debug: bool) -> threading.Event:
    """Keep a command's output to its own lines: an exception in a background thread (a gRPC
    channel's connectivity poller, a pool's worker) is one warning line while the command runs,
    and nothing once it has ended (its one error line is out and the process is exiting: the
    thread died of the teardown, e.g. a channel closed under it). ``--debug`` keeps Python's
    tracebacks. Returns the event to set when the command has ended."""
    ended = threading.Event()
    if debug:
        return ended
    default_thread_hook, default_unraisable = threading.excepthook, sys.unraisablehook

    def thread_hook(a: Any) -> None:
        if a.exc_type is SystemExit or ended.is_set():
            return
        try:
            name = a.thread.name if a.thread is not None else "?"
            print(f"{prog}: warning: background thread {name} failed: {a.exc_type.__name__}: "
                  f"{' '.join(str(a.exc_value).split())[:300]} (--debug shows the traceback)", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - stderr gone at exit: nothing more to say
            default_thread_hook(a)

    def unraisable_hook(u: Any) -> None:
        if not ended.is_set():  # e.g. a __del__ failing while the command runs: Python's own report
            default_unraisable(u)

    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    return ended


if __name__ == "__main__":
    # run the importable module's main, so that the parts' CLIs and this one share one UsageError
    from tessera.cli import main as _main

    sys.exit(_main())
