"""House rule: bad input gets a clear error and loses nothing.

For every kind of bad request this file checks, against real shard servers in
this process:

1. the status: INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS or RESOURCE_EXHAUSTED
   (through PSClient: the matching ``ps.errors`` class, with the gRPC code in
   ``err.code``; ``err.code`` absent when the client rejected the call itself);
2. the message names the table (where the request names one) and the problem;
3. nothing changed: every table on every shard (values, optimizer state, row
   versions, table versions and counters) equals the snapshot taken just
   before the bad call, both as read from the shard objects and as pulled over
   the wire, together with the Stats RPC's per-table numbers;
4. the shard still serves: a normal dense push and sparse push apply afterwards
   (a leaked table lock would show up as a deadline error here).

Requests are made two ways: through ``PSClient`` (client-side checks and
error typing) and as hand-made bytes on a plain gRPC channel, so the servers'
own validation is exercised even where the client would have caught the
mistake first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import grpc
import numpy as np
import pytest
import torch

from ps.client import PSClient
from ps.config import DENSE, InitializerSpec, OptimizerSpec, TableSpec
from ps.errors import (
    InvalidArgumentError,
    PSError,
    ResourceExhaustedError,
    TableExistsError,
    TableNotFoundError,
)
from ps.partition import SlotMap
from ps.table import DenseTable, SparseTable
from ps.wire import spec_to_proto
from tessera.codec import pack, unpack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(60)

SVC = "/tessera.v1.ParameterServer/"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

# The two tables every environment holds, with values, optimizer state and row
# versions that are all non-trivial (so "unchanged" means something).
DENSE_NAME = "weights"
DENSE_SHAPE = (5, 7)  # 35 elements: 18 + 17 over two shards, 3 chunks of <= 8 each
DENSE_KW: dict[str, Any] = dict(optimizer="adam", init=InitializerSpec("uniform"), seed=3, lr=0.01)
SPARSE_NAME = "emb"
DIM = 4
SPARSE_KW: dict[str, Any] = dict(optimizer="adagrad", init=InitializerSpec("normal", {"std": 0.1}), seed=5, lr=0.1)
LIVE_IDS = np.arange(-10, 30, dtype=np.int64)  # rows that exist on the shards


# =============================================================================== helpers
def owned(ids: Iterable[int], shard: int, num_shards: int, num_slots: int = 4096) -> np.ndarray:
    """The ids among ``ids`` that shard ``shard`` of ``num_shards`` owns."""
    arr = np.asarray(list(ids), np.int64)
    return arr[SlotMap(num_slots, num_shards).shard_of(arr) == shard]


def owned_ids(count: int, shard: int, num_shards: int, start: int = 1_000_000) -> np.ndarray:
    """``count`` fresh ids (not live rows) owned by ``shard``."""
    out = owned(range(start, start + 8 * count + 64), shard, num_shards)
    assert len(out) >= count
    return out[:count]


def f32(x: Any) -> bytes:
    return np.ascontiguousarray(x, "<f4").tobytes()


def i64(x: Any) -> bytes:
    return np.ascontiguousarray(x, "<i8").tobytes()


def sparse_push_req(
    table: str, ids: Any, grads: Any = None, *, dim: int = DIM, dtype: str = "float32",
    ids_bytes: bytes | None = None, data: bytes | None = None, base: bytes | None = None,
) -> bytes:
    """A PushSparseRequest as the wire carries it (payloads 13/14/15 beside the header)."""
    if data is None:
        g = np.zeros((len(ids), dim)) if grads is None else grads
        data = np.ascontiguousarray(g, {"float32": "<f4", "float16": "<f2"}.get(dtype, "<f4")).tobytes()
    payloads: dict[int, Any] = {14: ids_bytes if ids_bytes is not None else i64(ids), 15: data}
    if base is not None:
        payloads[13] = base
    return pack(pb.PushSparseRequest(table=table, dtype=dtype, dim=dim, worker="bad-input-test"), payloads)


def sparse_pull_req(table: str, ids: Any, *, dtype: str = "", ids_bytes: bytes | None = None) -> bytes:
    return pack(pb.PullSparseRequest(table=table, dtype=dtype), {15: ids_bytes if ids_bytes is not None else i64(ids)})


def dense_chunk(
    offset: int, values: Any = None, *, table: str = "", dtype: str = "float32", data: bytes | None = None, **fields: Any
) -> bytes:
    """One DenseChunk of a push; give ``table`` (and op, ...) on the first chunk only."""
    if data is None:
        data = f32(values)
    return pack(pb.DenseChunk(table=table, offset=offset, dtype=dtype, **fields), {15: data})


class Raw:
    """A plain gRPC channel to one shard: hand-made bytes in, bytes (or grpc.RpcError) out."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)

    def unary(self, method: str, raw: bytes) -> bytes:
        return self.channel.unary_unary(SVC + method)(raw, timeout=10)

    def push_dense(self, chunks: Sequence[bytes]) -> list[bytes]:
        return list(self.channel.stream_stream(SVC + "PushDense")(iter(chunks), timeout=10))

    def pull_dense(self, raw: bytes) -> list[bytes]:
        return list(self.channel.unary_stream(SVC + "PullDense")(raw, timeout=10))

    def stats(self) -> pb.StatsReply:
        return unpack(pb.StatsReply, self.unary("Stats", pb.StatsRequest().SerializeToString()))[0]

    def call(self, method: str, raw: bytes) -> Any:
        """Any method by name, unary or streaming (a stream gets ``raw`` as its only message)."""
        if method == "PushDense":
            return self.push_dense([raw])
        if method == "PullDense":
            return self.pull_dense(raw)
        return self.unary(method, raw)


def _check_message(msg: str, table: str | None, problem: Sequence[Any]) -> None:
    """``msg`` names ``table`` (quoted, as the PS writes names) and each problem (str or tuple of alternatives)."""
    if table is not None:
        assert f"'{table}'" in msg, f"message does not name table {table!r}: {msg!r}"
    low = msg.lower()
    for p in problem:
        alts = (p,) if isinstance(p, str) else tuple(p)
        assert any(a.lower() in low for a in alts), f"message does not mention {alts}: {msg!r}"


def rpc_error(call: Callable[[], Any], code: grpc.StatusCode, table: str | None, *problem: Any) -> grpc.RpcError:
    """Run a raw call that must fail with ``code`` and a message naming ``table`` and ``problem``."""
    with pytest.raises(grpc.RpcError) as ei:
        call()
    e = ei.value
    assert e.code() == code, f"expected {code.name}, got {e.code().name}: {e.details()!r}"
    _check_message(e.details() or "", table, problem)
    return e


def ps_error(call: Callable[[], Any], cls: type[PSError], code: Any, table: str | None, *problem: Any) -> PSError:
    """Run a PSClient call that must raise ``cls`` with ``err.code`` == ``code`` (or one of a tuple of codes).

    ``code`` None: rejected by the client itself, before any RPC (no ``err.code``).
    """
    with pytest.raises(Exception) as ei:
        call()
    e = ei.value
    assert isinstance(e, cls), f"expected {cls.__name__}, got {type(e).__name__}: {e}"
    got = getattr(e, "code", None)
    codes = code if isinstance(code, tuple) else (code,)
    assert got in codes, f"expected grpc code {' or '.join(map(str, codes))}, got {got}: {e}"
    _check_message(str(e), table, problem)
    return e


