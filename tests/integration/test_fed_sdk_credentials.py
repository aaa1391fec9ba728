"""The federated SDK's own credentials (issue 31 item 4), over a real TLS + token server on
127.0.0.1: ``start_client(..., token_file=PATH, identity=NAME)`` reads the file ``tessera fed
tokens`` writes (with the kernel's parser, the one the server uses) and trains; its errors name
its keyword arguments (``token_file=``, ``identity=``, ``tls_ca=``), while ``tessera fed client``
names its flags (``--tls-ca``) for the same mismatch."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from federated.client import start_client
from federated.config import ServerConfig
from federated.errors import ConfigError, TLSMismatchError
from federated.runtime import Client
from federated.server import FedServer
from federated.strategy import make_strategy
from tessera.cli import main
from tessera.service import load_token_file

pytestmark = pytest.mark.timeout(120)

W0 = [np.arange(6, dtype=np.float32).reshape(2, 3) / 10, np.ones(4, dtype=np.float32)]


class Shift(Client):
    """fit: every weight + ``shift``, ``n`` examples."""

    def __init__(self, shift: float, n: int) -> None:
        self.shift, self.n = shift, n

    def fit(self, weights: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        return [w + np.float32(self.shift) for w in weights], self.n, {}

    def evaluate(self, weights: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        return 0.0, self.n, {}


@pytest.fixture
def creds(tmp_path) -> dict[str, str]:
    """A certificate and a token file made by the commands the README gives."""
    d = str(tmp_path)
    assert main(["fed", "cert", "--out-dir", f"{d}/tls"]) == 0
    assert main(["fed", "tokens", "alice", "bob", "--out", f"{d}/tokens.txt"]) == 0
    (tmp_path / "one.txt").write_text(open(f"{d}/tokens.txt").read().splitlines()[0] + "\n")
    return {"ca": f"{d}/tls/server.crt", "key": f"{d}/tls/server.key", "tokens": f"{d}/tokens.txt", "one": f"{d}/one.txt"}


def _server(creds: dict[str, str], **kw: Any) -> FedServer:
    tokens = load_token_file(creds["tokens"])[0] if "tokens" in creds else None
    cfg = ServerConfig(tls_cert=creds.get("ca"), tls_key=creds.get("key"), tokens=tokens, rounds=1, min_clients=2,
                       round_timeout=30, wait_timeout=60, eval_every=0, **kw)
    return FedServer(cfg, make_strategy("fedavg"), W0)


def test_start_client_reads_the_token_file_over_tls(creds) -> None:
    server = _server(creds)
    port = server.start()
    done: dict[str, Any] = {}

    def run(identity: str, shift: float) -> None:
        try:
            done[identity] = start_client(f"127.0.0.1:{port}", Shift(shift, 1), tls_ca=creds["ca"],
                                          token_file=creds["tokens"], identity=identity, reconnect_timeout=30)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            done[identity] = e

    threads = [threading.Thread(target=run, args=a, daemon=True) for a in (("alice", 1.0), ("bob", 3.0))]
    for t in threads:
        t.start()
    try:
        history = server.run()
        for t in threads:
            t.join(30)
    finally:
        server.stop(grace=0.5)
    assert all(getattr(done.get(i), "contributed", 0) == 1 for i in ("alice", "bob")), done
    assert set(history[0]["clients"]) == {"alice", "bob"}  # named by the tokens the file gave them
    # reference: FedAvg of the two clients' answers, equal weights: W0 + mean(1, 3)
    for got, w in zip(server.weights, W0):
        np.testing.assert_allclose(got, w + 2.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw, needle", [
    ({"token_file": "MISSING"}, "token_file= 'MISSING': no such file"),
    ({"token_file": "TOKENS"}, "holds 2 identities: say which one with identity="),
    ({"token_file": "TOKENS", "identity": "carol"}, "has no identity 'carol' (identity=)"),
    ({"token_file": "TOKENS", "identity": "alice", "token": "x" * 32}, "give token= or token_file=, not both"),
    ({"identity": "alice"}, "identity= picks a line of token_file="),
], ids=["missing", "which", "no-such-identity", "both", "identity-alone"])
def test_token_file_errors_name_the_sdk_arguments(creds, kw, needle) -> None:
    kw = {k: {"TOKENS": creds["tokens"]}.get(v, v) for k, v in kw.items()}
    with pytest.raises(ConfigError) as e:  # before any connection: port 1 is never dialled
        start_client("127.0.0.1:1", Shift(0.0, 1), reconnect_timeout=1, **kw)
    assert needle in str(e.value) and "--" not in str(e.value), str(e.value)


def test_a_file_of_one_identity_needs_no_identity(creds) -> None:
    server = FedServer(ServerConfig(tls_cert=creds["ca"], tls_key=creds["key"], tokens=load_token_file(creds["tokens"])[0],
                                    rounds=1, min_clients=1, round_timeout=30, wait_timeout=60, eval_every=0),
                       make_strategy("fedavg"), W0)
    port = server.start()
    t = threading.Thread(target=lambda: start_client(f"127.0.0.1:{port}", Shift(1.0, 1), tls_ca=creds["ca"],
                                                      token_file=creds["one"], reconnect_timeout=30), daemon=True)
    t.start()
    try:
        history = server.run()
        t.join(30)
    finally:
        server.stop(grace=0.5)
    assert set(history[0]["clients"]) == {"alice"}  # the file's only line


def test_tls_mismatch_names_tls_ca_in_the_sdk_and_the_flag_in_the_cli(creds) -> None:
    server = _server(creds)
    port = server.start()
    try:
        # the SDK without tls_ca= against a TLS server: refused at once, in the SDK's words
        with pytest.raises(TLSMismatchError) as e:
            start_client(f"127.0.0.1:{port}", Shift(0.0, 1), token_file=creds["tokens"], identity="alice",
                         reconnect_timeout=20)
        assert e.value.kind == "tls_required" and "tls_ca=" in str(e.value) and "--tls-ca" not in str(e.value), str(e.value)
        # the CLI: the same mismatch in its flags, one line, exit 2
        r = subprocess.run([sys.executable, "-m", "tessera.cli", "fed", "client", "--server", f"127.0.0.1:{port}",
                            "--task", "digits_logreg", "--partition", "0/2", "--token-file", creds["tokens"],
                            "--identity", "alice", "--reconnect-timeout", "20"],
                           capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith("tessera fed client: error: ") and "--tls-ca" in lines[0] and "tls_ca=" not in lines[0]
    finally:
        server.stop(grace=0.5)
    # a TLS client (tls_ca=) against a plaintext server
    plain = _server({}, insecure=False)
    port = plain.start()
    try:
        with pytest.raises(TLSMismatchError) as e:
            start_client(f"127.0.0.1:{port}", Shift(0.0, 1), tls_ca=creds["ca"], reconnect_timeout=20)
        assert e.value.kind == "tls_unsupported" and "drop tls_ca=" in str(e.value), str(e.value)
    finally:
        plain.stop(grace=0.5)
