"""Conditional sparse pulls (issue 16): ``PullSparse`` with ``known_versions`` against real gRPC shards.

The caller names, per id, the row version it holds; the shard answers every id's version but sends row
values only where the version moved. Reference: an unconditional pull of the same ids at the same
moment (a second client), which must give the same versions, and the same values for every row sent.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

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
    rows0, ver0 = client.pull_sparse(name, ids, return_versions=True)
    pushed = ids[::3]
    client.push_sparse(name, pushed, rng.standard_normal((len(pushed), DIM)).astype(np.float32))
    client.push_sparse(name, pushed[:10], rng.standard_normal((10, DIM)).astype(np.float32))  # some twice
    ref_rows, ref_ver = truth.pull_sparse(name, ids, return_versions=True)

    before_rows, before_bytes = client.rows_pulled[name], _bytes_out(client)
    got = client.pull_sparse_changed(name, ids, ver0)
    cond_rows, cond_bytes = client.rows_pulled[name] - before_rows, _bytes_out(client) - before_bytes
    expect = np.isin(ids, pushed)
    np.testing.assert_array_equal(got.changed, expect)
    np.testing.assert_array_equal(got.versions, ref_ver)
    np.testing.assert_array_equal(got.rows, ref_rows[expect])
    assert not np.array_equal(ref_rows[expect], rows0[expect]), "the pushes changed nothing"
    assert cond_rows == expect.sum() == 100

    # nothing held (-1): every row comes back, as from an unconditional pull
    before_bytes = _bytes_out(client)
    full = client.pull_sparse_changed(name, ids, np.full(len(ids), -1))
    full_bytes = _bytes_out(client) - before_bytes
    assert full.changed.all()
    np.testing.assert_array_equal(full.rows, ref_rows)
    assert cond_bytes < full_bytes - 190 * DIM * 4, (cond_bytes, full_bytes)  # 200 rows of 32 bytes not sent

    # on the wire: one shard's reply carries data for its changed rows only, and says so
    head = pb.PullSparseRequest(table=name, dtype="float32")
    mine = np.sort(ids)[:80]  # those the shard of the first one owns, sent to it
    owner = client._sparse_meta(name).slots.shard_of(mine)
    mine = mine[owner == owner[0]]
    held = dict(zip(ids.tolist(), ver0.tolist()))
    known = np.array([held[i] for i in mine.tolist()], np.int64)
    msg, pl = unframe(pb.PullSparseReply, client._call(int(owner[0]), "PullSparse", frame(head, known_versions=known, ids=mine)))
    n_changed = int(np.isin(mine, pushed).sum())
    assert msg.conditional and 0 < n_changed < len(mine)
    assert len(pl["data"]) == n_changed * DIM * 4 and len(pl["versions"]) == len(mine) * 8
    # an old client (no known_versions): today's reply, every row
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
    fresh = np.arange(100, 105, dtype=np.int64)  # not created yet: a pull would create them
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
        client.pull_sparse_changed(name, fresh, np.zeros(4, np.int64))
    with pytest.raises(InvalidArgumentError, match="unique ids"):
        client.pull_sparse_changed(name, np.array([1, 1, 2]), np.zeros(3, np.int64))
    got = client.pull_sparse_changed(name, fresh, np.full(5, -1))
    assert got.changed.all() and got.rows.shape == (5, DIM)
    assert client.stats()[0].tables[0].rows == rows_before + 5
