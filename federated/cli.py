"""``tessera fed ...``: run a federated server, a built-in client, or a simulation;
make client tokens and a self-signed TLS certificate."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tessera.argtypes import KEY_VALUE_HELP, address_arg, parse_key_values
from tessera.service import add_client_security_args, add_server_security_args

__all__ = ["add_fed_commands", "explain_error", "CLI_NAMES"]


def _training_args(p: argparse.ArgumentParser, default_task: str | None = "digits") -> None:
    p.add_argument("--rounds", type=int, default=10, help="rounds to train (a resumed run counts its checkpoint's)")
    p.add_argument("--strategy", default="fedavg",
                   help="fedavg, fedavgm, fedprox, scaffold, fedadam, fedyogi, fedadagrad, fedbuff, median, "
                        "trimmed_mean, krum, multikrum, or package.module:Class")
    p.add_argument("--strategy-param", action="append", metavar="K=V", help=f"strategy parameter (repeatable; {KEY_VALUE_HELP})")
    p.add_argument("--fraction", type=float, default=None,
                   help="fraction of connected clients sampled per round (None: server 1.0, simulate 0.1)")
    p.add_argument("--min-clients", type=int, default=2, help="fewest answers a round aggregates")
    p.add_argument("--round-timeout", type=float, default=60.0, help="seconds a round waits for answers")
    p.add_argument("--compress", default="", help="uplink compression: fp16, int8 or topk:RATIO (empty: none)")
    p.add_argument("--secagg", action="store_true", help="secure aggregation (Bonawitz et al.)")
    p.add_argument("--secagg-threshold", type=float, default=0.6, help="Shamir threshold, fraction of sampled clients")
    p.add_argument("--dp-clip", type=float, default=0.0, help="client-level DP: L2 clip C of each update (0: off)")
    p.add_argument("--dp-noise", type=float, default=0.0, help="DP noise multiplier z (noise std z*C on the sum)")
    p.add_argument("--dp-mode", choices=["central", "local"], default="central",
                   help="where DP noise is added: on the server's sum (central) or on each client (local)")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="the delta of the reported (epsilon, delta)")
    p.add_argument("--dp-adaptive", action="store_true", help="adaptive clipping to the median update norm")
    p.add_argument("--epochs", type=int, default=None, help="local epochs (None: the task's)")
    p.add_argument("--lr", type=float, default=None, help="local learning rate (None: the task's)")
    p.add_argument("--batch-size", type=int, default=None, help="local batch size (None: the task's)")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every N rounds (0: never)")
    p.add_argument("--seed", type=int, default=0, help="seed of client sampling and of the task's initial weights")


def add_fed_commands(sub: Any) -> None:
    """Add ``tessera fed {server,client,simulate,tokens,cert}`` to the ``tessera`` parser's subcommands."""
    fed = sub.add_parser("fed", help="federated learning").add_subparsers(
        dest="fed_command", required=True)

    s = fed.add_parser("server", help="run a federated server for a built-in task or your own model "
                                      "(exits when the rounds are done)")
    s.add_argument("--task", default="digits",
                   help="built-in task (digits, digits_logreg) or package.module:function returning a "
                        "federated.ServerTask (your model, with central evaluation)")
    s.add_argument("--task-opt", action="append", default=[], metavar="K=V",
                   help=f"keyword argument for a package.module:function task (repeatable; {KEY_VALUE_HELP})")
    _training_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=0, help="port (0: pick a free one and print it)")
    s.add_argument("--min-available", type=int, default=0,
                   help="clients that must be connected before a round starts (0: --min-clients)")
    s.add_argument("--eval-fraction", type=float, default=1.0, help="fraction of clients evaluating each round")
    s.add_argument("--max-retries", type=int, default=20,
                   help="times a round that gathers too few answers is retried before the server gives up (exit 1)")
    s.add_argument("--retry-backoff", type=float, default=1.0,
                   help="seconds before the first retry of a round; doubles per retry, at most 30 s")
    s.add_argument("--wait-timeout", type=float, default=None,
                   help="give up (exit 1) when too few clients connect within this many seconds (None: wait forever)")
    add_server_security_args(s)  # --tls-cert --tls-key --tls-ca --token-file --insecure
    from tessera.metrics import add_metrics_args

    add_metrics_args(s)  # --metrics-port/--metrics-host: Prometheus (RPCs, rounds, clients connected)
    s.add_argument("--tokens", dest="token_file", help="the older name of --token-file")
    s.add_argument("--checkpoint", help="checkpoint file, written every round; resumes from it when present")
    s.add_argument("--results", help="write the round history (and peak RSS) here as JSON")
    s.add_argument("--ready-file", help="write the bound port here once serving")
    s.set_defaults(func=_server)

    c = fed.add_parser("client", help="run a built-in client on one part of a built-in task's data",
)
    c.add_argument("--server", required=True, type=address_arg("--server"), help="HOST:PORT of the server")
    c.add_argument("--task", default="digits", help="built-in task: digits, digits_logreg (the server's)")
    c.add_argument("--partition", required=True, metavar="I/N",
                   help="this client holds part I of N (0-based) of the task's training data")
    c.add_argument("--split", default="iid",
                   help="how the data is cut into the N parts: iid, dirichlet:ALPHA or shards:S (as fed simulate --split)")
    c.add_argument("--seed", type=int, default=0, help="split seed (the same on every client)")
    c.add_argument("--token", default=None, help="client token (or $TESSERA_FED_TOKEN, or --token-file)")
    add_client_security_args(c)  # --tls-ca --tls-cert --tls-key --token-file --identity
    c.add_argument("--root-cert", dest="tls_ca", help="the older name of --tls-ca")
    c.add_argument("--client-id", help="client id (None: the token's identity)")
    c.add_argument("--reconnect-timeout", type=float, default=60.0,
                   help="give up (exit 1) after this many seconds without reaching the server")
    c.set_defaults(func=_client)

    m = fed.add_parser("simulate", help="server + many clients on this machine over real gRPC; plots and results.json",
)
    m.add_argument("--task", default="digits", help="built-in task: digits, digits_logreg")
    _training_args(m)
    m.add_argument("--clients", type=int, default=100, help="registered (virtual) clients")
    m.add_argument("--split", default="dirichlet:0.5",
                   help="how the data is cut among the clients: iid, dirichlet:ALPHA or shards:S (as fed client --split)")
    m.add_argument("--partition", dest="old_partition", default=None, help=argparse.SUPPRESS)  # the older name of --split
    m.add_argument("--processes", type=int, default=0, help="client processes (0: client threads in this process)")
    m.add_argument("--workers", type=int, default=16, help="concurrent client tasks per node")
    m.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of clients evaluating (central eval always)")
    m.add_argument("--out", default="fed-sim", help="output directory")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.set_defaults(func=_simulate)

    t = fed.add_parser("tokens", help="write a token file with a fresh random token per identity: IDENTITY[:ROLE,...] ...")
    t.add_argument("identities", nargs="+", metavar="IDENTITY[:ROLE,...]",
                   help="one token each. An identity without roles is a client (joins rounds); NAME:reader may only "
                        "read the server's /metrics (--metrics-port), never join a round, e.g. metrics:reader for "
                        "Prometheus (roles: client, reader, admin; e.g. c0 c1 c2 metrics:reader)")
    t.add_argument("--out", required=True, help="token file to write (mode 0600)")
    t.set_defaults(func=_tokens)

    k = fed.add_parser("cert", help="write a self-signed TLS certificate and key (for trials)")
    k.add_argument("--out-dir", required=True, help="directory for server.crt and server.key")
    k.add_argument("--host", action="append", default=None,
                   help="DNS name or IP the certificate covers (repeatable; None: localhost and 127.0.0.1)")
    k.set_defaults(func=_cert)


