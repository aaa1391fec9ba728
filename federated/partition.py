"""Split a labelled dataset among simulated clients. Pure numpy, deterministic by seed.

Every partitioner returns one sorted int64 index array per client; the arrays are
disjoint and together cover the dataset (except ``shards``, which drops the
remainder when the data does not divide into equal shards).

* ``iid``: a random permutation cut into near-equal parts.
* ``dirichlet:ALPHA``: label skew (Hsu et al. 2019, as in NIID-Bench): for each
  class, the class's samples are split among clients by proportions drawn from
  Dir(ALPHA); small ALPHA gives each client few classes. Every client gets at
  least ``min_size`` samples.
* ``shards:S``: sort by label, cut into ``num_clients * S`` equal shards and give
  each client S random shards (McMahan et al. 2017's pathological non-IID split).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from federated.errors import ConfigError

__all__ = ["PartitionSpec", "parse_partition", "partition", "iid", "dirichlet", "label_shards", "label_counts"]


@dataclass(frozen=True)
class PartitionSpec:
    kind: str = "iid"  # iid | dirichlet | shards
    param: float = 0.0  # dirichlet: alpha; shards: shards per client

    def __str__(self) -> str:
        return self.kind if self.kind == "iid" else f"{self.kind}:{self.param:g}"


def parse_partition(spec: str) -> PartitionSpec:
    """``"iid"``, ``"dirichlet:0.5"``, ``"shards:2"`` -> PartitionSpec (ConfigError otherwise)."""
    kind, _, arg = spec.strip().lower().partition(":")
    if kind == "iid" and not arg:
        return PartitionSpec("iid")
    if kind in ("dirichlet", "shards"):
        try:
            value = float(arg) if arg else (0.5 if kind == "dirichlet" else 2.0)
        except ValueError:
            raise ConfigError(f"partition {spec!r}: {arg!r} is not a number") from None
        if kind == "dirichlet" and not (value > 0 and np.isfinite(value)):
            raise ConfigError(f"partition {spec!r}: alpha must be > 0")
        if kind == "shards" and (value < 1 or value != int(value)):
            raise ConfigError(f"partition {spec!r}: shards per client must be an integer >= 1")
        return PartitionSpec(kind, value)
    raise ConfigError(f"unknown partition {spec!r}; use iid, dirichlet:ALPHA or shards:S")


def _check(n: int, num_clients: int, min_size: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients * min_size > n:
        raise ConfigError(f"{n} samples cannot give {num_clients} clients {min_size} each")


def iid(n: int, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Near-equal random parts of range(n) (sizes differ by at most one)."""
    _check(n, num_clients, 1)
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1,
              max_tries: int = 100) -> list[np.ndarray]:
    """Label-skewed parts: per class, proportions ~ Dir(alpha) over clients.

    Clients already holding ``n / num_clients`` samples get no more of the next
    classes (NIID-Bench's balancing), and the draw is repeated until every client
    has ``min_size`` samples; after ``max_tries`` the smallest clients are topped up
    from the largest one, so the result always exists and stays deterministic.
    """
    labels = np.asarray(labels)
    n = len(labels)
    _check(n, num_clients, min_size)
    if not alpha > 0:
        raise ConfigError(f"dirichlet alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    parts: list[list[int]] = []
    for _ in range(max_tries):
        parts = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = p * np.array([len(b) < n / num_clients for b in parts])
            s = p.sum()
            p = p / s if s > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for b, piece in zip(parts, np.split(idx, cuts)):
                b.extend(piece.tolist())
        if min(len(b) for b in parts) >= min_size:
            break
    else:
        for b in sorted(parts, key=len):
            while len(b) < min_size:
                big = max(parts, key=len)
                b.append(big.pop())
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in parts]


def label_shards(labels: np.ndarray, num_clients: int, shards_per_client: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Sort by label (stable), cut into ``num_clients * shards_per_client`` equal shards,
    give each client ``shards_per_client`` random ones. The remainder is dropped."""
    labels = np.asarray(labels)
    n = len(labels)
    total = num_clients * shards_per_client
    _check(n, total, 1)
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    size = n // total
    shards = [order[i * size : (i + 1) * size] for i in range(total)]
    pick = rng.permutation(total).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[j] for j in row])).astype(np.int64) for row in pick]


def partition(labels: np.ndarray, num_clients: int, spec: PartitionSpec | str, seed: int = 0) -> list[np.ndarray]:
    """Dispatch on ``spec`` (a PartitionSpec or its string)."""
    if isinstance(spec, str):
        spec = parse_partition(spec)
    if spec.kind == "iid":
        return iid(len(labels), num_clients, seed)
    if spec.kind == "dirichlet":
        return dirichlet(labels, num_clients, spec.param, seed)
    return label_shards(labels, num_clients, int(spec.param), seed)


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int | None = None) -> np.ndarray:
    """(clients, classes) matrix of how many samples of each class each client holds."""
    labels = np.asarray(labels)
    k = int(num_classes if num_classes is not None else labels.max() + 1)
    return np.stack([np.bincount(labels[p], minlength=k) for p in parts]) if parts else np.zeros((0, k), np.int64)
