"""The live federated server the integration tests drive: a FedServer on 127.0.0.1:0 and client
nodes in threads (shared by test_fed_security.py, test_fed_hardening.py and test_fed_feedback.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from federated.client import ClientNode, check_outcome
from federated.config import NodeConfig, ServerConfig
from federated.runtime import Client, ClientRuntime
from federated.server import FedServer
from federated.strategy import Weights, make_strategy


class Harness:
    """A FedServer on 127.0.0.1:0 and client nodes in threads; everything stops at close().
    ``on_status``: the server's status lines, timestamped, land in ``status``; ``run_in_thread``
    runs the server's rounds (its exception, if any, in ``run_error``)."""

    def __init__(self, weights: Weights, strategy: str = "fedavg", **cfg: Any) -> None:
        cfg.setdefault("rounds", 1)
        cfg.setdefault("round_timeout", 20)
        cfg.setdefault("wait_timeout", 20)
        cfg.setdefault("eval_every", 0)
        self.status: list[tuple[float, str]] = []
        self.server = FedServer(ServerConfig(**cfg), make_strategy(strategy), weights,
                                on_status=lambda line: self.status.append((time.monotonic(), line)))
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[ClientNode] = []
        self.threads: list[threading.Thread] = []
        self.results: dict[int, BaseException | None] = {}
        self.channels: list[grpc.Channel] = []
        self.run_error: BaseException | None = None
        self.run_thread: threading.Thread | None = None

    def run_in_thread(self) -> None:
        def go() -> None:
            try:
                self.server.run()
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                self.run_error = e

        self.run_thread = threading.Thread(target=go, daemon=True)
        self.run_thread.start()

    def node(self, runtime: ClientRuntime, ids: list[str], check: bool = False, **kw: Any) -> ClientNode:
        """A client node in a thread; its outcome (None or the exception) lands in ``results``.
        ``check``: after ``run()``, raise what the run's outcome says (as ``start_client`` does)."""
        kw.setdefault("reconnect_timeout", 10)
        node = ClientNode(NodeConfig(address=self.address, **kw), runtime, ids)
        k = len(self.nodes)

        def run() -> None:
            try:
                node.run()
                if check:
                    check_outcome(node)
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

    def join(self, timeout: float = 30) -> None:
        """Wait for the server's run and every node to finish."""
        end = time.monotonic() + timeout
        for t in [self.run_thread, *self.threads]:
            if t is not None:
                t.join(max(0.1, end - time.monotonic()))
                assert not t.is_alive(), "a thread did not finish"

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