# ------------------------------------------------------------------- state snapshots
def _table_state(t: DenseTable | SparseTable) -> dict[str, Any]:
    """Everything a table holds that a request may change, as exactly comparable bytes."""
    if isinstance(t, DenseTable):
        version, blocks = t.snapshot()
        state = [
            {k: v.numpy().tobytes() for k, v in sorted(b.state.items())} for b in getattr(t, "_blocks", [])
        ]
        return {
            "kind": "dense",
            "version": version,
            "values": torch.cat(blocks).numpy().tobytes() if blocks else b"",
            "optimizer state": state,
            "staleness": (t.staleness.count, t.staleness.total, t.staleness.max),
        }
    pairs = sorted(t.items())
    rows = torch.from_numpy(np.asarray([r for _, r in pairs], np.int64))
    return {
        "kind": "sparse",
        "row ids": [i for i, _ in pairs],
        "values": t.values[rows].numpy().tobytes(),
        "row versions": t.versions[rows.numpy()].tobytes(),
        "optimizer state": {k: v[rows].numpy().tobytes() for k, v in sorted(t.state.items())},
        "step": t.step,
        "updates": t.updates,
        "dropped": t.dropped,
        "evicted": t.evicted,
        "staleness": (t.staleness.count, t.staleness.total, t.staleness.max),
    }


@dataclass
class Snapshot:
    shards: list[dict[str, dict[str, Any]]]  # per shard: table -> state (read from the Shard objects)
    dense_pulled: bytes  # the dense table pulled over the wire
    sparse_pulled: tuple[bytes, bytes]  # the live rows and their versions pulled over the wire
    stats: list[list[tuple]]  # per shard: Stats RPC per-table numbers


@dataclass
class Env:
    """A cluster holding DENSE_NAME and SPARSE_NAME with trained values, a client and raw channels."""

    cluster: Any
    client: PSClient
    raw: list[Raw]
    num_shards: int
    extra_clients: list[PSClient] = field(default_factory=list)

    @property
    def shards(self) -> list:
        return self.cluster.shards

    @property
    def addresses(self) -> list[str]:
        return self.cluster.addresses

    def new_client(self, addresses: Sequence[str] | None = None, **kw: Any) -> PSClient:
        c = PSClient(list(addresses or self.addresses), timeout=10, retries=0, **kw)
        self.extra_clients.append(c)
        return c

    def slice(self, shard: int, table: str = DENSE_NAME) -> tuple[int, int]:
        """(length, chunk_elems) of ``shard``'s part of dense ``table``."""
        t = self.shards[shard].tables[table]
        return t.length, t.chunk_elems

    def full_push(self, shard: int, fill: float = 0.5, table: str = DENSE_NAME, **head: Any) -> list[bytes]:
        """The chunks of a complete, valid raw dense push to ``shard``."""
        length, chunk = self.slice(shard, table)
        out = []
        for off in range(0, length, chunk):
            n = min(chunk, length - off)
            h = dict(table=table, **head) if off == 0 else {}
            out.append(dense_chunk(off, np.full(n, fill), **h))
        return out

    def requests_sent(self) -> list[dict[str, int]]:
        """Per shard: RPCs received so far by method (read without an RPC)."""
        return [dict(s.requests) for s in self.shards]

    # ---------------------------------------------------------------- snapshot / compare
    def snapshot(self) -> Snapshot:
        shards = [{name: _table_state(t) for name, t in sorted(s.tables.items())} for s in self.shards]
        dense = self.client.pull_dense(DENSE_NAME).tobytes()
        rows, versions = self.client.pull_sparse(SPARSE_NAME, LIVE_IDS, return_versions=True)
        stats = [
            sorted(
                (t.name, t.kind, t.rows, t.elements, t.param_bytes, t.state_bytes, t.version, t.offset, t.length,
                 t.evicted, t.dropped)
                for t in st.tables
            )
            for st in self.client.stats()
        ]
        return Snapshot(shards, dense, (rows.tobytes(), versions.tobytes()), stats)

    def assert_unchanged(self, before: Snapshot, ignore_tables: Sequence[str] = ()) -> None:
        after = self.snapshot()
        for i, (b, a) in enumerate(zip(before.shards, after.shards)):
            bt = {k: v for k, v in b.items() if k not in ignore_tables}
            at = {k: v for k, v in a.items() if k not in ignore_tables}
            assert sorted(at) == sorted(bt), f"shard {i}: tables {sorted(bt)} became {sorted(at)}"
            for name in bt:
                for key in bt[name]:
                    assert at[name][key] == bt[name][key], f"shard {i} table {name!r}: {key} changed"
        assert after.dense_pulled == before.dense_pulled, f"pulled values of {DENSE_NAME!r} changed"
        assert after.sparse_pulled[0] == before.sparse_pulled[0], f"pulled rows of {SPARSE_NAME!r} changed"
        assert after.sparse_pulled[1] == before.sparse_pulled[1], f"pulled row versions of {SPARSE_NAME!r} changed"
        for i, (bs, as_) in enumerate(zip(before.stats, after.stats)):
            bs = [t for t in bs if t[0] not in ignore_tables]
            as_ = [t for t in as_ if t[0] not in ignore_tables]
            assert as_ == bs, f"shard {i}: Stats per-table numbers changed: {bs} -> {as_}"

    def assert_serves(self) -> None:
        """A normal dense push and sparse push still apply on every shard."""
        v0 = [s.tables[DENSE_NAME].version for s in self.shards]
        res = self.client.push_dense(DENSE_NAME, np.full(DENSE_SHAPE, 0.25, np.float32))
        assert list(res.versions) == [v + 1 for v in v0], f"dense push after bad input: versions {v0} -> {res.versions}"
        ids = LIVE_IDS[:8]
        _, vers = self.client.pull_sparse(SPARSE_NAME, ids, return_versions=True)
        r = self.client.push_sparse(SPARSE_NAME, ids, np.ones((len(ids), DIM), np.float32))
        assert r.applied == len(ids) and r.dropped == 0
        _, vers2 = self.client.pull_sparse(SPARSE_NAME, ids, return_versions=True)
        np.testing.assert_array_equal(vers2, vers + 1)
        for raw in self.raw:
            assert raw.stats().num_shards == self.num_shards


@pytest.fixture
def make_env(inproc_cluster: Callable[..., Any]) -> Any:
    """make_env(num_shards=2, **ShardConfig fields) -> Env with both tables created and trained."""
    made: list[Env] = []

    def make(num_shards: int = 2, **config: Any) -> Env:
        config.setdefault("chunk_elems", 8)
        config.setdefault("workers", 4)
        cluster = inproc_cluster(num_shards, **config)
        client = cluster.client(timeout=10.0, retries=0)
        env = Env(cluster, client, [Raw(a) for a in cluster.addresses], num_shards)
        made.append(env)
        assert client.create_dense(DENSE_NAME, DENSE_SHAPE, **DENSE_KW)
        assert client.create_sparse(SPARSE_NAME, DIM, **SPARSE_KW)
        rng = np.random.default_rng(7)
        for _ in range(2):
            client.push_dense(DENSE_NAME, rng.standard_normal(DENSE_SHAPE).astype(np.float32))
        client.pull_sparse(SPARSE_NAME, LIVE_IDS)
        client.push_sparse(SPARSE_NAME, LIVE_IDS, rng.standard_normal((len(LIVE_IDS), DIM)).astype(np.float32))
        client.push_sparse(SPARSE_NAME, LIVE_IDS[::3], rng.standard_normal((len(LIVE_IDS[::3]), DIM)).astype(np.float32))
        for s in range(num_shards):
            assert len(owned(LIVE_IDS, s, num_shards)) >= 3, "every shard must own some live rows"
        return env

    yield make
    for env in made:
        for c in env.extra_clients:
            c.close()
        for r in env.raw:
            r.channel.close()


@pytest.fixture
def env(make_env: Any) -> Env:
    """Two shards, default limits."""
    return make_env(2)


