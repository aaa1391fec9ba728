"""BSP rounds on a shard that the workers went back from (issue 31): another shard came back from
an older checkpoint and every worker continues from the shards' common clock. Pure logic, no sockets."""
from __future__ import annotations

import pytest

from ps.consistency import APPLIED, HELD, LATE, Membership, SyncRound
from ps.errors import DeadlineExceededError, FailedPreconditionError


def _round() -> tuple[SyncRound, list[list[float]]]:
    m = Membership(10.0)
    applied: list[list[float]] = []
    r: SyncRound = SyncRound("t", m, lambda values: applied.append(list(values)))
    for w in "ab":
        m.join(w)
    return r, applied


def test_a_worker_that_went_back_withdraws_what_it_held_for_the_current_round() -> None:
    r, applied = _round()
    for w in "ab":
        r.contribute(w, 0, 1.0)  # clock 1
    assert r.contribute("a", 1, 99.0) == HELD  # computed before the other shard went back
    # a went back to clock 0: its push there is late, and what it held for clock 1 is withdrawn
    assert r.contribute("a", 0, 5.0) == LATE
    assert (r.pending(), r.withdrawn, r.late) == (0, 1, 1)
    assert r.contribute("b", 0, 6.0) == LATE  # b held nothing: only late
    assert r.withdrawn == 1
    # back at clock 1, the round is made of the values computed again, not the withdrawn one
    assert r.contribute("a", 1, 2.0) == HELD
    assert r.contribute("b", 1, 4.0) == APPLIED
    assert applied == [[1.0, 1.0], [2.0, 4.0]] and r.clock == 2


def test_a_retried_push_of_the_current_round_is_late_and_keeps_what_is_held() -> None:
    r, applied = _round()
    assert r.contribute("a", 0, 1.0) == HELD
    assert r.contribute("a", 0, 1.0) == LATE  # a retry: the held contribution stays
    assert (r.pending(), r.withdrawn) == (1, 0)
    assert r.contribute("b", 0, 3.0) == APPLIED and applied == [[1.0, 3.0]]


def test_a_push_ahead_of_the_table_names_a_shard_behind_the_worker() -> None:
    r, _ = _round()
    with pytest.raises(FailedPreconditionError, match=r"push for clock 3, but the table is at clock 0: this shard is behind"):
        r.contribute("a", 3, 1.0)
    assert r.pending() == 0 and r.clock == 0


def test_a_pull_more_than_one_round_ahead_fails_at_once_other_waits_wait() -> None:
    r, _ = _round()
    with pytest.raises(FailedPreconditionError, match=r"pull for clock 2, but the table is at clock 0: this shard is behind"):
        r.wait_clock(2, timeout=60, pull=True)  # at once, not after the timeout
    with pytest.raises(DeadlineExceededError):
        r.wait_clock(1, timeout=0.05, pull=True)  # the next round: a wait
    with pytest.raises(DeadlineExceededError):
        r.wait_clock(5, timeout=0.05)  # a checkpoint's cut waits for a later clock
