"""A shard's members and BSP rounds: joins, leases, clocks, waits and contributions.
Part of ``Shard`` (its facade, ps/shard.py); plain Python, no gRPC."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ps.consistency import LATE, SyncPolicy, SyncRound
from ps.errors import InvalidArgumentError, TableNotFoundError
from ps.names import OPEN
from ps.shardstate import PRIMARY, ShardState
from ps.table import PushResult

__all__ = ["Rounds", "MembershipView", "WorkerStats", "SyncPush"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerStats:
    """A member as Stats lists it: its clock, whether its lease holds, seconds since it was heard from."""

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


@dataclass(frozen=True)
class SyncPush:
    """Outcome of a push under a SyncPolicy: ``late`` BSP pushes were not applied; ``clock``: the table's BSP clock."""

    result: PushResult
    late: bool
    clock: int
    duplicate: bool = False  # a retried push, answered from the dedup record (not applied again)


class Rounds(ShardState):
    """Membership (``membership``) and each table's BSP round (``rounds``)."""

    def _expire(self) -> None:
        if self.role != PRIMARY:
            return  # a backup learns of leaves from its primary; its leases restart when it takes over
        for name in self.membership.expire():
            self._replicate_quietly({"k": "leave", "worker": name})

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

    def _round(self, name: str) -> SyncRound:
        r = self.rounds.get(name)
        if r is None:
            raise TableNotFoundError(f"table {name!r} not found on shard {self.config.shard_index}")
        return r

    def _view(self, worker: str = "", rejoined: bool = False) -> MembershipView:
        with self._lock:
            rounds = list(self.rounds.values())
        clocks = [r.clock for r in rounds if r.clock > 0]  # tables that took part in BSP
        return MembershipView(
            self.config.shard_index, tuple(sorted(self.membership.live())), min(clocks) if clocks else 0,
            self.membership.min_clock(exclude=worker), rejoined,
        )

    def join(self, worker: str, lease_s: float = 0.0, fresh: bool = False, identity: str = OPEN) -> MembershipView:
        """Add ``worker`` to the live set, as ``identity`` (its own name: ``WorkerNames.claim``). The
        view tells it where to start: BSP at ``sync_clock``, SSP/async at the slowest live worker's
        clock. ``fresh``: the worker starts a fresh run (its clock restarts at 0, not the one it had)."""
        if lease_s < 0:
            raise InvalidArgumentError(f"Join: lease_ms must be >= 0, got {lease_s * 1000:g}")
        self._member("Join", worker, identity)
        with self.gate.shared():
            self.membership.join(worker, lease_s, 0 if fresh else None)
            w = next((w for w in self.membership.workers() if w.name == worker), None)
            self._replicate({"k": "join", "worker": worker, "lease": w.lease_s if w else lease_s, "clock": w.clock if w else 0})
        return self._view(worker)

    def heartbeat(self, worker: str, leave: bool = False, clock: int = 0, identity: str = OPEN) -> MembershipView:
        """Renew ``worker``'s lease (rejoining it if it had expired) and raise its clock to ``clock``
        (a worker that joins a run under way declares the step it starts from); as ``identity``."""
        if clock < 0:
            raise InvalidArgumentError(f"Heartbeat: clock must be >= 0, got {clock}")
        self._member("Heartbeat", worker, identity)
        if leave:
            with self.gate.shared():
                self._replicate({"k": "leave", "worker": worker})
                self.membership.leave(worker)
            return self._view(worker)
        rejoined = self.membership.touch(worker)
        if clock > 0:
            self.membership.advance(worker, clock - 1)
        return self._view(worker, rejoined)

    def _member(self, what: str, worker: str, identity: str) -> None:
        if not worker:
            raise InvalidArgumentError(f"{what}: worker name is empty")
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
        if policy.bsp:
            r.wait_clock(policy.clock, timeout, pull=True)
        elif policy.ssp:
            self.membership.wait_ssp(policy.clock, policy.staleness, timeout)
        return r.clock

    def _contribute(self, name: str, worker: str, policy: SyncPolicy, value: object, client: str = "", seq: int = 0) -> SyncPush:
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

    def stop_waits(self) -> None:
        """Draining (SIGTERM): every BSP/SSP wait, now and later, ends at once with
        ShardUnavailableError (UNAVAILABLE, "the shard is stopping"); pushes still apply."""
        stopping = threading.Event()
        stopping.set()
        self.membership.stopping = stopping
        for cond in [self.membership.cond, *(r.cond for r in list(self.rounds.values()))]:
            with cond:
                cond.notify_all()
