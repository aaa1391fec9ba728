"""Who takes part in a round: one vote per participant, fewer draws for the unresponsive.

A *participant* is an authenticated identity (a bearer token's identity, or with mutual
TLS and no tokens a client certificate's name) together with every client id it
registers; on a server without authentication each client id is its own participant
(nothing tells two ids of one owner apart there). :func:`sample` draws participants, not
client ids, and sends each drawn participant's task to one of its ids: an identity that
registers 3 (or 10,000) ids has one vote in a round, in every strategy (FedAvg's
example weighting, median, trimmed mean, Krum, secure aggregation's sum, DP's
per-client clipping). Sampling one id per identity was chosen over aggregating an
identity's ids first because it works unchanged where the server never sees individual
updates (secure aggregation) and keeps DP's unit of privacy (one clipped update per
participant per round).

:class:`Responsiveness` counts, per participant, the rounds in a row it was sampled and
did not answer in time; a participant with a streak of ``s`` is eligible for a draw
with probability ``2**-s`` (at least ``2**-MAX_STREAK``), so one that keeps timing out is
rarely drawn, also at ``fraction`` 1.0, and one answer resets it.

Pure Python and numpy: no grpc.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import numpy as np

__all__ = ["MAX_STREAK", "Responsiveness", "Sample", "participant_of", "sample"]

MAX_STREAK = 10  # at worst drawn with probability 2**-10: a participant that recovers is seen again


def participant_of(identity: str | None, client_id: str) -> str:
    """The participant a client id belongs to: its identity, or without authentication the id itself."""
    return client_id if identity is None else identity


class Responsiveness:
    """Per participant, the rounds in a row it was sampled and did not answer in time.

    Not thread-safe (the round loop's thread alone uses it). Holds at most one small entry
    per participant with a streak (see :meth:`prune`)."""

    def __init__(self) -> None:
        self._streak: dict[str, int] = {}

    def streak(self, participant: str) -> int:
        """Rounds in a row ``participant`` was sampled and did not answer in time (0: none)."""
        return self._streak.get(participant, 0)

    def answered(self, participant: str) -> None:
        """It answered (an answer that was rejected counts too: it was not silent)."""
        self._streak.pop(participant, None)

    def timed_out(self, participant: str) -> None:
        """It did not answer before its round closed."""
        self._streak[participant] = min(MAX_STREAK, self._streak.get(participant, 0) + 1)

    def keep_probability(self, participant: str) -> float:
        """The chance that ``participant`` is eligible for a draw: ``2**-streak``."""
        return 2.0 ** -self.streak(participant)

    def prune(self, live: Collection[str]) -> None:
        """Forget participants not in ``live`` once the table outgrows it (anonymous ids come
        and go; an identity that reconnects is in ``live`` again and keeps its streak)."""
        if len(self._streak) > 4 * len(live) + 64:
            self._streak = {p: s for p, s in self._streak.items() if p in live}


@dataclass(frozen=True)
class Sample:
    """A draw: ``client_ids`` (sorted, one per drawn participant), ``participants`` (client id
    -> its participant) and ``eligible`` (how many participants the draw was made from, for
    DP's sampling rate)."""

    client_ids: list[str]
    participants: dict[str, str]
    eligible: int


def sample(participants: Mapping[str, Sequence[str]], fraction: float, min_clients: int, rng: np.random.Generator,
           responsiveness: Responsiveness | None = None) -> Sample:
    """Draw ``max(min_clients, ceil(fraction * len(participants)))`` participants (at most as
    many as are eligible) uniformly from the eligible ones, and one client id of each.

    ``participants``: participant -> its connected client ids (non-empty). A participant with
    a timeout streak is eligible with probability ``2**-streak``; when fewer than
    ``min_clients`` are eligible, those with the shortest streaks are added back. The draw is
    a function of ``rng``'s state and the participants' sorted keys and ids only."""
    keys = sorted(participants)
    n = len(keys)
    want = min(n, max(min_clients, math.ceil(fraction * n)))
    if responsiveness is None:
        eligible = keys
    else:
        coins = rng.random(n)
        eligible = [p for p, u in zip(keys, coins) if u < responsiveness.keep_probability(p)]
        floor = min(n, min_clients)
        if len(eligible) < floor:
            chosen = set(eligible)
            rest = sorted((p for p in keys if p not in chosen), key=responsiveness.streak)  # stable: keys stay sorted
            eligible = sorted(eligible + rest[: floor - len(eligible)])
    k = min(want, len(eligible))
    picked = rng.choice(len(eligible), size=k, replace=False) if k else np.zeros(0, dtype=np.int64)
    out: dict[str, str] = {}
    for i in sorted(picked.tolist()):
        p = eligible[i]
        ids = participants[p]
        cid = ids[0] if len(ids) == 1 else sorted(ids)[int(rng.integers(len(ids)))]
        out[cid] = p
    return Sample(sorted(out), out, len(eligible))
