"""Fuzzing a live federated server: random and mutated bytes on every RPC of tessera.v1.Federated.

A real FedServer (fedavg) is started in this process on 127.0.0.1:0 through ``make_fed_server``
(the place to hand tokens/TLS to: today it is fuzzed unauthenticated). Its round loop is not run;
instead one client node ("fuzz-a", a real Connect stream held open by this test) gets a FIT task
and an EVALUATE task issued through the server's registry, with the global weights as a blob to
Fetch, so the seeds (a Hello, Fetch requests and Submit answers for those tasks) are accepted
and mutations reach the decoding, ownership and update checks. The methods come from the
generated service descriptor: a new RPC is fuzzed from its empty request without editing this.

For every example:
1. the call ends with any status but UNKNOWN or INTERNAL;
2. if the server refused it (our own deadline and our cancel of an open Connect stream
   excepted), its state is unchanged: connected client ids, tasks in flight, Connect streams
   held, per task (done, ok, error, bytes fetched/submitted), the blobs, the global weights and
   history. One documented exception: a refused answer whose header names an open task and its
   client may close that task as failed (registry.submit: "a client that sends garbage gets no
   second try in this round"); that task must then be done and not ok, and nothing else may move;
3. a well-formed Fetch of the live FIT task's blob still answers OK;
and over the whole run this process's VmRSS grows by at most RSS_SLACK_MIB (200 MiB).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from federated.compress import encode_raw
from federated.config import ServerConfig
from federated.protocol import EVALUATE, FIT, Answer, Task
from federated.registry import Pending
from federated.server import FedServer
from federated.strategy import make_strategy
from federated.updates import accept_evaluation, accept_fit
from federated.wire import answer_chunks, make_blob
from fuzz_support import (
    FORBIDDEN_CODES,
    NOT_AN_ANSWER,
    call_raw,
    check_rss,
    fuzz_settings,
    methods,
    mutated_requests,
    random_requests,
    request_class,
    rss_baseline,
    wait_until,
)
from tessera.v1 import fed_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SERVICE = pb.DESCRIPTOR.services_by_name["Federated"]
METHODS = methods(SERVICE)
CALL_TIMEOUT = 1.0
EXAMPLES = 40  # per method and input kind; see fuzz_support.EXAMPLES
OPEN_ENDED = {"Connect": 1}  # streams that stay open by design: read this many replies, then cancel

W0 = [np.arange(12, dtype=np.float32).reshape(3, 4) / 10, np.ones(5, dtype=np.float32)]
CLIENT = "fuzz-a"
WORDS = (CLIENT, "fuzz-b", "weights", "float32", "raw", "int8", "topk", "fp16")


def make_fed_server(credentials: Any = None) -> FedServer:
    """The server under test. ``credentials``: reserved for tokens/TLS (ServerConfig.tokens,
    tls_cert/tls_key) once the fuzzer runs authenticated too; then ``fed_call_metadata`` returns
    the client's token. Today the fuzzed server is unauthenticated."""
    assert credentials is None, "fuzzing an authenticated server is not wired up yet"
    cfg = ServerConfig(rounds=1, min_clients=1, round_timeout=600, wait_timeout=600, eval_every=0, max_nodes=16,
                       shutdown_clients=False)
    server = FedServer(cfg, make_strategy("fedavg"), W0)
    server.start()
    return server


def fed_call_metadata(credentials: Any = None) -> list[tuple[str, str]]:
    return []


