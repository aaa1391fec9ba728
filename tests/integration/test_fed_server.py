"""The federated server over real gRPC on 127.0.0.1: resume after a restart, chunked
models, reconnects, compressed uplinks, refused combinations, and TorchClient's
FedProx and SCAFFOLD against a reference computed by hand in torch."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from federated.client import ClientNode
from federated.config import NodeConfig, SecAggSettings, ServerConfig
from federated.errors import ConfigError
from federated.privacy import DPConfig
from federated.runtime import Client, ClientRuntime
from federated.server import FedServer
from federated.strategy import make_strategy
from federated.torch_client import TensorBatches, TorchClient

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)


class RoundNoise(Client):
    """fit: w + N(0, 1) from default_rng([index, round]) in the weights' dtype."""

    def __init__(self, index: int, n: int) -> None:
        self.index, self.n = index, n

    def fit(self, weights, config):
        rng = np.random.default_rng([self.index, int(config["round"])])
        return [w + rng.normal(size=w.shape).astype(w.dtype) for w in weights], self.n, {}

    def evaluate(self, weights, config):
        return 1.0, self.n, {"acc": 0.5}


def hand(w0: list[np.ndarray], clients: dict[str, tuple[int, int]], rounds: int) -> list[np.ndarray]:
    """FedAvg of RoundNoise clients {id: (index, n)}, in client-id order, float64."""
    w = w0
    for rnd in range(1, rounds + 1):
        ids = sorted(clients)
        ups = {}
        for c in ids:
            rng = np.random.default_rng([clients[c][0], rnd])
            ups[c] = [x + rng.normal(size=x.shape).astype(x.dtype) for x in w]
        total = float(sum(n for _, n in clients.values()))
        w = [sum(clients[c][1] * ups[c][k] for c in ids) / total for k in range(len(w))]
    return w


class Nodes:
    def __init__(self) -> None:
        self.nodes: list[ClientNode] = []
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def add(self, address: str, client: Client, cid: str, **kw: Any) -> ClientNode:
        kw.setdefault("reconnect_timeout", 20)
        kw.setdefault("backoff_max", 0.5)
        node = ClientNode(NodeConfig(address=address, **kw), ClientRuntime(lambda _c: client), [cid])

        def run() -> None:
            try:
                node.run()
            except BaseException as e:  # noqa: BLE001
                self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.nodes.append(node)
        self.threads.append(t)
        return node

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        for t in self.threads:
            t.join(10)


@pytest.fixture
def nodes():
    n = Nodes()
    yield n
    n.stop()


@pytest.fixture
def servers():
    made: list[FedServer] = []
    yield made
    for s in made:
        s.stop(grace=0.2)



W0 = [np.linspace(-1, 1, 20).reshape(4, 5), np.zeros(3)]
CLIENTS = {"a": (1, 2), "b": (2, 7)}


def test_resume_after_restart_matches_an_uninterrupted_run(nodes, servers, tmp_path) -> None:
    ck = str(tmp_path / "ckpt.msgpack")
    port = free_port()
    cfg = ServerConfig(port=port, rounds=2, min_clients=2, round_timeout=20, wait_timeout=20, checkpoint=ck,
                       shutdown_clients=False, eval_every=1)
    first = FedServer(cfg, make_strategy("fedavgm", momentum=0.5), W0)
    servers.append(first)
    first.start()
    for cid, (i, n) in CLIENTS.items():
        nodes.add(f"127.0.0.1:{port}", RoundNoise(i, n), cid)
    h1 = first.run()
    first.stop(grace=0.1, notify_clients=False)  # like a crash: clients keep trying to reconnect
    assert [r["round"] for r in h1] == [1, 2]

    second = FedServer(ServerConfig(**{**cfg.__dict__, "rounds": 4, "shutdown_clients": True}),
                       make_strategy("fedavgm", momentum=0.5), [np.zeros_like(w) for w in W0])
    servers.append(second)
    second.start()
    h2 = second.run()
    assert [r["round"] for r in h2] == [1, 2, 3, 4]  # history carried over; only 3 and 4 ran now
    assert all(n.stats.connects >= 2 for n in nodes.nodes)

    # reference: one uninterrupted 4-round run on a fresh server (momentum state must have been restored)
    ref = FedServer(ServerConfig(rounds=4, min_clients=2, round_timeout=20, wait_timeout=20, eval_every=0),
                    make_strategy("fedavgm", momentum=0.5), W0)
    servers.append(ref)
    ref_port = ref.start()
    for cid, (i, n) in CLIENTS.items():
        nodes.add(f"127.0.0.1:{ref_port}", RoundNoise(i, n), cid)
    ref.run()
    for got, want in zip(second.weights, ref.weights):
        np.testing.assert_array_equal(got, want)