# =============================================================================== unknown tables
class TestUnknownTable:
    """Calls naming a table no shard has -> NOT_FOUND naming it. Reference: the snapshot before the call."""

    @pytest.mark.parametrize(
        "op",
        [
            lambda c: c.pull_dense("nope"),
            lambda c: c.push_dense("nope", np.zeros(3, np.float32)),
            lambda c: c.pull_sparse("nope", [1, 2]),
            lambda c: c.push_sparse("nope", [1, 2], np.zeros((2, DIM), np.float32)),
        ],
        ids=["pull_dense", "push_dense", "pull_sparse", "push_sparse"],
    )
    def test_client_call_on_unknown_table_is_not_found(self, env: Env, op: Callable) -> None:
        before = env.snapshot()
        ps_error(lambda: op(env.client), TableNotFoundError, NOT_FOUND, "nope", "not found")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "method,raw",
        [
            ("PullDense", pb.PullDenseRequest(table="nope").SerializeToString()),
            ("PushDense", dense_chunk(0, np.zeros(8), table="nope")),
            ("PullSparse", sparse_pull_req("nope", [1, 2])),
            ("PushSparse", sparse_push_req("nope", [1, 2])),
            ("DescribeTable", pb.DescribeTableRequest(table="nope").SerializeToString()),
        ],
        ids=["PullDense", "PushDense", "PullSparse", "PushSparse", "DescribeTable"],
    )
    @pytest.mark.parametrize("shard", [0, 1])
    def test_raw_call_on_unknown_table_is_not_found(self, env: Env, method: str, raw: bytes, shard: int) -> None:
        before = env.snapshot()
        rpc_error(lambda: env.raw[shard].call(method, raw), NOT_FOUND, "nope", "not found")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_sparse_call_on_dense_table_is_invalid(self, env: Env) -> None:
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PullSparse", sparse_pull_req(DENSE_NAME, [1])), INVALID, DENSE_NAME, "dense")
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(DENSE_NAME, [1])), INVALID, DENSE_NAME, "dense")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_dense_call_on_sparse_table_is_invalid(self, env: Env) -> None:
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].push_dense([dense_chunk(0, np.zeros(8), table=SPARSE_NAME)]), INVALID, SPARSE_NAME, "sparse")
        rpc_error(
            lambda: env.raw[1].pull_dense(pb.PullDenseRequest(table=SPARSE_NAME).SerializeToString()),
            INVALID, SPARSE_NAME, "sparse",
        )
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_sparse_call_on_dense_table_is_invalid(self, env: Env) -> None:
        before = env.snapshot()
        ps_error(lambda: env.client.pull_sparse(DENSE_NAME, [1]), InvalidArgumentError, None, DENSE_NAME, "dense")
        ps_error(lambda: env.client.push_dense(SPARSE_NAME, np.zeros(4)), InvalidArgumentError, None, SPARSE_NAME, "sparse")
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== create table
class TestCreateTable:
    """Re-creating a table is idempotent for the identical spec and ALREADY_EXISTS otherwise; a spec the
    shard cannot hold or accept is refused and leaves no table behind. Reference: snapshot before the call."""

    def test_identical_spec_is_a_noop(self, env: Env) -> None:
        before = env.snapshot()
        assert env.client.create_dense(DENSE_NAME, DENSE_SHAPE, **DENSE_KW) is False
        assert env.client.create_sparse(SPARSE_NAME, DIM, **SPARSE_KW) is False
        spec = env.shards[0].tables[DENSE_NAME].spec
        for raw in env.raw:
            reply, _ = unpack(
                pb.CreateTableReply,
                raw.unary("CreateTable", pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=2).SerializeToString()),
            )
            assert reply.created is False
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "change,fields",
        [
            (dict(lr=0.02), ("optimizer", "lr")),
            (dict(optimizer="sgd"), ("optimizer", "sgd")),
            (dict(shape=(5, 8)), ("shape",)),
            (dict(seed=4), ("seed",)),
            (dict(allow_nonfinite=True), ("allow_nonfinite",)),
        ],
        ids=["lr", "optimizer", "shape", "seed", "allow_nonfinite"],
    )
    def test_different_dense_spec_already_exists(self, env: Env, change: dict, fields: tuple) -> None:
        kw = {**DENSE_KW, **change}
        shape = kw.pop("shape", DENSE_SHAPE)
        if "optimizer" in change:
            kw.pop("lr")
        before = env.snapshot()
        ps_error(lambda: env.client.create_dense(DENSE_NAME, shape, **kw), TableExistsError, ALREADY_EXISTS, DENSE_NAME, *fields)
        env.assert_unchanged(before)
        env.assert_serves()

    def test_different_sparse_spec_already_exists(self, env: Env) -> None:
        before = env.snapshot()
        ps_error(lambda: env.client.create_sparse(SPARSE_NAME, DIM + 1, **SPARSE_KW), TableExistsError, ALREADY_EXISTS, SPARSE_NAME, "dim")
        ps_error(lambda: env.client.create_dense(SPARSE_NAME, 8), TableExistsError, ALREADY_EXISTS, SPARSE_NAME, "kind")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_different_spec_already_exists(self, env: Env) -> None:
        spec = TableSpec(DENSE_NAME, DENSE, shape=(35,), optimizer=OptimizerSpec("adam", {"lr": 0.01}),
                         initializer=InitializerSpec("uniform"), seed=3)
        req = pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=2).SerializeToString()
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].unary("CreateTable", req), ALREADY_EXISTS, DENSE_NAME, "shape")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_create_with_wrong_num_shards_is_invalid(self, env: Env) -> None:
        spec = TableSpec("fresh", DENSE, shape=(10,))
        req = pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=3).SerializeToString()
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("CreateTable", req), INVALID, "fresh", "3 shards")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "bad,problem",
        [
            (dict(kind=pb.TABLE_KIND_UNSPECIFIED), "kind"),
            (dict(shape=[4, -1]), "shape"),
            (dict(dtype="float64"), "dtype"),
            (dict(optimizer=pb.OptimizerSpec(name="foo")), "optimizer 'foo'"),
            (dict(optimizer=pb.OptimizerSpec(name="sgd", hparams={"lr": -1.0})), "lr"),
            (dict(optimizer=pb.OptimizerSpec(name="sgd", hparams={"gamma": 1.0})), "gamma"),
            (dict(initializer=pb.InitializerSpec(name="uniform", params={"low": 1.0, "high": 0.0})), "low"),
        ],
        ids=["kind", "negative_shape", "dtype", "unknown_optimizer", "negative_lr", "unknown_hparam", "uniform_low_high"],
    )
    def test_raw_create_with_invalid_spec_names_table(self, env: Env, bad: dict, problem: str) -> None:
        msg = pb.TableSpec(name="fresh", kind=pb.TABLE_KIND_DENSE, shape=[4, 4])
        for k, v in bad.items():
            if isinstance(v, list):
                del getattr(msg, k)[:]
                getattr(msg, k).extend(v)
            elif hasattr(v, "CopyFrom"):
                getattr(msg, k).CopyFrom(v)
            else:
                setattr(msg, k, v)
        req = pb.CreateTableRequest(spec=msg, num_shards=2).SerializeToString()
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("CreateTable", req), INVALID, "fresh", problem)
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_create_with_unknown_optimizer_names_table(self, env: Env) -> None:
        before = env.snapshot()
        ps_error(lambda: env.client.create_dense("fresh", 4, optimizer="foo"), InvalidArgumentError, None, "fresh", "optimizer 'foo'")
        env.assert_unchanged(before)

    def test_sparse_table_with_fewer_slots_than_shards_is_invalid(self, env: Env) -> None:
        before = env.snapshot()
        ps_error(
            lambda: env.client.create_sparse("fresh", 4, num_slots=1), InvalidArgumentError, INVALID, "fresh", "num_slots"
        )
        env.assert_unchanged(before)
        env.assert_serves()

    def test_dense_table_over_memory_budget_is_exhausted_and_absent(self, make_env: Any) -> None:
        env = make_env(2, max_bytes=100 << 10)
        before = env.snapshot()
        ps_error(lambda: env.client.create_dense("huge", 100_000), ResourceExhaustedError, EXHAUSTED, "huge", "bytes")
        env.assert_unchanged(before)
        ps_error(lambda: env.client.pull_dense("huge"), TableNotFoundError, NOT_FOUND, "huge")
        for raw in env.raw:
            rpc_error(lambda: raw.unary("DescribeTable", pb.DescribeTableRequest(table="huge").SerializeToString()),
                      NOT_FOUND, "huge")
        env.assert_serves()

    def test_dense_table_over_budget_on_one_shard_is_created_nowhere(self, make_env: Any) -> None:
        limit = 200 << 10
        env = make_env(2, max_bytes=limit)
        # make shard 0 hold 32 KiB more than shard 1: one row of a sparse table that lives on shard 0
        env.client.create_sparse("lopsided", 8)
        ids = owned_ids(1, 0, 2)
        env.client.push_sparse("lopsided", ids, np.zeros((len(ids), 8), np.float32))  # pushes make rows (pulls read)
        held = [s.held_bytes() for s in env.shards]
        assert held[0] > held[1] + (16 << 10)
        per_shard = (2 * limit - held[0] - held[1]) // 2 // 4  # fits on shard 1, not on shard 0
        before = env.snapshot()
        ps_error(lambda: env.client.create_dense("mid", 2 * per_shard), ResourceExhaustedError, EXHAUSTED, "mid", "bytes")
        for i, s in enumerate(env.shards):
            assert "mid" not in s.tables, f"shard {i} kept table 'mid' although the create was refused"
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== dense pushes
class TestDensePush:
    """Dense pushes whose size, offsets, chunking or dtype are wrong -> INVALID_ARGUMENT naming the table,
    and the slice is exactly as before (staged chunks are dropped). Reference: snapshot before the push."""

    def test_client_wrong_number_of_elements_rejected_before_sending(self, env: Env) -> None:
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_dense(DENSE_NAME, np.zeros((5, 6), np.float32)), InvalidArgumentError, None,
                 DENSE_NAME, "30", "35")
        ps_error(lambda: env.client.assign_dense(DENSE_NAME, np.zeros(36, np.float32)), InvalidArgumentError, None,
                 DENSE_NAME, "36")
        assert env.requests_sent() == sent, "a rejected push still reached a shard"
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "grad, problem",
        [
            (np.zeros((7, 5), np.float32), ("(7, 5)", "(5, 7)", "flat=True")),  # same numel, transposed
            (np.zeros(35, np.float32), ("(35,)", "(5, 7)", "flat=True")),  # the flat view, not asked for
            (torch.zeros((7, 5)), ("(7, 5)", "(5, 7)")),
            (np.zeros(DENSE_SHAPE, np.float64), ("float64", "float32")),
            (np.zeros(DENSE_SHAPE, np.float16), ("float16", "float32")),
            (torch.zeros(DENSE_SHAPE, dtype=torch.float64), ("float64", "float32")),
            (np.zeros(DENSE_SHAPE, np.int32), ("int32", "float32")),
        ],
        ids=["transposed", "flat_not_asked", "torch_transposed", "float64", "float16", "torch_float64", "int32"],
    )
    def test_client_wrong_shape_or_dtype_of_right_size_is_refused(self, env: Env, grad: Any, problem: tuple) -> None:
        """Issue 17: a (7, 5) push into a (5, 7) table, or a float64 one into a float32 table, was applied
        silently. Now: InvalidArgumentError naming the table, the expected and the given shape/dtype,
        nothing sent, nothing changed (push and assign alike). Reference: the snapshot before."""
        before = env.snapshot()
        sent = env.requests_sent()
        for call in (lambda: env.client.push_dense(DENSE_NAME, grad), lambda: env.client.assign_dense(DENSE_NAME, grad)):
            ps_error(call, InvalidArgumentError, None, DENSE_NAME, *problem)
        assert env.requests_sent() == sent, "a refused push still reached a shard"
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_flat_view_on_purpose_is_accepted(self, env: Env) -> None:
        """flat=True: the (35,) view of a (5, 7) table is pushed as its row-major flattening. Reference: a
        twin table (same spec and init) given the (5, 7) gradient."""
        g = np.random.default_rng(3).standard_normal(DENSE_SHAPE).astype(np.float32)
        for twin in ("twin_flat", "twin_shaped"):
            env.client.create_dense(twin, DENSE_SHAPE, **{**DENSE_KW, "init": "zeros"})
        env.client.push_dense("twin_flat", g.reshape(-1), flat=True)
        env.client.push_dense("twin_shaped", g)
        np.testing.assert_array_equal(env.client.pull_dense("twin_flat"), env.client.pull_dense("twin_shaped"))
        env.client.assign_dense("twin_flat", np.arange(35, dtype=np.float32), flat=True)
        np.testing.assert_array_equal(env.client.pull_dense("twin_flat"), np.arange(35, dtype=np.float32).reshape(DENSE_SHAPE))
        ps_error(lambda: env.client.push_dense("twin_flat", g, flat=True), InvalidArgumentError, None, "twin_flat", "(5, 7)", "(35,)")

    @pytest.mark.parametrize("shape, flat_view", [((7, 5), False), ((35,), False), ((5, 7), True), ((36,), True)])
    def test_raw_push_stating_wrong_shape_is_invalid(self, env: Env, shape: tuple, flat_view: bool) -> None:
        """The shard itself refuses a push whose first chunk states another shape (a client in another language)."""
        chunks = env.full_push(0, shape=list(shape), flat_view=flat_view)
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, str(shape), "nothing applied")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_push_stating_the_right_shape_applies(self, env: Env) -> None:
        v0 = env.shards[0].tables[DENSE_NAME].version
        for head in (dict(shape=list(DENSE_SHAPE)), dict(shape=[35], flat_view=True)):
            chunks = env.full_push(0, fill=0.0, **head)
            length, chunk = env.slice(0)
            last = (length - 1) // chunk * chunk
            chunks[-1] = dense_chunk(last, np.zeros(length - last), last=True, **(head if last == 0 else {}))
            env.raw[0].push_dense(chunks)
        assert env.shards[0].tables[DENSE_NAME].version == v0 + 2

    @pytest.mark.parametrize("shard", [0, 1])
    def test_raw_chunk_of_wrong_length(self, env: Env, shard: int) -> None:
        chunks = env.full_push(shard)
        chunks[1] = dense_chunk(8, np.full(7, 0.5))  # 7 elements where 8 belong
        before = env.snapshot()
        rpc_error(lambda: env.raw[shard].push_dense(chunks), INVALID, DENSE_NAME, "7 elements", "expected 8")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_last_chunk_too_long(self, env: Env) -> None:
        length, _ = env.slice(0)
        chunks = env.full_push(0)
        chunks[-1] = dense_chunk(16, np.full(length - 16 + 1, 0.5))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "elements")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("offset", [3, -8, 24, 1 << 40], ids=["misaligned", "negative", "past_end", "huge"])
    def test_raw_chunk_at_bad_offset(self, env: Env, offset: int) -> None:
        chunks = env.full_push(0)
        chunks.insert(1, dense_chunk(offset, np.full(8, 0.5)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "offset")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_missing_chunk_applies_nothing(self, env: Env) -> None:
        chunks = env.full_push(1)
        del chunks[1]
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].push_dense(chunks), INVALID, DENSE_NAME, "missing", "nothing applied")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_missing_chunk_with_return_params_applies_nothing(self, env: Env) -> None:
        chunks = env.full_push(0, return_params=True)
        del chunks[2]
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "missing")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_duplicate_chunk(self, env: Env) -> None:
        chunks = env.full_push(0)
        chunks.append(dense_chunk(8, np.full(8, 0.5)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "twice")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_chunk_for_another_table(self, env: Env) -> None:
        chunks = env.full_push(0)
        chunks[1] = dense_chunk(8, np.full(8, 0.5), table=SPARSE_NAME)
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, SPARSE_NAME)
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_empty_stream(self, env: Env) -> None:
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense([]), INVALID, None, "empty")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "dtype,data",
        [
            ("int32", np.ones(8, "<i4").tobytes()),
            ("float64", np.ones(8, "<f8").tobytes()),
            ("int64", np.ones(8, "<i8").tobytes()),
            ("foo", f32(np.ones(8))),
        ],
        ids=["int32", "float64", "int64", "unknown"],
    )
    @pytest.mark.parametrize("where", ["first", "later"])
    def test_raw_chunk_of_wrong_dtype(self, env: Env, dtype: str, data: bytes, where: str) -> None:
        chunks = env.full_push(1)
        k = 0 if where == "first" else 1
        chunks[k] = dense_chunk(8 * k, dtype=dtype, data=data, **({"table": DENSE_NAME} if k == 0 else {}))
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].push_dense(chunks), INVALID, DENSE_NAME, f"'{dtype}'")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_reply_dtype_unknown(self, env: Env) -> None:
        chunks = env.full_push(0, return_params=True, reply_dtype="int8")
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "reply_dtype", "'int8'")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_pull_dtype_unknown(self, env: Env) -> None:
        before = env.snapshot()
        req = pb.PullDenseRequest(table=DENSE_NAME, dtype="foo").SerializeToString()
        rpc_error(lambda: env.raw[0].pull_dense(req), INVALID, DENSE_NAME, "'foo'")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("nbytes", [31, 30, 1], ids=["31_bytes", "30_bytes", "1_byte"])
    def test_raw_chunk_bytes_not_whole_elements(self, env: Env, nbytes: int) -> None:
        chunks = env.full_push(0)
        chunks[1] = dense_chunk(8, data=f32(np.ones(8))[:nbytes])
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, ("truncated", "malformed", "whole number"))
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_unknown_op_is_invalid(self, env: Env) -> None:
        chunks = env.full_push(0, op=7)  # DenseOp has 0 (gradient) and 1 (assign) only
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "op", "7")
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== sparse pushes and pulls
class TestSparseShapes:
    """Sparse requests whose dim, row count, tensor bytes or dtypes do not match the table ->
    INVALID_ARGUMENT naming the table; no row changes. Reference: snapshot before the call."""

    def ids0(self, env: Env) -> np.ndarray:
        return owned(LIVE_IDS, 0, env.num_shards)[:3]

    def test_client_wrong_row_count(self, env: Env) -> None:
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, LIVE_IDS[:5], np.ones((4, DIM), np.float32)),
                 InvalidArgumentError, None, SPARSE_NAME, "4 gradient rows", "5 ids")
        assert env.requests_sent() == sent
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_wrong_dim(self, env: Env) -> None:
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, LIVE_IDS[:5], np.ones((5, DIM - 1), np.float32)),
                 InvalidArgumentError, None, SPARSE_NAME, "dim")
        assert env.requests_sent() == sent
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_wrong_shape_with_right_size(self, env: Env) -> None:
        """(2, 8) gradients for 4 ids of dim 4 must not be silently read as (4, 4)."""
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, LIVE_IDS[:4], np.ones((2, 2 * DIM), np.float32)),
                 InvalidArgumentError, None, SPARSE_NAME, ("shape", "dim"))
        assert env.requests_sent() == sent
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("dim", [DIM - 1, DIM + 1, 0, -4])
    def test_raw_wrong_dim_field(self, env: Env, dim: int) -> None:
        ids = self.ids0(env)
        data = f32(np.ones((len(ids), DIM)))  # bytes for the table's dim: only the declared dim is wrong
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, dim=dim, data=data)),
                  INVALID, SPARSE_NAME, "dim")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_rows_of_wrong_width(self, env: Env) -> None:
        ids = self.ids0(env)
        data = f32(np.ones((len(ids), DIM + 1)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, data=data)),
                  INVALID, SPARSE_NAME, ("truncated", "malformed"))
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("rows", [2, 4, 0])
    def test_raw_wrong_row_count(self, env: Env, rows: int) -> None:
        ids = self.ids0(env)
        data = f32(np.ones((rows, DIM)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, data=data)),
                  INVALID, SPARSE_NAME, ("truncated", "malformed"))
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("cut", [1, 3, 4], ids=["1_byte_short", "3_bytes_short", "1_element_short"])
    def test_raw_truncated_gradient_bytes(self, env: Env, cut: int) -> None:
        ids = self.ids0(env)
        data = f32(np.ones((len(ids), DIM)))[:-cut]
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, data=data)),
                  INVALID, SPARSE_NAME, ("truncated", "malformed"))
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "dtype,data",
        [
            ("int32", lambda n: np.ones((n, DIM), "<i4").tobytes()),
            ("float64", lambda n: np.ones((n, DIM), "<f8").tobytes()),
            ("int64", lambda n: np.ones((n, DIM), "<i8").tobytes()),
            ("foo", lambda n: f32(np.ones((n, DIM)))),
        ],
        ids=["int32", "float64", "int64", "unknown"],
    )
    def test_raw_gradient_of_wrong_dtype(self, env: Env, dtype: str, data: Callable[[int], bytes]) -> None:
        ids = self.ids0(env)
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, dtype=dtype, data=data(len(ids)))),
                  INVALID, SPARSE_NAME, f"'{dtype}'")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("dtype", ["int32", "float64", "foo"])
    def test_raw_pull_of_wrong_dtype(self, env: Env, dtype: str) -> None:
        before = env.snapshot()
        fresh = owned_ids(3, 0, env.num_shards)  # would create rows if accepted
        rpc_error(lambda: env.raw[0].unary("PullSparse", sparse_pull_req(SPARSE_NAME, fresh, dtype=dtype)),
                  INVALID, SPARSE_NAME, f"'{dtype}'")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_ids_as_float32_bytes(self, env: Env) -> None:
        """Three float32 ids are 12 bytes: not a whole number of int64 ids. (float64 ids are 8 bytes each
        and indistinguishable from int64 ids on the wire; the client refuses float ids, see TestIdRange.)"""
        ids = self.ids0(env)
        fbytes = np.asarray(ids, "<f4").tobytes()
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, ids_bytes=fbytes)),
                  INVALID, SPARSE_NAME, "ids", ("int64", "whole number"))
        rpc_error(lambda: env.raw[0].unary("PullSparse", sparse_pull_req(SPARSE_NAME, ids, ids_bytes=fbytes)),
                  INVALID, SPARSE_NAME, "ids", ("int64", "whole number"))
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("base", [i64([0, 0]), i64([0, 0, 0, 0]), b"\0" * 9], ids=["too_few", "too_many", "ragged"])
    def test_raw_base_versions_not_matching_ids(self, env: Env, base: bytes) -> None:
        ids = self.ids0(env)
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, np.ones((3, DIM)), base=base)),
                  INVALID, SPARSE_NAME, ("base version", "base_versions"))
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== id range and type
BAD_IDS = {
    "numpy_uint64_2**63": np.array([1, 2**63], np.uint64),
    "numpy_uint64_max": np.array([2**64 - 1], np.uint64),
    "python_int_2**64": [1, 2**64],
    "python_int_2**63": [2**63],
    "python_int_below_int64": [-(2**63) - 1],
    "numpy_float": np.array([1.0, 2.0]),
    "python_float": [1.0, 2.5],
    "torch_float": torch.tensor([1.0, 2.0]),
    "torch_uint64_2**63": torch.tensor([2**63], dtype=torch.uint64),
}


