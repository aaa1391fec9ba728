"""Primary-backup replication, the shard's side: every mutation is forwarded to the backup before it
is applied here; a backup installs its primary's snapshot, applies what it forwards, and takes
over. Part of ``Shard`` (its facade, ps/shard.py); plain Python, no gRPC (the wire: ps/replication.py)."""
from __future__ import annotations

import logging
import secrets
import time
from typing import Callable, Iterator

import numpy as np
import torch

from ps.checkpoint import ShardSnapshot, pack_plain, snapshot_to_plain
from ps.config import spec_from_dict
from ps.consistency import SyncPolicy
from ps.dedup import Dedup
from ps.errors import FailedPreconditionError, InvalidArgumentError, ShardUnavailableError
from ps.shardstate import BACKUP, PRIMARY, ShardState
from ps.table import DenseTable, DenseUpdate, PushResult, RowDelta, SparsePush, SparseTable

__all__ = ["Mirroring"]

log = logging.getLogger(__name__)


class Mirroring(ShardState):
    """Forwarding to the backup (a primary) and applying what the primary forwards (a backup)."""

    def _apply_round(self, name: str, values: list) -> PushResult:
        """Apply a completed BSP round (the mean of ``values``), replicated first."""
        t = self.table(name)
        clock = self._round(name).clock  # the round being applied (the clock moves on after)

        def replicate(entry: dict | None) -> None:
            self._live(name, t)
            self._replicate(entry)

        with self.gate.shared():
            return t.apply_mean(values, lambda res, x: replicate(None if x is None else _push_entry(t, x, res, "", 0, "", -1, clock)))

    def _replicate_contribution(self, name: str, worker: str, clock: int, value: object, backup_workers: int = 0) -> None:
        self._replicate({"k": "contrib", "t": name, "worker": worker, "clock": clock, "value": _contribution_plain(value), "bw": backup_workers})

    def _replicate(self, entry: dict | None) -> None:
        """Forward a mutation to the backup before it is applied here; raises (nothing applied) if
        the backup did not take it. With no backup: refuse writes for ``solo_after_s`` after losing
        one (it may be re-attaching, or about to take over), then go on alone. ``entry`` None: a
        mutation begun with no backup attached (none attaches before it ends): the checks only."""
        if self.role != PRIMARY:
            return
        forward = self._forward
        if forward is None:
            lost = self._backup_lost_at
            if lost is not None and time.monotonic() - lost < self.config.solo_after_s:
                raise ShardUnavailableError(
                    f"shard {self.config.shard_index}: its backup was lost {time.monotonic() - lost:.1f} s ago; "
                    f"writes wait up to {self.config.solo_after_s:.0f} s for it to re-attach or take over (retry)"
                )
            return
        assert entry is not None, "a backup attached while a push was being applied"
        try:
            forward(entry)
            self.replicated += 1
        except Exception as e:  # noqa: BLE001 - any failure detaches the backup: it must catch up again
            backup = self.backup
            self._lose_backup(f"{type(e).__name__}: {e}")
            # the error in one line (a gRPC error's status and details, not its debug string)
            code, details = getattr(e, "code", None), getattr(e, "details", None)
            short = f"{code().name}: {details()}" if callable(code) and callable(details) else f"{type(e).__name__}: {e}"
            raise ShardUnavailableError(
                f"shard {self.config.shard_index}: backup {backup} did not take the update ({short}); nothing applied (retry)"
            ) from None

    def _replicate_quietly(self, entry: dict) -> None:
        try:
            self._replicate(entry)
        except ShardUnavailableError as e:
            log.warning("%s", e)

    def _lose_backup(self, why: str) -> None:
        if self._forward is None:
            return
        log.error("shard %d: backup %s lost (%s); it must re-attach", self.config.shard_index, self.backup, why)
        self._forward = None
        self._backup_lost_at = time.monotonic()
        self.backups_lost += 1
        self.backup = ""
        for t in self._tables():
            if isinstance(t, SparseTable):
                t.track_evictions = False

    def attach(self, address: str, sender: Callable[[int], Callable[[dict], None]], chunk: int) -> Iterator[tuple[bytes, int]]:
        """Attach the backup at ``address`` (HOST:PORT; Attach): yields this primary's snapshot in
        pieces of ``chunk`` bytes, each with the attach id (set on the last piece only, 0 before),
        then forwards every mutation through ``sender(attach_id)``. The gate is held exclusive from
        the snapshot to the attach, so no mutation falls between the snapshot and the first forward."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 256:
            raise InvalidArgumentError(f"Attach: the backup's address {address[:64]!r} is not HOST:PORT")
        if self.role != PRIMARY:
            raise FailedPreconditionError(f"Attach: shard {self.config.shard_index} here is a backup itself")
        attach_id = secrets.randbits(63) or 1
        with self.gate.exclusive():
            data = pack_plain(snapshot_to_plain(self.snapshot(pending=True)))
            for off in range(0, len(data), chunk):
                yield data[off : off + chunk], attach_id if off + chunk >= len(data) else 0
            self.backup, self._forward, self._backup_lost_at = address, sender(attach_id), None
            self.backup_attach_id = attach_id
            for t in self._tables():
                if isinstance(t, SparseTable):
                    with t.lock:
                        t.track_evictions = True
                        t.take_evicted()
        log.info("shard %d: backup %s attached (%d bytes of snapshot)", self.config.shard_index, address, len(data))

    def install(self, snap: ShardSnapshot, attach_id: int) -> None:
        """A backup: replace everything with the primary's snapshot of attach ``attach_id``. Mutations
        forwarded under an earlier attach are refused from now on (apply_entry)."""
        with self.gate.exclusive():
            with self._lock:
                self._close_tables()
                self.tables.clear()
                self.rounds.clear()
            self.dedup = Dedup()
            self.membership.clear()
            self.restore(snap)
            for name, pending in snap.pending.items():
                r = self.rounds[name]
                for worker, value in pending:
                    r.mirror_contribution(worker, r.clock, _contribution_value(self.table(name), value))
            self.attach_id = attach_id
            self.installed.set()

    def apply_entry(self, entry: dict, attach_id: int, timeout: float = 30.0) -> None:
        """A backup: apply one mutation its primary forwarded under attach ``attach_id`` (in the
        primary's order per table). Waits for that attach's snapshot; refuses a stale attach's."""
        if self.role != BACKUP:
            raise FailedPreconditionError(f"Replicate: shard {self.config.shard_index} here is a primary (epoch {self.epoch})")
        deadline = time.monotonic() + timeout
        while True:
            with self.gate.shared():  # install() takes it exclusive: no entry applies across a re-install
                if self.attach_id == attach_id:
                    self._apply_entry(entry)
                    return
            if time.monotonic() > deadline:
                raise FailedPreconditionError(
                    f"Replicate: mutation of attach {attach_id}, this backup installed attach {self.attach_id}; re-attach"
                )
            time.sleep(0.01)

    def _apply_entry(self, entry: dict) -> None:
        k = entry["k"]
        if k == "create":
            self.create_table(spec_from_dict(entry["spec"]))
        elif k == "drop":
            self.drop_tables([str(n) for n in entry["tables"]], missing_ok=True)
        elif k == "join":
            self.membership.join(entry["worker"], float(entry["lease"]), int(entry["clock"]))
        elif k == "leave":
            self.membership.leave(entry["worker"])
        elif k in ("contrib", "dense", "sparse") and entry["t"] not in self.tables:
            # a mutation that raced a drop of its table on the primary (forwarded just after the drop;
            # the primary applied it to the detached table, invisible there too)
            log.warning("shard %d: skipped a forwarded %s of table %r: not held here (dropped)",
                        self.config.shard_index, k, entry["t"])
        elif k == "contrib":
            self.rounds[entry["t"]].mirror_contribution(
                entry["worker"], int(entry["clock"]), _contribution_value(self.table(entry["t"]), entry["value"]),
                int(entry["bw"]) if "bw" in entry else None,
            )
        elif k in ("dense", "sparse"):
            name = entry["t"]
            res = _result_from_plain(entry["result"])
            if k == "dense":
                t = self.dense(name)
                upd = t.begin_update(entry["op"], int(entry["base"]), bool(entry["sal"]))
                for block, data in sorted(entry["chunks"].items(), key=lambda kv: int(kv[0])):
                    upd.apply(int(block) * t.chunk_elems, data)
                upd.commit()
            else:
                self.sparse(name).apply_delta(
                    RowDelta(entry["ids"], entry["values"], entry["state"], entry["versions"]), int(entry["step"]), entry["evicted"]
                )
            self.dedup.record(entry["client"], name, int(entry["seq"]), res)
            if int(entry["round"]) >= 0:
                self.rounds[name].mirror_applied(int(entry["round"]))
            if entry["worker"]:
                self.pushed(entry["worker"], SyncPolicy(clock=int(entry["clock"])))
        else:
            raise InvalidArgumentError(f"unknown replication entry kind {k!r}")

    def promote(self) -> None:
        """A backup takes over as primary (its primary is gone): a new epoch, fresh leases for the
        members it mirrored, and rounds that every live worker has contributed to are applied."""
        if self.role == PRIMARY:
            return
        self.role = PRIMARY
        self.epoch += 1
        for w in self.membership.workers():
            if w.live:
                self.membership.join(w.name, w.lease_s, w.clock)
        log.warning("shard %d: promoted to primary (epoch %d)", self.config.shard_index, self.epoch)
        self._recheck_rounds()


def _result_to_plain(r: PushResult) -> list:
    return [r.applied, r.dropped, r.mean_staleness, r.max_staleness, r.version, r.late, r.clock]


def _result_from_plain(x: list) -> PushResult:
    return PushResult(int(x[0]), int(x[1]), float(x[2]), int(x[3]), int(x[4]), int(x[5]), int(x[6]))


def _push_entry(
    t: DenseTable | SparseTable, x: DenseUpdate | RowDelta, res: PushResult, client: str, seq: int, worker: str, clock: int,
    round_: int = -1,
) -> dict:
    """A push to forward to the backup: ``x`` a dense table's update (its staged chunks) or a sparse one's RowDelta."""
    if isinstance(x, DenseUpdate):
        chunks = {str(k): np.asarray(v) for k, v in x.staged.items()}
        entry = {"k": "dense", "op": x.op, "base": x.base_version, "sal": x.staleness_aware_lr, "chunks": chunks}
    else:
        assert isinstance(t, SparseTable)
        entry = {
            "k": "sparse", "ids": x.ids, "values": x.values, "state": x.state, "versions": x.versions, "step": res.version,
            "evicted": t.take_evicted(),
        }
    return {
        **entry, "t": t.spec.name, "client": client, "seq": seq, "result": _result_to_plain(res), "worker": worker, "clock": clock,
        "round": round_,
    }


def _contribution_plain(value: object) -> dict:
    if isinstance(value, SparsePush):
        return {"ids": value.ids, "grads": value.grads.numpy(), "base": value.base_versions}
    return {str(k): np.asarray(v) for k, v in value.items()}  # type: ignore[attr-defined]


def _contribution_value(t: DenseTable | SparseTable, plain: dict) -> object:
    if isinstance(t, SparseTable):
        return SparsePush(np.asarray(plain["ids"], np.int64), torch.from_numpy(np.asarray(plain["grads"], np.float32)), plain["base"])
    return {int(k): v for k, v in plain.items()}
