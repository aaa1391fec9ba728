"""A fused dense push (``push_dense(return_params=True)``, async mode) through real shard servers:
each new block streams back as soon as the shard computes it, before the push has been sent whole,
and the caller ends with the committed values, also when another push commits first (the shard
recomputes and sends every block again) and when the early blocks were never committed (an error,
a duplicate).

Reference: the optimizer applied in one process to the whole tensor, in commit order, with
torch.optim (SGD, Adam; fp32 rtol 1e-6), and the table's own values read back by a pull.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from ps.client import PSClient
from ps.errors import PSError
from tessera.codec import pack, unpack
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(120)
SVC = "/tessera.v1.ParameterServer/"
CHUNK = 64
N = CHUNK * 20 + 7  # 2 shards: 10-11 chunks each (>= 8: the shards compute pushes as their chunks arrive)
HP = {"sgd": {"lr": 0.1}, "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}}


class _Ref:
    """The single-process reference: torch.optim on the whole tensor."""

    def __init__(self, opt: str, w0: np.ndarray) -> None:
        self.p = torch.from_numpy(w0.copy()).requires_grad_(True)
        h = HP[opt]
        self.o = (torch.optim.SGD([self.p], lr=h["lr"]) if opt == "sgd"
                  else torch.optim.Adam([self.p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"]))

    def push(self, g: np.ndarray) -> np.ndarray:
        self.p.grad = torch.from_numpy(g.copy())
        self.o.step()
        return self.p.detach().numpy()


class _Tap:
    """Shard ``i``'s PushDense stream as the client sends and reads it (the client's own call, not
    replaced): records each reply chunk's (has data, early flag), and after ``pause_after`` request
    chunks calls ``at_pause()`` before sending the rest."""

    def __init__(self, client: PSClient, i: int, pause_after: int | None = None,
                 at_pause: Callable[[_Tap], None] | None = None) -> None:
        self.replies: list[tuple[bool, bool]] = []
        self.first_early = threading.Event()
        self.notes: list[str] = []
        stub = client._shards[i]
        call = stub.push_dense

        def push_dense(requests: Iterator[bytes]) -> Iterator[bytes]:
            def paced() -> Iterator[bytes]:
                for n, r in enumerate(requests):
                    if n == pause_after and at_pause is not None:
                        at_pause(self)
                    yield r

            for raw in call(paced()):
                msg = unpack(pb.DenseChunk, raw)[0]
                has_data = bool(msg.dtype)  # data chunks name their dtype; the status does not
                self.replies.append((has_data, msg.early))
                if has_data and msg.early:
                    self.first_early.set()
                yield raw

        stub.push_dense = push_dense  # type: ignore[method-assign]

    def wait_early(self) -> None:
        """Hold the request stream until an early block came back (the overlap), else note it."""
        if not self.first_early.wait(20):
            self.notes.append("no block came back while the push was still being sent")

    @property
    def status_early(self) -> bool:
        return self.replies[-1][1]


@pytest.fixture
def two_shards(inproc_cluster):
    cl = inproc_cluster(2, chunk_elems=CHUNK)
    return cl, cl.client()


def _w0() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(N, dtype=np.float32)


def _grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N, dtype=np.float32)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_fused_push_streams_blocks_back_early_and_returns_the_committed_values(two_shards, opt: str) -> None:
    """Three fused pushes: the result equals the table after each push and torch.optim on the whole
    tensor; every block came back early (the request stream is held after 3 chunks until one has),
    and the status says the early blocks held (no second copy sent)."""
    cl, c = two_shards
    c.create_dense("w", N, opt, init=_w0(), **HP[opt])
    ref = _Ref(opt, c.pull_dense("w"))
    for step in range(3):
        taps = [_Tap(c, i, pause_after=3, at_pause=lambda t: t.wait_early()) for i in range(2)]
        out = np.full(N, np.nan, np.float32)
        got = c.push_dense("w", _grad(step), return_params=True, out=out)
        assert got is out
        expect = ref.push(_grad(step))
        np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(out, c.pull_dense("w"))
        for t, sh in zip(taps, cl.shards):
            assert not t.notes, t.notes
            data = [e for d, e in t.replies if d]
            assert len(data) == sh.dense("w").num_blocks and all(data)  # each block once, early
            assert t.status_early
    assert [sh.dense("w").recomputed for sh in cl.shards] == [0, 0]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_push_another_commit_overtook_returns_the_recomputed_values(two_shards, inproc_cluster, opt: str) -> None:
    """Push A sends 3 chunks per shard and gets early blocks back; then push B (another client)
    commits on both shards; then A sends the rest. A is applied on top of B (recomputed at commit):
    A's result must equal the table and torch.optim applying B then A, not the early blocks it got
    first (the shard sends every block again and says the early ones did not hold)."""
    cl, c = two_shards
    c.create_dense("w", N, opt, init=_w0(), **HP[opt])
    ref = _Ref(opt, c.pull_dense("w"))
    other = cl.client()
    ga, gb = _grad(1), _grad(2)
    both = threading.Barrier(2, timeout=30)

    def at_pause(t: _Tap) -> None:
        t.wait_early()
        # both shards compute A early now; one stream pushes B (to both shards) while the other waits
        if both.wait() == 0:
            other.push_dense("w", gb)
        both.wait()

    taps = [_Tap(c, i, pause_after=3, at_pause=at_pause) for i in range(2)]
    out = c.push_dense("w", ga, return_params=True)
    ref.push(gb)
    expect = ref.push(ga)
    np.testing.assert_allclose(out, expect, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out, c.pull_dense("w"))
    for t, sh in zip(taps, cl.shards):
        assert not t.notes, t.notes
        n = sh.dense("w").num_blocks
        early = [e for d, e in t.replies if d and e]
        resent = [e for d, e in t.replies if d and not e]
        assert 1 <= len(early) < n and len(resent) == n  # some blocks early, then all again
        assert not t.status_early
        assert sh.dense("w").recomputed == 1
    assert [sh.dense("w").version for sh in cl.shards] == [2, 2]


def _raw_chunks(g: np.ndarray, seq: int, nan_last: bool = False, early: bool = True) -> Iterator[bytes]:
    offs = list(range(0, g.size, CHUNK))
    for i, off in enumerate(offs):
        part = g[off : off + CHUNK].copy()
        if nan_last and i == len(offs) - 1:
            part[0] = np.nan
        head = pb.DenseChunk(offset=off, dtype="float32", last=i == len(offs) - 1)
        if i == 0:
            head.table, head.client, head.seq, head.return_params, head.early = "w", "raw", seq, True, early
        yield pack(head, {15: part})


def _read(replies: Iterator[bytes], n: int) -> tuple[np.ndarray, list[Any]]:
    """A fused reply assembled as the client does (later chunks overwrite earlier ones), and its messages."""
    vals = np.full(n, np.nan, np.float32)
    msgs = []
    for raw in replies:
        msg, pl = unpack(pb.DenseChunk, raw, (15,))
        msgs.append(msg)
        if 15 in pl:
            d = np.frombuffer(pl[15], np.float32)
            vals[msg.offset : msg.offset + d.size] = d
    return vals, msgs


def test_nan_in_the_last_chunk_fails_after_early_blocks_and_changes_nothing(inproc_cluster) -> None:
    """A raw fused push whose last chunk holds a NaN: early blocks came back, then the call fails
    (INVALID_ARGUMENT, naming NaN/Inf); the table's values, state and version are unchanged; the
    shard keeps serving: a good fused push then equals torch.optim's SGD step from the old values."""
    cl = inproc_cluster(1, chunk_elems=CHUNK)
    c = cl.client()
    n = CHUNK * 9 + 5  # 10 chunks on one shard
    c.create_dense("w", n, "sgd", init=np.arange(n, dtype=np.float32), lr=0.5)
    t = cl.shards[0].dense("w")
    before = t.export_state()
    g = np.ones(n, np.float32)
    seen: list[bool] = []
    with grpc.insecure_channel(cl.addresses[0]) as ch:
        push = ch.stream_stream(SVC + "PushDense")
        with pytest.raises(grpc.RpcError) as e:
            for raw in push(_raw_chunks(g, 1, nan_last=True), timeout=10):
                seen.append(unpack(pb.DenseChunk, raw)[0].early)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN/Inf" in e.value.details()
    assert seen and all(seen)  # blocks had come back early: the caller's copy is not the table's
    after = t.export_state()
    assert after["version"] == before["version"] == 0
    np.testing.assert_array_equal(after["values"], before["values"])
    out = c.push_dense("w", g, return_params=True)
    np.testing.assert_allclose(out, np.arange(n, dtype=np.float32) - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(out, c.pull_dense("w"))


def test_a_client_push_that_fails_midway_raises_and_applies_nothing(two_shards) -> None:
    """PSClient.push_dense(return_params=True) whose request stream to shard 1 breaks after early
    blocks came back raises; nothing is applied on that shard (``out`` is unspecified then, as
    documented; shard 0's part is a separate push and commits)."""
    cl, c = two_shards
    c.create_dense("w", N, "sgd", init=_w0(), lr=0.1)
    w0 = c.pull_dense("w")

    def breaks(t: _Tap) -> None:
        t.wait_early()
        raise RuntimeError("the request stream breaks here")

    _Tap(c, 1, pause_after=4, at_pause=breaks)
    with pytest.raises(PSError):
        c.push_dense("w", _grad(3), return_params=True, out=np.empty(N, np.float32))
    assert [sh.dense("w").version for sh in cl.shards[1:]] == [0]
    np.testing.assert_array_equal(c.pull_dense("w")[cl.shards[1].dense("w").start :], w0[cl.shards[1].dense("w").start :])


def test_a_duplicate_push_sends_the_table_not_its_early_blocks(inproc_cluster) -> None:
    """The same (client, seq) pushed twice: the second is answered from the dedup record (nothing
    applied), so the blocks it computed early are not the table's: the shard sends every block
    again and the assembled reply equals the table (one SGD step, not two)."""
    cl = inproc_cluster(1, chunk_elems=CHUNK)
    c = cl.client()
    n = CHUNK * 9 + 5
    c.create_dense("w", n, "sgd", init=np.zeros(n, np.float32), lr=1.0)
    g = -np.ones(n, np.float32)
    with grpc.insecure_channel(cl.addresses[0]) as ch:
        push = ch.stream_stream(SVC + "PushDense")
        first, m1 = _read(push(_raw_chunks(g, 7), timeout=10), n)
        again, m2 = _read(push(_raw_chunks(g, 7), timeout=10), n)
    np.testing.assert_array_equal(first, np.ones(n, np.float32))
    assert m1[-1].early and not m1[-1].duplicate
    assert m2[-1].duplicate and not m2[-1].early
    assert any(m.early for m in m2[:-1]) and sum(not m.early for m in m2[:-1]) == cl.shards[0].dense("w").num_blocks
    np.testing.assert_array_equal(again, np.ones(n, np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), np.ones(n, np.float32))


def test_a_caller_that_does_not_say_it_reads_while_sending_gets_the_blocks_after_the_commit(inproc_cluster) -> None:
    """A fused push without ``early`` on its first chunk (a caller that may send everything before
    reading): no block is sent before the commit; every block follows it, equal to the table."""
    cl = inproc_cluster(1, chunk_elems=CHUNK)
    c = cl.client()
    n = CHUNK * 9 + 5
    c.create_dense("w", n, "sgd", init=np.zeros(n, np.float32), lr=1.0)
    with grpc.insecure_channel(cl.addresses[0]) as ch:
        got, msgs = _read(ch.stream_stream(SVC + "PushDense")(_raw_chunks(-np.ones(n, np.float32), 1, early=False), timeout=10), n)
    assert not any(m.early for m in msgs) and len(msgs) == cl.shards[0].dense("w").num_blocks + 1
    np.testing.assert_array_equal(got, np.ones(n, np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), got)