class TestIdRange:
    """Ids that are not int64 values (too large, negative overflow, floats) are refused by PSClient
    before anything is sent -- no wrap-around onto some other row. Reference: snapshot before, and the
    shards' request counters (unchanged: nothing reached a shard)."""

    @pytest.mark.parametrize("ids", list(BAD_IDS.values()), ids=list(BAD_IDS))
    @pytest.mark.parametrize("op", ["pull", "push"])
    def test_client_rejects_id_before_sending(self, env: Env, ids: Any, op: str) -> None:
        n = len(ids)
        call = (
            (lambda: env.client.pull_sparse(SPARSE_NAME, ids))
            if op == "pull"
            else (lambda: env.client.push_sparse(SPARSE_NAME, ids, np.ones((n, DIM), np.float32)))
        )
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(call, InvalidArgumentError, None, SPARSE_NAME, ("int64", "integer", "64 bits"))
        assert env.requests_sent() == sent, "ids out of range still reached a shard"
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== non-finite gradients
class TestNonFinite:
    """NaN/Inf in a gradient (or assigned values) -> INVALID_ARGUMENT naming the table, and nothing
    applied on ANY shard, even when only one shard's part is bad; accepted when the table was created
    with allow_nonfinite=True. Reference: snapshot before the push (and, when accepted, the update)."""

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
    def test_client_dense_bad_value_in_one_shards_part(self, env: Env, bad: float) -> None:
        g = np.full(DENSE_SHAPE, 0.1, np.float32)
        g.reshape(-1)[30] = bad  # element 30 lives on shard 1 only
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_dense(DENSE_NAME, g), InvalidArgumentError, None, DENSE_NAME, "nan/inf")
        assert env.requests_sent() == sent
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_assign_with_nan_in_one_shards_part(self, env: Env) -> None:
        v = np.full(DENSE_SHAPE, 0.1, np.float32)
        v.reshape(-1)[30] = np.nan  # shard 1's part
        before = env.snapshot()
        ps_error(lambda: env.client.assign_dense(DENSE_NAME, v), InvalidArgumentError, (None, INVALID), DENSE_NAME, "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
    def test_client_sparse_bad_value_in_one_row(self, env: Env, bad: float) -> None:
        ids = LIVE_IDS[:10]
        g = np.full((len(ids), DIM), 0.1, np.float32)
        g[7, 2] = bad
        before = env.snapshot()
        sent = env.requests_sent()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, ids, g), InvalidArgumentError, None, SPARSE_NAME, "nan/inf")
        assert env.requests_sent() == sent
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.filterwarnings("ignore:overflow encountered")
    def test_client_float16_wire_overflow_applies_nowhere(self, env: Env) -> None:
        """1e6 is finite in float32 but Inf in float16: the shard that gets it rejects, so must the rest."""
        c = env.new_client(wire_dtype="float16")
        g = np.full(DENSE_SHAPE, 0.1, np.float32)
        g.reshape(-1)[30] = 1e6  # shard 1's part
        before = env.snapshot()
        ps_error(lambda: c.push_dense(DENSE_NAME, g), InvalidArgumentError, (None, INVALID), DENSE_NAME, ("nan/inf", "float16"))
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.filterwarnings("ignore:overflow encountered")
    def test_client_float64_gradient_overflowing_float32_applies_nowhere(self, env: Env) -> None:
        """1e39 is finite in float64 but Inf in float32: a float64 push is refused for its dtype (issue 17),
        and cast by the caller, for its Inf."""
        g = np.full(DENSE_SHAPE, 0.1, np.float64)
        g.reshape(-1)[30] = 1e39  # shard 1's part
        before = env.snapshot()
        ps_error(lambda: env.client.push_dense(DENSE_NAME, g), InvalidArgumentError, None, DENSE_NAME, "float64", "float32")
        ps_error(lambda: env.client.push_dense(DENSE_NAME, g.astype(np.float32)), InvalidArgumentError, None, DENSE_NAME, "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.filterwarnings("ignore:overflow encountered")
    def test_client_sparse_float16_wire_overflow_applies_nowhere(self, env: Env) -> None:
        c = env.new_client(wire_dtype="float16")
        ids = np.concatenate([owned(LIVE_IDS, 0, 2)[:3], owned(LIVE_IDS, 1, 2)[:3]])
        g = np.full((len(ids), DIM), 0.1, np.float32)
        g[4, 0] = 1e6  # a shard-1 row
        before = env.snapshot()
        ps_error(lambda: c.push_sparse(SPARSE_NAME, ids, g), InvalidArgumentError, (None, INVALID), SPARSE_NAME,
                 ("nan/inf", "float16"))
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_sparse_duplicate_ids_summing_to_inf_applies_nowhere(self, env: Env) -> None:
        """Each row is finite, but the client sums duplicate ids first: 3e38 + 3e38 is Inf in float32."""
        i0, i1 = owned(LIVE_IDS, 0, 2)[:2], owned(LIVE_IDS, 1, 2)[0]
        ids = np.array([i0[0], i0[1], i1, i1])
        g = np.full((4, DIM), 0.1, np.float32)
        g[2:, 0] = 3e38  # the two copies of the shard-1 id
        before = env.snapshot()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, ids, g), InvalidArgumentError, (None, INVALID), SPARSE_NAME,
                 "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
    def test_raw_dense_chunk_with_bad_value(self, env: Env, bad: float) -> None:
        chunks = env.full_push(1)
        v = np.full(8, 0.5)
        v[5] = bad
        chunks[1] = dense_chunk(8, v)
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].push_dense(chunks), INVALID, DENSE_NAME, "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_dense_assign_with_nan(self, env: Env) -> None:
        chunks = env.full_push(0, op=pb.DENSE_OP_ASSIGN)
        v = np.full(2, 0.5)
        v[1] = np.nan
        chunks[2] = dense_chunk(16, v)
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, DENSE_NAME, "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("dtype", ["float32", "float16"])
    def test_raw_sparse_rows_with_bad_value(self, env: Env, dtype: str) -> None:
        ids = owned(LIVE_IDS, 1, 2)[:3]
        g = np.ones((3, DIM))
        g[2, 3] = np.inf
        before = env.snapshot()
        rpc_error(lambda: env.raw[1].unary("PushSparse", sparse_push_req(SPARSE_NAME, ids, g, dtype=dtype)),
                  INVALID, SPARSE_NAME, "nan/inf")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_dense_accepted_when_table_allows_nonfinite(self, env: Env) -> None:
        assert env.client.create_dense("loose", 10, allow_nonfinite=True)
        g = np.zeros(10, np.float32)
        g[9] = np.nan  # shard 1's part
        g[0] = np.inf
        res = env.client.push_dense("loose", g)
        assert res.versions == (1, 1)
        vals = env.client.pull_dense("loose")
        assert np.isnan(vals[9]) and vals[0] == -np.inf and (vals[1:9] == 0).all()

    def test_sparse_accepted_when_table_allows_nonfinite(self, env: Env) -> None:
        assert env.client.create_sparse("loose_rows", DIM, allow_nonfinite=True)
        ids = LIVE_IDS[:6]
        env.client.pull_sparse("loose_rows", ids)
        g = np.zeros((6, DIM), np.float32)
        g[4, 1] = np.nan
        r = env.client.push_sparse("loose_rows", ids, g)
        assert r.applied == 6
        rows, versions = env.client.pull_sparse("loose_rows", ids, return_versions=True)
        assert np.isnan(rows[4, 1]) and (versions == 1).all()
        # and at the raw level
        ids1 = owned(LIVE_IDS[:6], 1, 2)
        env.raw[1].unary("PushSparse", sparse_push_req("loose_rows", ids1, np.full((len(ids1), DIM), np.inf)))
        rows, versions = env.client.pull_sparse("loose_rows", ids1, return_versions=True)
        assert not np.isfinite(rows).any()
        assert (versions == 2).all()


