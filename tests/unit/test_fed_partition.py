"""Partitioners: disjoint, covering, deterministic by seed, and skewed as asked."""
from __future__ import annotations

import numpy as np
import pytest

from federated.errors import ConfigError
from federated.partition import PartitionSpec, dirichlet, iid, label_counts, label_shards, parse_partition, partition

LABELS = np.repeat(np.arange(10), [150, 160, 170, 180, 140, 150, 160, 170, 180, 130])  # 1590 samples
np.random.default_rng(0).shuffle(LABELS)


def _disjoint_cover(parts: list[np.ndarray], n: int, full: bool = True) -> None:
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "parts overlap"
    if full:
        assert np.array_equal(np.sort(allidx), np.arange(n))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)


def test_parse() -> None:
    assert parse_partition("iid") == PartitionSpec("iid")
    assert parse_partition("dirichlet:0.5") == PartitionSpec("dirichlet", 0.5)
    assert parse_partition("shards:2") == PartitionSpec("shards", 2.0)
    assert str(parse_partition("dirichlet:0.5")) == "dirichlet:0.5"
    for bad in ("random", "dirichlet:0", "dirichlet:-1", "shards:1.5", "shards:0", "iid:3", "dirichlet:x"):
        with pytest.raises(ConfigError):
            parse_partition(bad)


def test_iid_is_balanced_disjoint_and_seeded() -> None:
    parts = iid(len(LABELS), 7, seed=1)
    _disjoint_cover(parts, len(LABELS))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid(len(LABELS), 7, seed=1)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, iid(len(LABELS), 7, seed=2)))


def test_dirichlet_skew_follows_alpha() -> None:
    def classes_per_client(alpha: float) -> float:
        parts = dirichlet(LABELS, 20, alpha, seed=3)
        _disjoint_cover(parts, len(LABELS))
        counts = label_counts(LABELS, parts)
        # classes holding >= 5 % of the client's data
        return float(np.mean([(c >= 0.05 * c.sum()).sum() for c in counts]))

    few, many = classes_per_client(0.1), classes_per_client(100.0)
    assert few < 4 < 8 < many, (few, many)


def test_dirichlet_is_deterministic_and_respects_min_size() -> None:
    a = dirichlet(LABELS, 100, 0.5, seed=0, min_size=5)
    b = partition(LABELS, 100, "dirichlet:0.5", seed=0)
    assert all(len(p) >= 5 for p in a)
    _disjoint_cover(a, len(LABELS))
    assert all(len(p) >= 1 for p in b)
    assert all(np.array_equal(x, y) for x, y in zip(a, dirichlet(LABELS, 100, 0.5, seed=0, min_size=5)))
    # a nearly impossible draw still ends with every client served (top-up from the largest)
    c = dirichlet(LABELS, 300, 0.01, seed=0, min_size=5, max_tries=2)
    _disjoint_cover(c, len(LABELS))
    assert min(len(p) for p in c) >= 5


def test_label_shards_give_each_client_few_labels() -> None:
    parts = label_shards(LABELS, 20, shards_per_client=2, seed=4)
    _disjoint_cover(parts, len(LABELS), full=False)
    size = len(LABELS) // 40
    assert all(len(p) == 2 * size for p in parts)
    counts = label_counts(LABELS, parts)
    assert max((c > 0).sum() for c in counts) <= 4  # each shard spans at most 2 labels
    assert all(np.array_equal(x, y) for x, y in zip(parts, partition(LABELS, 20, "shards:2", seed=4)))


def test_impossible_requests_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="cannot give"):
        iid(5, 10)
    with pytest.raises(ConfigError):
        dirichlet(LABELS, 0, 0.5)
    with pytest.raises(ConfigError):
        label_shards(LABELS, 1000, 2)
    assert label_counts(LABELS, iid(len(LABELS), 4)).sum() == len(LABELS)