class FedEnv:
    def __init__(self) -> None:
        self.server = make_fed_server()
        self.registry = self.server.registry
        self.strategy = make_strategy("fedavg")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.metadata = fed_call_metadata()
        self.blob = make_blob(encode_raw(W0))
        self.blob_id = self.registry.put_blob(self.blob)
        self.pendings: list[Pending] = []
        self.fit: Pending | None = None
        self.eval: Pending | None = None
        self._node_stop: threading.Event | None = None
        self._node_call: Any = None
        self.ensure_live()

    def close(self) -> None:
        self._drop_node()
        self.channel.close()
        self.server.stop(grace=0.2, notify_clients=False)

    # ------------------------------------------------------------------ the client node and its tasks
    def _drop_node(self) -> None:
        if self._node_stop is not None:
            self._node_stop.set()
        if self._node_call is not None:
            self._node_call.cancel()

    def _connect_node(self) -> None:
        self._drop_node()
        stop = threading.Event()
        hello = pb.NodeMessage()
        hello.hello.node, hello.hello.version = "fuzz-node", "1"
        hello.hello.client_ids.append(CLIENT)

        def requests() -> Iterator[bytes]:
            yield hello.SerializeToString()
            stop.wait()

        call = self.channel.stream_stream(f"/{SERVICE.full_name}/Connect")(requests(), metadata=self.metadata or None)

        def drain() -> None:
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True, name="fuzz-node").start()
        self._node_stop, self._node_call = stop, call
        assert wait_until(lambda: CLIENT in self.registry.connected(), 10), "the fuzz node did not connect"

    def _issue(self, kind: str) -> Pending:
        task = Task(task_id=self.registry.new_task_id(), client_id=CLIENT, round=1, kind=kind, blob=self.blob_id,
                    blob_bytes=self.blob.nbytes, timeout_s=600.0)
        accept: Callable[[Answer], Any]
        if kind == FIT:
            accept = lambda a: accept_fit(a, 1, W0, self.strategy)  # noqa: E731
        else:
            accept = accept_evaluation
        p = self.registry.issue([(task, accept)])[0]
        self.pendings.append(p)
        return p

    def ensure_live(self) -> None:
        """The node is connected and holds an open FIT and an open EVALUATE task."""
        if CLIENT not in self.registry.connected():
            self._connect_node()
        if self.fit is None or self.fit.done:
            self.fit = self._issue(FIT)
        if self.eval is None or self.eval.done:
            self.eval = self._issue(EVALUATE)
        assert not self.fit.done and not self.eval.done, (self.fit.error, self.eval.error)
        self.pendings = self.pendings[-64:]

    # ------------------------------------------------------------------ seeds and state
    def seeds(self, name: str) -> list[list[bytes]]:
        assert self.fit is not None and self.eval is not None
        fit, ev = self.fit.task, self.eval.task
        if name == "Connect":
            m = pb.NodeMessage()
            m.hello.node, m.hello.version = "other", "1"
            m.hello.client_ids.extend(["fuzz-b", "fuzz-c"])
            hb = pb.NodeMessage()
            hb.heartbeat.SetInParent()
            return [[m.SerializeToString()], [m.SerializeToString(), hb.SerializeToString()]]
        if name == "Fetch":
            return [[pb.FetchRequest(blob=t.blob, client_id=CLIENT, task_id=t.task_id).SerializeToString()] for t in (fit, ev)]
        up = [w + np.float32(0.5) for w in W0]
        good_fit = Answer(fit.task_id, CLIENT, 1, FIT, num_examples=5, metrics={"acc": 0.5}, tensors=tuple(encode_raw(up)))
        delta = Answer(fit.task_id, CLIENT, 1, FIT, num_examples=5, is_delta=True,
                       tensors=tuple(encode_raw([np.full_like(w, 0.1) for w in W0])))
        good_eval = Answer(ev.task_id, CLIENT, 1, EVALUATE, num_examples=3, loss=0.25, metrics={"acc": 0.9})
        if name == "SubmitOne":
            return [list(answer_chunks(a, 1 << 20)) for a in (good_fit, delta, good_eval)]
        if name == "Submit":
            return [list(answer_chunks(good_fit, 16)), list(answer_chunks(delta, 1 << 20)), list(answer_chunks(good_eval))]
        return [[request_class(SERVICE.methods_by_name[name])().SerializeToString()]]

    def _task_state(self, p: Pending) -> tuple:
        return (p.task.task_id, p.done, p.ok, p.error, p.bytes_down, p.bytes_up)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "connected": self.registry.connected(),
            "in_flight": self.registry.in_flight(),
            "nodes": self.server.servicer.nodes,
            "closed": self.registry.closed,
            "tasks": {p.task.task_id: self._task_state(p) for p in self.pendings},
            "blob": self.registry.blob(self.blob_id) is self.blob,
            "weights": [w.tobytes() for w in self.server.weights],
            "history": len(self.server.history),
        }

    # ------------------------------------------------------------------ the properties
    def check(self, method: Any, requests: list[bytes]) -> None:
        self.ensure_live()
        nodes0 = self.server.servicer.nodes
        before = self.fingerprint()
        out = call_raw(self.channel, method, requests, CALL_TIMEOUT, max_replies=OPEN_ENDED.get(method.name),
                       metadata=self.metadata)
        assert out.code not in FORBIDDEN_CODES, (
            f"{method.name} answered {out.code.name} to bad input: {out.details!r}; requests={requests!r}"[:4000]
        )
        if out.code == grpc.StatusCode.OK and method.name in OPEN_ENDED:
            # accepted and cancelled by us: wait for the server to see the stream end
            assert wait_until(lambda: self.server.servicer.nodes <= nodes0, 10), "a cancelled Connect stream stays registered"
        if out.code != grpc.StatusCode.OK and out.code not in NOT_AN_ANSWER:
            after = self.fingerprint()
            owned = _answer_header(requests)
            for p in self.pendings:
                if owned is not None and owned == (p.task.task_id, p.client_id) and before["tasks"].get(p.task.task_id) != after["tasks"].get(p.task.task_id):
                    assert p.done and not p.ok, f"{method.name}: a refused answer left task {p.task.task_id} ok={p.ok}"
                    before["tasks"].pop(p.task.task_id)
                    after["tasks"].pop(p.task.task_id)
                    before["in_flight"] = after["in_flight"]  # closed, not yet collected: still counted
            assert after == before, (
                f"{method.name} was refused ({out.code.name}: {out.details!r}) but changed the server's state: "
                f"{ {k: (before[k], after[k]) for k in before if before[k] != after[k]} }; requests={requests!r}"[:4000]
            )
        self.ensure_live()
        assert self.fit is not None
        t = self.fit.task
        probe = call_raw(self.channel, SERVICE.methods_by_name["Fetch"],
                         [pb.FetchRequest(blob=t.blob, client_id=CLIENT, task_id=t.task_id).SerializeToString()], 10,
                         metadata=self.metadata)
        assert probe.code == grpc.StatusCode.OK and probe.replies >= 1, f"Fetch after {method.name}: {probe.code.name} {probe.details}"