def _reraise_if_debug(args: argparse.Namespace) -> None:
    """Inside an ``except``: re-raise (the traceback) when ``--debug`` (anywhere on the
    command line; ``tessera.cli.main`` takes it out before parsing) or $TESSERA_DEBUG asks for it."""
    if getattr(args, "debug", False) or "--debug" in sys.argv[1:] or os.environ.get("TESSERA_DEBUG", "") not in ("", "0"):
        raise  # noqa: PLE0704 - called from an except block


def _client_config(args: argparse.Namespace, task: Any) -> dict[str, Any]:
    """The task's client settings with the command line's --epochs/--lr/--batch-size on top."""
    cc = dict(task.client_config)
    for key in ("epochs", "lr", "batch_size"):
        v = getattr(args, key)
        if v is not None:
            cc[key] = v
    return cc


def _dp(args: argparse.Namespace) -> Any:
    if args.dp_clip <= 0:
        if args.dp_noise > 0:
            from federated.errors import ConfigError

            raise ConfigError("--dp-noise needs --dp-clip (the noise is scaled by the clip bound)")
        return None
    from federated.privacy import DPConfig

    return DPConfig(clip_norm=args.dp_clip, noise_multiplier=args.dp_noise, mode=args.dp_mode, delta=args.dp_delta,
                    adaptive=args.dp_adaptive)


