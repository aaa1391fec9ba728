"""A shard's tables: create, drop and look up its dense and sparse tables under one byte budget.
Part of ``Shard`` (its facade, ps/shard.py); plain Python, no gRPC."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Sequence

from ps.config import DENSE, SPARSE, TableSpec, spec_to_dict
from ps.consistency import SyncRound
from ps.errors import (DtypeError, FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError, TableExistsError,
                       TableNotFoundError)
from ps.shardstate import PRIMARY, ShardState
from ps.table import DenseTable, SparseTable

__all__ = ["Tables", "TableInfo", "TableStats"]

log = logging.getLogger(__name__)


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
    # sparse tables: where the bytes are (ps.table.TableMemory; "" / 0 for dense tables)
    row_dtype: str = ""
    bytes_per_row: float = 0.0
    payload_bytes_per_row: int = 0
    index_bytes: int = 0
    metadata_bytes: int = 0
    resident_rows: int = 0
    cold_rows: int = 0
    disk_bytes: int = 0
    held_bytes: int = 0
    row_path: str = ""  # sparse: "kernel" (ps.rowkernel) or "numpy (<why>)"


class Tables(ShardState):
    """The shard's tables (``tables``), their BSP rounds' creation and the byte budget they share."""

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
                    diff = ", ".join(f"{f}: {getattr(existing.spec, f)!r} != {getattr(spec, f)!r}"
                                     for f in existing.spec.__dataclass_fields__ if getattr(existing.spec, f) != getattr(spec, f))
                    raise TableExistsError(f"table {spec.name!r} exists with a different spec ({diff})")
                return False, self.info(spec.name)
            if len(self.tables) >= self.config.max_tables:
                raise ResourceExhaustedError(
                    f"table {spec.name!r}: shard {self.config.shard_index} holds {len(self.tables)} tables, "
                    f"its limit (max_tables) is {self.config.max_tables}"
                )
            extra = DenseTable.fixed_bytes(spec, self.config.num_shards) if spec.kind == DENSE else SparseTable.fixed_bytes(spec)
            with self._growth:
                self._reserve(extra, spec.name)
                if validate_only:
                    return True, None
                self._pending += extra  # counted until the table is in self.tables (it counts itself then)
            try:
                budget = functools.partial(self._reserve, name=spec.name)
                if spec.kind == DENSE:
                    table: DenseTable | SparseTable = DenseTable(
                        spec, self.config.shard_index, self.config.num_shards, self.config.chunk_elems,
                        max_bytes_fn=budget, growth_lock=self._growth,
                    )
                else:
                    # its row chunks under a byte budget: 64 MiB, at most an eighth of the budget (a table grows a chunk
                    # at a time: a 128 MiB budget in 64 MiB chunks would leave most of its last chunk's worth unusable),
                    # at least 256 KiB
                    mb = self.config.max_bytes
                    table = SparseTable(
                        spec, self.config.shard_index, self.config.num_shards, max_bytes_fn=budget,
                        resident_budget=self.resident_budget, spill_dir=self.config.spill_dir or None,
                        growth_lock=self._growth, chunk_bytes=64 << 20 if not mb else max(256 << 10, min(64 << 20, mb // 8)),
                    )
                with self.gate.shared():
                    self._replicate({"k": "create", "spec": spec_to_dict(spec)})
                    self.tables[spec.name] = table
                    self.rounds[spec.name] = SyncRound(
                        spec.name, self.membership, functools.partial(self._apply_round, spec.name),
                        on_hold=functools.partial(self._replicate_contribution, spec.name),
                    )
            finally:
                with self._growth:
                    self._pending -= extra
        return True, self.info(spec.name)

    def drop_tables(self, names: Sequence[str], missing_ok: bool = False) -> tuple[list[str], str]:
        """Drop ``names`` from this shard: values, optimizer state, BSP round (its waiters and later
        pushes get TableNotFoundError) and dedup records. Returns (the names dropped, the path of
        the checkpoint written after the drop: "" without ``config.checkpoint_dir``).

        Validated first: a name this shard does not hold raises TableNotFoundError naming it and
        nothing is dropped (``missing_ok``: it is skipped). Forwarded to the backup before it takes
        effect here (a backup that does not take it: ShardUnavailableError, nothing dropped). With a
        checkpoint directory a checkpoint is written right after, so the newest checkpoint never holds
        a dropped table; if that write fails the tables stay dropped and FailedPreconditionError says so."""
        if len(names) > self.config.max_tables:
            raise InvalidArgumentError(f"DropTable: {len(names)} names, more than the shard's {self.config.max_tables} tables")
        if not all(names):
            raise InvalidArgumentError("DropTable: a table name is empty")
        names = list(dict.fromkeys(names))
        if not names:
            raise InvalidArgumentError("DropTable: name at least one table")
        with self._lock:
            missing = [n for n in names if n not in self.tables]
            if missing and not missing_ok:
                raise TableNotFoundError(f"table {missing[0]!r} not found on shard {self.config.shard_index}; nothing dropped")
            present = [n for n in names if n in self.tables]
            if not present:
                return [], ""
            tables = [self.tables[n] for n in present]
            # the lock order of create_table (shard lock, then the gate). A commit in flight on a table
            # being dropped either forwarded its mutation before the drop (the backup applies both in
            # order) or finds its table gone in its before_swap hook and applies nothing; one that
            # passed the hook just before lands on the detached table (invisible) and the backup skips it
            with self.gate.shared():
                self._replicate({"k": "drop", "tables": present})
                for n in present:
                    del self.tables[n]
                    r = self.rounds.pop(n, None)
                    if r is not None:
                        r.drop(f"table {n!r} was dropped from shard {self.config.shard_index}")
                    self.dedup.forget(n)
        for t in tables:
            if isinstance(t, SparseTable):
                t.close()
        log.info("shard %d: dropped tables %s", self.config.shard_index, ", ".join(map(repr, present)))
        path = ""
        if self.config.checkpoint_dir:
            try:
                path = self.save_checkpoint()
            except Exception as e:  # noqa: BLE001 - reported to the caller: the newest checkpoint still holds them
                self.maintenance_errors += 1
                log.exception("shard %d: checkpoint after dropping %s failed", self.config.shard_index, present)
                if self.role != PRIMARY:
                    return present, ""  # a backup: the primary's drop stands; its own next checkpoint catches up
                raise FailedPreconditionError(
                    f"tables {present} dropped from shard {self.config.shard_index}, but the checkpoint written after "
                    f"the drop failed ({type(e).__name__}: {e}): until the next checkpoint, a --restore brings them back"
                ) from None
        return present, path

    def _live(self, name: str, t: DenseTable | SparseTable) -> None:
        """Raise TableNotFoundError if ``t`` is no longer the table ``name`` (dropped meanwhile)."""
        if self.tables.get(name) is not t:
            raise TableNotFoundError(f"table {name!r} was dropped from shard {self.config.shard_index}; nothing applied")

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
        t, c = self.table(name), self.config
        if isinstance(t, DenseTable):
            return TableInfo(t.spec, c.shard_index, c.num_shards, t.start, t.length, t.chunk_elems, t.version, c.max_ids_per_request)
        return TableInfo(t.spec, c.shard_index, c.num_shards, version=t.step, max_ids_per_request=c.max_ids_per_request)

    def check_ids_request(self, name: str, n: int) -> None:
        if n > self.config.max_ids_per_request:
            raise ResourceExhaustedError(
                f"table {name!r}: {n} ids in one request exceeds the shard's limit of {self.config.max_ids_per_request}; split the request"
            )

    def sparse_reply_dtype(self, name: str, wire_dtype: str = "float32") -> str:
        """The dtype a sparse pull of ``name`` answers in: ``wire_dtype`` (the caller's) for a float32
        table; a low-precision table's rows travel as stored (its row dtype: exact, never rounded twice,
        and no more bytes than any wire dtype asked for)."""
        row_dtype = self.sparse(name).spec.dtype
        return wire_dtype if row_dtype == "float32" else row_dtype

    def held_bytes(self) -> int:
        """What the tables hold (``config.max_bytes`` bounds it), and what tables being created were
        granted. Takes no lock: tables ask the budget while holding their own lock and ``_growth``
        (list() of a dict's values is one step under the GIL)."""
        return sum(t.held_bytes() for t in list(self.tables.values())) + self._pending

    def _tables(self) -> list[DenseTable | SparseTable]:
        with self._lock:
            return list(self.tables.values())

    def _reserve(self, extra: int, name: str) -> None:
        """Raise ResourceExhaustedError if ``extra`` more bytes would take the tables over
        ``config.max_bytes``. Callers hold ``_growth`` from this check until the bytes are
        allocated (and counted by ``held_bytes``), so concurrent growth cannot overshoot."""
        limit = self.config.max_bytes
        if limit and self.held_bytes() + extra > limit:
            raise ResourceExhaustedError(
                f"table {name!r}: needs {extra} more bytes, shard {self.config.shard_index} holds {self.held_bytes()} of its {limit}-byte budget"
            )

    def _close_tables(self) -> None:
        """Give back the sparse tables' disk-tier files and resident-budget shares."""
        for t in list(self.tables.values()):
            if isinstance(t, SparseTable):
                t.close()
