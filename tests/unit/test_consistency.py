"""ps/consistency.py without sockets: leases, clocks, BSP rounds, SSP waits."""
from __future__ import annotations

import threading
import time

import pytest

from ps.consistency import APPLIED, HELD, LATE, Membership, SyncRound
from ps.errors import DeadlineExceededError, FailedPreconditionError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(lease: float = 10.0):
    clock = Clock()
    m = Membership(lease, now=clock)
    applied: list[list[float]] = []
    r: SyncRound = SyncRound("t", m, lambda values: applied.append(list(values)))
    m.on_change(r.check)
    return clock, m, r, applied


def test_bsp_round_applies_once_when_every_live_worker_contributed() -> None:
    _, m, r, applied = make()
    for w in "abc":
        m.join(w)
    assert r.contribute("a", 0, 1.0) == HELD
    assert r.contribute("b", 0, 2.0) == HELD
    assert applied == [] and r.clock == 0
    assert r.contribute("c", 0, 3.0) == APPLIED
    assert applied == [[1.0, 2.0, 3.0]] and r.clock == 1


def test_late_and_duplicate_pushes_are_not_applied() -> None:
    _, m, r, applied = make()
    m.join("a")
    assert r.contribute("a", 0, 1.0) == APPLIED
    assert r.contribute("a", 0, 9.0) == LATE  # a retried push of an applied clock
    m.join("b")
    assert r.contribute("a", 1, 1.0) == HELD
    assert r.contribute("a", 1, 5.0) == LATE  # duplicate within the round
    assert r.late == 2
    with pytest.raises(FailedPreconditionError, match="clock 7"):
        r.contribute("b", 7, 1.0)
    assert r.contribute("b", 1, 2.0) == APPLIED
    assert applied == [[1.0], [1.0, 2.0]]


def test_backup_workers_apply_the_first_w_minus_b() -> None:
    _, m, r, applied = make()
    for w in "abcd":
        m.join(w)
    assert r.contribute("c", 0, 3.0, backup_workers=1) == HELD
    assert r.contribute("a", 0, 1.0, backup_workers=1) == HELD
    assert r.contribute("d", 0, 4.0, backup_workers=1) == APPLIED
    assert applied == [[3.0, 1.0, 4.0]]
    assert r.contribute("b", 0, 2.0, backup_workers=1) == LATE  # the straggler's gradient is dropped


def test_expired_lease_completes_the_round_and_a_late_request_rejoins() -> None:
    clock, m, r, applied = make(lease=2.0)
    m.join("a")
    m.join("b")
    assert r.contribute("a", 0, 1.0) == HELD
    clock.t = 1.5
    m.touch("a")
    assert m.expire() == [] and applied == []
    clock.t = 2.6  # b silent for 2.6 s > 2 s lease; a was seen 1.1 s ago
    assert m.expire() == ["b"]
    assert applied == [[1.0]] and r.clock == 1 and m.live() == {"a"}
    assert m.expired == 1
    assert m.touch("b") is True  # b comes back: live again, counted in the next round
    assert m.live() == {"a", "b"}
    assert r.contribute("a", 1, 1.0) == HELD


def test_leave_completes_the_round() -> None:
    _, m, r, applied = make()
    m.join("a")
    m.join("b")
    r.contribute("a", 0, 1.0)
    m.leave("b")
    assert applied == [[1.0]]


def test_wait_clock_blocks_until_the_round_applies() -> None:
    _, m, r, _ = make()
    m.join("a")
    m.join("b")
    r.contribute("a", 0, 1.0)
    done = threading.Event()

    def reader() -> None:
        r.wait_clock(1, timeout=10)
        done.set()

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.1)
    assert not done.is_set()
    r.contribute("b", 0, 2.0)
    th.join(5)
    assert done.is_set()
    with pytest.raises(DeadlineExceededError, match=r"still waiting for live worker\(s\) \['a', 'b'\]"):
        r.wait_clock(2, timeout=0.05)


def test_ssp_waits_for_the_slowest_live_worker_only() -> None:
    _, m, _, _ = make()
    m.join("fast")
    m.join("slow")
    for c in range(5):
        m.advance("fast", c)
    assert m.min_clock() == 0
    assert m.wait_ssp(clock=2, staleness=2, timeout=1) >= 0  # 0 >= 2 - 2
    with pytest.raises(DeadlineExceededError, match="slowest is at 0"):
        m.wait_ssp(clock=5, staleness=2, timeout=0.05)
    threading.Timer(0.1, lambda: m.advance("slow", 2)).start()
    assert m.wait_ssp(clock=5, staleness=2, timeout=5) > 0.05  # slow reached clock 3
    m.leave("slow")  # a worker that left no longer holds anyone back
    assert m.min_clock() == 5
    assert m.wait_ssp(clock=7, staleness=2, timeout=0.05) < 0.05


def test_join_starts_at_the_slowest_live_clock() -> None:
    _, m, _, _ = make()
    m.join("a")
    m.join("b")
    for c in range(3):
        m.advance("a", c)
    m.advance("b", 0)
    m.join("c")
    assert {w.name: w.clock for w in m.workers()} == {"a": 3, "b": 1, "c": 1}


def test_a_contribution_from_a_worker_that_left_does_not_stand_in_for_a_live_one() -> None:
    _, m, r, applied = make()
    m.join("a")
    m.join("b")
    r.contribute("a", 0, 1.0)
    m.leave("a")  # a finished its last step and left; b's gradient for clock 0 is still due
    assert applied == []
    assert r.contribute("b", 0, 2.0) == APPLIED
    assert applied == [[1.0, 2.0]]
