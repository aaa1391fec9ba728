"""FedAvg over real gRPC with three client *processes*: the server's weights equal the
example-weighted mean computed by hand, bit for bit (float64), round after round.
The clients exit cleanly when the server shuts down."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from fed_child import child_update
from federated.config import ServerConfig
from federated.server import FedServer
from federated.strategy import make_strategy

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fed_child.py")
EXAMPLES = {"c1": 3, "c2": 5, "c3": 11}


def spawn(address: str, cid: str, n: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, CHILD, address, cid, str(n), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def stop_all(procs: list[subprocess.Popen], grace: float = 10.0) -> list[str]:
    """Wait (with a deadline) for the children, kill stragglers; return their outputs."""
    outs = []
    end = time.monotonic() + grace
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return outs


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def hand_fedavg(w0: list[np.ndarray], rounds: int) -> list[np.ndarray]:
    w = w0
    for rnd in range(1, rounds + 1):
        ids = sorted(EXAMPLES)  # the server samples in client-id order
        ups = {c: child_update(w, int(c[1:]), rnd) for c in ids}
        total = float(sum(EXAMPLES.values()))
        w = [sum(EXAMPLES[c] * ups[c][k] for c in ids) / total for k in range(len(w))]
    return w


@pytest.mark.timeout(120)
def test_fedavg_three_processes_equals_hand_mean(children, tmp_path) -> None:
    rng = np.random.default_rng(0)
    w0 = [rng.normal(size=(7, 5)), rng.normal(size=(5,)), rng.normal(size=(3, 2, 2))]
    cfg = ServerConfig(rounds=3, min_clients=3, round_timeout=60, wait_timeout=60, eval_every=1,
                       checkpoint=str(tmp_path / "ck.msgpack"))
    server = FedServer(cfg, make_strategy("fedavg"), w0)
    port = server.start()
    try:
        for cid, n in EXAMPLES.items():
            children.append(spawn(f"127.0.0.1:{port}", cid, n))
        history = server.run()
    finally:
        server.stop(grace=1.0)
    outs = stop_all(children)
    expected = hand_fedavg(w0, 3)
    for got, want in zip(server.weights, expected):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)
    assert [r["answered"] for r in history] == [3, 3, 3]
    assert all(r["eval_clients"] == 3 for r in history)
    # every client counted bytes both ways, every round
    assert all(set(r["clients"]) == set(EXAMPLES) and all(v["up"] > 0 and v["down"] > 0 for v in r["clients"].values())
               for r in history)
    for p, out in zip(children, outs):
        assert p.returncode == 0 and "exit ok" in out, out
