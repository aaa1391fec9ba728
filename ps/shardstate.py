"""The state a shard's parts share (ps.tables, ps.rounds, ps.mirroring, ps.snapshots, and the
``Shard`` facade over them). Plain Python, no gRPC."""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

from ps.checkpoint import ShardSnapshot
from ps.config import ShardConfig
from ps.consistency import Membership, SyncPolicy, SyncRound
from ps.dedup import Dedup
from ps.gate import Gate
from ps.names import WorkerNames
from ps.table import DenseTable, PushResult, SparseTable
from ps.tier import ResidentBudget

if TYPE_CHECKING:
    from ps.rounds import MembershipView

__all__ = ["ShardState", "PRIMARY", "BACKUP"]

PRIMARY = "primary"
BACKUP = "backup"


class ShardState:
    """The fields; and the parts' methods that the others call (declared here, defined in their part)."""

    # ps.tables
    create_table: Callable
    drop_tables: Callable
    table: Callable[[str], DenseTable | SparseTable]
    dense: Callable[[str], DenseTable]
    sparse: Callable[[str], SparseTable]
    _live: Callable[[str, DenseTable | SparseTable], None]
    _tables: Callable[[], list[DenseTable | SparseTable]]
    _close_tables: Callable[[], None]
    # ps.rounds
    _round: Callable[[str], SyncRound]
    _recheck_rounds: Callable[[], None]
    _view: Callable[..., MembershipView]
    pushed: Callable[[str, SyncPolicy], None]
    # ps.mirroring
    _replicate: Callable[[dict], None]
    _replicate_quietly: Callable[[dict], None]
    _apply_round: Callable[[str, list], PushResult]
    _replicate_contribution: Callable[..., None]
    # ps.snapshots
    snapshot: Callable[..., ShardSnapshot]
    restore: Callable[[ShardSnapshot], None]
    save_checkpoint: Callable[[], str]

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
