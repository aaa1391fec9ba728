"""The `tessera fed` commands as separate processes: a TLS + token server for 2 rounds,
two built-in clients that exit cleanly when it is done, and an intruder with a wrong
token that is refused at once."""
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


@pytest.fixture
def procs():
    made: list[subprocess.Popen] = []
    yield made
    for p in made:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_server_and_clients_over_tls_with_tokens(procs, tmp_path) -> None:
    from tessera.cli import main

    d = str(tmp_path)
    assert main(["fed", "cert", "--out-dir", d]) == 0  # in this process: these two need no child
    assert main(["fed", "tokens", "alice", "bob", "--out", f"{d}/tokens"]) == 0
    tokens = dict(line.split() for line in open(f"{d}/tokens"))
    server = tessera("fed", "server", "--task", "digits_logreg", "--rounds", "2", "--min-clients", "2",
                     "--tls-cert", f"{d}/server.crt", "--tls-key", f"{d}/server.key", "--tokens", f"{d}/tokens",
                     "--results", f"{d}/results.json", "--checkpoint", f"{d}/ckpt", "--eval-fraction", "1",
                     stdout=subprocess.PIPE)
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    common = ("--server", address, "--task", "digits_logreg", "--root-cert", f"{d}/server.crt", "--reconnect-timeout", "20")
    intruder = tessera("fed", "client", *common, "--partition", "0/2", "--token=not-a-token",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(intruder)
    clients = [tessera("fed", "client", *common, "--partition", f"{i}/2", f"--token={tokens[name]}", stdout=subprocess.PIPE)
               for i, name in enumerate(("alice", "bob"))]
    procs.extend(clients)
    out_i, err_i = intruder.communicate(timeout=60)
    assert intruder.returncode == 2 and "UnauthenticatedError" in err_i and "unknown client token" in err_i
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
