"""Dense pushes computed at commit, in place where no reader holds a block, or into recycled blocks
as their chunks arrive (ps/table.py DenseTable/DenseUpdate).

Reference for the values: the path before this one, written out here on whole tensors: at commit,
each block's values and state are cloned and the optimizer's in-place ``update`` is applied to the
clones with step = version + 1 (assign: the values are replaced, the state kept). Every figure is
compared at fp32 1e-6 (the kernels are the same, so they match exactly in practice).
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

import ps.table
from ps.config import OptimizerSpec, TableSpec
from ps.errors import InternalError, NonFiniteError, ShapeMismatchError
from ps.optim import scaled_lr
from ps.table import ASSIGN, GRADIENT, DenseTable
from tessera.codec import to_wire

pytestmark = pytest.mark.timeout(120)

N, CHUNK = 23, 4  # 6 blocks, the last one short


EARLY = False  # _push's pushes ask to compute early (set per test by ``where``)


@pytest.fixture(autouse=True, params=["at-commit", "inline"])
def where(request, monkeypatch) -> str:
    """Each test two ways: blocks computed at commit (in place where nothing else refers to them), and
    as the chunks arrive (in the request thread, into spare blocks: a push that asks to compute early)."""
    monkeypatch.setattr(ps.table, "_EARLY_BLOCKS", 1)
    monkeypatch.setattr(sys.modules[__name__], "EARLY", request.param == "inline")
    return request.param


def _table(opt: str = "adam", n: int = N, chunk: int = CHUNK, **hp: float) -> DenseTable:
    return DenseTable(TableSpec("d", "dense", shape=(n,), optimizer=OptimizerSpec(opt, hp)), 0, 1, chunk)


class _OldPath:
    """The commit before recycled blocks: clone, then the optimizer's in-place update, per block."""

    def __init__(self, t: DenseTable) -> None:
        s = t.export_state()
        self.opt, self.chunk = t.optimizer, t.chunk_elems
        self.param = torch.from_numpy(s["values"].copy())
        self.state = {k: torch.from_numpy(v.copy()) for k, v in s["state"].items()}
        self.version = s["version"]

    def push(self, g: np.ndarray, op: str = GRADIENT, base: int = -1, sal: bool = False) -> None:
        staleness = self.version - base if base >= 0 else -1
        opt = scaled_lr(self.opt, 1.0 / staleness) if sal and staleness > 1 else self.opt
        param, state = self.param.clone(), {k: v.clone() for k, v in self.state.items()}
        for a in range(0, param.numel(), self.chunk):
            b = min(a + self.chunk, param.numel())
            if op == ASSIGN:
                param[a:b] = torch.from_numpy(g[a:b])
            else:
                st = {k: v[a:b].clone() for k, v in state.items()}
                p = param[a:b].clone()
                opt.update(p, torch.from_numpy(g[a:b].copy()), st, self.version + 1)
                param[a:b] = p
                for k, v in st.items():
                    state[k][a:b] = v
        self.param, self.state = param, state
        self.version += 1 if op == GRADIENT else 0

    def check(self, t: DenseTable) -> None:
        s = t.export_state()
        assert s["version"] == self.version
        np.testing.assert_allclose(s["values"], self.param.numpy(), rtol=1e-6, atol=1e-7)
        assert set(s["state"]) == set(self.state)
        for k in self.state:
            np.testing.assert_allclose(s["state"][k], self.state[k].numpy(), rtol=1e-6, atol=1e-7, err_msg=k)


def _push(t: DenseTable, g: np.ndarray, op: str = GRADIENT, base: int = -1, sal: bool = False, order=None):
    up = t.begin_update(op, base, staleness_aware_lr=sal, early=EARLY)
    for k in order if order is not None else range(t.num_blocks):
        a = k * t.chunk_elems
        up.apply(a, g[a : a + t.block_len(k)])
    return up.commit()


def _grad(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "nesterov", "adagrad", "adam", "adamw", "ftrl"])
def test_pushes_give_what_the_old_path_gives(opt: str) -> None:
    """Values, optimizer state and version after gradient pushes (in and out of chunk order, stale
    ones with staleness-aware lr) and an assign match the clone-then-update path."""
    hp = {"weight_decay": 0.01} if opt in ("sgd", "adam", "adamw") else {}
    t = _table(opt, **hp)
    ref = _OldPath(t)
    for i in range(6):
        g = _grad(i)
        sal = i in (3, 4)
        base = max(0, t.version - 2) if sal else -1
        order = list(reversed(range(t.num_blocks))) if i % 2 else None
        _push(t, g, base=base, sal=sal, order=order)
        ref.push(g, base=base, sal=sal)
        ref.check(t)
    v = _grad(99)
    _push(t, v, ASSIGN)
    ref.push(v, ASSIGN)
    ref.check(t)
    _push(t, _grad(7))
    ref.push(_grad(7))
    ref.check(t)
    if EARLY:
        assert t.blocks_reused > 0  # the pushes after the first wrote into recycled blocks
    else:  # nothing held a block: every push computed in place, the spares made with the table unused
        assert t.blocks_in_place == 8 * t.num_blocks and t.blocks_allocated == 0 and t.blocks_reused == 0


