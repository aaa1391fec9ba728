"""Conditional sparse pulls (issue 16): ``PullSparse`` with ``known_versions`` against real gRPC shards.

The caller names, per id, the row version it holds; the shard answers every id's version but sends row
values only where the version moved. Reference: an unconditional pull of the same ids at the same
moment (a second client), which must give the same versions, and the same values for every row sent.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps import AdmissionSpec, EvictionSpec
from ps.errors import InvalidArgumentError
from ps.wire import frame, unframe
from tessera.v1 import ps_pb2 as pb

DIM = 8


def _table(cluster, name: str = "cond/emb"):
    client = cluster.client()
    client.create_sparse(name, DIM, optimizer="adagrad", lr=0.1)
    return client, name


def _bytes_out(client) -> int:
    return sum(s.bytes_out for s in client.stats())


def test_conditional_pull_sends_only_rows_whose_version_moved(inproc_cluster) -> None:
    """2 shards; 300 rows pulled (version 0), then every third one pushed. A conditional pull naming the
    versions held gives the versions and values of an unconditional pull for the pushed rows, and no
    values for the others: the client's row counter, the raw reply's data and the shards' bytes out
    all shrink by the rows left out."""
    cluster = inproc_cluster(2)
    client, name = _table(cluster)
    truth = cluster.client()
    rng = np.random.default_rng(0)
    ids = rng.permutation(10_000)[:300].astype(np.int64)  # scattered over both shards, caller order unsorted
    first = client.pull_sparse_changed(name, ids, np.full(len(ids), -1), np.zeros(len(ids)))  # nothing held: every row
    assert first.changed.all()
    rows0, ver0, ep0 = first.rows, first.versions, first.epochs
    pushed = ids[::3]
    client.push_sparse(name, pushed, rng.standard_normal((len(pushed), DIM)).astype(np.float32))
    client.push_sparse(name, pushed[:10], rng.standard_normal((10, DIM)).astype(np.float32))  # some twice
    ref_rows, ref_ver = truth.pull_sparse(name, ids, return_versions=True)

    before_rows, before_bytes = client.rows_pulled[name], _bytes_out(client)
    got = client.pull_sparse_changed(name, ids, ver0, ep0)
    cond_rows, cond_bytes = client.rows_pulled[name] - before_rows, _bytes_out(client) - before_bytes
    expect = np.isin(ids, pushed)
    np.testing.assert_array_equal(got.changed, expect)
    np.testing.assert_array_equal(got.versions, ref_ver)
    np.testing.assert_array_equal(got.rows, ref_rows[expect])
    assert not np.array_equal(ref_rows[expect], rows0[expect]), "the pushes changed nothing"
    assert cond_rows == expect.sum() == 100

    # nothing held (-1): every row comes back, as from an unconditional pull
    before_bytes = _bytes_out(client)
    full = client.pull_sparse_changed(name, ids, np.full(len(ids), -1), ep0)
    full_bytes = _bytes_out(client) - before_bytes
    assert full.changed.all()
    np.testing.assert_array_equal(full.rows, ref_rows)
    assert cond_bytes < full_bytes - 190 * DIM * 4, (cond_bytes, full_bytes)  # 200 rows of 32 bytes not sent

    # on the wire: one shard's reply carries data for its changed rows only, and says so
    mine = np.sort(ids)[:80]  # those the shard of the first one owns, sent to it
    owner = client._sparse_meta(name).slots.shard_of(mine)
    mine = mine[owner == owner[0]]
    held = dict(zip(ids.tolist(), ver0.tolist()))
    known = np.array([held[i] for i in mine.tolist()], np.int64)
    epoch = int(ep0[ids == mine[0]][0])  # the shard's eviction epoch the versions were read at
    head = pb.PullSparseRequest(table=name, dtype="float32", known_epoch=epoch)
    msg, pl = unframe(pb.PullSparseReply, client._call(int(owner[0]), "PullSparse", frame(head, known_versions=known, ids=mine)))
    n_changed = int(np.isin(mine, pushed).sum())
    assert msg.conditional and 0 < n_changed < len(mine) and msg.epoch == epoch
    assert len(pl["data"]) == n_changed * DIM * 4 and len(pl["versions"]) == len(mine) * 8
    # another epoch named (versions read before rows were dropped, or of another instance): every row
    head.known_epoch = epoch + 1
    msg, pl = unframe(pb.PullSparseReply, client._call(int(owner[0]), "PullSparse", frame(head, known_versions=known, ids=mine)))
    assert not msg.conditional and len(pl["data"]) == len(mine) * DIM * 4
    # an old client (no known_versions): today's reply, every row
    head = pb.PullSparseRequest(table=name, dtype="float32")
    msg, pl = unframe(pb.PullSparseReply, client._call(int(owner[0]), "PullSparse", frame(head, ids=mine)))
    assert not msg.conditional and len(pl["data"]) == len(mine) * DIM * 4


def test_bad_known_versions_is_refused_naming_the_field(inproc_cluster) -> None:
    """known_versions whose length does not match the ids: INVALID_ARGUMENT naming the field, no row
    created, and the shard goes on serving (a good pull right after). The client checks the same before
    sending (and refuses repeated ids, whose known versions could disagree)."""
    cluster = inproc_cluster(1)
    client, name = _table(cluster)
    client.pull_sparse(name, np.arange(10, dtype=np.int64))
    rows_before = client.stats()[0].tables[0].rows
    fresh = np.arange(100, 105, dtype=np.int64)  # not created (pulls only read: they stay absent)
    head = pb.PullSparseRequest(table=name, dtype="float32")
    raw = frame(head, known_versions=np.zeros(3, np.int64), ids=fresh)
    unary = client._shards[0].replicas[0].unary["PullSparse"]
    with pytest.raises(grpc.RpcError) as e:
        unary(raw, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "known_versions" in e.value.details() and "5 ids" in e.value.details()
    with pytest.raises(InvalidArgumentError, match="known_versions"):  # typed, through the client's call path
        client._call(0, "PullSparse", frame(head, known_versions=b"\0" * 7, ids=fresh), name)
    assert client.stats()[0].tables[0].rows == rows_before, "a refused pull created rows"
    with pytest.raises(InvalidArgumentError, match="known_versions has 4 entries for 5 ids"):
        client.pull_sparse_changed(name, fresh, np.zeros(4, np.int64), np.zeros(5, np.int64))
    with pytest.raises(InvalidArgumentError, match="known_epochs has 6 entries for 5 ids"):
        client.pull_sparse_changed(name, fresh, np.zeros(5, np.int64), np.zeros(6, np.int64))
    with pytest.raises(InvalidArgumentError, match="unique ids"):
        client.pull_sparse_changed(name, np.array([1, 1, 2]), np.zeros(3, np.int64), np.zeros(3, np.int64))
    got = client.pull_sparse_changed(name, fresh, np.full(5, -1), np.zeros(5, np.int64))
    assert got.changed.all() and got.rows.shape == (5, DIM)
    assert client.stats()[0].tables[0].rows == rows_before


def _evict(client, name: str, how: str, rng: np.random.Generator) -> None:
    """Make the shards drop rows nobody touches now: pushes of other rows past ``ttl_steps`` (ttl), or
    pushes of more new rows than ``max_rows`` leaves room for (LRU; pulls make no rows)."""
    for k in range(4):
        filler = np.arange(10_000 + 30 * k, 10_030 + 30 * k, dtype=np.int64)
        client.push_sparse(name, filler, rng.standard_normal((len(filler), DIM)).astype(np.float32))


@pytest.mark.parametrize("how", ["ttl", "max_rows"])
def test_rows_evicted_and_created_again_at_the_same_version_are_sent(inproc_cluster, how: str) -> None:
    """The ABA case of versions: rows pulled at version 1 are evicted (``eviction.ttl_steps`` on 2 shards,
    or ``max_rows`` LRU on 1), created again and pushed once with other gradients: back at version 1 with
    other values. A conditional pull naming the old versions and their eviction epochs gets every row,
    values and versions equal to an unconditional pull by a second client (the reference); before
    eviction epochs, the versions matched and the stale rows were reported unchanged."""
    eviction = EvictionSpec(ttl_steps=2) if how == "ttl" else EvictionSpec(max_rows=60)
    cluster = inproc_cluster(2 if how == "ttl" else 1)
    client, truth = cluster.client(), cluster.client()
    name = f"cond/evict_{how}"
    client.create_sparse(name, DIM, optimizer="adagrad", init="normal", eviction=eviction, lr=0.1)
    rng = np.random.default_rng(1)
    ids = rng.permutation(5000)[:40].astype(np.int64)
    none = np.full(len(ids), -1)
    first = client.pull_sparse_changed(name, ids, none, np.zeros(len(ids)))  # initial values (version 0), nothing made
    client.push_sparse(name, ids, rng.standard_normal((len(ids), DIM)).astype(np.float32))
    held = client.pull_sparse_changed(name, ids, first.versions, first.epochs)
    assert held.changed.all() and (held.versions == 1).all()
    # nothing dropped yet: the same pull again sends nothing (the epochs still hold)
    again = client.pull_sparse_changed(name, ids, held.versions, held.epochs)
    assert not again.changed.any() and np.array_equal(again.epochs, held.epochs)

    _evict(truth, name, how, rng)
    _, v = truth.pull_sparse(name, ids, return_versions=True)  # the evicted ones read as new: version 0
    recreated = v == 0
    assert recreated.sum() >= len(ids) // 4, f"{how}: only {recreated.sum()} of {len(ids)} rows were evicted"
    truth.push_sparse(name, ids[recreated], rng.standard_normal((int(recreated.sum()), DIM)).astype(np.float32))
    ref_rows, ref_ver = truth.pull_sparse(name, ids, return_versions=True)
    assert (ref_ver[recreated] == 1).all(), "the evicted rows are not back at the version held"
    assert not np.array_equal(ref_rows[recreated], held.rows[recreated]), "the same values again: the test compares nothing"

    got = client.pull_sparse_changed(name, ids, held.versions, held.epochs)
    assert got.changed.all(), f"{int((~got.changed[recreated]).sum())} evicted rows reported unchanged"
    np.testing.assert_array_equal(got.versions, ref_ver)
    np.testing.assert_array_equal(got.rows, ref_rows)
    assert not np.array_equal(got.epochs, held.epochs)
    # the new epochs hold again: nothing changed since, nothing sent
    after = client.pull_sparse_changed(name, ids, got.versions, got.epochs)
    assert not after.changed.any()


def test_rows_not_admitted_yet_are_stable_at_version_zero(inproc_cluster) -> None:
    """Admission (``min_count=3``, counted per push) with a random-looking initializer and bfloat16 rows:
    a row the shard does not store yet reads at version 0 with its initial values, pulls do not count
    as sightings, and pushes refused by admission change nothing, so a cached version 0 stays valid and
    a conditional pull sends nothing for it; the third push creates the rows from exactly those values
    and updates them (version 1), and the conditional pull sends them. Reference: an unconditional
    pull by a second client, and one Adagrad step from the initial values."""
    cluster = inproc_cluster(2)
    client, truth = cluster.client(), cluster.client()
    name = "cond/admit"
    client.create_sparse(name, DIM, optimizer="adagrad", init="normal", admission=AdmissionSpec(min_count=3),
                         row_dtype="bfloat16", lr=0.1)
    ids = np.arange(50, 90, dtype=np.int64)
    first = client.pull_sparse_changed(name, ids, np.full(len(ids), -1), np.zeros(len(ids)))
    assert (first.versions == 0).all()

    def rows() -> int:
        return sum(t.rows for s in client.stats() for t in s.tables if t.name == name)

    for _ in range(3):
        client.pull_sparse(name, ids)  # reads: no sighting
    g = np.ones((len(ids), DIM), np.float32)
    for _ in range(2):  # sightings 1 and 2: refused by admission, nothing stored
        client.push_sparse(name, ids, g)
        got = client.pull_sparse_changed(name, ids, first.versions, first.epochs)
        assert not got.changed.any() and (got.versions == 0).all() and rows() == 0
    ref_rows, ref_ver = truth.pull_sparse(name, ids, return_versions=True)
    np.testing.assert_array_equal(first.rows, ref_rows)
    assert (ref_ver == 0).all() and np.abs(ref_rows).max() > 0
    client.push_sparse(name, ids, g)  # sighting 3: admitted, created from the initial values, updated
    assert rows() == len(ids)
    got = client.pull_sparse_changed(name, ids, first.versions, first.epochs)
    ref_rows, ref_ver = truth.pull_sparse(name, ids, return_versions=True)
    assert got.changed.all() and (got.versions == 1).all() and (ref_ver == 1).all()
    np.testing.assert_array_equal(got.rows, ref_rows)
    # Adagrad's first step moves each value by lr * g / |g| = 0.1 (then rounded to bfloat16)
    np.testing.assert_allclose(ref_rows, first.rows - 0.1, atol=0.02)
