"""Roles of federated identities (issue 30): the token file's role column is read. A line without
roles is a ``client``; one with roles has exactly those, so ``metrics <token> reader`` may scrape
/metrics (tests/multiproc/test_fed_metrics_auth.py) but is refused PERMISSION_DENIED when it tries
to join, is never connected, sampled or counted, and the round aggregates the clients alone.
``tessera fed tokens`` writes roles as ``tessera tokens`` does (``NAME:reader``).

Reference: every client's update is W0 + shift with the same example count, so FedAvg's global
model is W0 + the mean shift of the clients that answered (computed here in numpy)."""
from __future__ import annotations

import os
import stat
from typing import Callable, Iterator

import grpc
import numpy as np
import pytest
from fed_harness import Harness, harnesses, wait_until

from federated.config import ServerConfig
from federated.errors import ConfigError, PermissionDeniedError
from federated.runtime import Client
from tessera.cli import build_parser, main
from tessera.service import read_token_file, token_metadata
from tessera.v1 import fed_pb2 as pb

pytestmark = pytest.mark.timeout(120)

W0 = [np.arange(12, dtype=np.float64).reshape(3, 4) / 10, np.ones(5)]
TOKENS = {"c0": "tok-c0-0123456789abcdef", "c1": "tok-c1-0123456789abcdef", "metrics": "tok-metrics-0123456789",
          "both": "tok-both-0123456789abcdef"}
ROLES = {"metrics": ["reader"], "both": ["client", "reader"]}


class Shift(Client):
    """fit: every weight + ``shift``; 4 examples."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def fit(self, weights, config):
        return [w + self.shift for w in weights], 4, {}

    def evaluate(self, weights, config):
        return 0.0, 4, {}


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    with harnesses(W0) as make:
        yield make


def test_a_reader_identity_cannot_join_and_is_never_sampled(harness) -> None:
    h = harness(min_clients=3, fraction=1.0, tokens=TOKENS, roles=ROLES, insecure=True)
    # the SDK: refused at once (no retry), saying which role it would need
    reader = h.client(Shift(100.0), "metrics", token=TOKENS["metrics"])
    h.threads[0].join(15)
    err = h.results.get(0)
    assert isinstance(err, PermissionDeniedError), err
    assert "identity 'metrics' (roles ['reader'])" in str(err) and "['client']" in str(err), err
    assert not reader.connected.is_set()
    # the wire: Connect answers PERMISSION_DENIED before the Hello registers anything
    hello = pb.NodeMessage()
    hello.hello.client_ids.append("metrics")
    with pytest.raises(grpc.RpcError) as e:
        next(h.channel().stream_stream("/tessera.v1.Federated/Connect")(
            iter([hello.SerializeToString()]), metadata=token_metadata(TOKENS["metrics"]), timeout=10))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    assert h.server.registry.num_connected() == 0
    # a line without roles is a client; one listing client (and reader) is one too
    for who, shift in (("c0", 1.0), ("c1", 2.0), ("both", 6.0)):
        h.client(Shift(shift), who, token=TOKENS[who])
    assert wait_until(lambda: h.server.registry.num_connected() == 3, 20)
    rec = h.server.run()[0]
    assert rec["sampled"] == 3 and rec["answered"] == 3 and set(rec["clients"]) == {"c0", "c1", "both"}, rec
    for got, w in zip(h.server.weights, W0):  # FedAvg of equal counts: W0 + mean(1, 2, 6)
        np.testing.assert_allclose(got, w + 3.0, rtol=0, atol=1e-12)


def test_roles_the_server_does_not_know_and_a_file_without_clients_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"identity 'metrics': unknown role 'raeder' \(a federated identity's roles: "
                                          r"client, reader, admin\)"):
        ServerConfig(tokens=TOKENS, roles={"metrics": ["raeder"]}, insecure=True)
    with pytest.raises(ConfigError, match="no identity of the token list has the client role"):
        ServerConfig(tokens={"metrics": TOKENS["metrics"]}, roles={"metrics": ["reader"]}, insecure=True)
    ServerConfig(tokens=TOKENS, roles=ROLES, insecure=True)  # the valid one


def test_fed_server_cli_refuses_an_unknown_role_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "tokens").write_text(f"c0 {TOKENS['c0']}\nmetrics {TOKENS['metrics']} raeder\n")
    code = main(["fed", "server", "--task", "digits_logreg", "--rounds", "1", "--insecure",
                 "--token-file", str(tmp_path / "tokens")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("tessera-fed: identity 'metrics': unknown role 'raeder' "
                                 "(a federated identity's roles: client, reader, admin)"), (code, err)


def test_fed_tokens_writes_roles_as_tessera_tokens_does(tmp_path, capsys) -> None:
    out = tmp_path / "fed.tokens"
    assert main(["fed", "tokens", "c0", "c1", "metrics:reader", "ops:client,admin", "--out", str(out)]) == 0
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    tf = read_token_file(str(out))
    assert set(tf.tokens) == {"c0", "c1", "metrics", "ops"} and len(set(tf.tokens.values())) == 4
    assert tf.roles == {"metrics": ["reader"], "ops": ["client", "admin"]}
    assert ServerConfig(tokens=tf.tokens, roles=tf.roles, insecure=True).roles["metrics"] == ["reader"]
    capsys.readouterr()
    # refused, one line, exit 2, nothing written
    for args, said in ((["c0", "m:raeder"], "identity 'm': unknown role 'raeder'"),
                       (["metrics:reader"], "no client identity"),
                       (["c0", "c0:reader"], "identity 'c0' given twice"),
                       ([":reader", "c0"], "expected IDENTITY[:ROLE,...]")):
        bad = tmp_path / "bad"
        assert main(["fed", "tokens", *args, "--out", str(bad)]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("tessera fed tokens: error: ") and said in err and "\n" not in err, err
        assert not bad.exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fed", "tokens", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "IDENTITY[:ROLE,...]" in text and "NAME:reader may only read the server's /metrics" in text, text
