"""One federated identity, one vote (issue 30), against a live server on a socket (fed_harness):
an identity that registers many client ids is one participant in sampling and aggregation,
and ids that never answer neither fail nor slow the rounds.

References: the honest clients' updates are known in closed form (weights + shift), so the
global model after a round is compared with numpy's median / mean of those updates, computed
here in one process."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Iterator

import grpc
import numpy as np
import pytest
from fed_harness import Harness, harnesses, wait_until

from federated.runtime import Client, ClientRuntime
from tessera.service import token_metadata
from tessera.v1 import fed_pb2 as pb

pytestmark = pytest.mark.timeout(120)

W0 = [np.zeros((4, 3), np.float64), np.linspace(-1.0, 1.0, 5)]
TOKENS = {"h1": "tok-h1-0123456789abcdef", "h2": "tok-h2-0123456789abcdef", "eve": "tok-eve-0123456789abcdef"}


class Shift(Client):
    """fit: every weight + ``shift`` (after ``sleep`` seconds); 10 examples."""

    def __init__(self, shift: float, sleep: float = 0.0) -> None:
        self.shift, self.sleep = shift, sleep

    def fit(self, weights, config):
        if self.sleep:
            time.sleep(self.sleep)
        return [w + self.shift for w in weights], 10, {}

    def evaluate(self, weights, config):
        return float(self.shift), 10, {}


class Constant(Client):
    """fit: every weight set to ``value`` (the attacker's update)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def fit(self, weights, config):
        return [np.full_like(w, self.value) for w in weights], 10, {}


class Silent:
    """A raw Connect stream that registers ``ids`` and then never answers a task (it counts them)."""

    def __init__(self, address: str, ids: list[str], token: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        hello = pb.NodeMessage()
        hello.hello.client_ids.extend(ids)
        self._stop = threading.Event()

        def requests() -> Iterator[bytes]:
            yield hello.SerializeToString()
            self._stop.wait(120)

        self.call = self.channel.stream_stream("/tessera.v1.Federated/Connect")(
            requests(), metadata=token_metadata(token), timeout=120)
        welcome = pb.ServerMessage.FromString(next(self.call))
        assert len(welcome.welcome.client_ids) == len(ids)
        self.tasks = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self.call:
                if pb.ServerMessage.FromString(raw).WhichOneof("body") == "task":
                    self.tasks += 1
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._stop.set()
        self.call.cancel()
        self.channel.close()


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    with harnesses(W0) as make:
        yield make


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "anonymous"])
def test_median_of_honest_clients_holds_against_one_identity_with_three_ids(harness, tokens: bool) -> None:
    """With tokens, eve's 3 ids are one vote: the median of {h1, h2, eve} is h2's update (honest).
    Without tokens nothing tells eve's ids apart from 3 clients: 3 of 5 votes are 100.0 and win,
    which is why the README says that only authenticated identities get one vote."""
    auth = dict(tokens=TOKENS, insecure=True) if tokens else {}
    h = harness("median", min_clients=2, fraction=1.0, **auth)
    tok = (lambda who: TOKENS[who]) if tokens else (lambda who: None)
    h.client(Shift(1.0), "h1" if tokens else "h1", token=tok("h1"))
    h.client(Shift(3.0), "h2", token=tok("h2"))
    eve_ids = ["eve/0", "eve/1", "eve/2"] if tokens else ["e0", "e1", "e2"]
    h.node(ClientRuntime(lambda _c: Constant(100.0)), eve_ids, token=tok("eve"))
    assert wait_until(lambda: h.server.registry.num_connected() == 5)
    history = h.server.run()
    rec = history[0]
    updates = {"h1": [w + 1.0 for w in W0], "h2": [w + 3.0 for w in W0]}
    if tokens:
        trained = set(rec["clients"])
        assert rec["sampled"] == 3 and rec["answered"] == 3, rec
        assert {"h1", "h2"} <= trained and len(trained & set(eve_ids)) == 1  # one of eve's ids
        votes = [updates["h1"], updates["h2"], [np.full_like(w, 100.0) for w in W0]]
    else:
        assert rec["sampled"] == 5 and rec["answered"] == 5, rec
        votes = [updates["h1"], updates["h2"]] + [[np.full_like(w, 100.0) for w in W0]] * 3
    for i, got in enumerate(h.server.weights):
        want = np.median(np.stack([v[i] for v in votes]), axis=0)  # the single-process reference
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
        if tokens:  # inside the honest range: eve's ids moved nothing beyond one honest vote
            assert np.all(got >= W0[i] + 1.0 - 1e-12) and np.all(got <= W0[i] + 3.0 + 1e-12)
        else:
            assert np.all(got == 100.0)


