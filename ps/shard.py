"""A shard: its tables, its limits and its counters. What the servicer calls.

Plain Python: no gRPC, no protobuf. Every method validates before it mutates,
so a rejected request leaves the shard as it was.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ps.checkpoint import CheckpointError, ShardSnapshot, write_checkpoint
from ps.config import DENSE, SPARSE, ShardConfig, TableSpec, spec_from_dict, spec_to_dict
from ps.consistency import LATE, Membership, SyncPolicy, SyncRound
from ps.errors import (
    DtypeError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    ShapeMismatchError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
)
from ps.optim import make_optimizer
from ps.dedup import Dedup
from ps.gate import Gate
from ps.names import WorkerNames
from ps.tier import ResidentBudget
from ps.table import GRADIENT, DenseTable, DenseUpdate, PushResult, RowDelta, SparsePush, SparseTable

log = logging.getLogger(__name__)

PRIMARY = "primary"
BACKUP = "backup"

__all__ = [
    "Shard", "TableInfo", "TableStats", "ShardStats", "MembershipView", "WorkerStats", "SyncPush", "StepPart", "StepOutcome",
    "DensePush", "PushChunk", "DenseBlock", "DensePushOutcome",
    "PUSH_DENSE", "PUSH_SPARSE", "PULL_DENSE", "PULL_SPARSE",
]


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


@dataclass(frozen=True)
class WorkerStats:
    name: str
    clock: int
    live: bool
    idle_s: float


@dataclass(frozen=True)
class MembershipView:
    shard_index: int
    live: tuple[str, ...]
    sync_clock: int
    min_clock: int
    rejoined: bool = False


PUSH_DENSE = "push_dense"
PUSH_SPARSE = "push_sparse"
PULL_DENSE = "pull_dense"
PULL_SPARSE = "pull_sparse"


@dataclass(frozen=True)
class StepPart:
    """One part of a step (``Shard.step``): a push or a pull of one table on this shard.

    ``values``: a dense push's gradient for the whole slice (n,), or a sparse push's rows (len(ids), dim)
    (read-only views of the request are fine: never written). ``ids``: int64 (sparse)."""

    table: str
    op: str
    policy: SyncPolicy = SyncPolicy()
    seq: int = 0
    base_version: int = -1
    values: np.ndarray | None = None
    ids: np.ndarray | None = None
    base_versions: np.ndarray | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What a step part did: a push's ``push`` result; a dense pull's ``blocks`` (immutable tensors) and
    ``version``; a sparse pull's ``rows`` and row ``versions``; ``clock``: the table's BSP clock."""

    table: str
    op: str
    push: "SyncPush | None" = None
    version: int = 0
    clock: int = 0
    blocks: list | None = None
    rows: Any = None  # sparse pull: (n, dim) tensor in the table's row dtype
    versions: np.ndarray | None = None
    dtype: str = ""  # sparse pull: the dtype its rows travel in (``sparse_reply_dtype``)


@dataclass(frozen=True)
class DensePush:
    """A dense push streamed chunk by chunk (``Shard.push_dense``), as its first chunk states it.
    ``shape``: the shape the caller pushes (() : not stated); ``flat_view``: it pushes the flat view;
    ``return_params``: answer with the committed blocks; ``early``: the caller reads while it sends
    (blocks may go back as each chunk is applied)."""

    table: str
    op: str = GRADIENT
    policy: SyncPolicy = SyncPolicy()
    worker: str = ""
    client: str = ""
    seq: int = 0
    base_version: int = -1
    shape: tuple[int, ...] = ()
    flat_view: bool = False
    return_params: bool = False
    early: bool = False


@dataclass(frozen=True)
class PushChunk:
    """One chunk of a streamed dense push: float32 ``values`` at shard-relative ``offset`` (a view
    of the request: never written). ``head``: set on the first chunk; ``table``: the table the chunk
    names ("" : the push's); ``last``: the push commits after it."""

    offset: int
    values: np.ndarray
    last: bool = False
    table: str = ""
    head: DensePush | None = None


@dataclass(frozen=True)
class DenseBlock:
    """A block a dense push answers with: ``early``: computed as its chunk arrived (provisional
    until the outcome says the early blocks held)."""

    offset: int
    block: Any  # a torch tensor of the table's block (immutable while held)
    early: bool = False


@dataclass(frozen=True)
class DensePushOutcome:
    """How a streamed dense push ended: ``version``: the table's after it; ``early``: the blocks
    sent early are the committed ones."""

    table: str
    push: "SyncPush"
    version: int
    early: bool = False


@dataclass(frozen=True)
class SyncPush:
    """Outcome of a push under a SyncPolicy: ``late`` BSP pushes were not applied; ``clock``: the table's BSP clock."""

    result: PushResult
    late: bool
    clock: int
    duplicate: bool = False  # a retried push, answered from the dedup record (not applied again)


# most members one Stats reply lists (with names of at most 256 characters: ~3 MiB)
_STATS_WORKERS = 10_000

# the answer to a retried push older than its client's dedup window: it was applied, its result is gone
_TOO_OLD = PushResult(0, 0, -1.0, -1)


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
    workers: list[WorkerStats] = field(default_factory=list)
    leases_expired: int = 0
    pushes_aborted_idle: int = 0
    duplicates: int = 0
    maintenance_errors: int = 0
    sync_clock: int = 0
    checkpoints: int = 0
    last_checkpoint: str = ""
    role: str = "primary"
    backup: str = ""
    replicated: int = 0
    backups_lost: int = 0
    epoch: int = 0  # replication epoch (+1 per takeover)
    backup_of: str = ""  # a backup: the primary it mirrors