def _server(args: argparse.Namespace) -> int:
    """Refused setups (tokens over plaintext without --insecure, a bad token file, ...) print
    one line and exit 2 before anything binds."""
    from federated.errors import ConfigError
    from federated.orchestrator import RoundFailedError
    from federated.server import serve
    from federated.server_task import load_server_task
    from federated.simulate import peak_rss_mb
    from tessera import service

    try:
        # identities, tokens and roles (a line without roles is a client; reader: /metrics only)
        token_file = service.read_token_file(args.token_file) if args.token_file else None
    except (OSError, ValueError) as e:  # service.ConfigError is a ValueError
        _reraise_if_debug(args)
        print(f"tessera-fed: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        task = load_server_task(args.task, seed=args.seed, **parse_key_values(args.task_opt))
        server, strategy = _build_server(args, task, token_file)
    except ConfigError as e:
        _reraise_if_debug(args)
        print(f"tessera-fed: {e}", file=sys.stderr, flush=True)
        return 2
    if args.metrics_port:
        from tessera.metrics import FedCollector, start_from_args

        # behind the gRPC port's security: TLS (mutual too), and the reader or admin role
        start_from_args(args, [FedCollector(server)], what="tessera-fed", security=server.security)
    code, failure = 0, None
    try:
        history = serve(server, ready_file=args.ready_file)
    except RoundFailedError as e:  # clients were told; the history so far is still written
        history, code, failure = server.history, 1, str(e)
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"history": history, "peak_rss_mb": peak_rss_mb(), "strategy": strategy.name,
                       "params": strategy.params(), "failed": failure}, f, indent=1, default=float)
    if failure is not None:
        print(f"tessera-fed: training failed after {len(history)} completed round(s): {failure}", file=sys.stderr,
              flush=True)
    return code


def _build_server(args: argparse.Namespace, task: Any, token_file: Any) -> tuple[Any, Any]:
    """(FedServer, its strategy) from the command line and the parsed ``--token-file``
    (``tessera.service.TokenFile``, or None); ConfigError for a refused setup."""
    from federated.config import SecAggSettings, ServerConfig
    from federated.server import FedServer
    from federated.strategy import make_strategy
    from tessera.service import TokenFile

    tf = token_file or TokenFile()
    # a file of certificate identities only (every token '-'): no bearer tokens, roles by certificate
    tokens = tf.tokens if token_file is not None and (tf.tokens or not tf.certificates) else None

    cfg = ServerConfig(
        host=args.host, port=args.port, rounds=args.rounds, fraction=args.fraction if args.fraction is not None else 1.0,
        min_clients=args.min_clients, min_available=args.min_available, round_timeout=args.round_timeout,
        max_retries=args.max_retries, retry_backoff=args.retry_backoff,
        retry_backoff_max=max(30.0, args.retry_backoff), wait_timeout=args.wait_timeout,
        eval_fraction=args.eval_fraction, eval_every=args.eval_every, seed=args.seed, checkpoint=args.checkpoint,
        compress=args.compress, client_config=_client_config(args, task), dp=_dp(args),
        secagg=SecAggSettings(enabled=args.secagg, threshold=args.secagg_threshold),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, tokens=tokens, roles=tf.roles,
        certificates=tf.certificates, insecure=args.insecure,
    )
    strategy = make_strategy(args.strategy, **parse_key_values(args.strategy_param or [], "--strategy-param"))

    from federated.simulate import rss_mb

    def report(rec: dict[str, Any]) -> None:
        rec["rss_mb"] = rss_mb()
        eps = f" epsilon {rec['epsilon']:.3f}" if "epsilon" in rec else ""
        waited = f" (+{rec['wait_s']:.1f} s waiting for clients)" if rec.get("wait_s", 0) > 0.05 else ""
        central = ""
        if "central_loss" in rec:  # the task's central evaluation: loss and each metric
            central = f"central loss {rec['central_loss']:.4g}" + "".join(
                f", {k} {v:.4g}" for k, v in sorted(rec.get("central_metrics", {}).items())) + ", "
        print(f"round {rec['round']}: {rec.get('answered')}/{rec.get('sampled')} clients, "
              f"{rec['round_s'] - rec.get('wait_s', 0.0):.3f} s{waited}, "
              f"{central}up {rec['bytes_up']} B, down {rec['bytes_down']} B{eps}", flush=True)

    def status(line: str) -> None:
        print(f"tessera-fed: {line}", file=sys.stderr, flush=True)

    return FedServer(cfg, strategy, task.initial_weights, task.evaluate_fn, report, status), strategy


