"""Regression tests for the PS defects that lost or corrupted updates on a healthy cluster (issue 9).

Each test fails on the code before the fix:
1. LRU eviction inside one pull returned another id's row (rows are made by pushes now: inside one push);
2. a stalled dense push froze its table (the lock was held from the first chunk to commit);
3. a BSP round applied by the lease thread could kill it, and a failed apply moved the clock on;
4. a retried push whose reply was lost was applied twice;
5. restarting worker 0 reset the surviving shards' trained dense slices to the initial values;
6. the membership view iterated the rounds dict while tables were being created.
"""
from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np
import pytest

from ps.client import PSClient
from ps.config import SPARSE, EvictionSpec, InitializerSpec, ShardConfig, TableSpec
from ps.consistency import SyncPolicy
from ps.errors import InternalError, ResourceExhaustedError
from ps.shard import PUSH_DENSE, Shard, StepPart
from ps.table import SparseTable
from tessera.codec import pack, unpack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(60)
SVC = "/tessera.v1.ParameterServer/"


# ---------------------------------------------------------------------- 1. LRU eviction within one pull
def _lru_table(max_rows: int = 4) -> SparseTable:
    spec = TableSpec(
        "emb", SPARSE, dim=3, initializer=InitializerSpec("uniform"), seed=7, eviction=EvictionSpec(max_rows=max_rows)
    )
    return SparseTable(spec, 0, 1)


def test_eviction_never_takes_a_row_the_same_push_writes() -> None:
    """Rows are made by pushes (pulls only read): a push of a new id into a full table evicts the
    least recently pushed row outside the push. Reference: SGD by hand from the pulled values."""
    t = _lru_table()
    g = np.ones((4, 3), np.float32)
    t.push(np.arange(4), g)
    # give row 0 trained values, so "id 0 came back with id 4's values" cannot hide behind the initializer
    t.push(np.array([0]), g[:1])
    trained0, _ = t.pull(np.array([0]))
    # make 0 the least recently used of the four, so plain LRU would pick it
    t.push(np.array([1, 2, 3]), g[:3])
    init4, _ = t.pull(np.array([4]))
    assert t.rows == 4 and t.evicted == 0  # the pull of 4 made nothing
    t.push(np.array([0, 4]), g[:2])
    vals, vers = t.pull(np.array([0, 4]))
    lr = t.spec.optimizer.hparams["lr"]
    np.testing.assert_allclose(vals[0], trained0[0] - lr, rtol=1e-6)  # id 0's own (trained) row, not id 4's
    np.testing.assert_allclose(vals[1], init4[0] - lr, rtol=1e-6)
    assert vers.tolist() == [3, 1]
    assert t.rows == 4 and t.evicted == 1
    ids = {i for i, _ in t.items()}
    assert 0 in ids and 4 in ids  # a row outside the request was evicted instead


def test_push_larger_than_the_row_cap_is_refused_and_changes_nothing(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    c = cluster.client()
    c.create_sparse("emb", 3, init="uniform", seed=7, eviction=EvictionSpec(max_rows=4))
    c.push_sparse("emb", np.arange(4), np.ones((4, 3), np.float32))
    before = c.pull_sparse("emb", np.arange(4))
    c.pull_sparse("emb", np.arange(10, 15))  # a pull reads: any number of rows, nothing made or evicted
    with pytest.raises(ResourceExhaustedError) as e:
        c.push_sparse("emb", np.arange(10, 15), np.ones((5, 3), np.float32))
    msg = str(e.value)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "'emb'" in msg and "more than 4 distinct rows" in msg and "max_rows" in msg
    t = cluster.shards[0].sparse("emb")
    assert t.rows == 4 and t.evicted == 0
    np.testing.assert_array_equal(c.pull_sparse("emb", np.arange(4)), before)


# ---------------------------------------------------------------------- 2. a stalled dense push
def _stalled_push(address: str, table: str, chunk: int, stop: threading.Event) -> tuple[threading.Thread, list]:
    """Open a PushDense stream, send its first chunk, then send nothing until ``stop`` is set."""
    channel = grpc.insecure_channel(address)
    call = channel.stream_stream(SVC + "PushDense")
    outcome: list = []

    def requests():
        head = pb.DenseChunk(table=table, offset=0, dtype="float32", client="stall", seq=1)
        yield pack(head, {15: np.ones(chunk, np.float32)})
        stop.wait(30)

    def run() -> None:
        try:
            outcome.append(list(call(requests(), timeout=30)))
        except grpc.RpcError as e:
            outcome.append(e.code())
        finally:
            channel.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, outcome


def test_stalled_dense_push_neither_blocks_pulls_nor_pushes_and_is_aborted(inproc_cluster) -> None:
    # the stalled stream is aborted after 8 s idle: the pull and push below are served while it is
    # still open (its thread still waits, no outcome), which a shard that blocked them until the
    # abort would not do; event order, not a time bound a loaded machine could break
    cluster = inproc_cluster(1, chunk_elems=8, push_idle_timeout_s=8.0)
    c = cluster.client(timeout=5.0)
    c.create_dense("w", 20, init="zeros", lr=1.0)  # 3 chunks
    stop = threading.Event()
    th, outcome = _stalled_push(cluster.addresses[0], "w", 8, stop)
    try:
        time.sleep(0.3)  # the stalled stream holds its first chunk
        np.testing.assert_array_equal(c.pull_dense("w"), np.zeros(20, np.float32))
        c.push_dense("w", np.ones(20, np.float32))  # another push commits past the stalled one
        np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(20, np.float32))
        assert th.is_alive() and not outcome, outcome
        th.join(30)
        assert outcome and outcome[0] == grpc.StatusCode.CANCELLED  # aborted by the shard, not committed
    finally:
        stop.set()
    stats = c.stats()[0]
    assert stats.pushes_aborted_idle == 1
    np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(20, np.float32))  # its chunk applied nothing
    assert cluster.shards[0].dense("w").version == 1


