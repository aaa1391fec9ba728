"""Primary-backup replication of a shard, on the wire (the rules live in ``Shard``).

- ``ReplicaSender`` (on the primary): forwards one mutation to the backup and returns once the
  backup applied it; the primary applies it (and acknowledges the client) only after that, so an
  acknowledged update is on both.
- ``BackupFollower`` (on the backup): attaches to the primary (a snapshot streamed under the
  primary's exclusive gate, then forwarded mutations), checks every ``period`` that it is still
  the attached backup (re-attaching with a fresh snapshot if the primary dropped it), and takes
  over as primary once the primary was unreachable for ``config.failover_s``, but only while it
  is in sync (attached); a backup that lost its place never takes over with stale state.

Clients find the primary of a replica group with the ``Role`` RPC (highest epoch wins).
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from ps.checkpoint import pack_plain, snapshot_from_plain, unpack_plain
from ps.shard import BACKUP, Shard
from tessera.service import ClientSecurity, client_channel
from tessera.v1 import ps_pb2 as pb

__all__ = ["ReplicaSender", "BackupFollower", "SNAPSHOT_CHUNK"]

log = logging.getLogger(__name__)

_SERVICE = "/tessera.v1.ParameterServer/"
SNAPSHOT_CHUNK = 4 << 20


class ReplicaSender:
    """The primary's channel to its backup. ``send(entry)`` raises if the backup did not apply it."""

    def __init__(
        self, address: str, epoch: int, attach_id: int, timeout: float = 10.0, security: ClientSecurity | None = None
    ) -> None:
        self.address = address
        self.epoch = epoch
        self.attach_id = attach_id
        self.timeout = timeout
        self.channel = client_channel(address, security)
        self._replicate = self.channel.unary_unary(_SERVICE + "Replicate")

    def send(self, entry: dict) -> None:
        req = pb.ReplicateRequest(epoch=self.epoch, attach_id=self.attach_id, entry=pack_plain(entry))
        self._replicate(req.SerializeToString(), timeout=self.timeout)


class BackupFollower:
    """Runs on a backup shard: keeps it attached to ``shard.config.backup_of`` and promotes it when
    that primary is gone. ``advertise``: the address the primary dials to reach this backup."""

    def __init__(self, shard: Shard, advertise: str, period: float = 0.3, security: ClientSecurity | None = None) -> None:
        self.shard = shard
        self.primary = shard.config.backup_of
        self.advertise = advertise
        self.period = period
        self.in_sync = False
        self._stop = threading.Event()
        self.channel = client_channel(self.primary, security)
        self._role = self.channel.unary_unary(_SERVICE + "Role")
        self._attach = self.channel.unary_stream(_SERVICE + "Attach")
        self.thread = threading.Thread(target=self._run, name=f"ps{shard.config.shard_index}-backup", daemon=True)

    def start(self) -> "BackupFollower":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.channel.close()

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.is_set() and self.shard.role == BACKUP:
            try:
                request = pb.RoleRequest(backup=self.advertise, attach_id=self.shard.attach_id).SerializeToString()
                reply = pb.RoleReply.FromString(self._role(request, timeout=max(0.5, self.period * 3)))
                last_ok = time.monotonic()
                self.in_sync = reply.attached
                if not reply.attached:
                    self._attach_now()
            except grpc.RpcError as e:
                if self.in_sync and time.monotonic() - last_ok > self.shard.config.failover_s:
                    log.warning("backup of %s: primary unreachable for %.1f s (%s): taking over", self.primary,
                                time.monotonic() - last_ok, e.code() if hasattr(e, "code") else e)
                    self.shard.promote()
                    return
            except Exception:  # noqa: BLE001 - this thread must not die: log, count, go on
                self.shard.maintenance_errors += 1
                log.exception("backup of %s: follower step failed", self.primary)
            self._stop.wait(self.period)

    def _attach_now(self) -> None:
        """Fetch the primary's snapshot (it forwards every later mutation to us) and install it."""
        self.in_sync = False
        parts = []
        attach_id = 0
        # read to the end of the stream: the primary attaches us after its last chunk, and the call
        # must not be cancelled before that
        for raw in self._attach(pb.AttachRequest(backup=self.advertise).SerializeToString(), timeout=120):
            msg = pb.AttachChunk.FromString(raw)
            parts.append(msg.data)
            if msg.last:
                attach_id = msg.attach_id
        snap = snapshot_from_plain(unpack_plain(b"".join(parts)))
        self.shard.install(snap, attach_id)
        self.in_sync = True  # the stream ended normally: the primary has attached us
        log.info("backup of %s: attached (sync clock %d, %d tables)", self.primary, snap.sync_clock, len(snap.tables))
