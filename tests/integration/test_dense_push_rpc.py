"""Dense pushes through a real shard server: atomic when the stream breaks or the last chunk is bad,
no torn reads while pushes compute in place or recycle blocks, no lost update between concurrent pushes.

Reference: SGD with lr=1 and a gradient of -1 everywhere adds exactly 1 per applied push, so the
single-process expectation is "every element equals the number of pushes applied" (= the version).
"""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

import ps.table
from ps.client import PSClient
from tessera.codec import pack, unpack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(120)
SVC = "/tessera.v1.ParameterServer/"
CHUNK, N = 64, 64 * 6 + 10  # 7 chunks, the last one short


def _chunks(g: np.ndarray, seq: int, last: bool = True, stop_after: int | None = None, bad_last: bool = False, early: bool = False):
    """The PushDense stream of ``g`` (raw frames): optionally cut after ``stop_after`` chunks, or with a
    NaN in the last chunk; ``early``: asks for the new values back as they are computed."""
    offs = list(range(0, g.size, CHUNK))
    for i, off in enumerate(offs):
        if stop_after is not None and i == stop_after:
            raise RuntimeError("the client's stream breaks here")
        part = g[off : off + CHUNK].copy()
        if bad_last and i == len(offs) - 1:
            part[-1] = np.nan
        head = pb.DenseChunk(offset=off, dtype="float32", last=last and i == len(offs) - 1)
        if i == 0:
            head.table, head.client, head.seq = "w", "raw", seq
            head.return_params = head.early = early
        yield pack(head, {15: part})


@pytest.fixture(params=["at-commit", "early"])
def cluster(request, inproc_cluster, monkeypatch):
    """One in-process shard: plain pushes (computed at commit, in place where no pull holds a block),
    and pushes that ask for their values back while they send, computed as their chunks arrive (as a
    big table's are; 7 chunks count as big here, for both). Yields (cluster, client, early)."""
    early = request.param == "early"
    monkeypatch.setattr(ps.table, "_EARLY_BLOCKS", 1)  # both ways: only the push that asks computes early
    cl = inproc_cluster(1, chunk_elems=CHUNK)
    c = cl.client()
    c.create_dense("w", N, init="zeros", lr=1.0)
    return cl, c, early


def test_a_broken_or_bad_push_leaves_the_table_unchanged_and_serving(cluster) -> None:
    cl, c, early = cluster
    t = cl.shards[0].dense("w")
    minus1 = -np.ones(N, np.float32)
    c.push_dense("w", minus1, return_params=early)
    c.push_dense("w", minus1, return_params=early)
    before = t.export_state()
    with grpc.insecure_channel(cl.addresses[0]) as ch:
        push = ch.stream_stream(SVC + "PushDense")
        with pytest.raises(grpc.RpcError):  # the client's request stream fails midway: gRPC cancels the call
            list(push(_chunks(minus1, 1, stop_after=4, early=early), timeout=10))
        with pytest.raises(grpc.RpcError) as e:  # NaN in the last chunk
            list(push(_chunks(minus1, 2, bad_last=True, early=early), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN/Inf" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # the stream ends without its last chunk
            list(push(_chunks(minus1, 3, last=False, early=early), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "without its last chunk" in e.value.details()
        after = t.export_state()
        assert after["version"] == before["version"] == 2
        np.testing.assert_array_equal(after["values"], before["values"])
        np.testing.assert_array_equal(c.pull_dense("w"), np.full(N, 2, np.float32))
        # the table keeps serving, and the failed pushes gave their blocks back
        reply = unpack(pb.DenseChunk, list(push(_chunks(minus1, 4, early=early), timeout=10))[-1])[0]
        assert reply.version == 3
    np.testing.assert_array_equal(c.pull_dense("w"), np.full(N, 3, np.float32))
    assert t.spare_blocks() <= t.num_blocks * t.spare_generations  # the failed pushes gave their blocks back
    if early:  # into recycled blocks (one may still be on its way back to the caller: a fresh one then)
        assert t.blocks_reused > 0 and t.blocks_in_place == 0
    else:  # no pull held a block during a commit: each computed in place, the spares made with the table unused
        assert t.blocks_in_place == 3 * t.num_blocks and t.blocks_allocated == 0 and t.blocks_reused == 0
        assert t.spare_blocks() == t.num_blocks * t.spare_generations


def test_pulls_during_many_pushes_are_never_torn(cluster) -> None:
    """A pulling client and two pushing clients at once: every pull is all one version (the value
    equals it), versions never go back, and no push is lost (the end value is the push count)."""
    cl, c, early = cluster
    t = cl.shards[0].dense("w")
    minus1 = -np.ones(N, np.float32)
    stop = threading.Event()
    bad: list[str] = []
    pulls = [0]
    pushes = 60

    def puller() -> None:
        with PSClient(cl.addresses, timeout=20.0) as pc:
            last = -1
            while not stop.is_set():
                vals, (_, versions) = pc.pull_dense("w", return_clock=True)
                v = versions[0]
                if not (vals == v).all() or v < last:
                    bad.append(f"version {v} (after {last}): values {sorted(set(vals.tolist()))[:5]}")
                last = v
                pulls[0] += 1

    def pusher() -> None:
        with PSClient(cl.addresses, timeout=20.0) as pc:
            for _ in range(pushes):
                pc.push_dense("w", minus1, return_params=early)

    th = threading.Thread(target=puller)
    th.start()
    writers = [threading.Thread(target=pusher) for _ in range(2)]
    try:
        for w in writers:
            w.start()
        for w in writers:
            w.join(100)
    finally:
        stop.set()
        th.join(20)
    assert not bad, bad[:3]
    assert pulls[0] > 5
    assert t.version == 2 * pushes
    np.testing.assert_array_equal(c.pull_dense("w"), np.full(N, 2 * pushes, np.float32))
    assert t.blocks_reused > 0 and t.spare_blocks() <= t.num_blocks * t.spare_generations
    assert early or t.blocks_in_place > 0  # at commit: in place whenever the puller held nothing
