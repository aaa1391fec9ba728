"""federated.sampling without sockets: participants are drawn, not client ids; one id each; a
participant that keeps timing out is drawn with probability 2**-streak (at least 2**-10)."""
from __future__ import annotations

import numpy as np

from federated.sampling import MAX_STREAK, Responsiveness, participant_of, sample

PARTS = {"alice": [f"alice/{i}" for i in range(10_000)], "bob": ["bob"], "carol": ["carol/a", "carol/b"]}


def test_one_client_id_per_drawn_participant_and_reproducible() -> None:
    for seed in range(20):
        s = sample(PARTS, 1.0, 2, np.random.default_rng(seed))
        assert sorted(s.participants.values()) == ["alice", "bob", "carol"] and s.eligible == 3
        assert all(c in PARTS[p] for c, p in s.participants.items()) and s.client_ids == sorted(s.participants)
        again = sample(PARTS, 1.0, 2, np.random.default_rng(seed))
        assert again == s  # a function of the generator and the sorted participants only
    # fraction of participants (3), not of client ids (10,003): ceil(0.5 * 3) = 2
    assert len(sample(PARTS, 0.5, 1, np.random.default_rng(0)).client_ids) == 2
    assert participant_of(None, "c7") == "c7" and participant_of("alice", "alice/3") == "alice"


def test_timeouts_halve_the_chance_to_be_drawn_and_an_answer_resets_it() -> None:
    r = Responsiveness()
    assert r.keep_probability("alice") == 1.0
    r.timed_out("alice")
    r.timed_out("alice")
    assert r.streak("alice") == 2 and r.keep_probability("alice") == 0.25
    drawn = sum("alice" in sample(PARTS, 1.0, 1, np.random.default_rng(i), r).participants.values()
                for i in range(4000))
    assert 800 < drawn < 1200  # 1/4 of 4000 draws, at fraction 1.0 too
    for _ in range(50):
        r.timed_out("alice")
    assert r.streak("alice") == MAX_STREAK and r.keep_probability("alice") == 2.0 ** -MAX_STREAK
    r.answered("alice")
    assert r.keep_probability("alice") == 1.0


def test_too_few_eligible_are_filled_up_to_min_clients_by_the_shortest_streaks() -> None:
    r = Responsiveness()
    for _ in range(MAX_STREAK):
        r.timed_out("alice")
        r.timed_out("carol")
    r.timed_out("bob")
    for i in range(50):
        s = sample(PARTS, 0.1, 2, np.random.default_rng(i), r)
        assert len(s.client_ids) == 2  # min_clients, whatever the coins said
        assert "bob" in s.participants.values() or s.eligible >= 2