def test_sgd_matches_torch_optim() -> None:
    """SGD with weight decay, 5 pushes: torch.optim.SGD on the whole tensor (fp32 rtol 1e-5)."""
    t = _table("sgd", lr=0.1, weight_decay=0.01)
    p = torch.from_numpy(t.values().copy()).requires_grad_(True)
    ref = torch.optim.SGD([p], lr=0.1, weight_decay=0.01)
    for i in range(5):
        g = _grad(i)
        _push(t, g)
        p.grad = torch.from_numpy(g.copy())
        ref.step()
    np.testing.assert_allclose(t.values(), p.detach().numpy(), rtol=1e-5, atol=1e-7)


def test_a_push_whose_base_a_commit_replaced_is_computed_again(where: str) -> None:
    """Two pushes in flight: the first computes as its chunks arrive, the second commits first. The
    first must apply on top of the second (no lost update): as if applied in commit order."""
    t = _table("adam")
    ref = _OldPath(t)
    g1, g2 = _grad(1), _grad(2)
    early = t.begin_update(GRADIENT, early=EARLY)
    for k in range(3):  # half of it, computed early from version 0 (inline)
        early.apply(k * CHUNK, g1[k * CHUNK : (k + 1) * CHUNK])
    _push(t, g2)  # a second push commits in between (at commit: one early push at a time; in place)
    for k in range(3, t.num_blocks):
        early.apply(k * CHUNK, g1[k * CHUNK : k * CHUNK + t.block_len(k)])
    r = early.commit()
    ref.push(g2)
    ref.push(g1)
    ref.check(t)
    assert r.version == 2 and t.recomputed == (0 if where == "at-commit" else 1)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_failed_push_changes_nothing_and_the_table_keeps_serving(opt: str) -> None:
    """NaN in the last chunk, a stream that stops midway, a before_swap hook that raises: values,
    state and version are unchanged, the spare pool stays bounded, and the next push applies."""
    t = _table(opt)
    _push(t, _grad(0))  # spares exist from here on
    ref = _OldPath(t)
    g = _grad(1)

    up = t.begin_update(GRADIENT)
    for k in range(t.num_blocks - 1):
        up.apply(k * CHUNK, g[k * CHUNK : (k + 1) * CHUNK])
    bad = g[(t.num_blocks - 1) * CHUNK :].copy()
    bad[-1] = np.nan
    with pytest.raises(NonFiniteError):
        up.apply((t.num_blocks - 1) * CHUNK, bad)
    up.abort()
    ref.check(t)

    up = t.begin_update(GRADIENT)
    up.apply(0, g[:CHUNK])
    with pytest.raises(ShapeMismatchError, match="1 of 6 chunks"):
        up.commit()
    ref.check(t)

    def hook(res, upd) -> None:
        raise InternalError("the backup did not take it")

    up = t.begin_update(GRADIENT)
    for k in range(t.num_blocks):
        up.apply(k * CHUNK, g[k * CHUNK : k * CHUNK + t.block_len(k)])
    with pytest.raises(InternalError):
        up.commit(hook)
    ref.check(t)
    assert t.rejected == 3
    assert t.spare_blocks() <= t.num_blocks * t.spare_generations

    _push(t, g)
    ref.push(g)
    ref.check(t)


