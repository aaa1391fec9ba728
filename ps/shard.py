"""A shard: what the servicer calls. A facade over its parts (tables: ps.tables; members and BSP
rounds: ps.rounds; replication: ps.mirroring; snapshots and checkpoints: ps.snapshots); the push
protocol (Step, streamed dense pushes, sparse pushes), limits and counters are its own.

Plain Python: no gRPC, no protobuf. Every method validates before it mutates,
so a rejected request leaves the shard as it was.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ps.config import ShardConfig
from ps.consistency import SyncPolicy
from ps.errors import InvalidArgumentError, ResourceExhaustedError, ShapeMismatchError
from ps.mirroring import Mirroring, _push_entry
from ps.names import OPEN
from ps.rounds import MembershipView, Rounds, SyncPush, WorkerStats
from ps.shardstate import BACKUP, PRIMARY
from ps.snapshots import Snapshots
from ps.table import GRADIENT, DenseTable, DenseUpdate, PushResult, SparsePush
from ps.tables import TableInfo, Tables, TableStats

log = logging.getLogger(__name__)

__all__ = ["Shard", "TableInfo", "TableStats", "ShardStats", "MembershipView", "WorkerStats", "SyncPush", "StepPart",
           "StepOutcome", "DensePush", "PushChunk", "DenseBlock", "DensePushOutcome", "SparsePull", "PUSH_DENSE",
           "PUSH_SPARSE", "PULL_DENSE", "PULL_SPARSE", "PRIMARY", "BACKUP"]


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
class SparsePull:
    """A sparse pull's answer (``Shard.pull_rows``): ``rows`` in ``dtype`` (of every id, or with
    ``conditional`` of those whose version the caller does not hold), every id's ``versions``, the
    table's ``dim``, BSP ``clock`` and the eviction ``epoch`` the versions were read in."""

    rows: Any
    versions: np.ndarray
    dtype: str
    dim: int
    clock: int
    epoch: int
    conditional: bool = False


@dataclass(frozen=True)
class DensePushOutcome:
    """How a streamed dense push ended: ``version``: the table's after it; ``early``: the blocks
    sent early are the committed ones."""

    table: str
    push: "SyncPush"
    version: int
    early: bool = False


# most members one Stats reply lists (with names of at most 256 characters: ~3 MiB)
_STATS_WORKERS = 10_000

# the fields of a sparse table's TableMemory that its TableStats repeat
_MEMORY_STATS = ("row_dtype", "bytes_per_row", "payload_bytes_per_row", "index_bytes", "metadata_bytes", "resident_rows",
                 "cold_rows", "disk_bytes", "held_bytes", "row_path")

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


