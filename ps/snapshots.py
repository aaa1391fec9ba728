"""A shard's durable state: snapshots, restores, checkpoints and the cluster-wide consistent cut.
Part of ``Shard`` (its facade, ps/shard.py); plain Python, no gRPC (the format: ps/checkpoint.py)."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any

from ps.checkpoint import CheckpointError, ShardSnapshot, write_checkpoint
from ps.config import DENSE, SPARSE, spec_from_dict, spec_to_dict
from ps.consistency import SyncRound
from ps.errors import FailedPreconditionError
from ps.mirroring import _contribution_plain, _result_from_plain, _result_to_plain
from ps.shardstate import ShardState
from ps.table import DenseTable

__all__ = ["Snapshots"]

log = logging.getLogger(__name__)


class Snapshots(ShardState):
    """Snapshot and restore, checkpoints now or every ``config.checkpoint_every_s``, the two-phase cut."""

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
            tables.append({**st, "kind": DENSE if isinstance(t, DenseTable) else SPARSE, "spec": spec_to_dict(t.spec)})
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
