"""The PS gRPC servicer: decode, call the Shard, encode, map errors to status codes.

Requests arrive as raw bytes and are decoded here (not by gRPC) so that
malformed input becomes INVALID_ARGUMENT with a message, and bulk tensor
bytes are read in place.
"""
from __future__ import annotations

import logging
import secrets
from typing import Any, Callable, Iterator

import grpc
import numpy as np

from ps.errors import (
    DtypeError,
    FailedPreconditionError,
    InvalidArgumentError,
    MalformedMessageError,
    ShapeMismatchError,
    PermissionDeniedError,
    ShardUnavailableError,
    with_table,
)
from ps.checkpoint import CheckpointError, pack_plain, snapshot_to_plain, unpack_plain
from ps.replication import SNAPSHOT_CHUNK, ReplicaSender
from ps.shard import BACKUP, PRIMARY, PULL_DENSE, PULL_SPARSE, PUSH_DENSE, PUSH_SPARSE, Shard, StepPart
from ps.table import ASSIGN, GRADIENT, DenseTable
from ps.wire import (
    ERRORS,
    frame,
    frame_pieces,
    info_to_proto,
    membership_to_proto,
    policy_from_proto,
    spec_from_proto,
    stats_to_proto,
    unframe,
)
from tessera.codec import DTYPES, WIRE_FLOAT_DTYPES, CodecError, Packed, as_float32, byte_view, from_wire, to_wire
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
        """An async/SSP dense push (BSP: ``_push_dense_sync``). With ``return_params`` and ``early`` on
        the first chunk (the caller reads while it sends), a push that computes early sends each new
        block (``early`` set) right after its chunk, between reads of the request stream. The final
        status has ``early`` set if those blocks are the committed ones; else every block is sent
        again after the commit (unflagged; later chunks at an offset win)."""
        update = None
        table: DenseTable | None = None
        reply_dtype = "float32"
        want = early_ok = False
        last = False
        early_sent = 0  # blocks streamed back before the commit (computed early)
        try:
            with self.shard.watch_stream(context) as touch:
                for raw in request_iterator:
                    touch()
                    msg, pl = self._decode(pb.DenseChunk, raw)
                    if update is None:
                        table = self.shard.dense(msg.table)
                        reply_dtype = _float_dtype(msg.reply_dtype, table.spec.name, "reply_dtype")
                        want = msg.return_params
                        early_ok = want and msg.early  # the caller reads while it sends: blocks may go back early
                        if msg.op not in (pb.DENSE_OP_GRADIENT, pb.DENSE_OP_ASSIGN):
                            raise InvalidArgumentError(
                                f"table {table.spec.name!r}: unknown op {msg.op}; use DENSE_OP_GRADIENT (0) or DENSE_OP_ASSIGN (1)"
                            )
                        op = ASSIGN if msg.op == pb.DENSE_OP_ASSIGN else GRADIENT
                        if op == ASSIGN and not caller.has("admin"):
                            raise PermissionDeniedError(
                                f"table {table.spec.name!r}: assigning values needs the admin role; "
                                f"identity {caller.identity!r} has {sorted(caller.roles)}"
                            )
                        _check_push_shape(table, msg.shape, msg.flat_view)
                        policy = policy_from_proto(msg.sync, msg.HasField("sync"))
                        worker, client, seq = msg.worker, self._client_key(caller, msg.client), msg.seq
                        self._own(caller, worker)
                        if policy.sync and op == GRADIENT:
                            yield from self._push_dense_sync(msg, pl, request_iterator, table, worker, policy, touch, caller)
                            return
                        update = table.begin_update(op, msg.base_version, staleness_aware_lr=policy.staleness_aware_lr, early=early_ok)
                    update.apply(msg.offset, _chunk_data(msg, pl, table.spec.name))  # type: ignore[union-attr]
                    if early_ok:
                        # the push computes early: its new block goes back now, while the next chunks
                        # arrive (provisional until the commit says the early blocks held)
                        block = update.early_block(msg.offset // table.chunk_elems)  # type: ignore[union-attr]
                        if block is not None:
                            early_sent += 1
                            head = pb.DenseChunk(offset=msg.offset, dtype=reply_dtype, early=True)
                            yield self._out(frame_pieces(head, data=to_wire(block, reply_dtype)[1]))
                    if msg.last:
                        last = True
                        break  # commit now; never depend on how the stream ends
                if update is None or table is None:
                    raise InvalidArgumentError("PushDense: empty stream (no chunks)")
                if not last:
                    # gRPC ends the request stream the same way when the client half-closes and when the
                    # call failed (message too large, connection lost): only an explicit last chunk commits
                    have, need = len(update.staged), table.num_blocks
                    update.abort()
                    raise ShapeMismatchError(
                        f"table {table.spec.name!r}: push stream ended without its last chunk "
                        f"({have} of {need} chunks, {need - have} missing); nothing applied"
                    )
            out = self.shard.commit_dense(update, worker, policy, client, seq)
        except BaseException:
            if update is not None:
                update.abort()  # whatever ended the push (bad chunk, broken stream): its computed blocks go back
            raise
        result = out.result
        # the blocks sent early are the committed ones: only the status follows; else (another commit
        # came first and this one recomputed, a duplicate, or no early computation) every block again
        early_final = want and update.early_final and early_sent == table.num_blocks
        if want and not early_final:
            _, blocks = table.snapshot()
            for k, block in enumerate(blocks):
                yield self._out(frame_pieces(pb.DenseChunk(offset=k * table.chunk_elems, dtype=reply_dtype), data=to_wire(block, reply_dtype)[1]))
        yield self._out(
            pb.DenseChunk(
                table=table.spec.name, version=result.version, staleness=result.max_staleness,
                clock=out.clock, duplicate=out.duplicate, early=early_final,
            ).SerializeToString()
        )

    def _push_dense_sync(
        self, first: Any, first_pl: dict[str, memoryview], rest: Iterator[bytes], table: DenseTable, worker: str, policy: Any,
        touch: Callable[[], None], caller: Caller,
    ) -> Iterator[bytes]:
        """A BSP push: collect and validate every chunk (the request's bytes, not copied), then contribute."""
        name = table.spec.name
        chunks: dict[int, Any] = {}
        msg, pl = first, first_pl
        while True:
            data = _chunk_data(msg, pl, name)
            chunks[table.check_chunk(msg.offset, data, chunks)] = data
            if msg.last:
                break
            raw = next(rest, None)
            touch()
            if raw is None:
                raise ShapeMismatchError(
                    f"table {name!r}: push stream ended without its last chunk "
                    f"({len(chunks)} of {table.num_blocks} chunks); nothing applied"
                )
            msg, pl = self._decode(pb.DenseChunk, raw)
        if not worker:
            raise InvalidArgumentError(f"table {name!r}: a BSP push must name its worker")
        out = self.shard.push_dense_sync(name, worker, policy, chunks, self._client_key(caller, first.client), first.seq)
        yield self._out(
            pb.DenseChunk(
                table=name, version=table.version, staleness=0, clock=out.clock, late=out.late, duplicate=out.duplicate,
            ).SerializeToString()
        )

    def PullDense(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> Iterator[bytes]:
        req, _ = self._decode(pb.PullDenseRequest, raw)
        table = self.shard.dense(req.table)
        dtype = _float_dtype(req.dtype, table.spec.name, "dtype")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        self._pulled(caller, req.worker)
        clock = self.shard.wait(req.table, policy, self._budget(context))
        version, blocks = table.snapshot()
        for k, block in enumerate(blocks):
            head = pb.DenseChunk(offset=k * table.chunk_elems, dtype=dtype, version=version, clock=clock)
            yield self._out(frame_pieces(head, data=to_wire(block, dtype)[1]))

    # ------------------------------------------------------------------ step
    def Step(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.StepRequest, raw)
        parts = step_parts_from_proto(req, pl.get("data", memoryview(b"")))
        dtype = req.dtype or "float32"
        if any(p.op in (PUSH_DENSE, PUSH_SPARSE) for p in parts):
            self._own(caller, req.worker)  # its pushes join the worker (a step of pulls only is a read)
        else:
            self._pulled(caller, req.worker)
        outcomes = self.shard.step(parts, req.worker, self._client_key(caller, req.client), self._budget(context))
        reply = pb.StepReply()
        pieces: list[Any] = []
        at = 0
        for o in outcomes:
            r = reply.parts.add(table=o.table, op=_STEP_OPS_PB[o.op], version=o.version, clock=o.clock)
            if o.push is not None:
                res = o.push.result
                r.late, r.duplicate, r.applied, r.dropped = o.push.late, o.push.duplicate, res.applied, res.dropped
                r.mean_staleness, r.max_staleness, r.staleness = res.mean_staleness, res.max_staleness, res.max_staleness
                if o.op == PUSH_DENSE:
                    r.version = res.version if not o.push.late and res.version else o.version
            elif o.blocks is not None:
                r.data_at, r.count = at, sum(int(b.numel()) for b in o.blocks)
                for b in o.blocks:
                    piece = to_wire(b, dtype)[1]
                    pieces.append(piece)
                    at += piece.nbytes
            elif o.rows is not None and o.versions is not None:
                r.count, r.dim = o.rows.shape[0], o.rows.shape[1]
                rdtype = self.shard.sparse_reply_dtype(o.table, dtype)  # low-precision rows travel as stored
                if rdtype != dtype:
                    r.dtype = rdtype
                piece = to_wire(o.rows, rdtype)[1]
                r.data_at, at = at, at + piece.nbytes
                r.versions_at, at = at, at + o.versions.nbytes
                pieces += [piece, byte_view(o.versions)]
        return self._out(frame_pieces(reply, data=pieces))  # (not copied: bulk sends them as they are, gRPC joins)

    # ------------------------------------------------------------------ sparse
    def PullSparse(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.PullSparseRequest, raw)
        table = self.shard.sparse(req.table)
        dtype = _float_dtype(req.dtype, req.table, "dtype")
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
        clock = self.shard.wait(req.table, policy, self._budget(context))
        dtype = self.shard.sparse_reply_dtype(req.table, dtype)  # low-precision rows travel as stored
        # the eviction epoch before and after the read: equal, no row was dropped while the versions were
        # read (they name values of that epoch); the reply names the one before (a caller that got rows
        # read later holds an older epoch than they deserve: its next pull is sent whole, never wrong)
        epoch = table.eviction_epoch
        values, versions = self.shard.pull_sparse(req.table, ids, dtype)
        # the caller's versions name today's values only if read in this epoch (a dropped row created
        # again restarts at version 0: an equal version may hold another value); else every row is sent
        conditional = known is not None and req.known_epoch == epoch == table.eviction_epoch
        head = pb.PullSparseReply(dtype=dtype, dim=table.dim, clock=clock, conditional=conditional, epoch=epoch)
        if conditional:  # only the rows the caller does not hold at their current version
            changed = np.flatnonzero(versions != known)
            if len(changed) < len(ids):
                values = values[changed]  # a torch tensor (or array) of the rows as stored
        return self._out(frame_pieces(head, versions=byte_view(versions), data=to_wire(values, dtype)[1]))

    def PushSparse(self, raw: bytes, context: grpc.ServicerContext, caller: Caller) -> bytes:
        req, pl = self._decode(pb.PushSparseRequest, raw)
        table = self.shard.sparse(req.table)
        name = req.table
        dtype = _float_dtype(req.dtype, name, "dtype")
        ids = from_wire(pl.get("ids", b""), "int64", None, what=f"table {name!r}: ids")
        if req.dim != table.dim:
            raise ShapeMismatchError(f"table {name!r}: gradient dim {req.dim} != table dim {table.dim}")
        grads = as_float32(from_wire(pl.get("data", b""), dtype, (len(ids), table.dim), what=f"table {name!r}: gradient rows"))
        base = None
        if len(pl.get("base_versions", b"")):
            base = from_wire(pl["base_versions"], "int64", None, what=f"table {name!r}: base_versions")
        policy = policy_from_proto(req.sync, req.HasField("sync"))
        if policy.sync and not req.worker:
            raise InvalidArgumentError(f"table {name!r}: a BSP push must name its worker")
        self._own(caller, req.worker)
        out = self.shard.push_sparse(name, ids, grads, base, req.worker, policy, self._client_key(caller, req.client), req.seq)
        r = out.result
        return self._out(
            pb.PushSparseReply(
                applied=r.applied, dropped=r.dropped, mean_staleness=r.mean_staleness, max_staleness=r.max_staleness,
                late=out.late, clock=out.clock, duplicate=out.duplicate,
            ).SerializeToString()
        )


_STEP_OPS = {
    pb.STEP_OP_PUSH_DENSE: PUSH_DENSE,
    pb.STEP_OP_PUSH_SPARSE: PUSH_SPARSE,
    pb.STEP_OP_PULL_DENSE: PULL_DENSE,
    pb.STEP_OP_PULL_SPARSE: PULL_SPARSE,
}
_STEP_OPS_PB = {v: k for k, v in _STEP_OPS.items()}


def _span(data: memoryview, at: int, dtype: str, shape: tuple[int, ...], what: str) -> Any:
    """The array of ``dtype`` and ``shape`` that starts ``at`` bytes into ``data`` (a view; bfloat16: a copy)."""
    n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if at < 0 or any(d < 0 for d in shape) or at + n > len(data):
        raise MalformedMessageError(f"{what}: bytes [{at}, {at + n}) lie outside the request's {len(data)} data bytes")
    return from_wire(data[at : at + n], dtype, shape, what=what)


def step_parts_from_proto(req: Any, data: memoryview) -> list[StepPart]:
    """A StepRequest's parts as domain values (views of ``data``). Raises InvalidArgumentError naming the table."""
    dtype = _float_dtype(req.dtype, req.parts[0].table if req.parts else "", "dtype")
    parts = []
    for p in req.parts:
        name = p.table
        op = _STEP_OPS.get(p.op)
        if op is None:
            raise InvalidArgumentError(f"table {name!r}: unknown step op {p.op}")
        try:
            policy = policy_from_proto(p.sync, p.HasField("sync"))
        except InvalidArgumentError as e:
            raise with_table(name, e) from None
        if p.count < 0 or p.dim < 0:
            raise InvalidArgumentError(f"table {name!r}: count and dim must be >= 0, got {p.count} and {p.dim}")
        values = ids = base = None
        if op == PUSH_DENSE:
            values = as_float32(_span(data, p.data_at, dtype, (p.count,), f"table {name!r}: step gradient"))
        elif op in (PUSH_SPARSE, PULL_SPARSE):
            ids = _span(data, p.ids_at, "int64", (p.count,), f"table {name!r}: step ids")
            if op == PUSH_SPARSE:
                values = as_float32(_span(data, p.data_at, dtype, (p.count, p.dim), f"table {name!r}: step gradient rows"))
                if p.base_at >= 0:
                    base = _span(data, p.base_at, "int64", (p.count,), f"table {name!r}: step base versions")
        parts.append(StepPart(name, op, policy, p.seq, p.base_version, values, ids, base))
    return parts


def _chunk_data(msg: Any, pl: dict[str, memoryview], table: str) -> Any:
    """A pushed DenseChunk's values (a view of the request's bytes), after checking it is for ``table``."""
    if msg.table and msg.table != table:
        raise InvalidArgumentError(f"push to table {table!r} carries a chunk for {msg.table!r}")
    dtype = _float_dtype(msg.dtype, table, "dtype")
    return as_float32(from_wire(pl.get("data", b""), dtype, None, what=f"table {table!r}: chunk at offset {msg.offset}"))


def _check_push_shape(table: DenseTable, shape: Any, flat_view: bool) -> None:
    """A push that states its shape must state the table's (or, asking for it, the flat view)."""
    if not len(shape):
        return  # not stated (older clients): the element count is still checked chunk by chunk
    given = tuple(int(d) for d in shape)
    spec = table.spec
    want = (spec.numel,) if flat_view else tuple(spec.shape)
    if given != want:
        raise ShapeMismatchError(
            f"table {spec.name!r}: pushed shape {given}, expected {want}"
            + (" (the flat view)" if flat_view else f" (or flat_view with ({spec.numel},))") + "; nothing applied"
        )


def _float_dtype(dtype: str, table: str, field: str) -> str:
    dtype = dtype or "float32"
    if dtype not in WIRE_FLOAT_DTYPES:
        raise DtypeError(f"table {table!r}: {field} {dtype!r} not accepted; use one of {list(WIRE_FLOAT_DTYPES)}")
    return dtype