def test_model_larger_than_a_chunk_travels_in_pieces(nodes, servers) -> None:
    w0 = [np.random.default_rng(3).normal(size=(60, 50)), np.ones(7)]  # 24 KB float64; chunks of 1 KiB
    srv = FedServer(ServerConfig(rounds=2, min_clients=2, round_timeout=20, wait_timeout=20, chunk_bytes=1024,
                                 eval_every=0), make_strategy("fedavg"), w0)
    servers.append(srv)
    port = srv.start()
    for cid, (i, n) in CLIENTS.items():
        nodes.add(f"127.0.0.1:{port}", RoundNoise(i, n), cid, chunk_bytes=1024)
    history = srv.run()
    for got, want in zip(srv.weights, hand(w0, CLIENTS, 2)):
        np.testing.assert_array_equal(got, want)
    assert srv.servicer.requests["Fetch"] == 4 and srv.servicer.requests["Submit"] == 4
    assert history[0]["bytes_up"] > 2 * 24_000  # every byte arrived, in ~24 chunks per answer


def test_client_started_before_the_server_connects_when_it_comes_up(nodes, servers) -> None:
    port = free_port()
    for cid, (i, n) in CLIENTS.items():
        nodes.add(f"127.0.0.1:{port}", RoundNoise(i, n), cid)
    time.sleep(0.5)  # they are retrying with backoff
    srv = FedServer(ServerConfig(port=port, rounds=1, min_clients=2, round_timeout=20, wait_timeout=20, eval_every=0),
                    make_strategy("fedavg"), W0)
    servers.append(srv)
    srv.start()
    srv.run()
    for got, want in zip(srv.weights, hand(W0, CLIENTS, 1)):
        np.testing.assert_array_equal(got, want)
    for t in nodes.threads:
        t.join(10)  # they exit by themselves on the server's Shutdown
    assert not any(t.is_alive() for t in nodes.threads) and not nodes.errors
    assert all(n.shutdown_reason == "training finished" for n in nodes.nodes)


@pytest.mark.parametrize("spec,ratio,tol", [("fp16", 0.55, 2e-3), ("int8", 0.3, 2e-2), ("topk:0.25", 0.6, None)])
def test_compressed_uplink(nodes, servers, spec: str, ratio: float, tol: float | None) -> None:
    w0 = [np.zeros((40, 25), np.float32), np.zeros(10, np.float32)]
    results = {}
    for compress in ("", spec):
        srv = FedServer(ServerConfig(rounds=1, min_clients=2, round_timeout=20, wait_timeout=20, compress=compress,
                                     eval_every=0), make_strategy("fedavg"), w0)
        servers.append(srv)
        port = srv.start()
        for cid, (i, n) in CLIENTS.items():
            nodes.add(f"127.0.0.1:{port}", RoundNoise(i, n), cid)
        h = srv.run()
        results[compress] = (srv.weights, h[0]["bytes_up"])
    (raw_w, raw_up), (w, up) = results[""], results[spec]
    assert up < ratio * raw_up, (up, raw_up)
    if tol is not None:
        for a, b in zip(w, raw_w):
            np.testing.assert_allclose(a, b, atol=tol * float(np.abs(b).max()))
    else:  # top-k sends a quarter of the entries: what arrived is exactly the largest ones
        assert 0.2 < np.count_nonzero(w[0]) / w[0].size <= 0.5


def test_refused_combinations_name_the_problem() -> None:
    w = [np.zeros(3, np.float32)]
    with pytest.raises(ConfigError, match="robust aggregation.*secure aggregation"):
        FedServer(ServerConfig(secagg=SecAggSettings(enabled=True)), make_strategy("median"), w)
    with pytest.raises(ConfigError, match="krum"):
        FedServer(ServerConfig(secagg=SecAggSettings(enabled=True)), make_strategy("krum"), w)
    with pytest.raises(ConfigError, match="scaffold"):
        FedServer(ServerConfig(dp=DPConfig(clip_norm=1.0, noise_multiplier=1.0)), make_strategy("scaffold", num_clients=2), w)
    with pytest.raises(ConfigError, match="compress"):
        ServerConfig(secagg=SecAggSettings(enabled=True), compress="int8")


# --------------------------------------------------------------------------- TorchClient
def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,), generator=g)


def _ref_local(w: list[np.ndarray], x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, mu: float,
               corr: list[np.ndarray] | None) -> list[np.ndarray]:
    """Full-batch SGD by hand: loss = CE + mu/2 ||w - w_global||^2, gradient + (c - c_i)."""
    ps = [torch.tensor(a, requires_grad=True) for a in w]
    g0 = [torch.tensor(a) for a in w]
    for _ in range(steps):
        out = x @ ps[0].T + ps[1]
        loss = torch.nn.functional.cross_entropy(out, y) + mu / 2 * sum(((p - g) ** 2).sum() for p, g in zip(ps, g0))
        grads = torch.autograd.grad(loss, ps)
        with torch.no_grad():
            for k, (p, gr) in enumerate(zip(ps, grads)):
                p -= lr * (gr + (torch.from_numpy(corr[k]) if corr is not None else 0))
    return [p.detach().numpy() for p in ps]