# =============================================================================== malformed bytes
GARBAGE = {
    "random": np.random.default_rng(0).bytes(48),
    "truncated_varint": b"\x0a\x80",
    "truncated_field": b"\x0a\x10abc",
    "huge_varint": b"\x08" + b"\xff" * 11,
    "bad_utf8_name": b"\x0a\x02\xff\xfe",
}


class TestMalformed:
    """Bytes that do not decode as the request message -> INVALID_ARGUMENT "malformed". No table can be
    named (none was parsed). Reference: snapshot before the call."""

    @pytest.mark.parametrize("raw", list(GARBAGE.values()), ids=list(GARBAGE))
    @pytest.mark.parametrize("method", ["CreateTable", "DescribeTable", "PullDense", "PushDense", "PullSparse", "PushSparse", "Step"])
    def test_raw_garbage_is_malformed(self, env: Env, method: str, raw: bytes) -> None:
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].call(method, raw), INVALID, None, "malformed")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_garbage_chunk_mid_stream(self, env: Env) -> None:
        chunks = env.full_push(0)
        chunks[1] = GARBAGE["truncated_varint"]
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].push_dense(chunks), INVALID, None, "malformed", "truncated")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_payload_field_longer_than_message(self, env: Env) -> None:
        ids = owned(LIVE_IDS, 0, 2)[:3]
        full = sparse_push_req(SPARSE_NAME, ids, np.ones((3, DIM)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", full[:-5]), INVALID, None, "malformed", "truncated")
        rpc_error(lambda: env.raw[0].unary("PullSparse", sparse_pull_req(SPARSE_NAME, ids)[:-1]), INVALID, None,
                  "malformed", "truncated")
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== size limits
class TestLimits:
    """Requests beyond the shard's limits (message size, ids per request, memory budget) ->
    RESOURCE_EXHAUSTED naming the table where the shard could read it; nothing applied or created.
    Reference: snapshot before the call."""

    def test_raw_message_over_max_message_bytes(self, make_env: Any) -> None:
        """gRPC refuses the message before the shard parses it, so the message names the limit, not a table."""
        env = make_env(2, max_message_bytes=2 << 20, chunk_elems=1 << 16)
        ids = owned(LIVE_IDS, 0, 2)[:3]
        big = sparse_push_req(SPARSE_NAME, ids, data=b"\0" * (3 << 20))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary("PushSparse", big), EXHAUSTED, None, "larger than max")
        rpc_error(lambda: env.raw[0].push_dense([dense_chunk(0, table=DENSE_NAME, data=b"\0" * (3 << 20))]),
                  EXHAUSTED, None, "larger than max")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_oversized_chunk_after_complete_push_applies_nothing(self, make_env: Any) -> None:
        """A push whose stream fails (here: an oversized trailing chunk) must not commit, although every
        chunk of the range arrived before the failure. Repeated, since the outcome depends on timing."""
        env = make_env(2, max_message_bytes=2 << 20, chunk_elems=8)
        before = env.snapshot()
        for _ in range(20):
            chunks = env.full_push(0) + [dense_chunk(0, data=b"\0" * (3 << 20))]
            rpc_error(lambda: env.raw[0].push_dense(chunks), EXHAUSTED, None, "larger than max")
        time.sleep(0.3)  # let the handlers finish whatever they do after the client saw the error
        env.assert_unchanged(before)
        env.assert_serves()

    def test_raw_oversized_chunk_is_not_counted_as_internal_error(self, make_env: Any) -> None:
        """The shard's Stats must not blame itself (INTERNAL) for a client's oversized message."""
        env = make_env(2, max_message_bytes=2 << 20, chunk_elems=8)
        before = env.snapshot()
        for _ in range(20):  # repeated, since how the failed stream reaches the handler depends on timing
            chunks = env.full_push(0)[:1] + [dense_chunk(8, data=b"\0" * (3 << 20))]
            rpc_error(lambda: env.raw[0].push_dense(chunks), EXHAUSTED, None, "larger than max")
        time.sleep(0.3)
        errors = dict(env.raw[0].stats().errors)
        assert "INTERNAL" not in errors, f"a client's oversized message counted as an internal error: {errors}"
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_sparse_push_over_server_message_limit_names_table(self, make_env: Any) -> None:
        env = make_env(1, max_message_bytes=2 << 20, chunk_elems=1 << 16)
        ids = np.arange(100_000, dtype=np.int64)  # 100k x (8 + 16) bytes > 2 MiB in one request
        before = env.snapshot()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, ids, np.zeros((len(ids), DIM), np.float32)),
                 ResourceExhaustedError, EXHAUSTED, SPARSE_NAME, ("larger than max", "over the limit"))  # gRPC's words, bulk's
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize("method", ["PullSparse", "PushSparse"])
    def test_raw_too_many_ids(self, make_env: Any, method: str) -> None:
        env = make_env(2, max_ids_per_request=100)
        ids = np.concatenate([owned(LIVE_IDS, 0, 2), owned_ids(101 - len(owned(LIVE_IDS, 0, 2)), 0, 2)])
        assert len(ids) == 101
        raw = sparse_pull_req(SPARSE_NAME, ids) if method == "PullSparse" else sparse_push_req(SPARSE_NAME, ids, np.ones((101, DIM)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary(method, raw), EXHAUSTED, SPARSE_NAME, "101", "100")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_too_many_ids_one_shard(self, make_env: Any) -> None:
        env = make_env(1, max_ids_per_request=100)
        env.client.max_request_bytes = 16 << 20  # not split by bytes
        ids = np.concatenate([LIVE_IDS, np.arange(1000, 1061)])
        assert len(ids) == 101
        before = env.snapshot()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, ids, np.ones((101, DIM), np.float32)),
                 ResourceExhaustedError, (EXHAUSTED, None), SPARSE_NAME, "101", "100")
        ps_error(lambda: env.client.pull_sparse(SPARSE_NAME, ids), ResourceExhaustedError, (EXHAUSTED, None), SPARSE_NAME,
                 "101")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_client_too_many_ids_for_one_of_two_shards_applies_nowhere(self, make_env: Any) -> None:
        env = make_env(2, max_ids_per_request=100)
        live1 = owned(LIVE_IDS, 1, 2)  # shard 1 gets few ids (accepted alone), shard 0 gets 101
        ids = np.concatenate([owned(LIVE_IDS, 0, 2), owned_ids(101 - len(owned(LIVE_IDS, 0, 2)), 0, 2), live1])
        before = env.snapshot()
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, ids, np.ones((len(ids), DIM), np.float32)),
                 ResourceExhaustedError, (EXHAUSTED, None), SPARSE_NAME, "101")
        env.assert_unchanged(before)
        env.assert_serves()

    def test_sparse_rows_over_memory_budget(self, make_env: Any) -> None:
        # 1024 rows of dim 4 + adagrad state + 24 bytes of bookkeeping each (and 12 bytes of id index) fit, 2048 do not
        # (rows are made by pushes: a pull of any number of fresh ids holds nothing)
        env = make_env(2, max_bytes=100 << 10)
        fresh = owned_ids(2048, 0, 2)
        before = env.snapshot()
        env.raw[0].unary("PullSparse", sparse_pull_req(SPARSE_NAME, fresh))
        env.client.pull_sparse(SPARSE_NAME, np.arange(10_000, 18_000))
        rpc_error(lambda: env.raw[0].unary("PushSparse", sparse_push_req(SPARSE_NAME, fresh, np.ones((len(fresh), DIM)))),
                  EXHAUSTED, SPARSE_NAME, "bytes")
        ps_error(lambda: env.client.push_sparse(SPARSE_NAME, np.arange(10_000, 18_000), np.ones((8000, DIM), np.float32)),
                 ResourceExhaustedError, EXHAUSTED, SPARSE_NAME, "bytes")
        env.assert_unchanged(before)
        env.assert_serves()


