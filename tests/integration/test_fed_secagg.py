"""Secure aggregation and DP over real gRPC on 127.0.0.1.

The sum the server unmasks equals the plain sum of the clients' fixed-point
encodings exactly, with all 5 clients and with 1 of 5 dropping after the key
exchange; the resulting FedAvg step matches plain FedAvg to the fixed-point
resolution. DP reports epsilon every round, equal to the accountant's own figure.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from federated.client import ClientNode
from federated.config import NodeConfig, SecAggSettings, ServerConfig
from federated.privacy import DPConfig, RDPAccountant
from federated.protocol import SECAGG, Answer, Task
from federated.runtime import Client, ClientRuntime
from federated.secagg import decode_fixed, encode_fixed
from federated.secure_round import secagg_config_for
from federated.server import FedServer
from federated.strategy import make_strategy

W0 = [np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), np.zeros(6, np.float32)]
EXAMPLES = {"c1": 3, "c2": 5, "c3": 8, "c4": 13, "c5": 21}


class RoundNoise(Client):
    def __init__(self, index: int, n: int) -> None:
        self.index, self.n = index, n

    def fit(self, weights, config):
        rng = np.random.default_rng([self.index, int(config["round"])])
        return [w + (0.1 * rng.normal(size=w.shape)).astype(w.dtype) for w in weights], self.n, {}


class DropsAtMasking(ClientRuntime):
    """Fault injection: answers the key stages, then hangs past the stage deadline
    instead of sending its masked input (a client that dropped after key exchange)."""

    def handle(self, task: Task, tensors: Any, bytes_received: int = 0) -> Answer:
        if task.kind == SECAGG and task.secagg_stage == 2:
            time.sleep(2.0)
        return super().handle(task, tensors, bytes_received)


def run_round(secagg: bool, drop: str | None = None, **cfg: Any) -> FedServer:
    cfg.setdefault("rounds", 1)
    server = FedServer(
        ServerConfig(min_clients=5, round_timeout=1.5 if drop else 30, wait_timeout=20, eval_every=0,
                     secagg=SecAggSettings(enabled=secagg, stage_timeout=0.6 if drop else 0.0, max_examples=32), **cfg),
        make_strategy("fedavg"), W0,
    )
    port = server.start()
    nodes, threads = [], []
    for cid, n in EXAMPLES.items():
        cls = DropsAtMasking if cid == drop else ClientRuntime
        node = ClientNode(NodeConfig(address=f"127.0.0.1:{port}", reconnect_timeout=10),
                          cls(lambda _c, cid=cid, n=n: RoundNoise(int(cid[1:]), n)), [cid])
        t = threading.Thread(target=node.run, daemon=True)
        t.start()
        nodes.append(node)
        threads.append(t)
    try:
        server.run()
    finally:
        server.stop(grace=0.5)
        for node in nodes:
            node.stop()
        for t in threads:
            t.join(10)
    return server


def client_vector(cid: str, rnd: int = 1) -> np.ndarray:
    """What client ``cid`` feeds into the secure sum (see federated.secure_round)."""
    n = EXAMPLES[cid]
    new = RoundNoise(int(cid[1:]), n).fit([w.copy() for w in W0], {"round": rnd})[0]
    w = min(n, 32) / 32
    return np.concatenate([(a.astype(np.float64) - g.astype(np.float64)).ravel() * w for a, g in zip(new, W0)] + [np.array([w])])


@pytest.mark.parametrize("drop", [None, "c3"], ids=["all-5", "1-of-5-drops-after-key-exchange"])
def test_secure_sum_equals_plain_sum(drop: str | None) -> None:
    server = run_round(True, drop=drop)
    rec = server.history[0]
    survivors = [c for c in EXAMPLES if c != drop]
    assert rec["secagg"]["u1"] == 5 and rec["secagg"]["u3"] == len(survivors)
    assert rec["secagg"]["dropped"] == ([drop] if drop else [])
    cfg = secagg_config_for(5, 0.6, 8.0)
    ring = sum(encode_fixed(client_vector(c), cfg).astype(np.uint64) for c in survivors) % (1 << 32)
    expected = decode_fixed(ring.astype(np.uint32), cfg)
    got = server.orchestrator._secure.last_sum
    np.testing.assert_array_equal(got, expected)  # exact in fixed point
    plain = sum(client_vector(c) for c in survivors)
    np.testing.assert_allclose(got, plain, atol=len(survivors) * 2.0 ** -cfg.scale_bits)
    # and the step equals plain FedAvg over the survivors (to the fixed-point resolution)
    total = float(sum(EXAMPLES[c] for c in survivors))
    news = {c: RoundNoise(int(c[1:]), EXAMPLES[c]).fit([w.copy() for w in W0], {"round": 1})[0] for c in survivors}
    for k, g in enumerate(server.weights):
        want = sum(EXAMPLES[c] * news[c][k].astype(np.float64) for c in survivors) / total
        np.testing.assert_allclose(g, want, atol=1e-5)
    # the server never held an individual update: only opaque secagg bytes crossed, plus the sum
    assert all(v["up"] > 0 for v in rec["clients"].values())


def test_dp_reports_epsilon_every_round_and_secagg_composes() -> None:
    dp = DPConfig(clip_norm=0.5, noise_multiplier=1.1, delta=1e-5)
    for secagg in (False, True):
        server = run_round(secagg, dp=dp, rounds=3)
        eps = [r["epsilon"] for r in server.history]
        acc = RDPAccountant(1.1, 1.0)  # all 5 connected clients sampled: q = 1
        want = []
        for _ in range(3):
            acc.step(1)
            want.append(acc.epsilon(1e-5))
        np.testing.assert_allclose(eps, want, rtol=1e-12)
        assert eps[0] < eps[1] < eps[2]
        # the clipped, noised mean moved the weights, but by no more than C + noise allows
        step = np.sqrt(sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(server.weights, W0)))
        assert 0 < step < 3 * (0.5 + 1.1 * 0.5 * np.sqrt(30) / 5) * 3


def test_local_dp_and_adaptive_clipping() -> None:
    server = run_round(False, dp=DPConfig(clip_norm=0.05, noise_multiplier=0.5, mode="local"), rounds=2)
    assert all(r["epsilon"] > 0 for r in server.history)
    # adaptive: every update norm is far above C=0.05 (0.1 * N(0,1) over 30 entries), so C grows each round
    server = run_round(False, dp=DPConfig(clip_norm=0.05, noise_multiplier=0.5, adaptive=True, clip_lr=0.5), rounds=3)
    clips = [r["dp_clip"] for r in server.history]
    assert clips[0] == 0.05 and clips[0] < clips[1] < clips[2]