# how the client's errors name its security settings on the command line (the SDK: federated.client.SDK_NAMES)
CLI_NAMES = {"tls_ca": "--tls-ca", "tls_cert": "--tls-cert", "tls_key": "--tls-key", "token_file": "--token-file",
             "identity": "--identity"}


def explain_error(exc: BaseException) -> tuple[str, int] | None:
    """One line and an exit code for a federated error a command ends with (None: not one):
    2 for a setup to fix (a refused token, a TLS mismatch, a bad setting), 1 for a run that
    failed (server unreachable until --reconnect-timeout, no update accepted, training failed)."""
    from federated.errors import ConfigError, FedError, PermissionDeniedError, UnauthenticatedError

    if not isinstance(exc, FedError):
        return None
    return str(exc), 2 if isinstance(exc, (ConfigError, UnauthenticatedError, PermissionDeniedError)) else 1


def _client(args: argparse.Namespace) -> int:
    """Errors are raised, and said by ``tessera.cli.main`` as one line (``explain_error``)."""
    import torch

    from federated.client import mismatch_message, start_client
    from federated.errors import TLSMismatchError
    from federated.tasks import get_task
    from tessera.service import ClientSecurity, UsageError

    try:
        i_s, n_s = args.partition.split("/")
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise UsageError(f"--partition expects I/N (e.g. 0/2), got {args.partition!r}") from None
    if not 0 <= i < n:
        raise UsageError(f"--partition {args.partition}: need 0 <= I < N")
    if args.token and args.token_file:
        raise UsageError("give --token or --token-file, not both")
    # a missing file, no such identity (the kernel's ConfigError names --identity): one line, exit 2
    sec = ClientSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.token_file, args.identity,
                                    token=args.token if args.token_file is None else None)
    token = sec.token or (None if args.token_file else os.environ.get("TESSERA_FED_TOKEN") or None)
    torch.set_num_threads(1)
    task = get_task(args.task)
    parts = task.partitions(n, args.split, args.seed)
    client = task.client(parts[i], seed=args.seed * 1_000_003 + i, shared_model=False)
    who = args.client_id or args.identity or ("(the token's identity)" if token else "(id given by the server)")
    print(f"tessera fed client {who}: {len(parts[i])} examples of {args.task}, connecting to {args.server}", flush=True)

    def say(line: str) -> None:  # while the server is unreachable: a plain line every 5 s
        print(f"tessera fed client: {line}", file=sys.stderr, flush=True)

    try:
        stats = start_client(args.server, client, token=token, tls_ca=sec.tls_ca, tls_cert=sec.tls_cert,
                             tls_key=sec.tls_key, client_id=args.client_id, reconnect_timeout=args.reconnect_timeout,
                             say=say)
    except TLSMismatchError as e:  # the SDK names its keyword arguments; say it with this command's flags
        text = mismatch_message(e.kind, e.address, CLI_NAMES, client_cert=sec.tls_cert is not None)
        raise UsageError(text or str(e)) from None
    print(f"tessera fed client: server finished; exiting ({stats.contributed} update(s) contributed)", flush=True)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from federated.simulate import SimulationConfig, run_simulation

    split = args.split
    if args.old_partition is not None:
        print("tessera-fed simulate: --partition is now --split (in fed client, --partition is I/N)", file=sys.stderr)
        split = args.old_partition

    cc: dict[str, Any] = {}
    for key in ("epochs", "lr", "batch_size"):
        v = getattr(args, key)
        if v is not None:
            cc[key] = v
    cfg = SimulationConfig(
        task=args.task, clients=args.clients, fraction=args.fraction if args.fraction is not None else 0.1,
        rounds=args.rounds, strategy=args.strategy, strategy_params=parse_key_values(args.strategy_param or [], "--strategy-param"),
        partition=split, seed=args.seed, processes=args.processes, workers=args.workers,
        min_clients=args.min_clients, round_timeout=args.round_timeout, eval_fraction=args.eval_fraction,
        eval_every=args.eval_every, compress=args.compress, secagg=args.secagg, dp=_dp(args), client_config=cc,
        out=args.out, progress=not args.no_progress,
    )
    res = run_simulation(cfg)
    s = res["summary"]
    print(json.dumps({k: s[k] for k in ("final_accuracy", "s_per_round", "startup_s", "bytes_up_per_round",
                                         "peak_rss_mb", "server_peak_rss_mb", "epsilon")}, default=float))
    print(f"wrote {os.path.join(args.out, 'results.json')} and plots", file=sys.stderr)
    return 0