# =============================================================================== routing
class TestRouting:
    """Ids sent to a shard that does not own them, and clients that list the shards in the wrong order
    or number -> INVALID_ARGUMENT saying so; nothing applied. Reference: snapshot before the call."""

    @pytest.mark.parametrize("method", ["PullSparse", "PushSparse"])
    def test_raw_id_sent_to_wrong_shard(self, env: Env, method: str) -> None:
        mine, theirs = owned(LIVE_IDS, 0, 2)[:3], owned(LIVE_IDS, 1, 2)[:1]
        ids = np.concatenate([mine, theirs])
        assert (SlotMap(4096, 2).shard_of(theirs) == 1).all()
        raw = sparse_pull_req(SPARSE_NAME, ids) if method == "PullSparse" else sparse_push_req(SPARSE_NAME, ids, np.ones((4, DIM)))
        before = env.snapshot()
        rpc_error(lambda: env.raw[0].unary(method, raw), INVALID, SPARSE_NAME, f"id {int(theirs[0])}", "shard 1")
        env.assert_unchanged(before)
        env.assert_serves()

    @pytest.mark.parametrize(
        "order", [lambda a: a[::-1], lambda a: a[:1], lambda a: [a[0], a[0]], lambda a: a + a[:1]],
        ids=["reversed", "one_of_two", "same_twice", "three"],
    )
    @pytest.mark.parametrize(
        "op",
        [
            lambda c: c.pull_dense(DENSE_NAME),
            lambda c: c.push_dense(DENSE_NAME, np.ones(DENSE_SHAPE, np.float32)),
            lambda c: c.pull_sparse(SPARSE_NAME, LIVE_IDS),
            lambda c: c.push_sparse(SPARSE_NAME, LIVE_IDS, np.ones((len(LIVE_IDS), DIM), np.float32)),
        ],
        ids=["pull_dense", "push_dense", "pull_sparse", "push_sparse"],
    )
    def test_client_with_misconfigured_addresses(self, env: Env, order: Callable, op: Callable) -> None:
        c = env.new_client(order(list(env.addresses)))
        before = env.snapshot()
        sent = [d.get("PushDense", 0) + d.get("PushSparse", 0) for d in env.requests_sent()]
        ps_error(lambda: op(c), InvalidArgumentError, None, None, "shard", ("order", "expected"))
        assert [d.get("PushDense", 0) + d.get("PushSparse", 0) for d in env.requests_sent()] == sent
        env.assert_unchanged(before)
        env.assert_serves()

    def test_create_with_wrong_shard_count_is_refused(self, env: Env) -> None:
        c = env.new_client(env.addresses[:1])
        before = env.snapshot()
        ps_error(lambda: c.create_dense("fresh", 10), InvalidArgumentError, INVALID, "fresh", "1 shards")
        env.assert_unchanged(before)
        assert all("fresh" not in s.tables for s in env.shards)
        env.assert_serves()

    def test_create_with_reversed_addresses_raises(self, env: Env) -> None:
        """The shards cannot tell the order is wrong (CreateTableRequest carries only num_shards): the
        client raises once it sees the replies. Existing tables are untouched."""
        c = env.new_client(env.addresses[::-1])
        before = env.snapshot()
        ps_error(lambda: c.create_dense("fresh", 10), InvalidArgumentError, None, None, "order")
        env.assert_unchanged(before, ignore_tables=("fresh",))
        env.assert_serves()


