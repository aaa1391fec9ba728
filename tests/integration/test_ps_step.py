"""The Step RPC (``PSClient.step``): one call per shard per step, pushes of step t then pulls of step t+1.

Against real shard servers in this process (two shards, so every table is cut in two). References:
- async: the same pushes and pulls made with the separate calls on a twin table, and numpy SGD;
- BSP: a single-process torch model trained on the mean of both workers' gradients (torch.optim.Adam
  for the dense table, SGD rows for the sparse one), compared step by step with what each worker's
  Step reply carried (the values of the round its push completed), to fp32 rounding.
"""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from ps import SyncPolicy
from ps.errors import InvalidArgumentError, NonFiniteError, ShapeMismatchError
from tessera.codec import pack, unpack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(60)

SHAPE = (6, 5)
DIM = 4


def _tables(c, dense_opt: str = "sgd", **hp: float) -> None:
    c.create_dense("w", SHAPE, dense_opt, **(hp or {"lr": 0.5}))
    c.create_sparse("emb", DIM, "sgd", lr=0.5)


def _calls(cluster) -> list[dict[str, int]]:
    return [{k: v for k, v in s.requests.items() if k not in ("Stats", "DescribeTable", "CreateTable")} for s in cluster.shards]


def test_async_step_is_one_call_per_shard_and_matches_the_separate_calls(inproc_cluster) -> None:
    """Reference: numpy SGD (lr 0.5) from zeros, and the same values read back with the separate calls."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0")
    _tables(c)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    ids = np.array([5, 9, 5, 1000, -3, 9], np.int64)  # duplicates are summed
    rows = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    c.pull_sparse("emb", ids)  # rows exist (zeros)
    before = _calls(cluster)
    out = np.empty(SHAPE, np.float32)
    res = c.step(
        push_dense={"w": g}, push_sparse={"emb": (ids, rows)},
        pull_dense={"w": out}, pull_sparse={"emb": np.array([[9, 5], [7, 1000]])},
    )
    after = _calls(cluster)
    for b, a in zip(before, after):
        assert {k: a.get(k, 0) - b.get(k, 0) for k in a if a.get(k, 0) != b.get(k, 0)} == {"Step": 1}
    np.testing.assert_allclose(res.dense["w"], -0.5 * g, rtol=1e-6)
    assert res.dense["w"] is out
    want = {i: np.zeros(DIM, np.float32) for i in (5, 9, 1000, -3, 7)}
    for i, r in zip(ids, rows):
        want[int(i)] = want[int(i)] - 0.5 * r
    got_rows, got_versions = res.sparse["emb"]
    assert got_rows.shape == (2, 2, DIM)
    np.testing.assert_allclose(got_rows, np.stack([[want[9], want[5]], [want[7], want[1000]]]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got_versions, [[1, 1], [0, 1]])
    assert res.pushed["w"].versions == (1, 1) and res.pushed["emb"].applied == 4
    assert res.dense_versions["w"] == (1, 1)
    # the separate calls read the same state
    np.testing.assert_array_equal(c.pull_dense("w"), res.dense["w"])
    np.testing.assert_array_equal(c.pull_sparse("emb", [[9, 5], [7, 1000]]), got_rows)
    # torch in, torch out
    tres = c.step(pull_sparse={"emb": torch.tensor([1000, 9])}, pull_dense=["w"])
    assert isinstance(tres.sparse["emb"][0], torch.Tensor)
    np.testing.assert_array_equal(tres.sparse["emb"][0].numpy(), np.stack([want[1000], want[9]]))


def test_too_big_for_one_message_runs_as_separate_calls(inproc_cluster) -> None:
    """Same results either way (reference: numpy SGD); a step over max_request_bytes uses PushDense/PullDense."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0", max_request_bytes=64)
    _tables(c)
    g = np.ones(SHAPE, np.float32)
    res = c.step(push_dense={"w": g}, pull_dense=["w"], pull_sparse={"emb": [1, 2]})
    np.testing.assert_allclose(res.dense["w"], -0.5 * g)
    assert res.sparse["emb"][0].shape == (2, DIM)
    assert all("Step" not in s.requests for s in cluster.shards)
    assert res.pushed["w"].versions == (1, 1)


