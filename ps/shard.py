"""A shard: its tables, its limits and its counters. What the servicer calls.

Plain Python: no gRPC, no protobuf. Every method validates before it mutates,
so a rejected request leaves the shard as it was.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ps.config import DENSE, SPARSE, ShardConfig, TableSpec
from ps.errors import DtypeError, InvalidArgumentError, ResourceExhaustedError, TableExistsError, TableNotFoundError
from ps.optim import make_optimizer
from ps.table import DenseTable, PushResult, SparseTable

__all__ = ["Shard", "TableInfo", "TableStats", "ShardStats"]


@dataclass(frozen=True)
class TableInfo:
    spec: TableSpec
    shard_index: int
    num_shards: int
    offset: int = 0
    length: int = 0
    chunk_elems: int = 0
    version: int = 0
    max_ids_per_request: int = 0


@dataclass(frozen=True)
class TableStats:
    name: str
    kind: str
    rows: int
    elements: int
    param_bytes: int
    state_bytes: int
    version: int
    offset: int = 0
    length: int = 0
    evicted: int = 0
    dropped: int = 0
    rejected: int = 0
    mean_staleness: float = -1.0
    max_staleness: int = 0


@dataclass(frozen=True)
class ShardStats:
    shard_index: int
    num_shards: int
    tables: list[TableStats]
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    uptime_s: float = 0.0


class Shard:
    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.tables: dict[str, DenseTable | SparseTable] = {}
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

    # ------------------------------------------------------------------ tables
    def create_table(
        self, spec: TableSpec, num_shards: int | None = None, validate_only: bool = False
    ) -> tuple[bool, TableInfo | None]:
        """Create ``spec`` (idempotent for an identical spec). Returns (created, info).

        ``validate_only``: run every check (and the memory budget) but create nothing; info is None
        unless the table exists."""
        if num_shards is not None and num_shards != self.config.num_shards:
            raise InvalidArgumentError(
                f"table {spec.name!r}: client assumes {num_shards} shards, this shard is {self.config.shard_index} of {self.config.num_shards}"
            )
        if spec.kind == SPARSE and spec.num_slots < self.config.num_shards:
            raise InvalidArgumentError(
                f"table {spec.name!r}: num_slots {spec.num_slots} is fewer than the {self.config.num_shards} shards"
            )
        with self._lock:
            existing = self.tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise TableExistsError(
                        f"table {spec.name!r} exists with a different spec ({_diff(existing.spec, spec)})"
                    )
                return False, self.info(spec.name)
            if spec.kind == DENSE:
                length = -(-spec.numel // self.config.num_shards)
                per_elem = 4 * (1 + _state_per_elem(spec))
                self._reserve(length * per_elem, spec.name)
                if validate_only:
                    return True, None
                table: DenseTable | SparseTable = DenseTable(
                    spec, self.config.shard_index, self.config.num_shards, self.config.chunk_elems
                )
            else:
                if validate_only:
                    return True, None
                table = SparseTable(
                    spec,
                    self.config.shard_index,
                    self.config.num_shards,
                    max_bytes_fn=lambda extra, n=spec.name: self._reserve(extra, n),
                )
            self.tables[spec.name] = table
        return True, self.info(spec.name)

    def table(self, name: str) -> DenseTable | SparseTable:
        t = self.tables.get(name)
        if t is None:
            raise TableNotFoundError(f"table {name!r} not found on shard {self.config.shard_index}")
        return t

    def dense(self, name: str) -> DenseTable:
        t = self.table(name)
        if not isinstance(t, DenseTable):
            raise DtypeError(f"table {name!r} is sparse; use the sparse calls")
        return t

    def sparse(self, name: str) -> SparseTable:
        t = self.table(name)
        if not isinstance(t, SparseTable):
            raise DtypeError(f"table {name!r} is dense; use the dense calls")
        return t

    def info(self, name: str) -> TableInfo:
        t = self.table(name)
        if isinstance(t, DenseTable):
            return TableInfo(
                t.spec, self.config.shard_index, self.config.num_shards, t.start, t.length, t.chunk_elems, t.version,
                self.config.max_ids_per_request,
            )
        return TableInfo(
            t.spec, self.config.shard_index, self.config.num_shards, version=t.step,
            max_ids_per_request=self.config.max_ids_per_request,
        )

    # ------------------------------------------------------------------ sparse
    def check_ids_request(self, name: str, n: int) -> None:
        if n > self.config.max_ids_per_request:
            raise ResourceExhaustedError(
                f"table {name!r}: {n} ids in one request exceeds the shard's limit of {self.config.max_ids_per_request}; split the request"
            )

    def pull_sparse(self, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = self.sparse(name)
        self.check_ids_request(name, len(ids))
        return t.pull(ids)

    def push_sparse(
        self, name: str, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None
    ) -> PushResult:
        t = self.sparse(name)
        self.check_ids_request(name, len(ids))
        try:
            return t.push(ids, grads, base_versions)
        except Exception:
            t.rejected += 1
            raise

    # ------------------------------------------------------------------ memory
    def held_bytes(self) -> int:
        return sum(t.held_bytes() for t in list(self.tables.values()))

    def _reserve(self, extra: int, name: str) -> None:
        limit = self.config.max_bytes
        if limit and self.held_bytes() + extra > limit:
            raise ResourceExhaustedError(
                f"table {name!r}: needs {extra} more bytes, shard {self.config.shard_index} holds {self.held_bytes()} of its {limit}-byte budget"
            )

    # ------------------------------------------------------------------ stats
    def stats(self) -> ShardStats:
        tables = []
        for name, t in sorted(self.tables.items()):
            if isinstance(t, DenseTable):
                tables.append(
                    TableStats(
                        name, "dense", 1, t.length, t.param_bytes(), t.state_bytes(), t.version, t.start, t.length,
                        rejected=t.rejected, mean_staleness=t.staleness.mean, max_staleness=t.staleness.max,
                    )
                )
            else:
                tables.append(
                    TableStats(
                        name, "sparse", t.rows, t.rows * t.dim, t.param_bytes(), t.state_bytes(), t.updates,
                        evicted=t.evicted, dropped=t.dropped, rejected=t.rejected,
                        mean_staleness=t.staleness.mean, max_staleness=t.staleness.max,
                    )
                )
        return ShardStats(
            self.config.shard_index, self.config.num_shards, tables, dict(self.requests), dict(self.errors),
            self.bytes_in, self.bytes_out, time.monotonic() - self._started,
        )


def _state_per_elem(spec: TableSpec) -> int:
    return len(make_optimizer(spec.optimizer.name, spec.optimizer.hparams).elementwise_state)


def _diff(a: TableSpec, b: TableSpec) -> str:
    fields = [f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f)]
    return ", ".join(f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in fields)