def test_readers_never_see_a_recycled_block() -> None:
    """A reader holding value blocks (the tensors of snapshot(), a numpy view, a wire view) while
    many pushes commit still reads the values of its version: blocks are reused only once nothing
    refers to them. SGD lr=1 with gradient -1: every element of version v is v."""
    t = _table("sgd", n=10 * CHUNK, lr=1.0)
    minus1 = -np.ones(10 * CHUNK, np.float32)
    _push(t, minus1)
    version, blocks = t.snapshot()
    as_numpy = blocks[3].numpy()
    as_wire = to_wire(blocks[5], "float32")[1]
    del blocks
    in_place = t.blocks_in_place
    for _ in range(5):
        _push(t, minus1)
    np.testing.assert_array_equal(as_numpy, np.full(CHUNK, version, np.float32))
    np.testing.assert_array_equal(np.frombuffer(as_wire, np.float32), np.full(CHUNK, version, np.float32))
    if EARLY:
        assert t.blocks_reused > 0
    else:  # the two held blocks went into the table's spares once; every other block, every time, in place
        assert t.blocks_allocated == 0 and t.blocks_reused == 2 and t.blocks_in_place - in_place == 5 * t.num_blocks - 2
    del as_numpy, as_wire
    reused, in_place = t.blocks_reused, t.blocks_in_place
    _push(t, minus1)
    _push(t, minus1)
    if EARLY:
        assert t.blocks_reused - reused == 2 * t.num_blocks  # once released, every block is recycled again
    else:
        assert t.blocks_in_place - in_place == 2 * t.num_blocks  # once released, computed in place again
    assert t.version == 8


@pytest.mark.timeout(120)
def test_concurrent_readers_never_see_a_torn_block() -> None:
    """Reader threads snapshot and read (twice, with a pause between) while a writer commits 300
    pushes: each read is all of one version, the same both times. SGD lr=1, gradient -1."""
    t = _table("sgd", n=16 * CHUNK, lr=1.0)
    minus1 = -np.ones(16 * CHUNK, np.float32)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            version, blocks = t.snapshot()
            first = torch.cat(blocks).numpy().copy()
            time.sleep(0.0005)
            second = torch.cat(blocks).numpy()
            if not (first == version).all() or not (second == version).all():
                bad.append(f"version {version}: read {sorted(set(first.tolist()) | set(second.tolist()))}")
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        for _ in range(300):
            _push(t, minus1)
    finally:
        stop.set()
        for th in threads:
            th.join(10)
    assert not bad, bad[:3]
    assert reads[0] > 10 and t.version == 300
    # the pushes recycled blocks while readers came and went, and (at commit) computed in place between them
    assert t.blocks_reused > 0 and (EARLY or t.blocks_in_place > 0)


def test_the_spare_pool_is_bounded() -> None:
    """However readers hold blocks, at most spare_generations retired blocks per block are kept; a
    held block is not reused (a fresh one is allocated instead)."""
    t = _table("adam", n=8 * CHUNK)
    held = []
    for i in range(20):
        if i % 3 == 0:
            held.append(t.snapshot()[1])  # a reader that keeps its blocks
        _push(t, _grad(i, 8 * CHUNK))
        assert t.spare_blocks() <= t.num_blocks * t.spare_generations
    allocated = t.blocks_allocated
    assert allocated > t.num_blocks  # held blocks forced fresh ones
    held.clear()
    for i in range(5):
        _push(t, _grad(i, 8 * CHUNK))
    assert t.blocks_allocated == allocated  # released: recycled, nothing new
    assert t.spare_blocks() == t.num_blocks
    assert t.spare_bytes() == t.spare_blocks() * CHUNK * 4 * 3  # param + exp_avg + exp_avg_sq


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork only")
def test_a_forked_child_pushes_to_a_table_the_parent_used(where: str) -> None:
    """A table the parent pushed to takes a push in a forked child (the child's copy of the spares and
    the locks; no thread of the parent is waited on there: it would hang until the test's timeout)."""
    import os

    t = _table("adam")
    _push(t, _grad(0))
    pid = os.fork()
    if pid == 0:  # the child: push, and report through the exit code
        code = 1
        try:
            _push(t, _grad(1))
            code = 0 if t.version == 2 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's push hung")


@pytest.mark.parametrize("blocks, early", [(7, False), (8, True)])
def test_pushes_compute_early_where_the_range_has_8_chunks_or_more(monkeypatch, blocks: int, early: bool) -> None:
    """The README's "for a big table (8 chunks or more on the shard) [a push whose caller reads while it
    sends] applies the optimizer to each chunk as it arrives": a push whose base another commit
    replaced midway is computed again only if it had computed early."""
    monkeypatch.setattr(ps.table, "_EARLY_BLOCKS", 8)
    n = blocks * CHUNK
    t = _table("sgd", n=n)
    g = _grad(1, n)
    up = t.begin_update(GRADIENT, early=True)
    up.apply(0, g[:CHUNK])
    _push(t, _grad(2, n))
    for k in range(1, blocks):
        up.apply(k * CHUNK, g[k * CHUNK : (k + 1) * CHUNK])
    up.commit()
    assert t.recomputed == (1 if early else 0) and t.version == 2
