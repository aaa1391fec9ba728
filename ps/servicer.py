"""The PS gRPC servicer: decode, call the Shard, encode, map errors to status codes.

Requests arrive as raw bytes and are decoded here (not by gRPC) so that
malformed input becomes INVALID_ARGUMENT with a message, and bulk tensor
bytes are read in place.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any, Iterator

import grpc

from ps.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    MalformedMessageError,
    PermissionDeniedError,
    ShardUnavailableError,
)
from ps.checkpoint import CheckpointError, pack_plain, snapshot_to_plain, unpack_plain
from ps.replication import SNAPSHOT_CHUNK, ReplicaSender
from ps.shard import BACKUP, PRIMARY, PUSH_DENSE, PUSH_SPARSE, PushChunk, Shard
from ps.table import ASSIGN
from ps.wire import (
    ERRORS,
    dense_push_from_proto,
    dense_reply_to_proto,
    frame,
    frame_pieces,
    info_to_proto,
    membership_to_proto,
    policy_from_proto,
    push_chunk_from_proto,
    spec_from_proto,
    stats_to_proto,
    step_parts_from_proto,
    step_reply_to_proto,
    unframe,
    wire_float_dtype,
)
from tessera.codec import CodecError, Packed, as_float32, byte_view, from_wire, to_wire
from tessera.service import Method, guarded_handler
from tessera.service import Access, Caller, ClientSecurity, ServerSecurity
from tessera.v1 import ps_pb2 as pb

__all__ = ["PSServicer", "STATUS_OF", "ERRORS", "SERVICE_NAME", "ROLES", "METHOD_ROLES", "WAITS"]

log = logging.getLogger(__name__)

SERVICE_NAME = "tessera.v1.ParameterServer"

STATUS_OF = ERRORS.codes

# who may call what. admin: everything (create, assign, checkpoint); worker: train (pull, push
# gradients, join as its own names); reader: read; replica: a shard's peer (attach, replicate)
ROLES = ("admin", "worker", "reader", "replica")
METHOD_ROLES: dict[str, frozenset[str]] = {
    "CreateTable": frozenset({"admin"}),
    "DropTable": frozenset({"admin"}),
    "DescribeTable": frozenset(ROLES),
    "PushDense": frozenset({"admin", "worker"}),  # DENSE_OP_ASSIGN: admin only (checked in the handler)
    "PullDense": frozenset({"admin", "worker", "reader"}),
    "PullSparse": frozenset({"admin", "worker", "reader"}),
    "PushSparse": frozenset({"admin", "worker"}),
    "Stats": frozenset(ROLES),
    "Join": frozenset({"admin", "worker"}),
    "Heartbeat": frozenset({"admin", "worker"}),
    "Checkpoint": frozenset({"admin"}),
    "Step": frozenset({"admin", "worker"}),
    "Role": frozenset(ROLES),
    "Attach": frozenset({"admin", "replica"}),
    "Replicate": frozenset({"admin", "replica"}),
}

# methods that may block (BSP/SSP waits, a checkpoint cut, push streams a client feeds): an identity
# holds at most ServerSecurity.max_waiting of them at once, each wait at most Limits.max_wait_s
WAITS = frozenset({"PullDense", "PullSparse", "PushDense", "Step", "Checkpoint"})

# methods a backup answers itself; every other one is for the primary
_ANY_ROLE = frozenset({"Role", "Attach", "Replicate", "Stats", "DescribeTable"})


class PSServicer:
    """Handlers take (request bytes or iterator of bytes, context, caller) and return bytes.

    Every call passes ``access`` first (identity, role, per-identity limits). Worker names are
    the shard's (``Shard.names``, ps.names): pinned to identities by the token file, else bound to
    the first identity that joins or pushes with one (at most ``max_names``); pulls never bind."""

    def __init__(self, shard: Shard, access: Access | None = None, peer: ClientSecurity | None = None, max_names: int = 65536) -> None:
        self.shard = shard
        self.access = access or Access(ServerSecurity(), METHOD_ROLES, ROLES)
        self.peer = peer  # how this shard reaches its backup (replication)
        shard.names.max_names = max_names
        shard.names.pins = self.access.worker_names  # the token file's workers= pins
        self.bulk_port = 0  # > 0: the same handlers are served over tessera.bulk there (advertised by Role)

    def _own(self, caller: Caller, worker: str) -> None:
        """``caller`` writes or joins as ``worker``: it must be its own name (Shard.claim)."""
        self.shard.claim(caller.identity, worker)

    def _pulled(self, caller: Caller, worker: str) -> None:
        """A pull naming ``worker``: a read (Shard.pulled: no join, no binding; a reader's name is ignored)."""
        self.shard.pulled(worker, caller.identity, caller.has("worker") or caller.has("admin"))

    @staticmethod
    def _client_key(caller: Caller, client: str) -> str:
        """Dedup records are per identity: nobody can make another identity's pushes look retried."""
        return f"{caller.identity}/{client}" if caller.identity and client else client

    # ------------------------------------------------------------------ plumbing
    def _failed(self, method: str, code: grpc.StatusCode) -> None:
        if not (method == "DescribeTable" and code == grpc.StatusCode.NOT_FOUND):
            # a lookup that finds no table is an answer, not an error: workers poll DescribeTable for
            # the tables worker 0 has not created yet, and a healthy run must show no errors
            self.shard.errors[code.name] += 1

    def _budget(self, context: grpc.ServicerContext) -> float:
        """Seconds a wait of this call may block: its deadline, capped server-side (Access.wait_budget)."""
        return self.access.wait_budget(context)

    def _decode(self, cls: type, raw: bytes) -> tuple[Any, dict[str, memoryview]]:
        """The request and its bulk fields by name (zero-copy views; see ps.wire.frame)."""
        self.shard.bytes_in += len(raw)
        try:
            return unframe(cls, raw)
        except CodecError as e:
            raise MalformedMessageError(f"{cls.__name__}: {e}") from None

    def _out(self, data: Any) -> Any:
        self.shard.bytes_out += data.nbytes if isinstance(data, Packed) else len(data)
        return data

    def handlers(self) -> grpc.GenericRpcHandler:
        """The handlers of ``tessera.v1.ParameterServer``: each runs for the caller the server's
        ``access`` admitted (served by ps.server through the runtime's ``build_server(access=...)``
        and the bulk plane alike), inside the runtime's one error path (tessera.service.guarded_handler)."""
        streams = {"PushDense": Method(self.PushDense, request_stream=True, response_stream=True)}
        replies = {"PullDense": self.PullDense, "Attach": self.Attach}
        unary = {
            "CreateTable": self.CreateTable, "DescribeTable": self.DescribeTable, "DropTable": self.DropTable,
            "PullSparse": self.PullSparse, "PushSparse": self.PushSparse, "Stats": self.Stats, "Join": self.Join,
            "Heartbeat": self.Heartbeat, "Checkpoint": self.Checkpoint, "Step": self.Step, "Role": self.Role,
            "Replicate": self.Replicate,
        }
        methods = {
            **{n: Method(f) for n, f in unary.items()}, **{n: Method(f, response_stream=True) for n, f in replies.items()}, **streams,
        }
        return guarded_handler(SERVICE_NAME, methods, self.access, ERRORS, before=self._before, on_error=self._failed)

    def _before(self, method: str, caller: Caller) -> None:
        self.shard.requests[method] += 1
        self._check_role(method)

    def _check_role(self, method: str) -> None:
        if self.shard.role != PRIMARY and method not in _ANY_ROLE:
            raise ShardUnavailableError(
                f"{method}: shard {self.shard.config.shard_index} here is the backup of {self.shard.config.backup_of}; "
                "ask the primary (clients given both addresses fail over by themselves)"
            )

    # ------------------------------------------------------------------ replication
    def Role(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.RoleRequest, raw)
        sh = self.shard
        return self._out(
            pb.RoleReply(
                shard_index=sh.config.shard_index, num_shards=sh.config.num_shards, role=sh.role, epoch=sh.epoch,
                backup=sh.backup, attached=bool(req.backup) and req.backup == sh.backup and req.attach_id == sh.backup_attach_id,
                bulk_port=self.bulk_port,
            ).SerializeToString()
        )

    def Attach(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        req, _ = self._decode(pb.AttachRequest, raw)
        host, _, port = req.backup.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(req.backup) > 256:
            raise InvalidArgumentError(f"Attach: the backup's address {req.backup[:64]!r} is not HOST:PORT")
        sh = self.shard
        if sh.role != PRIMARY:
            raise FailedPreconditionError(f"Attach: shard {sh.config.shard_index} here is a backup itself")
        attach_id = secrets.randbits(63) or 1
        # no mutation may fall between the snapshot and the first forward: hold the gate throughout
        with sh.gate.exclusive():
            data = pack_plain(snapshot_to_plain(sh.snapshot(pending=True)))
            for off in range(0, len(data), SNAPSHOT_CHUNK):
                last = off + SNAPSHOT_CHUNK >= len(data)
                head = pb.AttachChunk(last=last, attach_id=attach_id if last else 0)
                yield self._out(frame(head, data=data[off : off + SNAPSHOT_CHUNK]))
            sh.attach_backup(req.backup, ReplicaSender(req.backup, sh.epoch, attach_id, security=self.peer).send, attach_id)
        log.info("shard %d: backup %s attached (%d bytes of snapshot)", sh.config.shard_index, req.backup, len(data))

    def Replicate(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.ReplicateRequest, raw)
        sh = self.shard
        if sh.role != BACKUP:
            raise FailedPreconditionError(f"Replicate: shard {sh.config.shard_index} here is a primary (epoch {sh.epoch})")
        try:
            entry = unpack_plain(pl.get("entry", b""))
        except CheckpointError as e:
            raise MalformedMessageError(f"Replicate: {e}") from None
        sh.apply_entry(entry, req.attach_id, self._budget(context))
        return self._out(pb.ReplicateReply().SerializeToString())

    # ------------------------------------------------------------------ tables
    def CreateTable(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.CreateTableRequest, raw)
        created, info = self.shard.create_table(spec_from_proto(req.spec), req.num_shards or None, req.validate_only)
        reply = pb.CreateTableReply(created=created)
        if info is not None:
            reply.info.CopyFrom(info_to_proto(info))
        return self._out(reply.SerializeToString())

    def DescribeTable(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.DescribeTableRequest, raw)
        return self._out(info_to_proto(self.shard.info(req.table)).SerializeToString())

    def DropTable(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.DropTableRequest, raw)
        if len(req.tables) > self.shard.config.max_tables:
            raise InvalidArgumentError(f"DropTable: {len(req.tables)} names, more than the shard's {self.shard.config.max_tables} tables")
        if any(not n for n in req.tables):
            raise InvalidArgumentError("DropTable: a table name is empty")
        dropped, path = self.shard.drop_tables(list(req.tables), req.missing_ok)
        reply = pb.DropTableReply(shard_index=self.shard.config.shard_index, dropped=dropped, checkpoint=path)
        return self._out(reply.SerializeToString())

    def Stats(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        self._decode(pb.StatsRequest, raw)
        return self._out(stats_to_proto(self.shard.stats()).SerializeToString())

    # ------------------------------------------------------------------ membership
    def Join(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.JoinRequest, raw)
        if req.lease_ms < 0:
            raise InvalidArgumentError(f"Join: lease_ms must be >= 0, got {req.lease_ms}")
        if not req.worker:
            raise InvalidArgumentError("Join: worker name is empty")
        self._own(caller, req.worker)
        view = self.shard.join(req.worker, req.lease_ms / 1000.0, req.fresh)
        return self._out(membership_to_proto(view).SerializeToString())

    def Heartbeat(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.HeartbeatRequest, raw)
        if not req.worker:
            raise InvalidArgumentError("Heartbeat: worker name is empty")
        if req.clock < 0:
            raise InvalidArgumentError(f"Heartbeat: clock must be >= 0, got {req.clock}")
        self._own(caller, req.worker)
        view = self.shard.heartbeat(req.worker, req.leave, req.clock)
        return self._out(membership_to_proto(view).SerializeToString())

    def Checkpoint(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.CheckpointRequest, raw)
        if req.hold:
            path, clock = "", self.shard.hold_cut(max(0, req.at_clock))
        else:
            path, clock = self.shard.cut_at(req.at_clock, self._budget(context))
        return self._out(pb.CheckpointReply(shard_index=self.shard.config.shard_index, path=path, clock=clock).SerializeToString())

    # ------------------------------------------------------------------ dense
    def PushDense(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        """A dense push streamed chunk by chunk: decoded here, driven by ``Shard.push_dense``."""
        reply_dtype = "float32"

        def chunks() -> Iterator[PushChunk]:
            nonlocal reply_dtype
            head = None
            for raw in request_iterator:
                msg, pl = self._decode(pb.DenseChunk, raw)
                if head is None:
                    head, reply_dtype = dense_push_from_proto(msg, self._client_key(caller, msg.client))
                    if head.op == ASSIGN and not caller.has("admin"):
                        raise PermissionDeniedError(
                            f"table {head.table!r}: assigning values needs the admin role; "
                            f"identity {caller.identity!r} has {sorted(caller.roles)}"
                        )
                    yield push_chunk_from_proto(msg, pl, head.table, head)
                else:
                    yield push_chunk_from_proto(msg, pl, head.table)

        for item in self.shard.push_dense(chunks(), context, caller.identity):
            yield self._out(dense_reply_to_proto(item, reply_dtype))

    def PullDense(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        req, _ = self._decode(pb.PullDenseRequest, raw)
        dtype = wire_float_dtype(req.dtype, req.table, "dtype")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        self._pulled(caller, req.worker)
        version, clock, blocks = self.shard.pull_dense(req.table, policy, self._budget(context))
        for b in blocks:
            head = pb.DenseChunk(offset=b.offset, dtype=dtype, version=version, clock=clock)
            yield self._out(frame_pieces(head, data=to_wire(b.block, dtype)[1]))

    # ------------------------------------------------------------------ step
    def Step(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.StepRequest, raw)
        parts = step_parts_from_proto(req, pl.get("data", memoryview(b"")))
        if any(p.op in (PUSH_DENSE, PUSH_SPARSE) for p in parts):
            self._own(caller, req.worker)  # its pushes join the worker (a step of pulls only is a read)
        else:
            self._pulled(caller, req.worker)
        dtype = req.dtype or "float32"
        outcomes = self.shard.step(parts, req.worker, self._client_key(caller, req.client), self._budget(context), dtype)
        reply, pieces = step_reply_to_proto(outcomes, dtype)
        return self._out(frame_pieces(reply, data=pieces))  # (not copied: bulk sends them as they are, gRPC joins)

    # ------------------------------------------------------------------ sparse
    def PullSparse(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.PullSparseRequest, raw)
        dtype = wire_float_dtype(req.dtype, req.table, "dtype")
        ids = from_wire(pl.get("ids", b""), "int64", None, what=f"table {req.table!r}: ids")
        known = None
        if "known_versions" in pl:  # a conditional pull: checked before anything is read or created
            kv = pl["known_versions"]
            if len(kv) != 8 * len(ids):
                raise InvalidArgumentError(
                    f"table {req.table!r}: known_versions has {len(kv)} bytes; {len(ids)} ids need {8 * len(ids)} "
                    "(one int64 per id, -1: none held)"
                )
            known = from_wire(kv, "int64", (len(ids),), what=f"table {req.table!r}: known_versions")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        self._pulled(caller, req.worker)
        r = self.shard.pull_rows(req.table, ids, policy, self._budget(context), dtype, known, req.known_epoch)
        head = pb.PullSparseReply(dtype=r.dtype, dim=r.dim, clock=r.clock, conditional=r.conditional, epoch=r.epoch)
        return self._out(frame_pieces(head, versions=byte_view(r.versions), data=to_wire(r.rows, r.dtype)[1]))

    def PushSparse(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.PushSparseRequest, raw)
        name = req.table
        dtype = wire_float_dtype(req.dtype, name, "dtype")
        ids = from_wire(pl.get("ids", b""), "int64", None, what=f"table {name!r}: ids")
        grads = as_float32(from_wire(pl.get("data", b""), dtype, (len(ids), req.dim), what=f"table {name!r}: gradient rows of dim {req.dim}"))
        base = None
        if len(pl.get("base_versions", b"")):
            base = from_wire(pl["base_versions"], "int64", None, what=f"table {name!r}: base_versions")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        self._own(caller, req.worker)
        out = self.shard.push_sparse(name, ids, grads, base, req.worker, policy, self._client_key(caller, req.client), req.seq)
        r = out.result
        return self._out(
            pb.PushSparseReply(
                applied=r.applied, dropped=r.dropped, mean_staleness=r.mean_staleness, max_staleness=r.max_staleness,
                late=out.late, clock=out.clock, duplicate=out.duplicate,
            ).SerializeToString()
        )
