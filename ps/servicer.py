"""The PS gRPC servicer: decode, call the Shard, encode, map errors to status codes.

Requests arrive as raw bytes and are decoded here (not by gRPC) so that
malformed input becomes INVALID_ARGUMENT with a message, and bulk tensor
bytes are read in place.
"""
from __future__ import annotations

from typing import Any, Iterator

import grpc

from ps.errors import MalformedMessageError, PermissionDeniedError, ShardUnavailableError
from ps.checkpoint import CheckpointError, unpack_plain
from ps.replication import SNAPSHOT_CHUNK, ReplicaSender
from ps.shard import PRIMARY, PushChunk, Shard
from ps.table import ASSIGN
from ps.wire import (ERRORS, dense_push_from_proto, dense_reply_to_proto, frame, frame_pieces, info_to_proto,
                     membership_to_proto, policy_from_proto, push_chunk_from_proto, spec_from_proto, stats_to_proto,
                     step_parts_from_proto, step_reply_to_proto, unframe, wire_float_dtype)
from tessera.codec import CodecError, Packed, as_float32, byte_view, from_wire, to_wire
from tessera.service import Access, Caller, ClientSecurity, Method, ServerSecurity, guarded_handler
from tessera.v1 import ps_pb2 as pb

__all__ = ["PSServicer", "STATUS_OF", "ERRORS", "SERVICE_NAME", "ROLES", "METHOD_ROLES", "WAITS"]


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

    @staticmethod
    def _reader(caller: Caller) -> dict[str, Any]:
        """Who a pull is (Shard.pulled: a read; a reader's worker name is ignored)."""
        return {"identity": caller.identity, "as_worker": caller.has("worker") or caller.has("admin")}

    # ------------------------------------------------------------------ plumbing
    def _failed(self, method: str, code: grpc.StatusCode) -> None:
        if not (method == "DescribeTable" and code == grpc.StatusCode.NOT_FOUND):
            # a lookup that finds no table is an answer, not an error: workers poll DescribeTable for
            # the tables worker 0 has not created yet, and a healthy run must show no errors
            self.shard.errors[code.name] += 1

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

        def sender(attach_id: int) -> Any:
            return ReplicaSender(req.backup, self.shard.epoch, attach_id, security=self.peer).send

        for piece, attach_id in self.shard.attach(req.backup, sender, SNAPSHOT_CHUNK):
            yield self._out(frame(pb.AttachChunk(last=attach_id != 0, attach_id=attach_id), data=piece))

    def Replicate(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.ReplicateRequest, raw)
        try:
            entry = unpack_plain(pl.get("entry", b""))
        except CheckpointError as e:
            raise MalformedMessageError(f"Replicate: {e}") from None
        self.shard.apply_entry(entry, req.attach_id, self.access.wait_budget(context))
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
        dropped, path = self.shard.drop_tables(list(req.tables), req.missing_ok)
        reply = pb.DropTableReply(shard_index=self.shard.config.shard_index, dropped=dropped, checkpoint=path)
        return self._out(reply.SerializeToString())

    def Stats(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        self._decode(pb.StatsRequest, raw)
        return self._out(stats_to_proto(self.shard.stats()).SerializeToString())

    # ------------------------------------------------------------------ membership
    def Join(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.JoinRequest, raw)
        view = self.shard.join(req.worker, req.lease_ms / 1000.0, req.fresh, caller.identity)
        return self._out(membership_to_proto(view).SerializeToString())

    def Heartbeat(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.HeartbeatRequest, raw)
        view = self.shard.heartbeat(req.worker, req.leave, req.clock, caller.identity)
        return self._out(membership_to_proto(view).SerializeToString())

    def Checkpoint(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, _ = self._decode(pb.CheckpointRequest, raw)
        if req.hold:
            path, clock = "", self.shard.hold_cut(max(0, req.at_clock))
        else:
            path, clock = self.shard.cut_at(req.at_clock, self.access.wait_budget(context))
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
                    head, reply_dtype = dense_push_from_proto(msg)
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
        version, clock, blocks = self.shard.pull_dense(req.table, policy, self.access.wait_budget(context), req.worker, **self._reader(caller))
        for b in blocks:
            head = pb.DenseChunk(offset=b.offset, dtype=dtype, version=version, clock=clock)
            yield self._out(frame_pieces(head, data=to_wire(b.block, dtype)[1]))

    # ------------------------------------------------------------------ step
    def Step(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.StepRequest, raw)
        parts = step_parts_from_proto(req, pl.get("data", memoryview(b"")))
        dtype = req.dtype or "float32"
        outcomes = self.shard.step(parts, req.worker, req.client, self.access.wait_budget(context), dtype, **self._reader(caller))
        reply, pieces = step_reply_to_proto(outcomes, dtype)
        return self._out(frame_pieces(reply, data=pieces))  # (not copied: bulk sends them as they are, gRPC joins)

    # ------------------------------------------------------------------ sparse
    def PullSparse(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.PullSparseRequest, raw)
        dtype = wire_float_dtype(req.dtype, req.table, "dtype")
        ids = from_wire(pl.get("ids", b""), "int64", None, what=f"table {req.table!r}: ids")
        known = None
        if "known_versions" in pl:  # a conditional pull
            known = from_wire(pl["known_versions"], "int64", None, what=f"table {req.table!r}: known_versions")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        r = self.shard.pull_rows(
            req.table, ids, policy, self.access.wait_budget(context), dtype, known, req.known_epoch, req.worker, **self._reader(caller)
        )
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
        out = self.shard.push_sparse(name, ids, grads, base, req.worker, policy, req.client, req.seq, caller.identity)
        r = out.result
        return self._out(
            pb.PushSparseReply(
                applied=r.applied, dropped=r.dropped, mean_staleness=r.mean_staleness, max_staleness=r.max_staleness,
                late=out.late, clock=out.clock, duplicate=out.duplicate,
            ).SerializeToString()
        )
