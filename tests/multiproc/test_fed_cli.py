"""The `tessera fed` commands as separate processes: a TLS + token server for 2 rounds,
two built-in clients that exit cleanly when it is done, and an intruder with a wrong
token that is refused at once; a mutual-TLS server and a client with its certificate;
setups the service runtime refuses (exit 2, one line, nothing bound)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ps.cli import read_first_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tessera(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tessera.cli", *args], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kw)


def test_server_and_clients_over_tls_with_tokens(procs, tmp_path) -> None:
    from tessera.cli import main

    d = str(tmp_path)
    assert main(["fed", "cert", "--out-dir", d]) == 0  # in this process: these two need no child
    assert main(["fed", "tokens", "alice", "bob", "--out", f"{d}/tokens"]) == 0
    tokens = dict(line.split() for line in open(f"{d}/tokens"))
    server = tessera("fed", "server", "--task", "digits_logreg", "--rounds", "2", "--min-clients", "2",
                     "--tls-cert", f"{d}/server.crt", "--tls-key", f"{d}/server.key", "--token-file", f"{d}/tokens",
                     "--results", f"{d}/results.json", "--checkpoint", f"{d}/ckpt", "--eval-fraction", "1",
                     stdout=subprocess.PIPE)
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    common = ("--server", address, "--task", "digits_logreg", "--tls-ca", f"{d}/server.crt", "--reconnect-timeout", "20")
    # the intruder first, while the server waits for its 2 clients: started beside them, it could find
    # the server already finished (2 quick rounds) and see only UNAVAILABLE until it gives up
    intruder = tessera("fed", "client", *common, "--partition", "0/2", "--token=not-a-token",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(intruder)
    out_i, err_i = intruder.communicate(timeout=60)
    lines = [ln for ln in err_i.splitlines() if ln.strip()]
    assert intruder.returncode == 2 and len(lines) == 1, err_i[-2000:]  # a refused token: a setup to fix, one line
    assert lines[0].startswith("tessera fed client: error: ") and "refused this client: unknown" in lines[0], lines
    clients = [  # alice's token on the command line, bob's from the token file
        tessera("fed", "client", *common, "--partition", "0/2", f"--token={tokens['alice']}", stdout=subprocess.PIPE),
        tessera("fed", "client", *common, "--partition", "1/2", "--token-file", f"{d}/tokens", "--identity", "bob",
                stdout=subprocess.PIPE),
    ]
    procs.extend(clients)
    for c in clients:
        out, _ = c.communicate(timeout=90)
        assert c.returncode == 0 and "server finished" in out, out
    assert server.wait(30) == 0
    res = json.load(open(f"{d}/results.json"))
    h = res["history"]
    assert [r["round"] for r in h] == [1, 2] and all(r["answered"] == 2 for r in h)
    assert set(h[0]["clients"]) == {"alice", "bob"} and all(r["eval_clients"] == 2 for r in h)
    assert h[-1]["central_metrics"]["accuracy"] > 0.5  # logistic regression on digits learns fast
    assert os.path.getsize(f"{d}/ckpt") > 0


def test_mutual_tls_server_and_client_with_its_certificate(procs, tmp_path) -> None:
    from tessera.cli import main

    d = str(tmp_path)
    assert main(["cert", "--out-dir", d, "--hosts", "localhost,127.0.0.1", "--clients", "alice"]) == 0
    server = tessera("fed", "server", "--task", "digits_logreg", "--rounds", "1", "--min-clients", "1", "--eval-every", "0",
                     "--tls-cert", f"{d}/server.crt", "--tls-key", f"{d}/server.key", "--tls-ca", f"{d}/ca.crt",
                     "--results", f"{d}/results.json", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    common = ("--server", address, "--task", "digits_logreg", "--partition", "0/1", "--root-cert", f"{d}/ca.crt")
    bare = tessera("fed", "client", *common, "--reconnect-timeout", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(bare)
    _, err = bare.communicate(timeout=60)
    assert bare.returncode == 2 and "requires a client certificate" in err, err[-2000:]  # no certificate: refused, says why
    assert "--tls-cert and --tls-key" in err and "tls_cert=" not in err  # in the command's own flags
    alice = tessera("fed", "client", *common, "--tls-cert", f"{d}/alice.crt", "--tls-key", f"{d}/alice.key",
                    "--reconnect-timeout", "20", stdout=subprocess.PIPE)
    procs.append(alice)
    out, _ = alice.communicate(timeout=90)
    assert alice.returncode == 0 and "server finished" in out, out
    assert server.wait(30) == 0
    h = json.load(open(f"{d}/results.json"))["history"]
    assert len(h) == 1 and set(h[0]["clients"]) == {"alice"}  # named by its certificate


@pytest.mark.parametrize("extra, message", [
    (("--token-file", "TOKENS"), "tokens over plaintext"),
    (("--host", "0.0.0.0"), "open server"),
    (("--tls-ca", "CA"), "mutual TLS"),
], ids=["tokens-plaintext", "open-non-loopback", "ca-without-cert"])
def test_refused_setups_exit_2_with_one_line(tmp_path, extra, message) -> None:
    from tessera.service import write_token_file

    write_token_file(str(tmp_path / "tokens"), {"alice": "a" * 32})
    (tmp_path / "ca").write_text("not used")
    extra = tuple({"TOKENS": str(tmp_path / "tokens"), "CA": str(tmp_path / "ca")}.get(a, a) for a in extra)
    p = tessera("fed", "server", "--task", "digits_logreg", "--rounds", "1", *extra,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 2, (out, err)
    assert "listening" not in out and "Traceback" not in err
    assert err.startswith("tessera-fed: ") and message in err and len(err.strip().splitlines()) == 1, err
    if message != "mutual TLS":
        assert "--insecure" in err  # names the way out


def test_older_flag_names_still_parse() -> None:
    from tessera.cli import build_parser

    s = build_parser().parse_args(["fed", "server", "--tokens", "t.txt"])
    assert s.token_file == "t.txt" and not s.insecure
    c = build_parser().parse_args(["fed", "client", "--server", "h:1", "--partition", "0/1", "--root-cert", "ca.pem"])
    assert c.tls_ca == "ca.pem" and c.tls_cert is None and c.token_file is None


def test_unreachable_server_one_plain_line_every_5_s_then_one_error_line_exit_1() -> None:
    """README (Federated mode): a client whose server is unreachable says so every 5 s, one plain
    line each (no log timestamps), then gives up after --reconnect-timeout with one error line
    and exit 1 (as its --help says)."""
    import re
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    p = tessera("fed", "client", "--server", dead, "--partition", "0/2", "--reconnect-timeout", "11",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 1 and "Traceback" not in err, err
    assert lines[-1] == f"tessera fed client: error: server {dead} unreachable for 11 s; giving up", lines
    waits = [int(m.group(1)) for ln in lines[:-1] if (m := re.match(rf"tessera fed client: server {dead} not reachable for "
                                                                    r"(\d+) s \(UNAVAILABLE: .*\); retrying until 11 s", ln))]
    assert len(waits) == len(lines) - 1 >= 2, lines  # nothing else: no WARNING, no timestamps; said again
    assert all(w >= 5 * k for k, w in enumerate(waits)), waits  # every 5 s, never more often
    help_text = " ".join(subprocess.run([sys.executable, "-m", "tessera.cli", "fed", "client", "--help"], capture_output=True,
                                        text=True, timeout=60).stdout.split())
    assert "give up (exit 1) after this many seconds without reaching the server" in help_text