def test_big_dense_slices_stream_beside_the_step_call(inproc_cluster) -> None:
    """A dense table whose slice is over step_inline_bytes goes by PushDense (one fused push that
    returns the values, async: no PullDense), the rest by Step; same results (reference: numpy SGD)."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0", step_inline_bytes=16)
    _tables(c)
    c.pull_sparse("emb", [1, 2])
    before = _calls(cluster)
    g = np.ones(SHAPE, np.float32)
    res = c.step(push_dense={"w": g}, push_sparse={"emb": ([1, 2], np.ones((2, DIM), np.float32))},
                 pull_dense=["w"], pull_sparse={"emb": [2, 1]})
    np.testing.assert_allclose(res.dense["w"], -0.5 * g)
    np.testing.assert_allclose(res.sparse["emb"][0], np.full((2, DIM), -0.5))
    assert res.pushed["w"].versions == (1, 1) and res.pushed["emb"].applied == 2
    after = _calls(cluster)
    for b, a in zip(before, after):
        assert {k: a.get(k, 0) - b.get(k, 0) for k in a if a.get(k, 0) != b.get(k, 0)} == {"Step": 1, "PushDense": 1}
    assert isinstance(res.dense["w"], np.ndarray) and res.dense_versions["w"] == (1, 1)
    with pytest.raises(ShapeMismatchError):  # checked before anything is sent, streamed or not
        c.step(push_dense={"w": np.ones((5, 6), np.float32)}, pull_sparse={"emb": [1]})
    assert _calls(cluster) == after


def test_a_big_dense_table_under_ssp_still_pulls_separately(inproc_cluster) -> None:
    """An SSP pull may have to wait for slower workers, which a fused push's reply does not: a big
    dense table stepped with an SSP pull policy is pushed, then pulled (reference: numpy SGD)."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0", step_inline_bytes=16)
    _tables(c)
    before = _calls(cluster)
    g = np.ones(SHAPE, np.float32)
    res = c.step(push_dense={"w": g}, pull_dense=["w"], policy=SyncPolicy(clock=0, staleness=1),
                 pull_policy=SyncPolicy(clock=1, staleness=1))
    np.testing.assert_allclose(res.dense["w"], -0.5 * g)
    after = _calls(cluster)
    for b, a in zip(before, after):
        assert {k: a.get(k, 0) - b.get(k, 0) for k in a if a.get(k, 0) != b.get(k, 0)} == {"PushDense": 1, "PullDense": 1}


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_step_at_a_low_precision_wire_dtype(inproc_cluster, wire: str) -> None:
    """Reference: numpy SGD on the gradient rounded to the wire dtype (values exact in both: multiples of 1/8)."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0", wire_dtype=wire)
    _tables(c)
    g = (np.arange(30, dtype=np.float32).reshape(SHAPE) - 15) / 8
    c.pull_sparse("emb", [3, 4])  # rows exist: a push to a row not there is dropped
    res = c.step(push_dense={"w": g}, push_sparse={"emb": ([3, 4], np.full((2, DIM), 0.25, np.float32))},
                 pull_dense=["w"], pull_sparse={"emb": [4, 3]})
    np.testing.assert_array_equal(res.dense["w"], -0.5 * g)
    np.testing.assert_array_equal(res.sparse["emb"][0], np.full((2, DIM), -0.125, np.float32))


def test_client_refuses_bad_parts_before_sending(inproc_cluster) -> None:
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0")
    _tables(c)
    before = _calls(cluster)
    with pytest.raises(ShapeMismatchError, match=r"table 'w'.*\(5, 6\).*\(6, 5\)"):
        c.step(push_dense={"w": np.zeros((5, 6), np.float32)}, pull_dense=["w"])
    with pytest.raises(InvalidArgumentError, match="float64"):
        c.step(push_dense={"w": np.zeros(SHAPE)})
    with pytest.raises(NonFiniteError, match="table 'emb'"):
        c.step(push_dense={"w": np.zeros(SHAPE, np.float32)}, push_sparse={"emb": ([1], np.full((1, DIM), np.nan, np.float32))})
    assert _calls(cluster) == before
    np.testing.assert_array_equal(c.pull_dense("w"), np.zeros(SHAPE, np.float32))


def _raw_step(address: str, parts: list[pb.StepPart], data: bytes, client: str = "raw", dtype: str = "float32") -> pb.StepReply:
    ch = grpc.insecure_channel(address)
    try:
        req = pb.StepRequest(worker="raw", client=client, dtype=dtype)
        req.parts.extend(parts)
        raw = ch.unary_unary("/tessera.v1.ParameterServer/Step")(pack(req, {15: data}), timeout=10)
        return unpack(pb.StepReply, raw)[0]
    finally:
        ch.close()


def test_shard_validates_every_part_before_applying_any(inproc_cluster) -> None:
    """A good dense push followed by a bad part: INVALID_ARGUMENT / NOT_FOUND naming the bad part's table,
    the dense slice unchanged (reference: its values and version before)."""
    cluster = inproc_cluster(1)
    c = cluster.client(worker="w0")
    _tables(c)
    c.pull_sparse("emb", [1, 2])
    good = pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=30, data_at=0)
    grad = np.ones(30, np.float32).tobytes()
    ids = np.array([1, 2], np.int64).tobytes()
    cases = [
        (pb.StepPart(table="emb", op=pb.STEP_OP_PUSH_SPARSE, count=2, dim=DIM, ids_at=120, data_at=136, base_at=-1),
         ids + np.full((2, DIM), np.inf, np.float32).tobytes(), grpc.StatusCode.INVALID_ARGUMENT, "'emb'"),
        (pb.StepPart(table="emb", op=pb.STEP_OP_PUSH_SPARSE, count=2, dim=DIM + 1, ids_at=120, data_at=136, base_at=-1),
         ids + np.zeros((2, DIM + 1), np.float32).tobytes(), grpc.StatusCode.INVALID_ARGUMENT, "'emb'"),
        (pb.StepPart(table="nope", op=pb.STEP_OP_PULL_DENSE), b"", grpc.StatusCode.NOT_FOUND, "'nope'"),
        (pb.StepPart(table="emb", op=pb.STEP_OP_PULL_SPARSE, count=5, ids_at=120), ids, grpc.StatusCode.INVALID_ARGUMENT, "'emb'"),
        (pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=29, data_at=0), b"", grpc.StatusCode.INVALID_ARGUMENT, "'w'"),
    ]
    shard = cluster.shards[0]
    for bad, extra, code, text in cases:
        v0, before = shard.tables["w"].version, shard.tables["w"].values().copy()
        rows0 = c.pull_sparse("emb", [1, 2])
        with pytest.raises(grpc.RpcError) as ei:
            _raw_step(cluster.addresses[0], [good, bad], grad + extra)
        assert ei.value.code() == code and text in ei.value.details(), ei.value.details()
        assert shard.tables["w"].version == v0
        np.testing.assert_array_equal(shard.tables["w"].values(), before)
        np.testing.assert_array_equal(c.pull_sparse("emb", [1, 2]), rows0)
    # and the same good part alone applies
    rep = _raw_step(cluster.addresses[0], [good], grad)
    assert rep.parts[0].version == 1


def test_retried_step_is_applied_once(inproc_cluster) -> None:
    """The same Step (same client and seq) twice: the second is answered from the dedup record."""
    cluster = inproc_cluster(1)
    c = cluster.client(worker="w0")
    _tables(c)
    part = pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=30, data_at=0, seq=77)
    grad = np.ones(30, np.float32).tobytes()
    first = _raw_step(cluster.addresses[0], [part, pb.StepPart(table="w", op=pb.STEP_OP_PULL_DENSE)], grad)
    again = _raw_step(cluster.addresses[0], [part, pb.StepPart(table="w", op=pb.STEP_OP_PULL_DENSE)], grad)
    assert not first.parts[0].duplicate and again.parts[0].duplicate
    assert cluster.shards[0].tables["w"].version == 1
    np.testing.assert_array_equal(c.pull_dense("w"), np.full(SHAPE, -0.5, np.float32))


def test_bsp_step_replies_carry_the_round_and_match_a_single_process_reference(inproc_cluster) -> None:
    """Two workers, two shards, BSP: each worker's step(t) pushes its gradients for clock t and pulls for
    clock t+1; the reply must hold exactly the values after the round of step t. Reference: one process,
    torch.optim.Adam on the dense parameter and SGD on the embedding rows, fed the mean of both workers'
    gradients; checked after every step, for both workers."""
    cluster = inproc_cluster(2, lease_s=60.0)  # no lease may run out on a loaded machine: the live set stays both
    lr = 0.05
    clients = [cluster.client(worker=f"w{k}", timeout=60.0) for k in range(2)]
    clients[0].create_dense("w", SHAPE, "adam", lr=lr)
    clients[0].create_sparse("emb", DIM, "sgd", lr=0.5)
    clients[0].pull_sparse("emb", np.arange(20))  # the rows exist (zeros): pushes to absent rows are dropped
    for c in clients:
        c.join()
    ref_w = torch.zeros(SHAPE, requires_grad=True)
    opt = torch.optim.Adam([ref_w], lr=lr)
    ref_rows: dict[int, np.ndarray] = {}
    steps = 4
    rng = np.random.default_rng(5)
    grads = [[rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2)] for _ in range(steps)]
    ids = [[rng.integers(0, 20, size=6).astype(np.int64) for _ in range(2)] for _ in range(steps)]
    rows = [[rng.standard_normal((6, DIM)).astype(np.float32) for _ in range(2)] for _ in range(steps)]
    got: list[list] = [[None] * 2 for _ in range(steps)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            c = clients[k]
            for t in range(steps):
                res = c.step(
                    push_dense={"w": grads[t][k]}, push_sparse={"emb": (ids[t][k], rows[t][k])},
                    pull_dense=["w"], pull_sparse={"emb": np.arange(20)},
                    policy=SyncPolicy(clock=t, sync=True), pull_policy=SyncPolicy(clock=t + 1, sync=True),
                )
                got[t][k] = (res.dense["w"].copy(), res.sparse["emb"][0].copy(), res.clock)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=50)
    assert not errors, errors
    for t in range(steps):
        opt.zero_grad()
        ref_w.grad = torch.from_numpy((grads[t][0] + grads[t][1]) / 2)
        opt.step()
        for k in range(2):
            for i, r in zip(ids[t][k], rows[t][k]):
                ref_rows[int(i)] = ref_rows.get(int(i), np.zeros(DIM, np.float32)) - 0.5 * r / 2
        want_rows = np.stack([ref_rows.get(i, np.zeros(DIM, np.float32)) for i in range(20)])
        for k in range(2):
            w, e, clock = got[t][k]
            torch.testing.assert_close(torch.from_numpy(w), ref_w.detach(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(e, want_rows, rtol=1e-5, atol=1e-6)
            assert clock == {"w": t + 1, "emb": t + 1}


@pytest.mark.parametrize(
    "part, data, dtype, text",
    [
        (pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=30, data_at=64), np.ones(30, np.float32).tobytes(), "float32", "outside"),
        (pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=30, data_at=0), np.ones(30).tobytes()[:240], "float64", "float64"),
        (pb.StepPart(table="w", op=pb.STEP_OP_PUSH_DENSE, count=30, data_at=0, sync=pb.SyncSpec(sync=True, clock=-1)),
         np.ones(30, np.float32).tobytes(), "float32", "clock"),
        (pb.StepPart(table="w", op=99), b"", "float32", "unknown step op"),
        (pb.StepPart(table="emb", op=pb.STEP_OP_PULL_SPARSE, count=-1, ids_at=0), b"", "float32", "count"),
    ],
    ids=["data_outside_the_request", "float64", "bsp_negative_clock", "unknown_op", "negative_count"],
)
def test_malformed_step_parts_are_invalid_and_name_the_table(inproc_cluster, part, data, dtype, text) -> None:
    """Each a clear INVALID_ARGUMENT naming the table and the problem; nothing applied (reference: the
    slice's version and values before)."""
    cluster = inproc_cluster(1)
    c = cluster.client(worker="w0")
    _tables(c)
    t = cluster.shards[0].tables["w"]
    v0, before = t.version, t.values().copy()
    with pytest.raises(grpc.RpcError) as ei:
        _raw_step(cluster.addresses[0], [part], data, dtype=dtype)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert f"'{part.table}'" in ei.value.details() and text in ei.value.details(), ei.value.details()
    assert t.version == v0
    np.testing.assert_array_equal(t.values(), before)
