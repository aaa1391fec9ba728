"""``--debug-collectives``: fingerprint every collective, name the rank and the op on a mismatch or a stall.

Before each collective peer mode issues, every rank of the collective's group posts ``#seq op
dtype[shape]`` to the rendezvous store (its own client, keys of this attempt; one sequence per
group, so the DP groups of pipeline stages whose sizes differ are each checked among their own
ranks) and waits, at most ``timeout_s``, until every rank of the group has posted the same
sequence number. Then it compares: ranks about to issue different
collectives (another op, dtype or shape: the usual cause of a silent hang or of garbage) raise
``CollectiveMismatchError`` on every rank, naming each rank's op; a rank that does not arrive in
time is named with the last collective it did reach. Costs store round trips per collective: a
debugging aid, off by default.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from worker.peer.mesh import PeerError

__all__ = ["CollectiveChecker", "CollectiveMismatchError", "disable", "enable", "fingerprint"]

_ACTIVE: CollectiveChecker | None = None


class CollectiveMismatchError(PeerError):
    """Ranks disagree on a collective, or one did not reach it in time."""


class CollectiveChecker:
    """Fingerprints of this rank's collectives, checked against every other rank's through the store."""

    def __init__(self, rank: int, world: int, timeout_s: float = 30.0) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.seq: dict[str, int] = {}  # per group (its global ranks): collectives checked so far
        base = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.store = dist.PrefixStore(f"tessera/fp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", base)

    def check(self, op: str, *tensors: torch.Tensor, group: Any = None) -> None:
        """Post this collective on ``group`` (None: every rank) and compare it with its other ranks'."""
        ranks = list(range(self.world)) if group in (None, dist.group.WORLD) else dist.get_process_group_ranks(group)
        g = "w" if len(ranks) == self.world else "g" + "-".join(map(str, ranks))
        n = self.seq[g] = self.seq.get(g, 0) + 1
        desc = f"{op} " + ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
        self.store.set(f"{g}/{n}/{self.rank}", desc)
        self.store.set(f"last/{self.rank}", f"#{n} {desc}" + ("" if g == "w" else f" (ranks {ranks})"))
        keys = [f"{g}/{n}/{r}" for r in ranks]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - a timeout (DistStoreError); named below
            missing = [r for r in ranks if not self.store.check([f"{g}/{n}/{r}"])]
            last = {r: (self.store.get(f"last/{r}").decode() if self.store.check([f"last/{r}"]) else "none") for r in missing}
            raise CollectiveMismatchError(
                f"collective #{n} ({desc}): rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"reach it within {self.timeout_s:.0f} s; last collective reached: "
                + "; ".join(f"rank {r}: {v}" for r, v in last.items())
            ) from None
        descs = [self.store.get(k).decode() for k in keys]
        if len(set(descs)) > 1:
            raise CollectiveMismatchError(
                f"collective #{n} differs between ranks: " + "; ".join(f"rank {r}: {d}" for r, d in zip(ranks, descs))
            )
        if n > 2:  # the store keeps the last two rounds only
            self.store.delete_key(f"{g}/{n - 2}/{self.rank}")


def enable(rank: int, world: int, timeout_s: float = 30.0) -> CollectiveChecker:
    """Check every following peer-mode collective of this process."""
    global _ACTIVE
    _ACTIVE = CollectiveChecker(rank, world, timeout_s)
    return _ACTIVE


def disable() -> None:
    global _ACTIVE
    _ACTIVE = None


def fingerprint(op: str, *tensors: Any, group: Any = None) -> None:
    """Called before each collective on ``group`` (None: every rank; a group of one is not checked);
    a no-op unless ``enable`` was called."""
    if _ACTIVE is not None and not isinstance(group, str):  # str: core.ALONE, no collective at all
        _ACTIVE.check(op, *tensors, group=group)
