"""Partitioning and determinism across real shard processes.

References: an even split (each shard within one element of N/S, measured by
the shards' own Stats RPC), and a 1-shard cluster for sparse initial rows.

The tests share one 4-shard cluster (each works on tables of its own names, and what one counts,
another does not touch), so the module starts 5 shard processes, not 10.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Iterator

import numpy as np
import pytest

from ps.cli import start_local_shards, stop_processes
from ps.client import PSClient


@pytest.fixture(scope="module")
def four() -> Iterator[list[str]]:
    """Addresses of 4 shard processes, shared by the module's tests."""
    procs, addresses = start_local_shards(4)
    try:
        yield addresses
    finally:
        stop_processes(procs, grace=3.0)


def test_dense_params_and_state_split_evenly(four) -> None:
    addresses = four
    with PSClient(addresses) as c:
        n = 1_000_003
        c.create_dense("big", (n,), "adam", lr=0.01)  # adam: 2 state elements per parameter
        c.create_dense("mom", (10, 10), "momentum", lr=0.1)
        stats = c.stats()
    for name, numel, state_per_elem in (("big", n, 2), ("mom", 100, 1)):
        held = [next(t for t in s.tables if t.name == name) for s in stats]
        assert sum(t.elements for t in held) == numel
        for t in held:
            assert abs(t.elements - numel / 4) <= 1, (name, t.elements)
            assert t.param_bytes == 4 * t.elements
            assert t.state_bytes == 4 * state_per_elem * t.elements
        # contiguous, non-overlapping ranges in shard order
        assert [t.offset for t in held] == [sum(t.length for t in held[:k]) for k in range(4)]


def test_sparse_initial_rows_do_not_depend_on_shard_count(proc_cluster, four) -> None:
    one = proc_cluster(1)
    ids = np.concatenate([np.arange(-50, 50), np.array([2**62, -(2**63), 2**63 - 1, 987654321987])]).astype(np.int64)
    rows = []
    for addresses in (one, four):
        with PSClient(addresses) as c:
            for init in ("normal", "uniform"):
                c.create_sparse(f"emb-{init}", 16, "adagrad", init=init, seed=42)
            rows.append([c.pull_sparse(f"emb-{init}", ids) for init in ("normal", "uniform")])
            c.push_sparse("emb-normal", ids, np.zeros((len(ids), 16), np.float32))  # pushes make rows (pulls read)
            stats = c.stats()
        assert sum(next(t for t in s.tables if t.name == "emb-normal").rows for s in stats) == len(ids)
        if len(addresses) == 4:  # every shard got a share of the ids
            assert all(next(t for t in s.tables if t.name == "emb-normal").rows > 0 for s in stats)
    for a, b in zip(rows[0], rows[1]):
        np.testing.assert_array_equal(a, b)
    normal = rows[0][0]
    assert abs(normal.mean()) < 0.002 and 0.0095 < normal.std() < 0.0105  # N(0, 0.01) by default
    assert len(np.unique(normal[:, 0])) == len(ids)  # distinct per id


def test_stats_cli(four) -> None:
    addresses = four
    with PSClient(addresses) as c:
        c.create_dense("w", (10,), "adam")
        c.push_dense("w", np.ones(10, np.float32))  # the module's only dense push
    out = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "ps", "stats", "--ps", ",".join(addresses)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert all(f"shard {k}/4" in out for k in range(4)) and "PushDense=1" in out, out
    assert out.count(" w ") == 4, out
    js = json.loads(
        subprocess.run(
            [sys.executable, "-m", "tessera.cli", "ps", "stats", "--ps", ",".join(addresses), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    )
    w = [next(t for t in s["tables"] if t["name"] == "w") for s in js]
    assert [t["elements"] for t in w] == [3, 3, 2, 2]  # 10 elements in 4 near-equal contiguous ranges
    assert all(t["state_bytes"] == 8 * t["elements"] for t in w)  # adam: 2 float32 per element
