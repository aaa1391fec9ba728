"""Consistency on one shard: worker membership with leases, worker clocks, BSP rounds.

Pure Python (no gRPC). The shard owns one ``Membership`` and one ``SyncRound``
per table; requests say which protocol they take part in (``SyncPolicy``), so
tables stay mode-agnostic and hybrid runs (sparse async, dense sync) need
nothing special.

- ASP: a push applies at once; pulls never wait.
- SSP(K): pushes apply at once; a worker about to compute step c waits while
  the slowest *live* worker's clock is below c - K.
- BSP: a push for clock c is held; once every live worker (or all but
  ``backup_workers`` of them) contributed for c, the mean of the contributions
  is applied once and the table's clock becomes c + 1. A pull for step c waits
  until the table's clock reaches c. A push for a clock already applied is
  *late*: counted, not applied (the stragglers of backup workers, or a retried
  push that had in fact arrived).

A worker silent for longer than its lease is dropped from the live set; rounds
and waits are then re-checked, so a dead worker never hangs the others. Its
next Join, Heartbeat or push rejoins it; pulls are reads: they renew a live
member's lease (``renew``) but never add or bring back a member.

Thread-safety: every class here is safe to call from many threads.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from ps.errors import (DeadlineExceededError, FailedPreconditionError, InternalError, InvalidArgumentError,
                       ResourceExhaustedError, ShardUnavailableError, TableNotFoundError)

__all__ = ["SyncPolicy", "ASYNC", "Membership", "SyncRound", "WorkerState", "LATE", "HELD", "APPLIED", "MAX_WORKER_NAME"]

MAX_WORKER_NAME = 256  # characters; bounds what each member costs (and what Stats returns per member)

LATE = "late"
HELD = "held"
APPLIED = "applied"


@dataclass(frozen=True)
class SyncPolicy:
    """What a request asks of the consistency layer. The default is plain async."""

    clock: int = -1
    sync: bool = False
    staleness: int = -1
    backup_workers: int = 0
    staleness_aware_lr: bool = False

    @property
    def bsp(self) -> bool:
        """Whether this request takes part in the BSP round of ``clock`` (a push joins it, a pull waits for it)."""
        return self.sync and self.clock >= 0

    @property
    def ssp(self) -> bool:
        """Whether this request follows the bounded-staleness rule (async with a staleness bound)."""
        return not self.sync and self.staleness >= 0 and self.clock >= 0


ASYNC = SyncPolicy()  # the default (frozen: one instance serves every request that names none)

@dataclass
class WorkerState:
    name: str
    lease_s: float
    last_seen: float
    clock: int = 0  # steps whose push this shard has seen complete
    live: bool = True
    left_at: float = 0.0  # when it left or its lease ran out (meaningful while not live)


class Membership:
    """Live workers, their leases and clocks; SSP waits.

    ``now`` is injectable so unit tests can move time by hand. ``max_lease_s`` caps every lease
    whatever a Join asks (a ghost with a huge lease cannot stall BSP rounds longer; it must be >=
    the default), ``max_workers`` bounds the members remembered (0: no bound; see ``join``),
    ``forget_s``: how long a dead member is remembered by ``forget()``.
    """

    # set (an Event that is set) by Shard.stop_waits(): a stopping shard ends every wait at once
    stopping: threading.Event | None = None

    def check_stopping(self) -> None:
        """Raise ShardUnavailableError (UNAVAILABLE) if the shard is stopping: waits end, callers retry elsewhere or later."""
        if self.stopping is not None and self.stopping.is_set():
            raise ShardUnavailableError("the shard is stopping (SIGTERM): this wait ended; retry once it is back, or on its backup")

    def __init__(
        self, default_lease_s: float = 10.0, now: Callable[[], float] = time.monotonic, max_lease_s: float = math.inf,
        max_workers: int = 0, forget_s: float = math.inf,
    ) -> None:
        if default_lease_s <= 0 or max_lease_s < default_lease_s:
            raise ValueError("lease must be > 0 and max_lease_s >= it")
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self.max_workers = max_workers
        self.forget_s = forget_s
        self._now = now
        self._workers: dict[str, WorkerState] = {}
        self.cond = threading.Condition()
        self.expired = 0
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ membership
    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (outside the lock) whenever a worker leaves or expires."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

    def join(self, worker: str, lease_s: float = 0.0, clock: int | None = None) -> bool:
        """Add (or re-add) ``worker`` with a lease of ``lease_s`` (0: the default; capped at
        ``max_lease_s``); returns True if it was not live before. Raises ResourceExhaustedError for a
        new worker when ``max_workers`` members are remembered and none of them is dead (the
        longest-dead one is forgotten to make room)."""
        if not worker:
            raise FailedPreconditionError("join: the worker needs a non-empty name")
        if len(worker) > MAX_WORKER_NAME:
            raise InvalidArgumentError(f"join: worker name has {len(worker)} characters, at most {MAX_WORKER_NAME}")
        if not math.isfinite(lease_s) or lease_s < 0:
            raise InvalidArgumentError(f"join: lease must be finite and >= 0 seconds, got {lease_s}")
        lease = min(lease_s or self.default_lease_s, self.max_lease_s)
        with self.cond:
            w = self._workers.get(worker)
            if w is None and self.max_workers and len(self._workers) >= self.max_workers:
                dead = [d for d in self._workers.values() if not d.live]
                if not dead:
                    raise ResourceExhaustedError(
                        f"join: worker {worker!r} refused: this shard has {len(self._workers)} live members, "
                        f"its limit (max_workers) is {self.max_workers}"
                    )
                del self._workers[min(dead, key=lambda d: d.left_at).name]
            was_live = w is not None and w.live
            start = clock if clock is not None else (w.clock if w is not None else self._min_clock(exclude=worker, default=0))
            self._workers[worker] = WorkerState(worker, lease, self._now(), max(0, start))
            self.cond.notify_all()
            return not was_live

    def forget(self) -> list[str]:
        """Forget members dead for longer than ``forget_s``; returns their names. A forgotten worker
        that comes back joins afresh (its clock starts at the slowest live worker's)."""
        now = self._now()
        with self.cond:
            gone = [w.name for w in self._workers.values() if not w.live and now - w.left_at > self.forget_s]
            for name in gone:
                del self._workers[name]
        return gone

    def touch(self, worker: str) -> bool:
        """Record a request from ``worker`` (renews its lease). Returns True if this rejoined it."""
        if not worker or self.renew(worker):
            return False
        with self.cond:
            w = self._workers.get(worker)
        self.join(worker, w.lease_s if w is not None else 0.0)
        return True

    def renew(self, worker: str) -> bool:
        """A read by ``worker`` (a pull): renew its lease if it is a live member. Never adds a member
        and never brings back one whose lease ran out (that takes a Join, a Heartbeat or a push), so
        pulls alone cannot keep a name in the live set it is not already in. Returns whether it is live."""
        with self.cond:
            w = self._workers.get(worker)
            if w is None or not w.live:
                return False
            w.last_seen = self._now()
            return True

    def leave(self, worker: str) -> None:
        with self.cond:
            w = self._workers.get(worker)
            if w is None or not w.live:
                return
            w.live = False
            w.left_at = self._now()
            self.cond.notify_all()
        self._changed()

    def expire(self) -> list[str]:
        """Drop workers whose lease ran out; returns their names."""
        now = self._now()
        with self.cond:
            gone = [w.name for w in self._workers.values() if w.live and now - w.last_seen > w.lease_s]
            for name in gone:
                self._workers[name].live = False
                self._workers[name].left_at = now
            if gone:
                self.expired += len(gone)
                self.cond.notify_all()
        if gone:
            self._changed()
        return gone

    def clear(self) -> None:
        with self.cond:
            self._workers.clear()
            self.cond.notify_all()

    def live(self) -> frozenset[str]:
        with self.cond:
            return frozenset(w.name for w in self._workers.values() if w.live)

    def workers(self) -> list[WorkerState]:
        with self.cond:
            return [WorkerState(w.name, w.lease_s, w.last_seen, w.clock, w.live, w.left_at) for w in self._workers.values()]

    def idle_s(self, w: WorkerState) -> float:
        return self._now() - w.last_seen

    # ------------------------------------------------------------------ clocks
    def advance(self, worker: str, clock: int) -> None:
        """``worker`` finished pushing step ``clock``: its clock becomes at least clock + 1."""
        with self.cond:
            w = self._workers.get(worker)
            if w is not None and clock + 1 > w.clock:
                w.clock = clock + 1
                self.cond.notify_all()

    def _min_clock(self, exclude: str | None = None, default: int = -1) -> int:
        return min((w.clock for w in self._workers.values() if w.live and w.name != exclude), default=default)

    def min_clock(self, exclude: str | None = None) -> int:
        """Slowest live worker's clock (``exclude`` left out); -1 if none."""
        with self.cond:
            return self._min_clock(exclude)

    def wait_ssp(self, clock: int, staleness: int, timeout: float) -> float:
        """Block while the slowest live worker is below ``clock - staleness``. Returns seconds waited.

        Raises DeadlineExceededError after ``timeout`` seconds."""
        need = clock - staleness
        t0 = time.monotonic()
        with self.cond:
            while True:
                slowest = self._min_clock()
                if slowest < 0 or slowest >= need:
                    return time.monotonic() - t0
                self.check_stopping()
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise DeadlineExceededError(
                        f"SSP wait: step {clock} with staleness {staleness} needs every live worker at clock >= {need}; "
                        f"the slowest is at {slowest} after {timeout:.1f} s"
                    )
                self.cond.wait(min(left, 0.5))


C = TypeVar("C")


class SyncRound(Generic[C]):
    """One table's BSP round on this shard.

    ``apply(values)`` is called with the contributions of the round (in arrival
    order) once the round is complete; it must apply their mean. It runs on the
    thread that completed the round, *outside* every lock of this module, so a
    slow apply never blocks membership or other tables. ``clock`` counts applied
    rounds. A round either applies (the clock moves on) or fails: then the clock
    stays, the failure is kept, and every worker waiting for the next clock gets
    it as an error (the contributions are not applied; the workers' retried pushes
    can run the round again).

    The quorum rule (``backup_workers``) is the table's, fixed by its first contribution (one
    request cannot lower the quorum for everyone): ``backup_workers`` is None until then.
    """

    def __init__(
        self, name: str, membership: Membership, apply: Callable[[list[C]], Any],
        on_hold: Callable[[str, int, C, int], None] | None = None,
    ) -> None:
        self.name = name
        # called (under the lock) with (worker, clock, value, backup_workers) before a contribution
        # is held; raising refuses it (nothing changes, the quorum rule included)
        self._on_hold = on_hold
        self.membership = membership
        self._apply = apply
        self.clock = 0
        self.late = 0
        self.withdrawn = 0  # held contributions dropped because their worker went back to an older clock
        self.failed: str | None = None  # why the last round at ``clock`` failed to apply
        self._pending: dict[str, C] = {}
        self._applying = False
        self.backup_workers: int | None = None  # the quorum rule, fixed by the first contribution
        self.hold_at: int | None = None  # a cluster checkpoint: do not apply the round for this clock yet
        self.dropped: str | None = None  # the table was dropped (why): contributions and waits fail NOT_FOUND
        self.cond = threading.Condition()

    def drop(self, why: str) -> None:
        """The table is gone: every waiter and every later contribution gets TableNotFoundError(``why``);
        held contributions are discarded."""
        with self.cond:
            self.dropped = why
            self._pending.clear()
            self.cond.notify_all()

    def contribute(self, worker: str, clock: int, value: C, backup_workers: int = 0) -> str:
        """Offer ``worker``'s gradient for ``clock``. Returns LATE, HELD or APPLIED.

        The first contribution fixes the table's ``backup_workers``; a later one asking for a
        different value raises FailedPreconditionError (nothing held). Raises FailedPreconditionError
        for a clock ahead of the table (the worker skipped a pull), and whatever ``apply`` raised if
        this contribution completed a round that failed to apply.
        """
        if backup_workers < 0:
            raise InvalidArgumentError(f"table {self.name!r}: backup_workers must be >= 0, got {backup_workers}")
        with self.cond:
            if self.dropped is not None:
                raise TableNotFoundError(self.dropped)
            if self.backup_workers is not None and backup_workers != self.backup_workers:
                raise FailedPreconditionError(
                    f"table {self.name!r}: this BSP push asks for backup_workers={backup_workers}, but the table's "
                    f"quorum was fixed at backup_workers={self.backup_workers} by its first BSP push; every worker "
                    "of a run must push with the same value"
                )
            if clock < self.clock or worker in self._pending or (self._applying and clock == self.clock):
                if clock < self.clock and self._pending.pop(worker, None) is not None:
                    # the worker went back to an older clock (another shard came back from an older
                    # checkpoint: every worker continues from the shards' common clock): what it holds
                    # for this round was computed from parameters that no longer exist. It pushes this
                    # round again when it gets here
                    self.withdrawn += 1
                self.late += 1
                return LATE
            if clock > self.clock:
                raise FailedPreconditionError(
                    f"table {self.name!r}: push for clock {clock}, but the table is at clock {self.clock}: "
                    "this shard is behind the worker (restarted from an older checkpoint?); the worker must "
                    "continue from the shards' common clock (a BSP worker computes step c from the parameters of clock c)"
                )
            if self._on_hold is not None:
                self._on_hold(worker, clock, value, backup_workers)
            self._pending[worker] = value
            self.backup_workers = backup_workers
            batch = self._take()
        return APPLIED if self._run(batch) else HELD

    def check(self) -> bool:
        """Re-check completion (membership changed). True if a round was applied; raises if it failed."""
        with self.cond:
            batch = self._take()
        return self._run(batch)

    def _take(self) -> list[C] | None:
        """Under the lock: the round's contributions if it is complete (and mark it applying)."""
        if not self._pending or self._applying or (self.hold_at is not None and self.clock >= self.hold_at):
            return None
        live = self.membership.live()
        # the quorum counts live workers only: a contribution from a worker that has since left still
        # goes into the mean, but must not stand in for a live worker's
        if not live <= self._pending.keys():
            backup = self.backup_workers or 0
            if not backup or len(live & self._pending.keys()) < len(live) - backup:
                return None
        values = list(self._pending.values())
        self._pending.clear()
        self._applying = True
        return values

    def _run(self, values: list[C] | None) -> bool:
        """Apply a round's contributions (``_take``'s; None: no round complete). True if applied; raises if it failed."""
        if values is None:
            return False
        failed = None
        try:
            self._apply(values)
        except BaseException as e:
            failed = f"round for clock {self.clock} failed to apply ({type(e).__name__}: {e}); nothing applied"
            raise
        finally:
            with self.cond:
                self._applying = False
                self.failed = failed
                if failed is None:
                    self.clock += 1
                self.cond.notify_all()
        return True

    def mirror_contribution(self, worker: str, clock: int, value: C, backup_workers: int | None = None) -> None:
        """A backup: hold ``worker``'s contribution as the primary did (never applied here), and
        take the primary's quorum rule (``backup_workers``, when given)."""
        with self.cond:
            if backup_workers is not None:
                self.backup_workers = backup_workers
            if clock == self.clock:
                self._pending[worker] = value

    def mirror_applied(self, clock: int) -> None:
        """A backup: the primary applied the round for ``clock``."""
        with self.cond:
            self.clock = max(self.clock, clock + 1)
            self._pending.clear()
            self.failed = None
            self.cond.notify_all()

    def hold(self, clock: int) -> None:
        """Keep the table at ``clock``: the round for ``clock`` is not applied until release()
        (a consistent cut across shards). Raises FailedPreconditionError if the table is past it."""
        with self.cond:
            if self.reached() > clock:
                raise FailedPreconditionError(f"table {self.name!r} is at clock {self.reached()}, past the requested {clock}")
            self.hold_at = clock
            batch = self._take()  # a hold moved forward may free a round that is complete already
        self._run(batch)

    def reached(self) -> int:
        """The clock, counting a round being applied now as applied."""
        with self.cond:
            return self.clock + (1 if self._applying else 0)

    def release(self) -> None:
        with self.cond:
            self.hold_at = None
        self.check()

    def wait_clock(self, clock: int, timeout: float, pull: bool = False) -> float:
        """Block until this table applied every clock below ``clock``. Returns seconds waited.

        Raises InternalError if the round this wait needs failed to apply. ``pull`` (a worker's BSP
        pull for step ``clock``): FailedPreconditionError at once for a clock more than one round ahead
        of the table: a worker pulls step c after it read step c - 1 from every shard, so the table
        was at c - 1 or later and has gone back since (restarted from an older checkpoint); no round
        brings it there before the worker goes back."""
        t0 = time.monotonic()
        with self.cond:
            if pull and clock > self.clock + 1:
                raise FailedPreconditionError(
                    f"table {self.name!r}: pull for clock {clock}, but the table is at clock {self.clock}: this shard "
                    "is behind the worker (restarted from an older checkpoint?); the worker must continue from the "
                    "shards' common clock"
                )
            while self.clock < clock:
                if self.dropped is not None:
                    raise TableNotFoundError(self.dropped)
                self.membership.check_stopping()
                if self.failed is not None and not self._applying:
                    raise InternalError(f"table {self.name!r}: {self.failed}; push the step again")
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    waiting = sorted(self.membership.live() - self._pending.keys())
                    raise DeadlineExceededError(
                        f"table {self.name!r}: BSP wait for clock {clock} timed out after {timeout:.1f} s at clock "
                        f"{self.clock}; still waiting for live worker(s) {waiting}"
                    )
                self.cond.wait(min(left, 0.5))
            return time.monotonic() - t0

    def pending(self) -> int:
        with self.cond:
            return len(self._pending)

    def pending_items(self) -> list[tuple[str, C]]:
        with self.cond:
            return list(self._pending.items())