def _write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by its owner only from the first byte on: a new
    file is created with mode 0600 (``os.open``, not chmod after the fact), an existing
    one is set to 0600 before anything is written, and a symlink is refused, not followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a file it creates
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _tokens(args: argparse.Namespace) -> int:
    """``tessera fed tokens``: one fresh random token per ``IDENTITY[:ROLE,...]`` (as ``tessera
    tokens``; no roles: a client), written 0600. UsageError (exit 2, nothing written) for an
    empty, repeated or malformed identity, an unknown role, or no client at all."""
    from federated.config import DEFAULT_ROLES, ROLES
    from tessera.service import UsageError, new_tokens, write_token_file

    roles: dict[str, list[str]] = {}
    for spec in args.identities:
        name, _, listed = spec.partition(":")
        if not name or any(c.isspace() or c in "#=" for c in name):
            raise UsageError(f"identity {spec!r}: expected IDENTITY[:ROLE,...] (no spaces, '#' or '=' in IDENTITY)")
        if name in roles:
            raise UsageError(f"identity {name!r} given twice")
        roles[name] = [r for r in listed.split(",") if r]
        unknown = sorted(set(roles[name]) - set(ROLES))
        if unknown:
            raise UsageError(f"identity {name!r}: unknown role {', '.join(map(repr, unknown))} "
                             f"(a federated identity's roles: {', '.join(ROLES)})")
    if not any("client" in (r or DEFAULT_ROLES) for r in roles.values()):
        raise UsageError("no client identity (one without roles, or with the client role): no client could join")
    tokens = new_tokens(roles)
    # the kernel's format: what the server and start_client(token_file=) read
    write_token_file(args.out, tokens, {name: r for name, r in roles.items() if r})
    print(f"wrote {len(tokens)} tokens to {args.out}; give each client its line's token")
    return 0


def _cert(args: argparse.Namespace) -> int:
    """``tessera fed cert``: a self-signed server certificate and key (for trials)."""
    from tessera.service import self_signed_cert

    os.makedirs(args.out_dir, exist_ok=True)
    cert, key = self_signed_cert(tuple(args.host or ["localhost", "127.0.0.1"]))
    with open(os.path.join(args.out_dir, "server.crt"), "wb") as f:
        f.write(cert)
    _write_private(os.path.join(args.out_dir, "server.key"), key)
    print(f"wrote {args.out_dir}/server.crt and server.key")
    return 0
