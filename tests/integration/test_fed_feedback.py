"""What a federated server and client say while things go wrong (issue 17 items 9, 11, 13), with a
real FedServer on 127.0.0.1:0 and client nodes on real sockets in threads:

* a round whose clients all fail is retried with doubling backoff (not 21 times in milliseconds),
  each retry reported with the clients' errors; after ``max_retries`` the server raises
  RoundFailedError and tells the clients "training failed: ..."; a client that never contributed
  raises ClientFailedError naming its own error;
* a client that contributed while another failed finishes normally;
* while too few clients are connected the server says "waiting for clients (k/n connected)";
* a client whose server is unreachable warns every ``note_every`` seconds, then gives up.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Any

import numpy as np
import pytest
from fed_harness import Harness

from federated.client import ClientNode, check_outcome
from federated.config import NodeConfig, ServerConfig
from federated.errors import (
    ClientFailedError,
    ConfigError,
    ServerUnavailableError,
    TrainingFailedError,
)
from federated.orchestrator import RoundFailedError
from federated.runtime import Client, ClientRuntime
from federated.server import FedServer
from federated.strategy import make_strategy

W0 = [np.zeros((3, 2), np.float32), np.zeros(2, np.float32)]


class AddOne(Client):
    """fit: every weight + 1 (FedAvg of one such client: the global weights + 1)."""

    def fit(self, weights, config):
        return [w + 1 for w in weights], 4, {}


class WrongModel(Client):
    """A client whose model does not match the server's (as a user's mismatched model would)."""

    def fit(self, weights, config):
        raise ValueError(f"size mismatch: my model has 7 parameters, got {sum(w.size for w in weights)}")


class Live(Harness):
    """fed_harness's server and nodes with this file's defaults: 10 rounds, no wait timeout, and
    each node's outcome checked as ``start_client`` does after ``run()``."""

    def __init__(self, **cfg: Any) -> None:
        cfg.setdefault("rounds", 10)
        cfg.setdefault("round_timeout", 10)
        cfg.setdefault("wait_timeout", None)
        super().__init__(W0, **cfg)

    def client(self, client: Client, cid: str | None, **kw: Any) -> ClientNode:
        kw.setdefault("reconnect_timeout", 20)
        return super().client(client, cid, check=True, **kw)


@pytest.fixture
def live():
    made: list[Live] = []

    def make(**cfg: Any) -> Live:
        made.append(Live(**cfg))
        return made[-1]

    yield make
    for x in made:
        x.close()


@pytest.mark.timeout(60)
def test_failing_round_backs_off_reports_and_stops_cleanly(live) -> None:
    s = live(min_clients=1, max_retries=2, retry_backoff=0.4, retry_backoff_max=10)
    s.client(WrongModel(), "bad")
    t0 = time.monotonic()
    with pytest.raises(RoundFailedError) as e:
        s.server.run()
    took = time.monotonic() - t0
    assert "round 1: fewer than 1 clients answered in 3 attempts" in str(e.value)
    assert "size mismatch" in str(e.value)  # the clients' own errors, not just a count
    retries = [(t, line) for t, line in s.status if "retrying in" in line]
    assert [line.split("retrying in ")[1].split(" s")[0] for _, line in retries] == ["0.4", "0.8"]  # doubling
    assert all("size mismatch" in line and "0 of 1 sampled clients answered" in line for _, line in retries)
    assert retries[1][0] - retries[0][0] >= 0.4 - 0.05  # it really waited
    assert took >= 0.4 + 0.8 - 0.05
    s.threads[0].join(20)
    err = s.results[0]
    # the client never contributed: it says so, with its own error and the server's reason
    assert isinstance(err, ClientFailedError), err
    assert "never contributed" in str(err) and "size mismatch" in str(err) and "training failed" in str(err)
    assert s.nodes[0].shutdown_reason.startswith("training failed: round 1")