# =============================================================================== stats
class TestStatsCounters:
    """After a run of bad requests the Stats RPC counts each under its status code, still counts every
    request by method, and the tables are unchanged. Reference: Stats and snapshot before the run."""

    def test_errors_and_requests_are_counted(self, make_env: Any) -> None:
        env = make_env(2, max_ids_per_request=100)
        r0 = env.raw[0]
        other_before = env.raw[1].stats()
        before = env.snapshot()
        s0 = r0.stats()
        mine = owned(LIVE_IDS, 0, 2)[:3]
        bad_calls = [
            ("PullSparse", lambda: r0.unary("PullSparse", sparse_pull_req("nope", [1])), NOT_FOUND),
            ("PushSparse", lambda: r0.unary("PushSparse", sparse_push_req("nope", [1])), NOT_FOUND),
            ("DescribeTable", lambda: r0.unary("DescribeTable", pb.DescribeTableRequest(table="nope").SerializeToString()), NOT_FOUND),
            ("PushSparse", lambda: r0.unary("PushSparse", sparse_push_req(SPARSE_NAME, mine, dtype="int32", data=b"\0" * 48)), INVALID),
            ("PushSparse", lambda: r0.unary("PushSparse", GARBAGE["truncated_varint"]), INVALID),
            ("PullSparse", lambda: r0.unary("PullSparse", sparse_pull_req(SPARSE_NAME, owned(LIVE_IDS, 1, 2)[:1])), INVALID),
            ("PushDense", lambda: r0.push_dense([dense_chunk(3, np.ones(8), table=DENSE_NAME)]), INVALID),
            ("PullSparse", lambda: r0.unary("PullSparse", sparse_pull_req(SPARSE_NAME, owned_ids(101, 0, 2))), EXHAUSTED),
            ("CreateTable", lambda: r0.unary("CreateTable", pb.CreateTableRequest(
                spec=pb.TableSpec(name=DENSE_NAME, kind=pb.TABLE_KIND_DENSE, shape=[1]), num_shards=2).SerializeToString()), ALREADY_EXISTS),
        ]
        for _, call, code in bad_calls:
            rpc_error(call, code, None)
        s1 = r0.stats()
        want_errors: dict[str, int] = {}
        want_requests: dict[str, int] = {"Stats": 1}
        for method, _, code in bad_calls:
            if not (method == "DescribeTable" and code == NOT_FOUND):  # a lookup's answer, not an error
                want_errors[code.name] = want_errors.get(code.name, 0) + 1
            want_requests[method] = want_requests.get(method, 0) + 1
        got_errors = {k: s1.errors[k] - s0.errors.get(k, 0) for k in s1.errors if s1.errors[k] != s0.errors.get(k, 0)}
        got_requests = {k: s1.requests[k] - s0.requests.get(k, 0) for k in s1.requests if s1.requests[k] != s0.requests.get(k, 0)}
        assert got_errors == want_errors
        assert got_requests == want_requests
        # a good request afterwards is counted as a request and not as an error
        r0.unary("PullSparse", sparse_pull_req(SPARSE_NAME, mine))
        s2 = r0.stats()
        assert s2.requests["PullSparse"] == s1.requests["PullSparse"] + 1
        assert dict(s2.errors) == dict(s1.errors)
        # the other shard saw none of it
        other = env.raw[1].stats()
        assert dict(other.errors) == dict(other_before.errors)
        env.assert_unchanged(before)
        env.assert_serves()
