"""The live federated server the integration tests drive: a FedServer on 127.0.0.1:0 and client
nodes in threads (shared by test_fed_security.py and test_fed_hardening.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from federated.client import ClientNode
from federated.config import NodeConfig, ServerConfig
from federated.runtime import Client, ClientRuntime
from federated.server import FedServer
from federated.strategy import Weights, make_strategy


class Harness:
    """A FedServer on 127.0.0.1:0 and client nodes in threads; everything stops at close()."""

    def __init__(self, weights: Weights, strategy: str = "fedavg", **cfg: Any) -> None:
        cfg.setdefault("rounds", 1)
        cfg.setdefault("round_timeout", 20)
        cfg.setdefault("wait_timeout", 20)
        cfg.setdefault("eval_every", 0)
        self.server = FedServer(ServerConfig(**cfg), make_strategy(strategy), weights)
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


@contextlib.contextmanager
def harnesses(weights: Weights) -> Iterator[Callable[..., Harness]]:
    """``make(strategy="fedavg", **ServerConfig fields) -> Harness``; every one made is closed at exit."""
    made: list[Harness] = []

    def make(strategy: str = "fedavg", **cfg: Any) -> Harness:
        h = Harness(weights, strategy, **cfg)
        made.append(h)
        return h

    try:
        yield make
    finally:
        for h in made:
            h.close()


def wait_until(pred: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()