@pytest.mark.parametrize("strategy", ["fedprox", "scaffold"])
def test_torch_client_fedprox_and_scaffold_match_hand_reference(nodes, servers, strategy: str) -> None:
    lr, epochs, mu = 0.1, 3, 0.5
    torch.manual_seed(0)
    model0 = torch.nn.Linear(3, 2).double()
    w0 = [model0.weight.detach().numpy().copy(), model0.bias.detach().numpy().copy()]
    data = {"a": _data(1), "b": _data(2)}
    params = {"proximal_mu": mu} if strategy == "fedprox" else {"num_clients": 2}
    srv = FedServer(ServerConfig(rounds=2, min_clients=2, round_timeout=20, wait_timeout=20, eval_every=0,
                                 client_config={"lr": lr, "epochs": epochs}), make_strategy(strategy, **params), w0)
    servers.append(srv)
    port = srv.start()
    for cid, (x, y) in data.items():
        nodes.add(f"127.0.0.1:{port}", TorchClient(torch.nn.Linear(3, 2).double(), TensorBatches(x, y, batch_size=8)), cid)
    srv.run()

    # reference
    w = w0
    c = [np.zeros_like(a) for a in w0]
    c_i = {k: [np.zeros_like(a) for a in w0] for k in data}
    for _ in range(2):
        ys, dcs = [], []
        for cid in sorted(data):
            x, y = data[cid]
            if strategy == "fedprox":
                ys.append(_ref_local(w, x, y, epochs, lr, mu, None))
            else:
                yk = _ref_local(w, x, y, epochs, lr, 0.0, [a - b for a, b in zip(c, c_i[cid])])
                new_ci = [ci - cc + (xx - yy) / (epochs * lr) for ci, cc, xx, yy in zip(c_i[cid], c, w, yk)]
                dcs.append([a - b for a, b in zip(new_ci, c_i[cid])])
                c_i[cid] = new_ci
                ys.append(yk)
        if strategy == "fedprox":
            w = [(8 * a + 8 * b) / 16 for a, b in zip(*ys)]
        else:
            w = [xx + ((a - xx) + (b - xx)) / 2 for xx, a, b in zip(w, *ys)]
            c = [cc + (2 / 2) * (a + b) / 2 for cc, a, b in zip(c, *dcs)]
    for got, want in zip(srv.weights, w):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_small_models_ride_inside_the_task_larger_ones_are_fetched_in_1_mib_chunks(nodes, servers, monkeypatch) -> None:
    """README (Federated mode, Wire): "`Fetch` (a task's tensors in 1 MiB chunks; blobs under 64 KiB
    ride inside the task)". Two servers with ServerConfig's defaults, one client each, one round:
    a 56,000-byte model (float64, under 64 KiB) reaches the client with no Fetch call; a 2.5 MiB
    model costs one Fetch per task, whose reply is 3 messages each carrying at most 1 MiB of the
    model (2**20 + 2**20 + the rest; counted on the server's own Fetch stream). Both rounds end with
    the model a client computed by hand (``hand``), so the bytes arrived whole."""
    from federated import servicer as servicer_mod

    pieces: list[int] = []
    real_chunks = servicer_mod.blob_chunks

    def counting_chunks(blob, chunk_bytes):  # type: ignore[no-untyped-def]
        for msg in real_chunks(blob, chunk_bytes):
            pieces.append(len(msg))
            yield msg

    monkeypatch.setattr(servicer_mod, "blob_chunks", counting_chunks)
    for w0, fetches in (([np.linspace(-1, 1, 7000)], 0), ([np.linspace(-1, 1, 5 * 2**16)], 1)):
        pieces.clear()
        srv = FedServer(ServerConfig(rounds=1, min_clients=1, round_timeout=60, wait_timeout=60, eval_every=0),
                        make_strategy("fedavg"), w0)
        servers.append(srv)
        nodes.add(f"127.0.0.1:{srv.start()}", RoundNoise(1, 3), f"c{fetches}")
        srv.run()
        np.testing.assert_array_equal(srv.weights[0], hand(w0, {"c": (1, 3)}, 1)[0])
        assert srv.servicer.requests["Fetch"] == fetches, (w0[0].nbytes, srv.servicer.requests)
        if fetches:
            assert len(pieces) == 3 and all(n <= 2**20 + 4096 for n in pieces) and pieces[0] > 2**20 - 4096, pieces
        else:
            assert pieces == []
