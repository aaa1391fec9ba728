"""`tessera fed` as a new user meets it (issue 17 items 11, 13, 14), each command a real process:

* --help shows defaults and a line for every option; `--partition` (I/N) and `--split` (how data is
  cut) mean the same in `fed client` and `fed simulate`;
* a user's mistake is one line on stderr, exit 2, no traceback (`--debug` shows it);
* a client whose model does not match the server's: the server retries with backoff, reports each
  retry with the client's error, then stops with one line and exit 1; the client exits 1 saying it
  never contributed and why;
* a server restarted on the checkpoint of a finished run says the run is complete (exit 0, no
  "listening"), and a client whose server is unreachable says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from ps.cli import read_first_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "multiproc", "fed_child.py")


def tessera(*args: str, cwd: str = ROOT, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tessera.cli", *args], cwd=cwd, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def fed_parsers() -> dict[str, argparse.ArgumentParser]:
    from tessera.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    fed = sub.choices["fed"]
    fed_sub = next(a for a in fed._actions if isinstance(a, argparse._SubParsersAction))
    return dict(fed_sub.choices)


def test_help_shows_defaults_and_every_option_has_a_line() -> None:
    parsers = fed_parsers()
    assert set(parsers) == {"server", "client", "simulate", "tokens", "cert"}
    for name, p in parsers.items():
        assert issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        for a in p._actions:
            assert a.help, f"fed {name} {a.option_strings or a.dest} has no help text"
    server = " ".join(parsers["server"].format_help().split())
    for shown in ("--rounds ROUNDS rounds to train (a resumed run counts its checkpoint's) (default: 10)",
                  "--max-retries MAX_RETRIES times a round that gathers too few answers is retried",
                  "(default: 20)", "--retry-backoff RETRY_BACKOFF seconds before the first retry"):
        assert shown in server, shown
    # one name, one meaning: --partition is I/N (client only); --split is how data is cut (both)
    sim, cli = parsers["simulate"].format_help(), parsers["client"].format_help()
    assert "--partition" not in sim and "--split" in sim and "--partition I/N" in cli and "--split" in cli
    old = parsers["simulate"].parse_args(["--partition", "iid"])  # the older name still parses
    assert old.old_partition == "iid"


@pytest.mark.timeout(150)  # two interpreter starts, on a loaded 2-core machine
@pytest.mark.parametrize("args, message", [
    (["fed", "server", "--task", "nosuchmod:make"], "cannot import module 'nosuchmod'"),
    (["fed", "server", "--task", "digits", "--task-opt", "dim"], "expects KEY=VALUE, got 'dim'"),
    (["fed", "client", "--server", "127.0.0.1:1", "--partition", "2/2"], "--partition 2/2: need 0 <= I < N"),
])
def test_user_errors_are_one_line_without_traceback(args, message) -> None:
    p = tessera(*args)
    out, err = p.communicate(timeout=70)
    assert p.returncode == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    if "nosuchmod:make" in args:  # --debug (anywhere on the line) shows the traceback instead
        p = tessera(*args, "--debug")
        _, err = p.communicate(timeout=70)
        assert p.returncode != 0 and "Traceback" in err and message in err


@pytest.mark.timeout(120)
def test_mismatched_client_server_backs_off_and_both_exit_non_zero(procs, tmp_path) -> None:
    server = tessera("fed", "server", "--task", "digits_logreg", "--rounds", "2", "--min-clients", "1",
                     "--max-retries", "2", "--retry-backoff", "0.3", "--eval-every", "0", "--round-timeout", "20",
                     "--results", str(tmp_path / "r.json"))
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    # the server trains digits_logreg (64-10); this client's model is the digits MLP (64-64-10)
    client = tessera("fed", "client", "--server", address, "--task", "digits", "--partition", "0/1")
    procs.append(client)
    c_out, c_err = client.communicate(timeout=90)
    s_out, s_err = server.communicate(timeout=60)
    assert server.returncode == 1, (s_out, s_err)
    retries = [ln for ln in s_err.splitlines() if "retrying in" in ln]
    assert [ln.split("retrying in ")[1].split(" s")[0] for ln in retries] == ["0.3", "0.6"], s_err  # backs off
    assert all("0 of 1 sampled clients answered" in ln and "got 2 arrays, the model has 4" in ln for ln in retries), retries
    last = s_err.strip().splitlines()[-1]
    assert last.startswith("tessera-fed: training failed after 0 completed round(s): round 1: fewer than 1 "
                           "clients answered in 3 attempts"), s_err
    assert "Traceback" not in s_err and "Traceback" not in c_err
    assert json.loads((tmp_path / "r.json").read_text())["failed"].startswith("round 1")
    assert client.returncode == 1, (c_out, c_err)
    c_last = c_err.strip().splitlines()[-1]
    assert c_last.startswith("tessera fed client: error: ") and "never contributed: 3 of its tasks failed" in c_last
    assert "got 2 arrays, the model has 4" in c_last and "training failed" in c_last
    assert "server finished" not in c_out


TINY_TASK = textwrap.dedent("""
    import numpy as np
    from federated import ServerTask

    def make(n: int = 3):
        return ServerTask([np.zeros(n, np.float32)], lambda w: (float(np.sum(w[0])), {"sum": float(np.sum(w[0]))}))
""")


@pytest.mark.timeout(120)
def test_rerun_of_a_finished_server_says_complete_and_unreachable_client_says_so(procs, tmp_path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_TASK)
    cmd = ("fed", "server", "--task", "tiny:make", "--task-opt", "n=3", "--rounds", "1", "--min-clients", "1",
           "--checkpoint", str(tmp_path / "ck"), "--eval-every", "1", "--eval-fraction", "0")
    server = tessera(*cmd, cwd=str(tmp_path))
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    child = subprocess.Popen([sys.executable, CHILD, address, "c1", "4"], stdout=subprocess.PIPE, text=True)
    procs.append(child)
    assert "exit ok" in child.communicate(timeout=60)[0]
    s_out, s_err = server.communicate(timeout=60)
    assert server.returncode == 0 and "round 1: 1/1 clients" in s_out and "central loss" in s_out, s_out + s_err
    again = tessera(*cmd, cwd=str(tmp_path))
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0 and "listening" not in out, out
    assert "the run is already complete: checkpoint" in out and "all 1 rounds" in out, out
    # nobody listens on the finished server's port now: a client says so, then gives up (exit 1, as its --help says)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = tessera("fed", "client", "--server", f"127.0.0.1:{port}", "--task", "digits_logreg", "--partition", "0/1",
                "--reconnect-timeout", "2")
    out, err = c.communicate(timeout=60)
    assert c.returncode == 1, (out, err)
    last = err.strip().splitlines()[-1]
    assert f"127.0.0.1:{port} not reachable" in err and last.startswith("tessera fed client: error: "), err
    assert "unreachable for" in last and "Traceback" not in err, err