def test_min_clients_counts_identities_not_client_ids(harness) -> None:
    """3 client ids of one token are one participant: a server needing 2 keeps waiting for a second
    identity (and gives up after wait_timeout), then trains once one joins."""
    from federated.orchestrator import RoundFailedError

    h = harness(tokens=TOKENS, insecure=True, min_clients=2, wait_timeout=1.0)
    eve = Silent(h.address, ["eve/0", "eve/1", "eve/2"], TOKENS["eve"])
    try:
        assert wait_until(lambda: h.server.registry.num_connected() == 3)
        assert h.server.registry.num_participants() == 1
        with pytest.raises(RoundFailedError, match="only 1 of the 2 clients needed connected"):
            h.server.run()
        assert any("waiting for clients (1/2 connected)" in line for _, line in h.status)
    finally:
        eve.close()


def test_silent_ids_do_not_stall_client_evaluation(harness) -> None:
    """Evaluation samples identities too, and closes without the stragglers once half answered."""
    h = harness(tokens=TOKENS, insecure=True, min_clients=2, rounds=3, eval_every=1, eval_fraction=1.0,
                round_timeout=20)
    eve = Silent(h.address, [f"eve/{i}" for i in range(100)], TOKENS["eve"])
    try:
        h.client(Shift(1.0, sleep=0.15), "h1", token=TOKENS["h1"])
        h.client(Shift(3.0, sleep=0.15), "h2", token=TOKENS["h2"])
        assert wait_until(lambda: h.server.registry.num_connected() == 102)
        history = h.server.run()
    finally:
        eve.close()
    assert [r["eval_clients"] for r in history] == [2, 2, 2]
    assert all(r["loss"] == 2.0 for r in history)  # the mean of the honest clients' losses 1 and 3
    assert max(r["eval_s"] for r in history) < 20 / 4, history  # none waited for eve until the timeout


def _rounds(h: Harness, rounds: int) -> list[float]:
    history = h.server.run()
    assert len(history) == rounds
    return [r["round_s"] for r in history]


@pytest.mark.parametrize("fraction", [0.1, 1.0])
def test_ten_thousand_silent_ids_neither_fail_nor_slow_the_rounds(harness, fraction: float) -> None:
    """Eve registers 10,000 client ids (her whole quota) on one stream and answers nothing. The
    same run without her is the baseline, measured in this test: every round still completes
    with the two honest clients (the same global model as the baseline), and the median round
    takes at most 2x the baseline's, none near the round timeout (20 s here)."""
    rounds = 12
    cfg = dict(tokens=TOKENS, insecure=True, min_clients=2, fraction=fraction, rounds=rounds, round_timeout=20,
               retry_backoff=0.0, retry_backoff_max=0.0)

    def honest(h: Harness) -> None:
        h.client(Shift(1.0, sleep=0.15), "h1", token=TOKENS["h1"])
        h.client(Shift(3.0, sleep=0.15), "h2", token=TOKENS["h2"])

    base = harness(**cfg)
    honest(base)
    assert wait_until(lambda: base.server.registry.num_connected() == 2)
    base_s = _rounds(base, rounds)
    base_w = base.server.weights

    flood = harness(**cfg)
    eve = Silent(flood.address, [f"eve/{i}" for i in range(10_000)], TOKENS["eve"])
    try:
        honest(flood)
        assert wait_until(lambda: flood.server.registry.num_connected() == 10_002, 20)
        flood_s = _rounds(flood, rounds)
        history = flood.server.history
    finally:
        eve.close()
    for rec in history:  # every round aggregated exactly the two honest clients' updates
        assert rec["answered"] == 2 and rec["attempts"] == 1, rec
    for got, want in zip(flood.server.weights, base_w):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    np.testing.assert_allclose(base_w[0], W0[0] + 2.0 * rounds, atol=1e-10)  # the mean of +1 and +3, each round
    # eve timed out, so she is drawn less: at most half the rounds asked any of her ids
    assert 1 <= eve.tasks <= rounds // 2, eve.tasks
    # the median round, robust to the load of a shared machine (one round stalled by a busy CPU
    # would move a total); a round eve was asked in takes about 2x (the straggler rule; the honest fits
    # take 0.15 s, above ServerConfig.straggler_min_s), the rest 1x. Measured: median 1.0x, total 1.3-1.5x
    ratio_median = statistics.median(flood_s) / statistics.median(base_s)
    assert ratio_median <= 2.0, (base_s, flood_s)
    assert max(flood_s) < cfg["round_timeout"] / 4, flood_s  # no round waited for eve's ids until its timeout