class Shard:
    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.tables: dict[str, DenseTable | SparseTable] = {}
        self._lock = threading.RLock()  # re-entered: create_table -> _reserve -> held_bytes
        self._started = time.monotonic()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0
        self.membership = Membership(
            config.lease_s, max_lease_s=config.max_lease_s, max_workers=config.max_workers, forget_s=config.forget_s
        )
        self.rounds: dict[str, SyncRound] = {}
        self.dedup: Dedup = Dedup()
        self.names = WorkerNames()  # who may use which worker name (pins: set by the servicer from its token file)
        # the byte budget: held from a check to the allocation it allowed (every table of the shard)
        self._growth = threading.Lock()
        self._pending = 0  # bytes granted to tables being created, not yet in self.tables
        self.membership.on_change(self._recheck_rounds)
        self._closed = threading.Event()
        self._streams: dict[int, list] = {}  # id -> [last activity (monotonic), context]: pushes being received
        self._streams_lock = threading.Lock()
        self.pushes_aborted_idle = 0
        self.maintenance_errors = 0
        self._checkpoint_lock = threading.Lock()
        self._cut_lock = threading.Lock()
        self._cut: tuple[list[SyncRound], float] | None = None  # held rounds, lapse time
        self.checkpoints = 0
        self.last_checkpoint = ""
        # replication (primary-backup): every mutation passes the gate shared and is forwarded to the
        # backup before it becomes visible here; attaching a backup takes the gate exclusive
        self.role = PRIMARY if not config.backup_of else BACKUP
        # the RAM the sparse tables' rows may take together; rows beyond it go to the disk tier
        self.resident_budget = ResidentBudget(config.max_resident_bytes) if config.max_resident_bytes else None
        self.epoch = 0
        self.gate = Gate()
        self.backup = ""  # address of the attached backup ("" : none)
        self._forward: Callable[[dict], None] | None = None
        self._backup_lost_at: float | None = None
        self.replicated = 0
        self.backups_lost = 0
        self.installed = threading.Event()  # a backup: a snapshot of its primary is in
        self.attach_id = 0  # a backup: the attach whose snapshot it holds (its mutations apply, others wait or fail)
        self.backup_attach_id = 0  # a primary: the attach of its current backup
        self.on_close: list[Callable[[], None]] = []
        # leases are enforced by time, not by the next request: a dead worker's round must complete
        threading.Thread(target=self._maintain, name=f"ps{config.shard_index}-maintenance", daemon=True).start()
        if config.checkpoint_every_s:
            threading.Thread(target=self._checkpoint_loop, name=f"ps{config.shard_index}-checkpoints", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for fn in self.on_close:
            fn()
        self._close_tables()

    def _close_tables(self) -> None:
        """Give back the sparse tables' disk-tier files and resident-budget shares."""
        for t in list(self.tables.values()):
            if isinstance(t, SparseTable):
                t.close()

    def _maintain(self) -> None:
        """Expire leases and abort idle push streams, forever. A failure is logged and counted and
        the loop goes on: this thread must never die (a dead reaper would hang every BSP round)."""
        period = min(0.2, self.config.lease_s / 10)
        while not self._closed.wait(period):
            for task in (self._expire, self._forget, self._abort_idle_streams, self._lapse_cut):
                try:
                    task()
                except Exception:  # noqa: BLE001 - logged, counted, and the loop goes on
                    self.maintenance_errors += 1
                    log.exception("shard %d: %s failed (the maintenance thread goes on)", self.config.shard_index, task.__name__)

    def _expire(self) -> None:
        if self.role != PRIMARY:
            return  # a backup learns of leaves from its primary; its leases restart when it takes over
        for name in self.membership.expire():
            self._replicate_quietly({"k": "leave", "worker": name})

    def _forget(self) -> None:
        self.membership.forget()  # members dead for config.forget_s (bounded memory, bounded Stats)

    def _recheck_rounds(self) -> None:
        if self.role != PRIMARY:
            return  # a backup never applies a round itself: it mirrors the primary's
        with self._lock:
            rounds = list(self.rounds.values())
        for r in rounds:
            try:
                r.check()
            except Exception:  # noqa: BLE001 - the round keeps the failure and its waiters get it
                log.exception("shard %d: BSP round of table %r failed to apply", self.config.shard_index, r.name)

    # ------------------------------------------------------------------ push streams
    @contextlib.contextmanager
    def watch_stream(self, context: Any) -> Iterator[Callable[[], None]]:
        """Track a push stream being received: the maintenance thread cancels it (``context.cancel()``)
        once no chunk arrived for ``config.push_idle_timeout_s``. Yields ``touch()``, to call per chunk."""
        entry = [time.monotonic(), context]
        key = id(entry)
        with self._streams_lock:
            self._streams[key] = entry

        def touch() -> None:
            entry[0] = time.monotonic()

        try:
            yield touch
        finally:
            with self._streams_lock:
                self._streams.pop(key, None)

    def _abort_idle_streams(self) -> None:
        limit = self.config.push_idle_timeout_s
        now = time.monotonic()
        with self._streams_lock:
            idle = [k for k, (t, _) in self._streams.items() if now - t > limit]
            stale = [self._streams.pop(k) for k in idle]
        for _, context in stale:
            self.pushes_aborted_idle += 1
            log.warning("shard %d: push stream idle for more than %.1f s: aborted (nothing applied)", self.config.shard_index, limit)
            context.cancel()

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
            if len(self.tables) >= self.config.max_tables:
                raise ResourceExhaustedError(
                    f"table {spec.name!r}: shard {self.config.shard_index} holds {len(self.tables)} tables, "
                    f"its limit (max_tables) is {self.config.max_tables}"
                )
            if spec.kind == DENSE:
                length = -(-spec.numel // self.config.num_shards)
                extra = length * 4 * (1 + _state_per_elem(spec))
            else:
                extra = SparseTable.fixed_bytes(spec)  # the admission sketch (index and chunks come with rows)
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
                    table = SparseTable(
                        spec, self.config.shard_index, self.config.num_shards, max_bytes_fn=budget,
                        resident_budget=self.resident_budget, spill_dir=self.config.spill_dir or None,
                        growth_lock=self._growth, chunk_bytes=_chunk_bytes(self.config.max_bytes),
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
        names = list(dict.fromkeys(names))
        if not names:
            raise InvalidArgumentError("DropTable: name at least one table")
        with self._lock:
            missing = [n for n in names if n not in self.tables]
            if missing and not missing_ok:
                raise TableNotFoundError(
                    f"table {missing[0]!r} not found on shard {self.config.shard_index}; nothing dropped"
                )
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

    def _round(self, name: str) -> SyncRound:
        r = self.rounds.get(name)
        if r is None:
            raise TableNotFoundError(f"table {name!r} not found on shard {self.config.shard_index}")
        return r

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

    # ------------------------------------------------------------------ membership
    def _view(self, worker: str = "", rejoined: bool = False) -> MembershipView:
        with self._lock:
            rounds = list(self.rounds.values())
        clocks = [r.clock for r in rounds if r.clock > 0]  # tables that took part in BSP
        return MembershipView(
            self.config.shard_index, tuple(sorted(self.membership.live())), min(clocks) if clocks else 0,
            self.membership.min_clock(exclude=worker), rejoined,
        )

    def join(self, worker: str, lease_s: float = 0.0, fresh: bool = False) -> MembershipView:
        """Add ``worker`` to the live set. The view tells it where to start: BSP at ``sync_clock``,
        SSP/async at the slowest live worker's clock. ``fresh``: the worker starts a fresh run (its
        clock restarts at 0 instead of the one it had here)."""
        with self.gate.shared():
            self.membership.join(worker, lease_s, 0 if fresh else None)
            w = next((w for w in self.membership.workers() if w.name == worker), None)
            self._replicate({"k": "join", "worker": worker, "lease": w.lease_s if w else lease_s, "clock": w.clock if w else 0})
        return self._view(worker)

    def heartbeat(self, worker: str, leave: bool = False, clock: int = 0) -> MembershipView:
        """Renew ``worker``'s lease (rejoining it if it had expired) and raise its clock to ``clock``
        (a worker that joins a run under way declares the step it starts from)."""
        if leave:
            with self.gate.shared():
                self._replicate({"k": "leave", "worker": worker})
                self.membership.leave(worker)
            return self._view(worker)
        rejoined = self.membership.touch(worker)
        if clock > 0:
            self.membership.advance(worker, clock - 1)
        return self._view(worker, rejoined)

    def claim(self, identity: str, worker: str) -> None:
        """``identity`` writes or joins as ``worker`` (Join, Heartbeat, a push): the name must be its
        own (pinned to it, or bound to it; a free unpinned name is bound to it now). Raises
        PermissionDeniedError naming the owner; "" (an open server) may use any name."""
        self.names.claim(identity, worker)

    def pulled(self, worker: str, identity: str, as_worker: bool) -> None:
        """A pull that names ``worker``. A read: it never joins a name, never binds one and never
        brings back a member whose lease ran out. Only a caller pulling ``as_worker`` (a worker or
        admin role) that owns the name renews the lease of that live member; a reader's worker name
        is ignored. Raises PermissionDeniedError if a worker caller names another identity's worker."""
        if worker and as_worker and self.names.check(identity, worker):
            self.membership.renew(worker)

    def wait(self, name: str, policy: SyncPolicy, timeout: float) -> int:
        """Block until ``policy`` lets a worker read ``name`` for step ``policy.clock``; returns the table's BSP clock."""
        self.table(name)
        r = self._round(name)
        if policy.sync and policy.clock >= 0:
            r.wait_clock(policy.clock, timeout, pull=True)
        elif policy.ssp:
            self.membership.wait_ssp(policy.clock, policy.staleness, timeout)
        return r.clock

    def push_dense(self, chunks: Iterator[PushChunk], context: Any = None, identity: str = "") -> Iterator[DenseBlock | DensePushOutcome]:
        """A dense push streamed chunk by chunk (PushDense); the first chunk's ``head`` says what it is.

        The head is validated (table, stated shape; a BSP push names its worker), ``identity`` claims
        the worker name (``claim``), each chunk is validated and staged as it arrives (the maintenance
        thread cancels ``context`` after ``config.push_idle_timeout_s`` without one), and the push
        commits on the chunk flagged ``last``, at most once per (client, seq); a stream that ends
        without it applies nothing (ShapeMismatchError). Yields the reply in order: blocks computed
        early (as their chunk is applied), then, if ``return_params`` and those were not the
        committed ones, every committed block, then the outcome. A BSP gradient joins its round and
        answers with the outcome only."""
        intake: _DenseIntake | None = None
        head = DensePush("")
        last = False
        try:
            with self.watch_stream(context) as touch:
                for c in chunks:
                    touch()
                    if intake is None:
                        assert c.head is not None  # the wire's decoder sets it on the first chunk
                        head = c.head
                        intake = self._begin_dense(head, identity)
                    elif c.table and c.table != head.table:
                        raise InvalidArgumentError(f"push to table {head.table!r} carries a chunk for {c.table!r}")
                    block = intake.add(c.offset, c.values)
                    if block is not None:
                        yield DenseBlock(c.offset, block, early=True)
                    if c.last:
                        last = True
                        break  # commit now; never depend on how the stream ends
                if intake is None:
                    raise InvalidArgumentError("PushDense: empty stream (no chunks)")
                if not last:
                    # gRPC ends the request stream the same way when the client half-closes and when the
                    # call failed (message too large, connection lost): only an explicit last chunk commits
                    have, need = intake.staged(), intake.table.num_blocks
                    raise ShapeMismatchError(
                        f"table {head.table!r}: push stream ended without its last chunk "
                        f"({have} of {need} chunks, {need - have} missing); nothing applied"
                    )
            intake.check_complete()
            out = intake.commit(head.client, head.seq)
        except BaseException:
            if intake is not None:
                intake.abort()  # whatever ended the push (bad chunk, broken stream): its computed blocks go back
            raise
        t = intake.table
        if intake.update is None:  # a BSP gradient: held for its round
            yield DensePushOutcome(head.table, out, t.version)
            return
        # the blocks sent early are the committed ones: only the outcome follows; else (another commit
        # came first and this one recomputed, a duplicate, or no early computation) every block again
        early = head.return_params and intake.early_final
        if head.return_params and not early:
            _, blocks = t.snapshot()
            for k, b in enumerate(blocks):
                yield DenseBlock(k * t.chunk_elems, b)
        yield DensePushOutcome(head.table, out, out.result.version, early)

    def _begin_dense(self, head: DensePush, identity: str) -> "_DenseIntake":
        t = self.dense(head.table)
        _check_push_shape(t, head.shape, head.flat_view)
        self.claim(identity, head.worker)
        return _DenseIntake(self, t, head.op, head.policy, head.worker, head.base_version, head.return_params and head.early)

    @staticmethod
    def _check_writer(name: str, policy: SyncPolicy, worker: str) -> None:
        """A BSP push joins its worker's round: it must say whose it is."""
        if policy.sync and not worker:
            raise InvalidArgumentError(f"table {name!r}: a BSP push must name its worker")

    def commit_dense(
        self, update: DenseUpdate, worker: str, policy: SyncPolicy, client: str = "", seq: int = 0
    ) -> SyncPush:
        """Commit an async/SSP dense push at most once per (client, seq)."""
        name = update.table.spec.name
        once, dup = self._once(client, name, seq)

        def before_swap(res: PushResult, upd: DenseUpdate) -> None:
            self._live(name, upd.table)
            self._replicate(_dense_entry(upd, client, seq, res, worker, policy.clock))
            self.dedup.record(client, name, seq, res)

        with self.gate.shared():
            result = update.commit(before_swap, once=once)
        if not dup:
            self.pushed(worker, policy)
        return SyncPush(result, False, self._round(name).clock, bool(dup))

    def _once(self, client: str, name: str, seq: int) -> tuple[Callable[[], PushResult | None], list[bool]]:
        """A dedup check for a table's commit hook, and a list that says afterwards whether it hit."""
        dup: list[bool] = []

        def once() -> PushResult | None:
            prior = self.dedup.seen(client, name, seq, _TOO_OLD)
            dup.extend([True] if prior is not None else [])
            return prior

        return once, dup

    def _contribute(
        self, name: str, worker: str, policy: SyncPolicy, value: object, client: str = "", seq: int = 0
    ) -> SyncPush:
        # BSP needs no dedup record: a retry of a push the round holds, or of a round applied, is
        # *late* (never applied twice), and one whose round was lost with a checkpoint restore is new
        self.membership.touch(worker)
        r = self._round(name)
        outcome = r.contribute(worker, policy.clock, value, policy.backup_workers)
        if outcome != LATE:
            self.membership.advance(worker, policy.clock)
        return SyncPush(PushResult(0 if outcome == LATE else 1, 0, 0.0, 0), outcome == LATE, r.clock)

    def pushed(self, worker: str, policy: SyncPolicy) -> None:
        """An async/SSP push by ``worker`` committed: renew its lease and advance its clock."""
        if worker:
            self.membership.touch(worker)
            if policy.clock >= 0:
                self.membership.advance(worker, policy.clock)

    # ------------------------------------------------------------------ sparse
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

    def pull_sparse(self, name: str, ids: np.ndarray, wire_dtype: str = "float32", checked: bool = False) -> tuple[Any, np.ndarray]:
        """Rows and versions of ``ids``: rows as stored ((n, dim) tensor in the table's row dtype),
        int64 versions. The reply's size (rows in ``sparse_reply_dtype(name, wire_dtype)`` + int64
        versions) is checked against the message limit before anything is allocated
        (ResourceExhaustedError)."""
        t = self.sparse(name)
        self.check_ids_request(name, len(ids))
        item = 2 if self.sparse_reply_dtype(name, wire_dtype) in ("float16", "bfloat16") else 4
        reply = len(ids) * (t.dim * item + 8) + 4096
        if reply > self.config.max_message_bytes:
            raise ResourceExhaustedError(
                f"table {name!r}: a pull of {len(ids)} ids of dim {t.dim} needs a {reply}-byte reply, over the "
                f"shard's {self.config.max_message_bytes}-byte message limit; split the request"
            )
        return t.pull_rows(ids, checked=checked)

    def push_sparse(
        self, name: str, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None,
        worker: str = "", policy: SyncPolicy = SyncPolicy(), client: str = "", seq: int = 0,
    ) -> SyncPush:
        return self.apply_sparse(name, self.prepare_sparse(name, ids, grads, base_versions, policy, worker), worker, policy, client, seq)

    def prepare_sparse(
        self, name: str, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None,
        policy: SyncPolicy = SyncPolicy(), worker: str = "",
    ) -> SparsePush:
        """Validate a sparse push (and sum its duplicate ids); changes nothing but the rejected count."""
        t = self.sparse(name)
        self._check_writer(name, policy, worker)
        self.check_ids_request(name, len(ids))
        try:
            return t.prepare_push(ids, grads, base_versions)
        except Exception:
            t.rejected += 1
            raise

    def apply_sparse(
        self, name: str, prepared: SparsePush, worker: str = "", policy: SyncPolicy = SyncPolicy(), client: str = "",
        seq: int = 0,
    ) -> SyncPush:
        """Apply a prepared sparse push: BSP contributes it to the round of ``policy.clock``; async/SSP
        apply it now, at most once per (client, seq)."""
        t = self.sparse(name)
        if policy.sync and policy.clock >= 0:
            return self._contribute(name, worker, policy, prepared, client, seq)
        once, dup = self._once(client, name, seq)

        def before_swap(res: PushResult, delta: RowDelta) -> None:
            self._live(name, t)
            self._replicate(_sparse_entry(t, delta, res, client, seq, worker, policy.clock))
            self.dedup.record(client, name, seq, res)

        with self.gate.shared():
            result = t.apply_push(prepared, policy.staleness_aware_lr, once=once, before_swap=before_swap)
        if not dup:
            self.pushed(worker, policy)
        return SyncPush(result, False, self._round(name).clock, bool(dup))

    # ------------------------------------------------------------------ step
    def step(
        self, parts: Sequence[StepPart], worker: str = "", client: str = "", timeout: float = 300.0, wire_dtype: str = "float32"
    ) -> list[StepOutcome]:
        """One worker's step on this shard: every push part, then every pull part (in order).

        All parts are validated first (tables, kinds, sizes, finiteness, id limits): a bad part raises
        naming its table and nothing is applied. Then each push commits as PushDense/PushSparse would
        (atomically per table, at most once per (client, seq); BSP pushes join their round), then each
        pull waits as its policy requires (a BSP pull for clock t+1 waits for round t: in sync mode it
        returns the values of the round the pushes took part in) and reads. Blocks up to ``timeout``.
        ``wire_dtype``: the dtype the caller reads in (a sparse pull's outcome says its rows' dtype)."""
        staged: list[Any] = []
        try:
            for p in parts:
                staged.append(self._stage(p, worker))
            out: list[StepOutcome] = []
            for p, st in zip(parts, staged):
                if p.op == PUSH_DENSE:
                    res = st.commit(client, p.seq)
                    out.append(StepOutcome(p.table, p.op, push=res, version=self.dense(p.table).version, clock=res.clock))
                elif p.op == PUSH_SPARSE:
                    res = self.apply_sparse(p.table, st, worker, p.policy, client, p.seq)
                    out.append(StepOutcome(p.table, p.op, push=res, clock=res.clock))
            for p in parts:
                if p.op == PULL_DENSE:
                    clock = self.wait(p.table, p.policy, timeout)
                    version, blocks = self.dense(p.table).snapshot()
                    out.append(StepOutcome(p.table, p.op, version=version, clock=clock, blocks=blocks))
                elif p.op == PULL_SPARSE:
                    clock = self.wait(p.table, p.policy, timeout)
                    assert p.ids is not None
                    values, versions = self.pull_sparse(p.table, p.ids, checked=True)  # _stage checked the ids
                    rdtype = self.sparse_reply_dtype(p.table, wire_dtype)  # low-precision rows travel as stored
                    out.append(StepOutcome(p.table, p.op, clock=clock, rows=values, versions=versions, dtype=rdtype))
            return out
        finally:
            for st in staged:
                if isinstance(st, _DenseIntake):
                    st.abort()  # a no-op once committed; drops what a failed step staged

    def _stage(self, p: StepPart, worker: str) -> Any:
        """Validate one part of a step; for a push, what applying it takes (nothing changes)."""
        if p.op == PUSH_DENSE:
            t = self.dense(p.table)
            assert p.values is not None
            if p.values.ndim != 1 or p.values.shape[0] != t.length:
                raise ShapeMismatchError(
                    f"table {p.table!r}: step pushes {p.values.size} elements, this shard's slice has {t.length}; nothing applied"
                )
            intake = _DenseIntake(self, t, GRADIENT, p.policy, worker, p.base_version)
            try:
                for k in range(t.num_blocks):
                    off = k * t.chunk_elems
                    intake.add(off, p.values[off : off + t.block_len(k)])
                intake.check_complete()
            except BaseException:
                intake.abort()
                raise
            return intake
        if p.op == PUSH_SPARSE:
            assert p.ids is not None and p.values is not None
            return self.prepare_sparse(p.table, p.ids, p.values, p.base_versions, p.policy, worker)
        if p.op == PULL_DENSE:
            return self.dense(p.table)
        if p.op == PULL_SPARSE:
            assert p.ids is not None
            st = self.sparse(p.table)
            self.check_ids_request(p.table, len(p.ids))
            st.check_ids(p.ids)
            return st
        raise InvalidArgumentError(f"table {p.table!r}: unknown step op {p.op!r}")

    # ------------------------------------------------------------------ replication
    def _apply_round(self, name: str, values: list) -> PushResult:
        """Apply a completed BSP round (the mean of ``values``), replicated first."""
        t = self.table(name)
        clock = self._round(name).clock  # the round being applied (the clock moves on after)

        def replicate(entry: dict) -> None:
            self._live(name, t)
            self._replicate(entry)

        with self.gate.shared():
            if isinstance(t, DenseTable):
                return t.apply_mean(values, lambda res, upd: replicate(_dense_entry(upd, "", 0, res, "", -1, clock)))
            return t.apply_mean(values, lambda res, delta: replicate(_sparse_entry(t, delta, res, "", 0, "", -1, clock)))

    def _replicate_contribution(self, name: str, worker: str, clock: int, value: object, backup_workers: int = 0) -> None:
        entry = _contribution_entry(name, worker, clock, value)
        entry["bw"] = backup_workers
        self._replicate(entry)

    def _replicate(self, entry: dict) -> None:
        """Forward a mutation to the backup before it is applied here; raises (nothing applied) if
        the backup did not take it. With no backup: refuse writes for ``solo_after_s`` after losing
        one (it may be re-attaching, or about to take over), then go on alone."""
        if self.role != PRIMARY:
            return
        forward = self._forward
        if forward is None:
            lost = self._backup_lost_at
            if lost is not None and time.monotonic() - lost < self.config.solo_after_s:
                raise ShardUnavailableError(
                    f"shard {self.config.shard_index}: its backup was lost {time.monotonic() - lost:.1f} s ago; "
                    f"writes wait up to {self.config.solo_after_s:.0f} s for it to re-attach or take over (retry)"
                )
            return
        try:
            forward(entry)
            self.replicated += 1
        except Exception as e:  # noqa: BLE001 - any failure detaches the backup: it must catch up again
            backup = self.backup
            self._lose_backup(f"{type(e).__name__}: {e}")
            raise ShardUnavailableError(
                f"shard {self.config.shard_index}: backup {backup} did not take the update ({_short(e)}); nothing applied (retry)"
            ) from None

    def _replicate_quietly(self, entry: dict) -> None:
        try:
            self._replicate(entry)
        except ShardUnavailableError as e:
            log.warning("%s", e)

    def _lose_backup(self, why: str) -> None:
        if self._forward is None:
            return
        log.error("shard %d: backup %s lost (%s); it must re-attach", self.config.shard_index, self.backup, why)
        self._forward = None
        self._backup_lost_at = time.monotonic()
        self.backups_lost += 1
        self.backup = ""
        for t in self._tables():
            if isinstance(t, SparseTable):
                t.track_evictions = False

    def attach_backup(self, address: str, forward: Callable[[dict], None], attach_id: int = 0) -> None:
        """Make ``address`` this primary's backup: every mutation from now on is forwarded through
        ``forward``. Call under ``gate.exclusive()``, after the backup received ``snapshot(pending=True)``
        taken under the same hold (so no mutation falls between the snapshot and the first forward)."""
        if self.role != PRIMARY:
            raise FailedPreconditionError(f"shard {self.config.shard_index} is a backup; attach to its primary")
        self.backup, self._forward, self._backup_lost_at = address, forward, None
        self.backup_attach_id = attach_id
        for t in self._tables():
            if isinstance(t, SparseTable):
                with t.lock:
                    t.track_evictions = True
                    t.take_evicted()

    def install(self, snap: ShardSnapshot, attach_id: int) -> None:
        """A backup: replace everything with the primary's snapshot of attach ``attach_id``. Mutations
        forwarded under an earlier attach are refused from now on (apply_entry)."""
        with self.gate.exclusive():
            with self._lock:
                self._close_tables()
                self.tables.clear()
                self.rounds.clear()
            self.dedup = Dedup()
            self.membership.clear()
            self.restore(snap)
            for name, pending in snap.pending.items():
                r = self.rounds[name]
                for worker, value in pending:
                    r.mirror_contribution(worker, r.clock, _contribution_value(self.table(name), value))
            self.attach_id = attach_id
            self.installed.set()

    def apply_entry(self, entry: dict, attach_id: int, timeout: float = 30.0) -> None:
        """A backup: apply one mutation its primary forwarded under attach ``attach_id`` (in the
        primary's order per table). Waits for that attach's snapshot; refuses a stale attach's."""
        deadline = time.monotonic() + timeout
        while True:
            with self.gate.shared():  # install() takes it exclusive: no entry applies across a re-install
                if self.attach_id == attach_id:
                    self._apply_entry(entry)
                    return
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise FailedPreconditionError(
            f"Replicate: mutation of attach {attach_id}, this backup installed attach {self.attach_id}; re-attach"
        )

    def _apply_entry(self, entry: dict) -> None:
        k = entry["k"]
        if k == "create":
            self.create_table(spec_from_dict(entry["spec"]))
        elif k == "drop":
            self.drop_tables([str(n) for n in entry["tables"]], missing_ok=True)
        elif k == "join":
            self.membership.join(entry["worker"], float(entry["lease"]), int(entry["clock"]))
        elif k == "leave":
            self.membership.leave(entry["worker"])
        elif k in ("contrib", "dense", "sparse") and entry["t"] not in self.tables:
            # a mutation that raced a drop of its table on the primary (forwarded just after the drop;
            # the primary applied it to the detached table, invisible there too)
            log.warning("shard %d: skipped a forwarded %s of table %r: not held here (dropped)",
                        self.config.shard_index, k, entry["t"])
        elif k == "contrib":
            self.rounds[entry["t"]].mirror_contribution(
                entry["worker"], int(entry["clock"]), _contribution_value(self.table(entry["t"]), entry["value"]),
                int(entry["bw"]) if "bw" in entry else None,
            )
        elif k in ("dense", "sparse"):
            name = entry["t"]
            res = _result_from_plain(entry["result"])
            if k == "dense":
                t = self.dense(name)
                upd = t.begin_update(entry["op"], int(entry["base"]), bool(entry["sal"]))
                for block, data in sorted(entry["chunks"].items(), key=lambda kv: int(kv[0])):
                    upd.apply(int(block) * t.chunk_elems, data)
                upd.commit()
            else:
                self.sparse(name).apply_delta(
                    RowDelta(entry["ids"], entry["values"], entry["state"], entry["versions"]), int(entry["step"]), entry["evicted"]
                )
            self.dedup.record(entry["client"], name, int(entry["seq"]), res)
            if int(entry["round"]) >= 0:
                self.rounds[name].mirror_applied(int(entry["round"]))
            if entry["worker"]:
                self.pushed(entry["worker"], SyncPolicy(clock=int(entry["clock"])))
        else:
            raise InvalidArgumentError(f"unknown replication entry kind {k!r}")

    def promote(self) -> None:
        """A backup takes over as primary (its primary is gone): a new epoch, fresh leases for the
        members it mirrored, and rounds that every live worker has contributed to are applied."""
        if self.role == PRIMARY:
            return
        self.role = PRIMARY
        self.epoch += 1
        for w in self.membership.workers():
            if w.live:
                self.membership.join(w.name, w.lease_s, w.clock)
        log.warning("shard %d: promoted to primary (epoch %d)", self.config.shard_index, self.epoch)
        self._recheck_rounds()

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, pending: bool = False) -> ShardSnapshot:
        """The shard's durable state: every table (each consistent with its dedup records), the BSP
        clocks, and the live members. Pushes go on meanwhile (each table is copied atomically).
        ``pending``: also the contributions BSP rounds hold (for a backup; a checkpoint leaves them
        out: after a restore the workers push those steps again)."""
        with self._lock:
            items = sorted(self.tables.items())
            rounds = dict(self.rounds)
        held = {n: [(w, _contribution_plain(v)) for w, v in r.pending_items()] for n, r in rounds.items()} if pending else {}
        tables: list[dict[str, Any]] = []
        dedup: list[Any] = []
        for name, t in items:
            st = t.export_state(functools.partial(self.dedup.export, name))
            dedup.extend((c, tn, [(seq, _result_to_plain(r)) for seq, r in recs]) for c, tn, recs in st.pop("along"))
            st["kind"] = DENSE if isinstance(t, DenseTable) else SPARSE
            st["spec"] = spec_to_dict(t.spec)
            tables.append(st)
        workers = [(w.name, w.clock, w.lease_s) for w in self.membership.workers() if w.live]
        return ShardSnapshot(
            self.config.shard_index, self.config.num_shards, tables, {n: r.clock for n, r in rounds.items()}, dedup, workers,
            pending={n: p for n, p in held.items() if p},
        )

    def restore(self, snap: ShardSnapshot) -> None:
        """Load ``snap`` into this (empty) shard: tables, optimizer state, versions, clocks, dedup
        records; its members rejoin with their clocks and a fresh lease."""
        if (snap.shard_index, snap.num_shards) != (self.config.shard_index, self.config.num_shards):
            raise CheckpointError(
                f"checkpoint of shard {snap.shard_index}/{snap.num_shards} cannot load into shard "
                f"{self.config.shard_index}/{self.config.num_shards} (use `tessera ps reshard`)"
            )
        if self.tables:
            raise FailedPreconditionError(f"shard {self.config.shard_index} already holds tables; restore into an empty shard")
        for t in snap.tables:
            spec = spec_from_dict(t["spec"])
            self.create_table(spec)
            self.table(spec.name).load_state(t)
            self.rounds[spec.name].clock = int(snap.clocks.get(spec.name, 0))
        self.dedup.load([(c, tn, [(seq, _result_from_plain(r)) for seq, r in recs]) for c, tn, recs in snap.dedup])
        for name, clock, lease_s in snap.workers:
            self.membership.join(name, lease_s, clock)

    def stop_waits(self) -> None:
        """Draining (SIGTERM): every BSP/SSP wait, now and later, ends at once with
        ShardUnavailableError (UNAVAILABLE, "the shard is stopping"); pushes still apply."""
        stopping = threading.Event()
        stopping.set()
        self.membership.stopping = stopping
        for cond in [self.membership.cond, *(r.cond for r in list(self.rounds.values()))]:
            with cond:
                cond.notify_all()

    def save_checkpoint(self) -> str:
        """Write a checkpoint to ``config.checkpoint_dir`` now; returns its path."""
        if not self.config.checkpoint_dir:
            raise FailedPreconditionError(f"shard {self.config.shard_index} has no checkpoint directory (--checkpoint-dir)")
        with self._checkpoint_lock:
            path = write_checkpoint(self.config.checkpoint_dir, self.snapshot(), self.config.checkpoint_keep)
            self.checkpoints += 1
            self.last_checkpoint = path
            return path

    def hold_cut(self, at_least: int = 0) -> int:
        """Phase 1 of a cluster checkpoint: hold every table that takes part in BSP at one clock
        >= ``at_least`` (its round for that clock waits); returns that clock. The hold lapses after
        ``config.cut_hold_s`` if no cut_at() follows (a coordinator that died)."""
        with self._cut_lock:
            self._release_cut()
            with self._lock:
                rounds = [r for r in self.rounds.values() if r.clock > 0 or r.pending()]
            for _ in range(100):
                h = max([at_least] + [r.reached() for r in rounds])
                held: list[SyncRound] = []
                try:
                    for r in rounds:
                        r.hold(h)
                        held.append(r)
                    self._cut = (rounds, time.monotonic() + self.config.cut_hold_s)
                    return h
                except FailedPreconditionError:  # a round applied meanwhile: aim higher
                    for r in held:
                        r.release()
            raise FailedPreconditionError(f"shard {self.config.shard_index}: could not hold its tables for a checkpoint")

    def cut_at(self, clock: int, timeout: float) -> tuple[str, int]:
        """Phase 2: let the held tables reach ``clock`` (the highest any shard held at), snapshot
        them there, release. With every shard cut at the same clock the checkpoints form one
        consistent cut. ``clock`` < 0: a checkpoint now, without coordination. Returns (path, clock)."""
        if clock < 0:
            return self.save_checkpoint(), self._view().sync_clock
        with self._cut_lock:
            held = self._cut is not None
        if not held:  # a cut without a hold: this shard alone
            self.hold_cut(clock)
        with self._cut_lock:
            if self._cut is None:
                raise FailedPreconditionError(f"shard {self.config.shard_index}: the checkpoint hold lapsed before the cut")
            rounds = self._cut[0]
            self._cut = (rounds, time.monotonic() + timeout + self.config.cut_hold_s)
        try:
            for r in rounds:
                r.hold(clock)
            deadline = time.monotonic() + timeout
            for r in rounds:
                r.wait_clock(clock, max(0.0, deadline - time.monotonic()))
            return self.save_checkpoint(), clock
        finally:
            with self._cut_lock:
                self._release_cut()

    def _release_cut(self, only_expired: bool = False) -> None:
        """Caller holds _cut_lock."""
        if self._cut is None or (only_expired and time.monotonic() < self._cut[1]):
            return
        rounds, self._cut = self._cut[0], None
        if only_expired:
            log.warning("shard %d: checkpoint hold lapsed (no cut followed)", self.config.shard_index)
        for r in rounds:
            r.release()

    def _lapse_cut(self) -> None:
        with self._cut_lock:
            self._release_cut(only_expired=True)

    def _checkpoint_loop(self) -> None:
        every = self.config.checkpoint_every_s
        while not self._closed.wait(every):
            try:
                self.save_checkpoint()
            except Exception:  # noqa: BLE001 - logged and counted; the next period tries again
                self.maintenance_errors += 1
                log.exception("shard %d: periodic checkpoint failed", self.config.shard_index)

    # ------------------------------------------------------------------ memory
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

    # ------------------------------------------------------------------ stats
    def stats(self) -> ShardStats:
        tables = []
        with self._lock:
            items = sorted(self.tables.items())
        for name, t in items:
            if isinstance(t, DenseTable):
                tables.append(
                    TableStats(
                        name, "dense", 1, t.length, t.param_bytes(), t.state_bytes(), t.version, t.start, t.length,
                        rejected=t.rejected, mean_staleness=t.staleness.mean, max_staleness=t.staleness.max,
                    )
                )
            else:
                m = t.memory_stats()
                tables.append(
                    TableStats(
                        name, "sparse", m.rows, m.rows * t.dim, t.param_bytes(), t.state_bytes(), t.updates,
                        evicted=t.evicted, dropped=t.dropped, rejected=t.rejected,
                        mean_staleness=t.staleness.mean, max_staleness=t.staleness.max,
                        row_dtype=m.row_dtype, bytes_per_row=m.bytes_per_row, payload_bytes_per_row=m.payload_bytes_per_row,
                        index_bytes=m.index_bytes, metadata_bytes=m.metadata_bytes, resident_rows=m.resident_rows,
                        cold_rows=m.cold_rows, disk_bytes=m.disk_bytes, held_bytes=m.held_bytes, row_path=m.row_path,
                    )
                )
        # bounded: max_workers members with names of <= 256 characters; beyond _STATS_WORKERS, the
        # live ones first, then the most recently seen
        members = sorted(self.membership.workers(), key=lambda w: (not w.live, -w.last_seen))[:_STATS_WORKERS]
        workers = [WorkerStats(w.name, w.clock, w.live, self.membership.idle_s(w)) for w in sorted(members, key=lambda w: w.name)]
        return ShardStats(
            self.config.shard_index, self.config.num_shards, tables, dict(self.requests), dict(self.errors),
            self.bytes_in, self.bytes_out, time.monotonic() - self._started, workers, self.membership.expired,
            self.pushes_aborted_idle, self.dedup.duplicates, self.maintenance_errors, self._view().sync_clock,
            self.checkpoints, self.last_checkpoint, self.role, self.backup, self.replicated, self.backups_lost,
            self.epoch, self.config.backup_of if self.role == BACKUP else "",
        )


class _DenseIntake:
    """One dense push being received: a Step part, or a PushDense stream chunk by chunk. A BSP
    gradient's chunks are collected for its round (checked, not copied); an async/SSP push or an
    assign stages each chunk into a DenseUpdate (computing early where ``early``). Nothing is
    visible before ``commit``; ``abort`` drops what was staged."""

    def __init__(
        self, shard: Shard, t: DenseTable, op: str, policy: SyncPolicy, worker: str, base_version: int = -1, early: bool = False
    ) -> None:
        self.shard, self.table, self.policy, self.worker, self.early = shard, t, policy, worker, early
        self.chunks: dict[int, Any] = {}
        self.update: DenseUpdate | None = None
        if policy.sync and op == GRADIENT:
            shard._check_writer(t.spec.name, policy, worker)
        else:
            self.update = t.begin_update(op, base_version, staleness_aware_lr=policy.staleness_aware_lr, early=early)
        self.early_sent = 0

    def add(self, offset: int, data: np.ndarray) -> Any:
        """Validate and stage the chunk at ``offset``; returns its new block if the push computed it
        early (to send now, provisionally), else None."""
        if self.update is None:
            self.chunks[self.table.check_chunk(offset, data, self.chunks)] = data
            return None
        self.update.apply(offset, data)
        block = self.update.early_block(offset // self.table.chunk_elems) if self.early else None
        self.early_sent += block is not None
        return block

    def staged(self) -> int:
        return len(self.chunks if self.update is None else self.update.staged)

    def check_complete(self) -> None:
        self.table.check_complete(self.chunks if self.update is None else self.update.staged)

    @property
    def early_final(self) -> bool:
        """After commit: every block went back early, and those are the committed ones."""
        return self.update is not None and self.update.early_final and self.early_sent == self.table.num_blocks

    def commit(self, client: str, seq: int) -> SyncPush:
        if self.update is None:
            return self.shard._contribute(self.table.spec.name, self.worker, self.policy, self.chunks, client, seq)
        return self.shard.commit_dense(self.update, self.worker, self.policy, client, seq)

    def abort(self) -> None:
        if self.update is not None:
            self.update.abort()  # a no-op once committed


def _check_push_shape(table: DenseTable, shape: tuple[int, ...], flat_view: bool) -> None:
    """A push that states its shape must state the table's (or, asking for it, the flat view)."""
    if not shape:
        return  # not stated (older clients): the element count is still checked chunk by chunk
    spec = table.spec
    want = (spec.numel,) if flat_view else tuple(spec.shape)
    if shape != want:
        raise ShapeMismatchError(
            f"table {spec.name!r}: pushed shape {shape}, expected {want}"
            + (" (the flat view)" if flat_view else f" (or flat_view with ({spec.numel},))") + "; nothing applied"
        )


def _chunk_bytes(max_bytes: int) -> int:
    """Bytes of a sparse table's row chunk under a byte budget: 64 MiB, at most an eighth of the
    budget (a table grows a chunk at a time: a 128 MiB budget in 64 MiB chunks would leave most of
    its last chunk's worth unusable), at least 256 KiB."""
    return 64 << 20 if not max_bytes else max(256 << 10, min(64 << 20, max_bytes // 8))


def _state_per_elem(spec: TableSpec) -> int:
    return len(make_optimizer(spec.optimizer.name, spec.optimizer.hparams).elementwise_state)


def _diff(a: TableSpec, b: TableSpec) -> str:
    fields = [f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f)]
    return ", ".join(f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in fields)


def _result_to_plain(r: PushResult) -> list:
    return [r.applied, r.dropped, r.mean_staleness, r.max_staleness, r.version, r.late, r.clock]


def _result_from_plain(x: list) -> PushResult:
    return PushResult(int(x[0]), int(x[1]), float(x[2]), int(x[3]), int(x[4]), int(x[5]), int(x[6]))


def _dense_entry(upd: DenseUpdate, client: str, seq: int, res: PushResult, worker: str, clock: int, round_: int = -1) -> dict:
    return {
        "k": "dense", "t": upd.table.spec.name, "op": upd.op, "base": upd.base_version, "sal": upd.staleness_aware_lr,
        "chunks": {str(k): np.asarray(v) for k, v in upd.staged.items()}, "client": client, "seq": seq,
        "result": _result_to_plain(res), "worker": worker, "clock": clock, "round": round_,
    }


def _sparse_entry(
    t: SparseTable, delta: RowDelta, res: PushResult, client: str, seq: int, worker: str, clock: int, round_: int = -1
) -> dict:
    return {
        "k": "sparse", "t": t.spec.name, "ids": delta.ids, "values": delta.values, "state": delta.state,
        "versions": delta.versions, "step": res.version, "evicted": t.take_evicted(), "client": client, "seq": seq,
        "result": _result_to_plain(res), "worker": worker, "clock": clock, "round": round_,
    }


def _contribution_plain(value: object) -> dict:
    if isinstance(value, SparsePush):
        return {"ids": value.ids, "grads": value.grads.numpy(), "base": value.base_versions}
    return {str(k): np.asarray(v) for k, v in value.items()}  # type: ignore[attr-defined]


def _contribution_entry(name: str, worker: str, clock: int, value: object) -> dict:
    return {"k": "contrib", "t": name, "worker": worker, "clock": clock, "value": _contribution_plain(value)}


def _contribution_value(t: DenseTable | SparseTable, plain: dict) -> object:
    if isinstance(t, SparseTable):
        import torch

        return SparsePush(np.asarray(plain["ids"], np.int64), torch.from_numpy(np.asarray(plain["grads"], np.float32)), plain["base"])
    return {int(k): v for k, v in plain.items()}


def _short(e: BaseException) -> str:
    """An error in one line (a gRPC error's status and details, not its debug string)."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(e).__name__}: {e}"
