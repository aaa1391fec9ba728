"""Federated hardening (issue 10) over real gRPC on 127.0.0.1: DP noise nobody can
predict, task ids nobody can guess and only their client can answer, per-identity
quotas, and secure aggregation that survives a wrong share and names its sender."""
from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest

from federated.client import ClientNode
from federated.config import NodeConfig, SecAggSettings, ServerConfig
from federated.errors import ConfigError
from federated.privacy import DPConfig
from federated.protocol import FIT, SECAGG, Answer, Task
from federated.runtime import Client, ClientRuntime
from federated.secagg import decode_fixed, encode_fixed
from federated.secure_round import secagg_config_for
from federated.server import FedServer
from federated.strategy import make_strategy
from tessera.codec import pack
from tessera.security import token_metadata
from tessera.v1 import fed_pb2 as pb

W0 = [np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), np.zeros(6, np.float32)]


class Same(Client):
    """fit: the weights unchanged (delta 0), so a DP round's step is the noise alone."""

    def __init__(self, n: int = 1, sleep: float = 0.0) -> None:
        self.n, self.sleep = n, sleep

    def fit(self, weights, config):
        if self.sleep:
            time.sleep(self.sleep)
        return [w.copy() for w in weights], self.n, {}

    def evaluate(self, weights, config):
        return 0.0, self.n, {}


class Shift(Client):
    def __init__(self, shift: float, n: int = 1) -> None:
        self.shift, self.n = shift, n

    def fit(self, weights, config):
        return [w + np.float32(self.shift) for w in weights], self.n, {}

    def evaluate(self, weights, config):
        return 0.0, self.n, {}


class Harness:
    """A FedServer on 127.0.0.1:0 and client nodes in threads; everything stops at close()."""

    def __init__(self, strategy: str = "fedavg", **cfg: Any) -> None:
        cfg.setdefault("rounds", 1)
        cfg.setdefault("round_timeout", 20)
        cfg.setdefault("wait_timeout", 20)
        cfg.setdefault("eval_every", 0)
        self.server = FedServer(ServerConfig(**cfg), make_strategy(strategy), W0)
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[ClientNode] = []
        self.threads: list[threading.Thread] = []
        self.results: dict[int, BaseException | None] = {}
        self.channels: list[grpc.Channel] = []

    def node(self, runtime: ClientRuntime, ids: list[str], **kw: Any) -> ClientNode:
        kw.setdefault("reconnect_timeout", 10)
        node = ClientNode(NodeConfig(address=self.address, **kw), runtime, ids)
        k = len(self.nodes)

        def run() -> None:
            try:
                node.run()
                self.results[k] = None
            except BaseException as e:  # noqa: BLE001
                self.results[k] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.nodes.append(node)
        self.threads.append(t)
        return node

    def client(self, client: Client, cid: str | None, **kw: Any) -> ClientNode:
        return self.node(ClientRuntime(lambda _c: client), [cid] if cid else [], **kw)

    def channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(self.address)
        self.channels.append(ch)
        return ch

    def close(self) -> None:
        self.server.stop(grace=0.5)
        for n in self.nodes:
            n.stop()
        for t in self.threads:
            t.join(10)
        for ch in self.channels:
            ch.close()


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(strategy: str = "fedavg", **cfg: Any) -> Harness:
        h = Harness(strategy, **cfg)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def wait_until(pred: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# --------------------------------------------------------------------------- 1. DP noise
def _dp_step(harness: Any) -> list[np.ndarray]:
    """One central-DP round of two clients whose delta is 0: the step is noise / 2."""
    h = harness(min_clients=2, dp=DPConfig(clip_norm=1.0, noise_multiplier=1.0))
    h.client(Same(), "a")
    h.client(Same(), "b")
    h.server.run()
    return [w.astype(np.float64) - w0 for w, w0 in zip(h.server.weights, W0)]


def test_dp_noise_differs_between_servers_with_the_default_config(harness) -> None:
    first, second = _dp_step(harness), _dp_step(harness)
    for a, b in zip(first, second):
        assert np.all(a != b), "two servers with the default config drew the same DP noise"
    # and it is not the noise a seed of 0 (the old default) gives: a client could subtract that
    rng = np.random.default_rng([0, 11])
    predictable = [rng.standard_normal(w.shape) * 1.0 / 2 for w in W0]
    for got in (first, second):
        for a, p in zip(got, predictable):
            assert not np.allclose(a, p, atol=1e-3)
    # it is noise of the advertised scale: std z * C / n = 0.5 per entry (30 entries)
    flat = np.concatenate([a.ravel() for a in first + second])
    assert 0.25 < flat.std() < 0.8


def test_a_seed_with_dp_is_refused() -> None:
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="insecure_reproducible_seed.*cannot combine with dp"):
        ServerConfig(dp=dp, insecure_reproducible_seed=7)
    ServerConfig(insecure_reproducible_seed=7)  # a non-private reproducibility run is fine
    ServerConfig(dp=dp, seed=7)  # the public sampling seed of non-DP rounds is not used under DP