# ---------------------------------------------------------------------- 3. a BSP round that fails to apply
def test_failed_round_on_the_lease_thread_keeps_the_thread_alive_and_tells_the_contributors() -> None:
    shard = Shard(ShardConfig(lease_s=0.3))
    try:
        shard.create_table(TableSpec("w", "dense", shape=(4,)))
        table = shard.dense("w")
        r = shard.rounds["w"]
        boom: list[int] = []

        def failing_apply(values):  # a fault injected into the apply step (e.g. a backup gone)
            boom.append(len(values))
            raise RuntimeError("injected apply failure")

        real_apply, r._apply = r._apply, failing_apply
        shard.join("a", lease_s=60)
        shard.join("b", lease_s=0.3)  # b dies: the lease thread closes the round, and the apply fails there
        push = [StepPart("w", PUSH_DENSE, SyncPolicy(clock=0, sync=True), values=np.ones(4, np.float32))]
        assert shard.step(push, "a")[0].push.late is False
        deadline = time.monotonic() + 5
        while not boom and time.monotonic() < deadline:
            time.sleep(0.05)
        assert boom == [1]
        with pytest.raises(InternalError, match="injected apply failure"):
            shard.wait("w", SyncPolicy(clock=1, sync=True), timeout=5)  # the contributor hears of it
        assert r.clock == 0 and table.version == 0  # the clock did not move on without the values
        np.testing.assert_array_equal(table.values(), np.zeros(4, np.float32))
        assert shard.maintenance_errors == 0  # the failure was the round's, reported; the thread lived
        # the thread still expires leases ...
        shard.join("c", lease_s=0.3)
        deadline = time.monotonic() + 5
        while "c" in shard.membership.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "c" not in shard.membership.live()
        # ... and a retried push runs the round again once the fault is gone
        r._apply = real_apply
        shard.step(push, "a")
        assert shard.wait("w", SyncPolicy(clock=1, sync=True), timeout=5) == 1
        assert table.version == 1
    finally:
        shard.close()


def test_maintenance_thread_survives_an_exception() -> None:
    shard = Shard(ShardConfig(lease_s=0.3))
    try:
        calls = []

        def broken_listener() -> None:
            calls.append(1)
            raise RuntimeError("listener bug")

        shard.membership.on_change(broken_listener)
        shard.join("x", lease_s=0.2)
        deadline = time.monotonic() + 5
        while shard.maintenance_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls and shard.maintenance_errors == 1
        shard.join("y", lease_s=0.2)  # leases still expire afterwards
        deadline = time.monotonic() + 5
        while "y" in shard.membership.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "y" not in shard.membership.live()
    finally:
        shard.close()


# ---------------------------------------------------------------------- 4. retried pushes
def _raw_sparse_push(channel: grpc.Channel, table: str, seq: int, ids: np.ndarray, grads: np.ndarray) -> pb.PushSparseReply:
    head = pb.PushSparseRequest(table=table, dim=grads.shape[1], dtype="float32", client="w0", seq=seq)
    raw = channel.unary_unary(SVC + "PushSparse")(pack(head, {14: ids, 15: grads}), timeout=5)
    return unpack(pb.PushSparseReply, raw)[0]


def _raw_dense_push(channel: grpc.Channel, table: str, seq: int, grad: np.ndarray) -> pb.DenseChunk:
    head = pb.DenseChunk(table=table, offset=0, dtype="float32", client="w0", seq=seq, last=True)
    replies = list(channel.stream_stream(SVC + "PushDense")(iter([pack(head, {15: grad})]), timeout=5))
    return unpack(pb.DenseChunk, replies[-1])[0]