@pytest.mark.timeout(60)
def test_contributing_client_finishes_while_a_mismatched_one_fails(live) -> None:
    s = live(min_clients=1, rounds=2, fraction=1.0, min_available=2, retry_backoff=5)
    s.client(AddOne(), "good")
    s.client(WrongModel(), "bad")
    history = s.server.run()
    s.join()
    assert [r["answered"] for r in history] == [1, 1] and [r["attempts"] for r in history] == [1, 1]
    # reference: FedAvg of the one good client, twice, from zeros, computed here
    for got, w0 in zip(s.server.weights, W0):
        np.testing.assert_array_equal(got, w0 + 2)
    assert s.results[0] is None and s.nodes[0].stats.contributed == 2
    assert isinstance(s.results[1], ClientFailedError) and "never contributed: 2" in str(s.results[1])


@pytest.mark.timeout(60)
def test_server_says_it_is_waiting_for_clients(live) -> None:
    s = live(min_clients=2, rounds=1)
    s.run_in_thread()
    deadline = time.monotonic() + 10
    while not any("(0/2 connected)" in line for _, line in s.status):
        assert time.monotonic() < deadline, s.status
        time.sleep(0.05)
    s.client(AddOne(), "a")
    while not any("(1/2 connected)" in line for _, line in s.status):
        assert time.monotonic() < deadline, s.status
        time.sleep(0.05)
    s.client(AddOne(), "b")
    s.join()
    assert s.run_error is None and len(s.server.history) == 1
    assert [line for _, line in s.status] == ["waiting for clients (0/2 connected)", "waiting for clients (1/2 connected)"]
    assert all(x is None for x in s.results.values())


@pytest.mark.timeout(30)
def test_client_says_periodically_that_the_server_is_unreachable(caplog) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = ClientNode(NodeConfig(address=f"127.0.0.1:{port}", reconnect_timeout=2.0, note_every=0.5, backoff_max=0.2),
                      ClientRuntime(lambda _c: AddOne()), ["a"])
    caplog.set_level(logging.WARNING, logger="federated.client")
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="unreachable for 2 s; giving up"):
        node.run()
    assert time.monotonic() - t0 >= 2.0
    notes = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert 3 <= len(notes) <= 6, notes  # about every 0.5 s for 2 s, not once per retry
    assert all(f"127.0.0.1:{port} not reachable" in n and "UNAVAILABLE" in n for n in notes)


def test_training_failed_reason_alone_raises_training_failed() -> None:
    node = ClientNode(NodeConfig(address="127.0.0.1:1"), ClientRuntime(lambda _c: AddOne()), ["a"])
    node.shutdown_reason = "training failed: round 3: fewer than 2 clients answered"
    node.stats.contributed = 2  # it did its part; the run still failed
    with pytest.raises(TrainingFailedError, match="round 3"):
        check_outcome(node)
    node.shutdown_reason = "training finished"
    check_outcome(node)  # no error


@pytest.mark.timeout(30)
def test_waiting_note_repeats_and_wait_timeout_fails_the_run(live, monkeypatch) -> None:
    import federated.orchestrator as orch

    monkeypatch.setattr(orch, "_WAIT_NOTE_S", 0.3)  # README: "... and every 5 s"; shortened here
    s = live(min_clients=2, rounds=1, wait_timeout=1.2)
    with pytest.raises(RoundFailedError, match=r"only 0 of the 2 clients needed connected within 1.2 s"):
        s.server.run()
    notes = [line for _, line in s.status]
    assert 3 <= len(notes) <= 6 and set(notes) == {"waiting for clients (0/2 connected)"}, notes


def test_retry_delay_doubles_up_to_its_cap() -> None:
    cfg = ServerConfig(retry_backoff=1.0, retry_backoff_max=30.0)
    o = FedServer(cfg, make_strategy("fedavg"), W0).orchestrator
    assert [o.retry_delay(a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ConfigError, match="retry_backoff"):
        ServerConfig(retry_backoff=5.0, retry_backoff_max=1.0)
