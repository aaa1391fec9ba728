"""Federated hardening (issue 10) over real gRPC on 127.0.0.1: DP noise nobody can
predict, task ids nobody can guess and only their client can answer, per-identity
quotas, and secure aggregation that survives a wrong share and names its sender."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import grpc
import msgpack
import numpy as np
import pytest
from fed_harness import Harness, harnesses, wait_until

from federated.config import SecAggSettings, ServerConfig
from federated.errors import ConfigError
from federated.privacy import DPConfig
from federated.protocol import SECAGG, Answer, Task
from federated.runtime import Client, ClientRuntime
from federated.secagg import decode_fixed, encode_fixed
from federated.secure_round import secagg_config_for
from tessera.codec import pack
from tessera.service import token_metadata
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


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    with harnesses(W0) as make:
        yield make


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


# --------------------------------------------------------------------------- 2. task ids and ownership
class Recording(ClientRuntime):
    """Records the tasks it is sent (what a client legitimately learns), then runs them
    after ``sleep`` seconds (the task stays open meanwhile)."""

    def __init__(self, client: Client, sleep: float = 0.0) -> None:
        super().__init__(lambda _c: client)
        self.tasks: list[Task] = []
        self.sleep = sleep

    def handle(self, task: Task, tensors: Any, bytes_received: int = 0) -> Answer:
        self.tasks.append(task)
        time.sleep(self.sleep)
        return super().handle(task, tensors, bytes_received)


def _header(task_id: str, client_id: str, total: int) -> pb.UpdateHeader:
    h = pb.UpdateHeader(task_id=task_id, client_id=client_id, round=1, kind=pb.TASK_KIND_FIT, num_examples=1,
                        total=total)
    h.specs.add(group="weights", encoding="raw", shape=[total // 4], dtype="float32").parts.add(
        dtype="float32", shape=[total // 4])
    return h


def _submit(ch: grpc.Channel, task_id: str, client_id: str, total: int = 120, chunk: int = 120,
            token: str | None = None) -> grpc.RpcError | None:
    """A raw Submit of ``total`` zero bytes in ``chunk``-byte pieces; the error, or None if accepted."""
    def messages():
        for off in range(0, total, chunk):
            n = min(chunk, total - off)
            m = pb.SubmitChunk(offset=off, last=off + n >= total)
            if off == 0:
                m.header.CopyFrom(_header(task_id, client_id, total))
            yield pack(m, {15: bytes(n)})

    try:
        ch.stream_unary("/tessera.v1.Federated/Submit")(messages(), timeout=10, metadata=token_metadata(token))
    except grpc.RpcError as e:
        return e
    return None


def _fetch(ch: grpc.Channel, blob: str, task_id: str, client_id: str, token: str | None = None) -> grpc.RpcError | None:
    req = pb.FetchRequest(blob=blob, client_id=client_id, task_id=task_id).SerializeToString()
    try:
        list(ch.unary_stream("/tessera.v1.Federated/Fetch")(req, timeout=10, metadata=token_metadata(token)))
    except grpc.RpcError as e:
        return e
    return None


def _run_in_thread(h: Harness) -> threading.Thread:
    t = threading.Thread(target=h.server.run, daemon=True)
    t.start()
    return t


def test_guessed_task_and_blob_ids_hit_nothing(harness) -> None:
    # no tokens, and the weights travel by Fetch (inline_bytes=0): the task id is all that stands guard
    h = harness(min_clients=1, inline_bytes=0)
    victim = Recording(Shift(1.0, n=2), sleep=1.0)  # its task stays open while the attacker guesses
    h.node(victim, ["victim"])
    assert wait_until(lambda: h.server.registry.num_connected() == 1)
    rounds = _run_in_thread(h)
    assert wait_until(lambda: len(victim.tasks) == 1)
    ch = h.channel()
    codes = set()
    # the old scheme: one counter for blobs ("b<n>") and tasks ("t<n>"), a blob right before its tasks
    for k in range(1, 40):
        for task_id in (f"t{k}", f"t{k + 1}"):
            e = _fetch(ch, f"b{k}", task_id, "victim")
            assert e is not None, f"guessed blob b{k} of task {task_id} was served"
            codes.add(e.code())
        e = _submit(ch, f"t{k}", "victim")
        assert e is not None, f"an answer to guessed task t{k} was accepted"
        codes.add(e.code())
    assert codes == {grpc.StatusCode.NOT_FOUND}
    rounds.join(20)
    rec = h.server.history[0]
    assert rec["answered"] == 1 and rec["failed"] == {}  # the victim's own answer still counted
    task = victim.tasks[0]
    assert len(task.task_id) >= 32 and len(task.blob) >= 32  # 128 random bits each
    for got, w in zip(h.server.weights, W0):
        np.testing.assert_allclose(got, w + 1.0, rtol=1e-6)


def test_submit_for_a_task_not_ones_own_is_refused_before_its_data_is_read(harness) -> None:
    h = harness(min_clients=1)
    victim = Recording(Same(sleep=1.0))
    h.node(victim, ["victim"])
    assert wait_until(lambda: h.server.registry.num_connected() == 1)
    rounds = _run_in_thread(h)
    assert wait_until(lambda: len(victim.tasks) == 1)
    real = victim.tasks[0].task_id
    ch = h.channel()
    sv = h.server.servicer
    mib = 1 << 20
    for task_id, client_id, code, needle in [
        ("t" + "0" * 32, "victim", grpc.StatusCode.NOT_FOUND, "unknown"),  # made up
        (real, "mallory", grpc.StatusCode.PERMISSION_DENIED, "not issued to client 'mallory'"),  # someone else's
    ]:
        before = sv.bytes_in
        e = _submit(ch, task_id, client_id, total=8 * mib, chunk=mib)  # announces 8 MiB, in 8 chunks
        assert e is not None and e.code() == code and needle in e.details(), (e.code(), e.details())
        assert task_id in e.details()
        assert sv.bytes_in - before < 2 * mib  # the header's chunk at most: nothing buffered past it
        assert h.server.registry.in_flight() == 1  # the victim's task is still open, unchanged
    rounds.join(20)
    assert h.server.history[0]["answered"] == 1 and h.server.history[0]["failed"] == {}


def test_one_identity_cannot_answer_or_fetch_anothers_task(harness) -> None:
    tokens = {"alice": "tok-a-0123456789abcdef", "bob": "tok-b-0123456789abcdef"}
    h = harness(tokens=tokens, min_clients=2, inline_bytes=0, insecure=True)  # both: alice is the slow one
    alice = Recording(Shift(1.0, n=1), sleep=1.0)
    h.node(alice, [], token="tok-a-0123456789abcdef")
    bob = Recording(Same())
    h.node(bob, [], token="tok-b-0123456789abcdef")
    assert wait_until(lambda: h.server.registry.num_connected() == 2)
    rounds = _run_in_thread(h)
    assert wait_until(lambda: len(alice.tasks) == 1 and len(bob.tasks) == 1)
    t = alice.tasks[0]  # suppose bob learnt alice's task and blob ids
    ch = h.channel()
    for client_id in ("bob", "alice"):
        e = _submit(ch, t.task_id, client_id, token="tok-b-0123456789abcdef")
        assert e is not None and e.code() == grpc.StatusCode.PERMISSION_DENIED, client_id
        e = _fetch(ch, t.blob, t.task_id, client_id, token="tok-b-0123456789abcdef")
        assert e is not None and e.code() == grpc.StatusCode.PERMISSION_DENIED, client_id
    assert "not issued to client 'bob'" in e.details() or "'bob' may not" in e.details()
    rounds.join(20)
    rec = h.server.history[0]
    assert rec["answered"] == 2 and rec["failed"] == {}  # alice's own answer still counted


# --------------------------------------------------------------------------- 3. quotas
class Held:
    """A raw Connect stream kept open (a node that registered and then just sits there)."""

    def __init__(self, ch: grpc.Channel, ids: list[str], token: str) -> None:
        hello = pb.NodeMessage()
        hello.hello.client_ids.extend(ids)
        self._stop = threading.Event()

        def requests():
            yield hello.SerializeToString()
            self._stop.wait(60)

        self.call = ch.stream_stream("/tessera.v1.Federated/Connect")(requests(), metadata=token_metadata(token),
                                                                      timeout=60)
        self.welcome = next(self.call)  # raises the refusal

    def close(self) -> None:
        self._stop.set()
        self.call.cancel()


def _refused(ch: grpc.Channel, ids: list[str], token: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        Held(ch, ids, token)
    return e.value


def test_one_identity_cannot_crowd_out_the_others(harness) -> None:
    tokens = {"alice": "tok-a-0123456789abcdef", "bob": "tok-b-0123456789abcdef"}
    h = harness(tokens=tokens, min_clients=2, max_clients_per_identity=3, max_calls_per_identity=3,
                insecure=True)
    ch = h.channel()
    reg = h.server.registry
    held = [Held(ch, [f"alice/{i}"], "tok-a-0123456789abcdef") for i in range(3)]  # alice at both her limits
    e = _refused(ch, ["alice/9"], "tok-a-0123456789abcdef")  # a 4th open call
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    assert "identity 'alice' has 3 calls in flight already (the limit)" in e.details()  # the runtime's Access
    held.pop().close()
    assert wait_until(lambda: reg.num_connected() == 2)
    e = _refused(ch, ["alice/3", "alice/4"], "tok-a-0123456789abcdef")  # 2 + 2 client ids > 3
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    assert "identity 'alice'" in e.details() and "limit is 3" in e.details() and "client ids" in e.details()
    assert reg.num_connected() == 2  # the refused Hello registered nothing
    # a reconnect of ids alice holds already does not count twice
    held.append(Held(ch, ["alice/0", "alice/1"], "tok-a-0123456789abcdef"))
    for x in held:
        x.close()
    assert wait_until(lambda: reg.num_connected() == 0)
    # bob registers and takes part while alice holds her full quota of 3 client ids
    alice = h.node(ClientRuntime(lambda _c: Shift(1.0, 1)), ["alice/0", "alice/1", "alice/2"], token="tok-a-0123456789abcdef",
                   backoff_max=0.2)
    h.client(Shift(5.0, 1), None, token="tok-b-0123456789abcdef")
    history = h.server.run()
    # one identity, one vote: the round trains one of alice's 3 ids, and bob
    trained = set(history[0]["clients"])
    assert "bob" in trained and len(trained & {"alice/0", "alice/1", "alice/2"}) == 1 and len(trained) == 2
    assert history[0]["answered"] == 2
    assert alice.client_ids == ["alice/0", "alice/1", "alice/2"]
    for got, w in zip(h.server.weights, W0):
        np.testing.assert_allclose(got, w + 3.0, rtol=1e-6)  # (1 + 5) / 2, not (3 * 1 + 5) / 4


def test_num_examples_beyond_the_limit_is_refused(harness) -> None:
    h = harness(min_clients=2, min_available=3, max_num_examples=1000)
    h.client(Shift(1.0, 10), "a")
    h.client(Shift(3.0, 30), "b")
    greedy = h.client(Shift(100.0, 10**12), "greedy")  # would outweigh everyone
    rec = h.server.run()[0]
    assert rec["answered"] == 2 and rec["failed"]["greedy"].startswith("rejected:")
    assert "num_examples 1000000000000" in rec["failed"]["greedy"] and "1000" in rec["failed"]["greedy"]
    assert wait_until(lambda: greedy.stats.rejected == 1)
    assert greedy.stats.errors[0].startswith("INVALID_ARGUMENT") and "max_num_examples" in greedy.stats.errors[0]
    for got, w in zip(h.server.weights, W0):
        np.testing.assert_allclose(got, w + 2.5, rtol=1e-6)  # (10 * 1 + 30 * 3) / 40


# --------------------------------------------------------------------------- 4. a wrong secagg share
EXAMPLES = {"c1": 3, "c2": 5, "c3": 8, "c4": 13, "c5": 21}


class Noise(Client):
    def __init__(self, index: int, n: int) -> None:
        self.index, self.n = index, n

    def fit(self, weights, config):
        rng = np.random.default_rng([self.index, int(config["round"])])
        return [w + (0.1 * rng.normal(size=w.shape)).astype(w.dtype) for w in weights], self.n, {}

    def evaluate(self, weights, config):
        return 0.0, self.n, {}


class WrongShares(ClientRuntime):
    """Fault injection: every share this client reveals in the unmasking stage is wrong."""

    def handle(self, task: Task, tensors: Any, bytes_received: int = 0) -> Answer:
        from dataclasses import replace

        from federated.secure_round import bytes_tensor

        a = super().handle(task, tensors, bytes_received)
        if task.kind != SECAGG or task.secagg_stage != 3 or a.error:
            return a
        msg = msgpack.unpackb(a.tensors[0].parts[0].tobytes(), raw=False)
        for table in ("b_shares", "s_shares"):
            msg[table] = {v: (int.from_bytes(sh, "big") ^ 0x5A5A).to_bytes(66, "big") for v, sh in msg[table].items()}
        return replace(a, tensors=(bytes_tensor(msgpack.packb(msg, use_bin_type=True)),))


def _vector(cid: str) -> np.ndarray:
    """What client ``cid`` feeds into the secure sum (federated.secure_round, max_examples 32)."""
    n = EXAMPLES[cid]
    new = Noise(int(cid[1:]), n).fit([w.copy() for w in W0], {"round": 1})[0]
    w = min(n, 32) / 32
    return np.concatenate([(a.astype(np.float64) - g.astype(np.float64)).ravel() * w for a, g in zip(new, W0)]
                          + [np.array([w])])


def test_secagg_round_survives_a_wrong_share_and_names_its_sender(harness) -> None:
    # max_retries=0: a round that fails on the wrong share is not rescued by a retry
    h = harness(min_clients=5, max_retries=0, secagg=SecAggSettings(enabled=True, max_examples=32))
    for cid, n in EXAMPLES.items():
        # c1 sorts first: its shares are among the first `threshold` the server used to combine
        runtime = (WrongShares if cid == "c1" else ClientRuntime)(lambda _c, cid=cid, n=n: Noise(int(cid[1:]), n))
        h.node(runtime, [cid])
    rec = h.server.run()[0]
    assert rec["secagg"]["u3"] == 5 and rec["secagg"]["threshold"] == 3
    assert sorted(rec["secagg"]["bad_shares"]) == ["c1"]  # the misbehaving client is named
    assert len(rec["secagg"]["bad_shares"]["c1"]) == 5  # one wrong share of each survivor's seed
    assert rec["secagg"]["unresolved_shares"] == []
    cfg = secagg_config_for(5, 0.6, 8.0)
    got = h.server.orchestrator._secure.last_sum
    ring = sum(encode_fixed(_vector(c), cfg).astype(np.uint64) for c in EXAMPLES) % (1 << 32)
    np.testing.assert_array_equal(got, decode_fixed(ring.astype(np.uint32), cfg))  # exact in fixed point
    plain = sum(_vector(c) for c in EXAMPLES)
    np.testing.assert_allclose(got, plain, atol=5 * 2.0 ** -cfg.scale_bits)  # = the plain sum of the updates
    total = float(sum(EXAMPLES.values()))
    news = {c: Noise(int(c[1:]), EXAMPLES[c]).fit([w.copy() for w in W0], {"round": 1})[0] for c in EXAMPLES}
    for k, g in enumerate(h.server.weights):  # and the step is plain FedAvg
        want = sum(EXAMPLES[c] * news[c][k].astype(np.float64) for c in EXAMPLES) / total
        np.testing.assert_allclose(g, want, atol=1e-5)
