"""Fuzzing a live PS shard: random and mutated bytes on every RPC of tessera.v1.ParameterServer.

One real shard (shard 0 of 2, so ids of shard 1 are misrouted input) is built in this process
with ps.server.build_server on 127.0.0.1:0 for each (method, input kind), through
``make_ps_server`` (the one place to hand credentials to once the PS requires them). It holds a
trained dense table (adam) and a sparse table (adagrad) and a joined worker. The methods come
from the generated service descriptor, so a new RPC is fuzzed without editing this file (its
seed is the empty request until one is added to ``_seeds``).

For every example:
1. the call ends with any status but UNKNOWN or INTERNAL;
2. if the server refused it (any status but OK; our own deadline and cancel excepted), the
   shard's state is byte-identical to before: ``shard.snapshot(pending=True)`` (tables' values,
   optimizer state, versions, row ids, BSP clocks and held contributions, dedup records) plus
   every worker the membership knows (name, clock, lease) and the shard's replication role;
3. a well-formed Stats call still answers OK;
and over the whole run this process's VmRSS grows by at most RSS_SLACK_MIB (200 MiB).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import (
    FORBIDDEN_CODES,
    NOT_AN_ANSWER,
    Outcome,
    call_raw,
    check_rss,
    fuzz_settings,
    methods,
    mutated_requests,
    random_requests,
    request_class,
    rss_baseline,
)
from ps.checkpoint import pack_plain, snapshot_to_plain
from ps.config import ShardConfig
from ps.partition import SlotMap
from ps.server import build_server
from ps.shard import Shard
from tessera.codec import pack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"]
METHODS = methods(SERVICE)
CALL_TIMEOUT = 0.5  # BSP/SSP waits end here (DEADLINE_EXCEEDED is a fine answer)
EXAMPLES = 30  # per method and input kind; see fuzz_support.EXAMPLES

DENSE, SPARSE, DIM = "weights", "emb", 4
WORDS = (DENSE, SPARSE, "w1", "w2", "float32", "float16", "c")


def make_ps_server(tmp_dir: str, credentials: Any = None) -> tuple[grpc.Server, int, Shard]:
    """The shard under test. ``credentials``: reserved for the authenticated PS (TLS, tokens, roles):
    build it here and return metadata from ``ps_call_metadata``; today the PS has none."""
    assert credentials is None, "the PS has no authentication yet"
    cfg = ShardConfig(
        shard_index=0, num_shards=2, chunk_elems=8, workers=16, max_bytes=64 << 20, max_ids_per_request=4096,
        max_tables=32, max_workers=64, lease_s=30.0, push_idle_timeout_s=5.0, checkpoint_dir=tmp_dir,
        checkpoint_keep=2,
    )
    return build_server(cfg)


def ps_call_metadata(credentials: Any = None) -> list[tuple[str, str]]:
    return []


def fingerprint(shard: Shard) -> bytes:
    plain = snapshot_to_plain(shard.snapshot(pending=True))
    plain.pop("created", None)
    # the live members change by themselves when a lease runs out (a fuzzed Join may ask for 1 ms):
    # compare every member the shard knows, live or not, by name, clock and lease instead
    plain.pop("workers", None)
    plain["members"] = sorted((w.name, w.clock, w.lease_s) for w in shard.membership.workers())
    plain["role"] = (shard.role, shard.epoch, shard.backup)
    return pack_plain(plain)


def owned_ids(n: int, start: int = 0, shard: int = 0) -> np.ndarray:
    ids = np.arange(start, start + 8 * n + 64, dtype=np.int64)
    return ids[SlotMap(4096, 2).shard_of(ids) == shard][:n]


def i64(a: Any) -> bytes:
    return np.ascontiguousarray(a, "<i8").tobytes()


def f32(a: Any) -> bytes:
    return np.ascontiguousarray(a, "<f4").tobytes()


class PSEnv:
    def __init__(self, tmp_dir: str) -> None:
        self.server, port, self.shard = make_ps_server(tmp_dir)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.metadata = ps_call_metadata()
        self._setup()
        self.seeds = _seeds(self)
        a, b = fingerprint(self.shard), fingerprint(self.shard)
        assert a == b, "the fingerprint is not deterministic"

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.shard.close()

    def ok(self, name: str, msgs: Sequence[bytes]) -> Outcome:
        out = call_raw(self.channel, SERVICE.methods_by_name[name], msgs, 10, metadata=self.metadata)
        assert out.code == grpc.StatusCode.OK, f"setup {name}: {out.code.name} {out.details}"
        return out

    def _setup(self) -> None:
        self.ok("CreateTable", [pb.CreateTableRequest(num_shards=2, spec=pb.TableSpec(
            name=DENSE, kind=pb.TABLE_KIND_DENSE, shape=[5, 7], dtype="float32", seed=3,
            optimizer=pb.OptimizerSpec(name="adam", hparams={"lr": 0.01}),
            initializer=pb.InitializerSpec(name="uniform"))).SerializeToString()])
        self.ok("CreateTable", [pb.CreateTableRequest(num_shards=2, spec=pb.TableSpec(
            name=SPARSE, kind=pb.TABLE_KIND_SPARSE, dim=DIM, dtype="float32", seed=5,
            optimizer=pb.OptimizerSpec(name="adagrad", hparams={"lr": 0.1}),
            initializer=pb.InitializerSpec(name="normal", params={"std": 0.1}))).SerializeToString()])
        t = self.shard.tables[DENSE]
        self.length, self.chunk = t.length, t.chunk_elems
        self.ids = owned_ids(12)
        rng = np.random.default_rng(7)
        self.ok("PushDense", self.dense_push(rng.standard_normal(self.length)))
        self.ok("PullSparse", [pack(pb.PullSparseRequest(table=SPARSE), {15: i64(self.ids)})])
        self.ok("PushSparse", [self.sparse_push(self.ids, rng.standard_normal((len(self.ids), DIM)))])
        self.ok("Join", [pb.JoinRequest(worker="w1", lease_ms=30_000).SerializeToString()])

    def dense_push(self, values: Any, **head: Any) -> list[bytes]:
        values = np.asarray(values, np.float32)
        out = []
        for off in range(0, self.length, self.chunk):
            last = off + self.chunk >= self.length
            h = dict(table=DENSE, **head) if off == 0 else {}
            out.append(pack(pb.DenseChunk(offset=off, dtype="float32", last=last, **h), {15: f32(values[off : off + self.chunk])}))
        return out

    def sparse_push(self, ids: Any, grads: Any, **head: Any) -> bytes:
        head.setdefault("worker", "w1")
        return pack(pb.PushSparseRequest(table=SPARSE, dtype="float32", dim=DIM, **head), {14: i64(ids), 15: f32(grads)})

    # ------------------------------------------------------------------ the properties
    def check(self, method: Any, requests: list[bytes]) -> None:
        before = fingerprint(self.shard)
        out = call_raw(self.channel, method, requests, CALL_TIMEOUT, metadata=self.metadata)
        assert out.code not in FORBIDDEN_CODES, (
            f"{method.name} answered {out.code.name} to bad input: {out.details!r}; requests={requests!r}"[:4000]
        )
        if out.code != grpc.StatusCode.OK and out.code not in NOT_AN_ANSWER:
            after = fingerprint(self.shard)
            assert after == before, (
                f"{method.name} was refused ({out.code.name}: {out.details!r}) but changed the shard's state; "
                f"requests={requests!r}"[:4000]
            )
        stats = call_raw(self.channel, SERVICE.methods_by_name["Stats"], [pb.StatsRequest().SerializeToString()], 10,
                         metadata=self.metadata)
        assert stats.code == grpc.StatusCode.OK, f"Stats after {method.name}: {stats.code.name} {stats.details}"


def _seeds(env: PSEnv) -> dict[str, list[list[bytes]]]:
    """Valid requests per method (a list of messages each; one message for unary requests)."""
    ids = env.ids
    g = np.ones((len(ids), DIM), np.float32)
    spec = pb.TableSpec(name="fresh", kind=pb.TABLE_KIND_DENSE, shape=[4, 3], dtype="float32",
                        optimizer=pb.OptimizerSpec(name="momentum", hparams={"lr": 0.1, "momentum": 0.9}))
    sspec = pb.TableSpec(name="fresh_sparse", kind=pb.TABLE_KIND_SPARSE, dim=3, dtype="float32", num_slots=4096,
                         optimizer=pb.OptimizerSpec(name="ftrl", hparams={"lr": 0.1}),
                         admission=pb.AdmissionSpec(min_count=2), eviction=pb.EvictionSpec(ttl_steps=5, max_rows=100))
    bsp = pb.SyncSpec(clock=0, sync=True)
    s = {
        "CreateTable": [pb.CreateTableRequest(spec=spec, num_shards=2), pb.CreateTableRequest(spec=sspec, num_shards=2),
                        pb.CreateTableRequest(spec=spec, num_shards=2, validate_only=True)],
        "DescribeTable": [pb.DescribeTableRequest(table=DENSE), pb.DescribeTableRequest(table=SPARSE)],
        "PullDense": [pb.PullDenseRequest(table=DENSE), pb.PullDenseRequest(table=DENSE, dtype="float16", worker="w1"),
                      pb.PullDenseRequest(table=DENSE, sync=pb.SyncSpec(clock=0, sync=True), worker="w1")],
        "Stats": [pb.StatsRequest()],
        "Join": [pb.JoinRequest(worker="w2", lease_ms=20_000)],
        "Heartbeat": [pb.HeartbeatRequest(worker="w1", clock=1), pb.HeartbeatRequest(worker="w1", leave=True)],
        "Checkpoint": [pb.CheckpointRequest(at_clock=-1), pb.CheckpointRequest(at_clock=0, hold=True)],
        "Role": [pb.RoleRequest(backup="127.0.0.1:1", attach_id=1)],
        "Attach": [pb.AttachRequest(backup="127.0.0.1:1")],
        "Replicate": [pb.ReplicateRequest(epoch=0, attach_id=1, entry=pack_plain({"op": "noop"}))],
    }
    seeds: dict[str, list[list[bytes]]] = {k: [[m.SerializeToString()] for m in v] for k, v in s.items()}
    seeds["PullSparse"] = [[pack(pb.PullSparseRequest(table=SPARSE, worker="w1"), {15: i64(ids)})],
                           [pack(pb.PullSparseRequest(table=SPARSE, dtype="float16", sync=bsp, worker="w1"), {15: i64(ids[:3])})]]
    seeds["PushSparse"] = [[env.sparse_push(ids, g)],
                           [env.sparse_push(ids[:4], g[:4], sync=bsp, client="c", seq=1)],
                           [pack(pb.PushSparseRequest(table=SPARSE, dtype="float16", dim=DIM),
                                 {13: i64(np.zeros(3)), 14: i64(ids[:3]), 15: np.ones((3, DIM), "<f2").tobytes()})]]
    seeds["PushDense"] = [env.dense_push(np.full(env.length, 0.5)),
                          env.dense_push(np.full(env.length, 0.5), op=pb.DENSE_OP_ASSIGN, return_params=True),
                          env.dense_push(np.full(env.length, 0.5), sync=bsp, worker="w1", client="c", seq=2, base_version=1)]
    for m in METHODS:  # an RPC added to the proto is fuzzed from its empty request
        seeds.setdefault(m.name, [[request_class(m)().SerializeToString()]])
    return seeds


# ------------------------------------------------------------------------------------ tests
def _run(tmp_path: Any, body: Callable[[PSEnv], None]) -> None:
    rss_baseline()
    env = PSEnv(str(tmp_path))
    try:
        body(env)
    finally:
        env.close()
    check_rss("PS fuzz")


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_ps_random_bytes(method: Any, tmp_path: Any) -> None:
    def body(env: PSEnv) -> None:
        @fuzz_settings(EXAMPLES)
        @given(requests=random_requests(method.client_streaming))
        def fuzz(requests: list[bytes]) -> None:
            env.check(method, requests)

        fuzz()

    _run(tmp_path, body)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_ps_mutated_messages(method: Any, tmp_path: Any) -> None:
    def body(env: PSEnv) -> None:
        cls = request_class(method)

        @fuzz_settings(EXAMPLES)
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            env.check(method, mutated_requests(data, cls, env.seeds[method.name], method.client_streaming, WORDS))

        fuzz()

    _run(tmp_path, body)


def test_every_ps_method_has_a_seed(tmp_path: Any) -> None:
    """The seeds name only real methods (a renamed RPC must not silently lose its seeds)."""
    env = PSEnv(str(tmp_path))
    try:
        assert set(env.seeds) == {m.name for m in METHODS}
    finally:
        env.close()