def test_a_retried_push_is_answered_with_the_original_result_and_not_applied_again(inproc_cluster) -> None:
    """Reference: SGD with lr 1 applied once per distinct (client, seq)."""
    cluster = inproc_cluster(1)
    c = cluster.client()
    c.create_dense("w", 6, init="zeros", lr=1.0)
    c.create_sparse("emb", 2, init="zeros", lr=1.0)
    c.pull_sparse("emb", np.array([1, 2]))
    ch = grpc.insecure_channel(cluster.addresses[0])
    try:
        g = np.arange(6, dtype=np.float32)
        first = _raw_dense_push(ch, "w", 10, g)
        again = _raw_dense_push(ch, "w", 10, g)  # the same request, retried after a lost reply
        assert not first.duplicate and again.duplicate and again.version == first.version == 1
        np.testing.assert_array_equal(c.pull_dense("w"), -g)
        _raw_dense_push(ch, "w", 11, g)  # a new request applies
        np.testing.assert_array_equal(c.pull_dense("w"), -2 * g)

        rows = np.ones((2, 2), np.float32)
        r1 = _raw_sparse_push(ch, "emb", 20, np.array([1, 2]), rows)
        r2 = _raw_sparse_push(ch, "emb", 20, np.array([1, 2]), rows)
        assert r1.applied == r2.applied == 2 and not r1.duplicate and r2.duplicate
        np.testing.assert_array_equal(c.pull_sparse("emb", np.array([1, 2])), -rows)
        # out of order within the window: 22 then 21 both apply, then both are duplicates
        _raw_sparse_push(ch, "emb", 22, np.array([1]), rows[:1])
        _raw_sparse_push(ch, "emb", 21, np.array([1]), rows[:1])
        assert _raw_sparse_push(ch, "emb", 21, np.array([1]), rows[:1]).duplicate
        np.testing.assert_array_equal(c.pull_sparse("emb", np.array([1])), -3 * rows[:1])
        assert c.stats()[0].duplicates == 3
    finally:
        ch.close()


class _DropFirstReply(grpc.UnaryUnaryClientInterceptor):
    """Fault: the shard applies the request, then the reply is lost (the client sees UNAVAILABLE)."""

    def __init__(self) -> None:
        self.dropped = 0

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        outcome = continuation(details, request)
        if details.method.endswith("PushSparse") and self.dropped == 0:
            outcome.result()  # the shard did apply it
            self.dropped += 1
            raise _Unavailable()
        return outcome


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "reply lost (injected)"


def test_psclient_retry_after_a_lost_reply_applies_once(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    fault = _DropFirstReply()
    c = PSClient(cluster.addresses, timeout=10, interceptors=[fault], worker="w0")
    try:
        c.create_sparse("emb", 2, init="zeros", lr=1.0)
        c.pull_sparse("emb", np.array([5]))
        c.push_sparse("emb", np.array([5]), np.ones((1, 2), np.float32))
        assert fault.dropped == 1 and c.duplicates == 1  # retried, and the shard recognised the retry
        np.testing.assert_array_equal(c.pull_sparse("emb", np.array([5])), -np.ones((1, 2), np.float32))
    finally:
        c.close()


# ---------------------------------------------------------------------- 5. worker 0 restarting
def test_recreating_a_dense_table_seeds_only_the_new_slices(inproc_cluster) -> None:
    cluster = inproc_cluster(2)
    c = cluster.client()
    init = np.full(10, 5.0, np.float32)
    assert c.create_dense("w", 10, init=init, lr=1.0)
    c.push_dense("w", np.ones(10, np.float32))
    trained = c.pull_dense("w")
    np.testing.assert_array_equal(trained, np.full(10, 4.0, np.float32))
    # shard 1 restarts empty (no checkpoint), then worker 0 restarts and creates its tables again
    cluster.servers[1].stop(0)
    cluster.shards[1].close()
    from ps.server import build_server

    port = int(cluster.addresses[1].rsplit(":", 1)[1])
    server, _, shard = build_server(ShardConfig(shard_index=1, num_shards=2, port=port))
    cluster.servers[1], cluster.shards[1] = server, shard
    c2 = cluster.client()
    assert c2.create_dense("w", 10, init=init, lr=1.0)  # created on shard 1 only
    got = c2.pull_dense("w")
    np.testing.assert_array_equal(got[:5], trained[:5])  # shard 0's trained slice kept
    np.testing.assert_array_equal(got[5:], init[5:])  # shard 1's new slice seeded
    assert not c2.create_dense("w", 10, init=init, lr=1.0)  # nothing new: nothing assigned
    np.testing.assert_array_equal(c2.pull_dense("w"), got)


# ---------------------------------------------------------------------- 6. membership view vs table creation
def test_membership_calls_race_table_creation_without_error() -> None:
    shard = Shard(ShardConfig())
    errors: list[BaseException] = []
    stop = threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def members() -> None:
        i = 0
        while not stop.is_set():
            try:
                shard.join(f"w{i % 3}")
                shard.heartbeat(f"w{i % 3}", clock=1)
                shard.stats()
                shard.membership.leave(f"w{i % 3}")  # runs the rounds re-check
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            i += 1

    threads = [threading.Thread(target=members) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for i in range(1000):
            shard.create_table(TableSpec(f"t{i}", "dense", shape=(1,)))
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        sys.setswitchinterval(old)
        shard.close()
    assert not errors, errors[0]
