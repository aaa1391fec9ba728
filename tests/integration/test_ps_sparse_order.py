"""Sparse rows come back in the caller's order, whatever the ids' order (sorted, distinct but unsorted,
duplicated, torch), by ``pull_sparse`` and by ``step``; a push reuses the grouping of the ids the last
pull sent only while they are the same ids, even when the caller changed that array in place since.

Against real shard servers in this process (two shards, so ids are split between them). Reference:
numpy SGD (lr 0.5) from zeros, one value per id (each row its id's gradient), kept in a dict.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(60)

DIM = 3
LR = 0.5


def _grad(ids: np.ndarray) -> np.ndarray:
    """A gradient row per id that tells ids apart: (id, id / 7, 1)."""
    ids = np.asarray(ids, np.float32).reshape(-1)
    return np.stack([ids, ids / 7, np.ones_like(ids)], axis=1).astype(np.float32)


def _want(ref: dict[int, np.ndarray], ids: np.ndarray) -> np.ndarray:
    flat = np.asarray(ids).reshape(-1)
    return np.stack([ref.get(int(i), np.zeros(DIM, np.float32)) for i in flat]).reshape(np.shape(ids) + (DIM,))


def _push(c, ref: dict[int, np.ndarray], ids: np.ndarray) -> None:
    """Push each id's gradient once (distinct ids, rows pulled before: a push skips rows a shard does
    not hold) and apply the same SGD step to the reference."""
    c.push_sparse("e", ids, _grad(ids).reshape(np.shape(ids) + (DIM,)))
    for i, g in zip(np.asarray(ids).reshape(-1), _grad(ids)):
        ref[int(i)] = ref.get(int(i), np.zeros(DIM, np.float32)) - np.float32(LR) * g


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "duplicates", "torch", "2d"])
def test_rows_come_back_in_the_callers_order(inproc_cluster, kind: str) -> None:
    """pull_sparse and step's pull of the same ids give the reference rows, id by id, in the ids' order."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0")
    c.create_sparse("e", DIM, "sgd", lr=LR)
    ref: dict[int, np.ndarray] = {}
    c.pull_sparse("e", np.array([3, 11, 40, 57, 98, 1001, -5], np.int64))  # the rows exist (zeros)
    _push(c, ref, np.array([3, 11, 40, 57, 98, 1001, -5], np.int64))
    ids = {
        "sorted": np.array([-5, 3, 11, 40, 57, 98, 1001, 2000], np.int64),
        "unsorted": np.array([98, 3, 2000, -5, 57, 1001, 11, 40], np.int64),
        "duplicates": np.array([98, 3, 98, -5, 3, 3, 2000], np.int64),
        "torch": torch.tensor([1001, -5, 40, 2000, 3], dtype=torch.int64),
        "2d": np.array([[57, 3], [2000, 98], [-5, 11]], np.int64),
    }[kind]
    np_ids = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    want = _want(ref, np_ids)
    rows, versions = c.pull_sparse("e", ids, return_versions=True)
    got = c.step(pull_sparse={"e": ids}).sparse["e"]
    for r, v in (rows, versions), got:
        if kind == "torch":
            assert isinstance(r, torch.Tensor) and isinstance(v, torch.Tensor)
            r, v = r.numpy(), v.numpy()
        assert r.shape == np_ids.shape + (DIM,) and v.shape == np_ids.shape
        np.testing.assert_allclose(r, want, rtol=1e-6)
        np.testing.assert_array_equal(v, np.isin(np_ids, list(ref)).astype(np.int64))  # one update per pushed id


def test_a_push_regroups_ids_the_caller_changed_in_place(inproc_cluster) -> None:
    """Pull ids A, overwrite A in place with other ids, push with a fresh array equal to A's old ids, then
    with A (the new ids), twice: each push reaches the rows of the ids it carries."""
    cluster = inproc_cluster(2)
    c = cluster.client(worker="w0")
    c.create_sparse("e", DIM, "sgd", lr=LR)
    ref: dict[int, np.ndarray] = {}
    c.pull_sparse("e", np.arange(100))  # every row used below exists (zeros)
    a = np.array([2, 5, 9, 14, 33, 70], np.int64)  # sorted and distinct: the client may keep it as sent
    old = a.copy()
    c.pull_sparse("e", a)
    a[:] = [1, 6, 8, 15, 34, 71]
    _push(c, ref, old.copy())  # equal to what was pulled: that grouping, but not the array changed since
    _push(c, ref, a)  # the ids now in the array, not the ones pulled
    _push(c, ref, a.copy())  # the same again (the grouping of the last ids)
    everything = np.concatenate([old, a])
    np.testing.assert_allclose(c.pull_sparse("e", everything), _want(ref, everything), rtol=1e-6)
    res = c.step(push_sparse={"e": (a, _grad(a))}, pull_sparse={"e": a})  # pushes t, then pulls t+1's rows
    for i, g in zip(a, _grad(a)):
        ref[int(i)] = ref[int(i)] - np.float32(LR) * g
    np.testing.assert_allclose(res.sparse["e"][0], _want(ref, a), rtol=1e-6)


def test_calls_of_no_ids_answer_empty(inproc_cluster) -> None:
    """A pull, a conditional pull, a push and a step of zero ids answer empty, shaped by the ids (the
    fan-out had no call to make: it raised IndexError)."""
    c = inproc_cluster(2).client(worker="w0")
    c.create_sparse("e", DIM, "sgd", lr=LR)
    none = np.zeros(0, np.int64)
    rows, versions = c.pull_sparse("e", none, return_versions=True)
    assert rows.shape == (0, DIM) and versions.shape == (0,)
    assert c.push_sparse("e", none, np.zeros((0, DIM), np.float32)).applied == 0
    changed = c.pull_sparse_changed("e", none, none, none)
    assert changed.rows.shape == (0, DIM) and changed.changed.shape == (0,) and changed.versions.shape == (0,)
    got = c.step(push_sparse={"e": (none, np.zeros((0, DIM), np.float32))}, pull_sparse={"e": torch.zeros((0, 2), dtype=torch.int64)})
    assert tuple(got.sparse["e"][0].shape) == (0, 2, DIM) and isinstance(got.sparse["e"][0], torch.Tensor)