class Shard(Tables, Rounds, Mirroring, Snapshots):
    """A shard: what the servicer calls (see the module docstring)."""

    def __init__(self, config: ShardConfig) -> None:
        super().__init__(config)
        self.membership.on_change(self._recheck_rounds)
        # leases are enforced by time, not by the next request: a dead worker's round must complete
        threading.Thread(target=self._maintain, name=f"ps{config.shard_index}-maintenance", daemon=True).start()
        if config.checkpoint_every_s:
            threading.Thread(target=self._checkpoint_loop, name=f"ps{config.shard_index}-checkpoints", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for fn in self.on_close:
            fn()
        self._close_tables()

    def _maintain(self) -> None:
        """Expire leases, forget long-dead members (bounded memory, bounded Stats) and abort idle push
        streams, forever. A failure is logged and counted and the loop goes on: this thread must never
        die (a dead reaper would hang every BSP round)."""
        period = min(0.2, self.config.lease_s / 10)
        while not self._closed.wait(period):
            for task in (self._expire, self.membership.forget, self._abort_idle_streams, self._lapse_cut):
                try:
                    task()
                except Exception:  # noqa: BLE001 - logged, counted, and the loop goes on
                    self.maintenance_errors += 1
                    log.exception("shard %d: %s failed (the maintenance thread goes on)", self.config.shard_index, task.__name__)

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

    def push_dense(self, chunks: Iterator[PushChunk], context: Any = None, identity: str = OPEN) -> Iterator[DenseBlock | DensePushOutcome]:
        """A dense push streamed chunk by chunk (PushDense); the first chunk's ``head`` says what it is.

        The head is validated (table, stated shape; a BSP push names its worker), ``identity`` claims
        the worker name (``WorkerNames.claim``), each chunk is validated and staged as it arrives (the
        maintenance thread cancels ``context`` after ``config.push_idle_timeout_s`` without one), and the push
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
                        t = self.dense(head.table)
                        _check_push_shape(t, head.shape, head.flat_view)
                        self.names.claim(identity, head.worker)
                        intake = _DenseIntake(self, t, head.op, head.policy, head.worker, head.base_version,
                                              head.return_params and head.early)
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
            out = intake.commit(_dedup_key(identity, head.client), head.seq)
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

    @staticmethod
    def _check_writer(name: str, policy: SyncPolicy, worker: str) -> None:
        """A BSP push joins its worker's round: it must say whose it is."""
        if policy.sync and not worker:
            raise InvalidArgumentError(f"table {name!r}: a BSP push must name its worker")

    def commit_dense(self, update: DenseUpdate, worker: str, policy: SyncPolicy, client: str = "", seq: int = 0) -> SyncPush:
        """Commit an async/SSP dense push at most once per (client, seq)."""
        return self._apply_once(update.table, lambda once, before_swap, _: update.commit(before_swap, once=once), worker, policy, client, seq)

    def _apply_once(
        self, t: Any, apply: Callable[[Any, Any, bool], PushResult], worker: str, policy: SyncPolicy, client: str, seq: int,
    ) -> SyncPush:
        """An async/SSP push to ``t`` applied (``apply(once, before_swap, mirrored)``) at most once per
        (client, seq); before its swap the table is checked live, the push replicated and its result
        recorded. ``mirrored``: a backup is attached, so a sparse push's new rows are wanted (without
        one the table updates its rows in place and ``before_swap`` gets None)."""
        name = t.spec.name
        dup: list[bool] = []

        def once() -> PushResult | None:
            prior = self.dedup.seen(client, name, seq, _TOO_OLD)
            dup.extend([True] if prior is not None else [])
            return prior

        def before_swap(res: PushResult, x: Any) -> None:
            self._live(name, t)
            self._replicate(None if x is None else _push_entry(t, x, res, client, seq, worker, policy.clock))
            self.dedup.record(client, name, seq, res)

        with self.gate.shared():  # (a backup attaches under the gate held exclusive: none while this runs)
            result = apply(once, before_swap, self._forward is not None)
        if not dup:
            self.pushed(worker, policy)
        return SyncPush(result, False, self._round(name).clock, bool(dup))

    # ------------------------------------------------------------------ sparse

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

    def pull_rows(
        self, name: str, ids: np.ndarray, policy: SyncPolicy, timeout: float, wire_dtype: str = "float32",
        known: np.ndarray | None = None, known_epoch: int = 0, worker: str = "", identity: str = OPEN, as_worker: bool = True,
    ) -> SparsePull:
        """A sparse pull (PullSparse) naming ``worker`` (``pulled``): waits as ``policy`` requires (up
        to ``timeout``), then reads. ``known``: the versions the caller holds of ``ids`` (-1: none),
        read in eviction epoch ``known_epoch``: while that is still the table's, only the rows it
        lacks are sent."""
        t = self.sparse(name)
        if known is not None and len(known) != len(ids):  # checked before anything is read or created
            raise InvalidArgumentError(
                f"table {name!r}: known_versions has {len(known)} entries; {len(ids)} ids need {len(ids)} "
                "(one int64 per id, -1: none held)"
            )
        self.pulled(worker, identity, as_worker)
        clock = self.wait(name, policy, timeout)
        dtype = self.sparse_reply_dtype(name, wire_dtype)  # low-precision rows travel as stored
        # the eviction epoch before and after the read: equal, no row was dropped while the versions were
        # read (they name values of that epoch); the reply names the one before (a caller that got rows
        # read later holds an older epoch than they deserve: its next pull is sent whole, never wrong)
        epoch = t.eviction_epoch
        values, versions = self.pull_sparse(name, ids, dtype)
        # the caller's versions name today's values only if read in this epoch (a dropped row created
        # again restarts at version 0: an equal version may hold another value); else every row is sent
        conditional = known is not None and known_epoch == epoch == t.eviction_epoch
        if conditional:  # only the rows the caller does not hold at their current version
            changed = np.flatnonzero(versions != known)
            if len(changed) < len(ids):
                values = values[changed]  # a torch tensor (or array) of the rows as stored
        return SparsePull(values, versions, dtype, t.dim, clock, epoch, conditional)

    def pull_dense(
        self, name: str, policy: SyncPolicy, timeout: float, worker: str = "", identity: str = OPEN, as_worker: bool = True
    ) -> tuple[int, int, list[DenseBlock]]:
        """A dense pull (PullDense) naming ``worker`` (``pulled``): waits as ``policy`` requires (up
        to ``timeout``); returns (version, BSP clock, the slice's blocks)."""
        self.pulled(worker, identity, as_worker)
        t = self.dense(name)
        clock = self.wait(name, policy, timeout)
        version, blocks = t.snapshot()
        return version, clock, [DenseBlock(k * t.chunk_elems, b) for k, b in enumerate(blocks)]

    def push_sparse(
        self, name: str, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None,
        worker: str = "", policy: SyncPolicy = SyncPolicy(), client: str = "", seq: int = 0, identity: str = OPEN,
    ) -> SyncPush:
        """A sparse push (PushSparse) by ``identity`` as ``worker`` (``WorkerNames.claim``), at most once per (client, seq)."""
        self.names.claim(identity, worker)
        prepared = self.prepare_sparse(name, ids, grads, base_versions, policy, worker)
        return self.apply_sparse(name, prepared, worker, policy, _dedup_key(identity, client), seq)

    def prepare_sparse(
        self, name: str, ids: np.ndarray, grads: np.ndarray, base_versions: np.ndarray | None = None,
        policy: SyncPolicy = SyncPolicy(), worker: str = "",
    ) -> SparsePush:
        """Validate a sparse push (and sum its duplicate ids); changes nothing but the rejected count."""
        t = self.sparse(name)
        self._check_writer(name, policy, worker)
        self.check_ids_request(name, len(ids))
        try:
            # an async/SSP push is applied in this call: its rows are read from the request, not copied
            return t.prepare_push(ids, grads, base_versions, hold=policy.bsp)
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
        if policy.bsp:
            return self._contribute(name, worker, policy, prepared, client, seq)
        return self._apply_once(
            t, lambda once, before_swap, mirrored: t.apply_push(
                prepared, policy.staleness_aware_lr, once=once, before_swap=before_swap, delta=mirrored,
            ),
            worker, policy, client, seq,
        )

    # ------------------------------------------------------------------ step
    def step(
        self, parts: Sequence[StepPart], worker: str = "", client: str = "", timeout: float = 300.0, wire_dtype: str = "float32",
        identity: str = OPEN, as_worker: bool = True,
    ) -> list[StepOutcome]:
        """One worker's step on this shard: every push part, then every pull part (in order).

        All parts are validated first (tables, kinds, sizes, finiteness, id limits): a bad part raises
        naming its table and nothing is applied. Then each push commits as PushDense/PushSparse would
        (atomically per table, at most once per (client, seq); BSP pushes join their round), then each
        pull waits as its policy requires (a BSP pull for clock t+1 waits for round t: in sync mode it
        returns the values of the round the pushes took part in) and reads. Blocks up to ``timeout``.
        ``wire_dtype``: the dtype the caller reads in (a sparse pull's outcome says its rows' dtype).
        A step with pushes claims ``worker`` for ``identity`` (``WorkerNames.claim``); one of pulls only is a read (``pulled``)."""
        if any(p.op in (PUSH_DENSE, PUSH_SPARSE) for p in parts):
            self.names.claim(identity, worker)
        else:
            self.pulled(worker, identity, as_worker)
        client = _dedup_key(identity, client)
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

    # ------------------------------------------------------------------ stats
    def stats(self) -> ShardStats:
        tables = []
        with self._lock:
            items = sorted(self.tables.items())
        for name, t in items:
            common: dict[str, Any] = {
                "rejected": t.rejected, "mean_staleness": t.staleness.mean, "max_staleness": t.staleness.max,
            }
            if isinstance(t, DenseTable):
                tables.append(TableStats(name, "dense", 1, t.length, t.param_bytes(), t.state_bytes(), t.version, t.start, t.length, **common))
                continue
            m = t.memory_stats()
            tables.append(TableStats(
                name, "sparse", m.rows, m.rows * t.dim, t.param_bytes(), t.state_bytes(), t.updates, evicted=t.evicted,
                dropped=t.dropped, **common, **{f: getattr(m, f) for f in _MEMORY_STATS},
            ))
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


def _dedup_key(identity: str, client: str) -> str:
    """Dedup records are per identity: nobody can make another identity's pushes look retried."""
    return f"{identity}/{client}" if identity and client else client


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