def _answer_header(requests: Sequence[bytes]) -> tuple[str, str] | None:
    """(task id, client id) named by the header of a Submit/SubmitOne's first message, if it parses."""
    if not requests:
        return None
    m = pb.SubmitChunk()
    try:
        m.ParseFromString(requests[0])
    except Exception:  # noqa: BLE001 - not a SubmitChunk: names no task
        return None
    return (m.header.task_id, m.header.client_id) if m.HasField("header") else None


# ------------------------------------------------------------------------------------ tests
def _run(body: Callable[[FedEnv], None]) -> None:
    rss_baseline()
    env = FedEnv()
    try:
        body(env)
    finally:
        env.close()
    check_rss("federated fuzz")


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_fed_random_bytes(method: Any) -> None:
    def body(env: FedEnv) -> None:
        @fuzz_settings(EXAMPLES)
        @given(requests=random_requests(method.client_streaming))
        def fuzz(requests: list[bytes]) -> None:
            env.check(method, requests)

        fuzz()

    _run(body)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_fed_mutated_messages(method: Any) -> None:
    def body(env: FedEnv) -> None:
        cls = request_class(method)

        @fuzz_settings(EXAMPLES)
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            env.ensure_live()
            env.check(method, mutated_requests(data, cls, env.seeds(method.name), method.client_streaming, WORDS))

        fuzz()

    _run(body)


def test_fed_seeds_are_accepted() -> None:
    """Each seed is a valid request (so mutations start from something the server takes)."""
    env = FedEnv()
    try:
        for m in METHODS:
            for k in range(len(env.seeds(m.name))):
                env.ensure_live()
                seed = env.seeds(m.name)[k]
                out = call_raw(env.channel, m, seed, 5, max_replies=OPEN_ENDED.get(m.name), metadata=env.metadata)
                assert out.code == grpc.StatusCode.OK, f"seed {k} of {m.name}: {out.code.name} {out.details}"
                if m.name in OPEN_ENDED:
                    assert wait_until(lambda: env.server.servicer.nodes <= 1, 10)
    finally:
        env.close()
