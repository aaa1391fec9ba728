"""Protobuf messages <-> PS domain values (pure and symmetric), and the framing of messages
whose bulk bytes travel beside them (``frame`` / ``unframe``)."""
from __future__ import annotations

import functools
import math
from dataclasses import fields
from typing import Any, Sequence, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from ps.config import DENSE, SPARSE, AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.consistency import ASYNC, SyncPolicy
from ps.errors import (DeadlineExceededError, DtypeError, FailedPreconditionError, InternalError, InvalidArgumentError,
                       MalformedMessageError, PermissionDeniedError, PSError, ResourceExhaustedError, ShardUnavailableError,
                       TableExistsError, TableNotFoundError, UnauthenticatedError, with_table)
from ps.shard import (PULL_DENSE, PULL_SPARSE, PUSH_DENSE, PUSH_SPARSE, DenseBlock, DensePush, DensePushOutcome,
                      MembershipView, PushChunk, ShardStats, StepOutcome, StepPart, SyncPush, TableInfo, TableStats,
                      WorkerStats)
from ps.table import ASSIGN, GRADIENT, PushResult
from tessera.codec import ALIGN, DTYPES, WIRE_FLOAT_DTYPES, CodecError, Packed, as_float32, byte_view, from_wire, pack, to_wire, unpack
from tessera.service import ErrorTable
from tessera.v1 import ps_pb2 as pb

M = TypeVar("M", bound=Message)
T = TypeVar("T")

__all__ = ["ERRORS", "BULK", "frame", "frame_pieces", "unframe", "spec_to_proto", "spec_from_proto", "info_to_proto",
           "info_from_proto", "stats_to_proto", "stats_from_proto", "policy_to_proto", "policy_from_proto",
           "membership_to_proto", "membership_from_proto", "wire_float_dtype", "step_parts_from_proto",
           "step_parts_to_proto", "step_reply_to_proto", "step_reply_from_proto", "dense_push_from_proto",
           "push_chunk_from_proto", "dense_reply_to_proto"]

# ---------------------------------------------------------------------- framing
# The bulk ``bytes`` fields of each message: sent beside the header, not copied through protobuf
# (tessera.codec.pack/unpack), and read back as zero-copy views. Named here once; their numbers
# come from the .proto (13/14/15 by convention: the last fields of a message on the wire).
BULK: dict[type, tuple[str, ...]] = {
    pb.PullSparseRequest: ("known_versions", "ids"),
    pb.PullSparseReply: ("versions", "data"),
    pb.PushSparseRequest: ("base_versions", "ids", "data"),
    pb.DenseChunk: ("data",),
    pb.StepRequest: ("data",),
    pb.StepReply: ("data",),
    pb.AttachChunk: ("data",),
    pb.ReplicateRequest: ("entry",),
}
_NUMBERS: dict[type, dict[str, int]] = {
    cls: {n: cls.DESCRIPTOR.fields_by_name[n].number for n in names}  # type: ignore[attr-defined]
    for cls, names in BULK.items()
}
_NAMES: dict[type, dict[int, str]] = {cls: {v: k for k, v in m.items()} for cls, m in _NUMBERS.items()}


def frame(msg: Any, **bulk: Any) -> bytes:
    """``msg`` serialized with its bulk fields (by name: bytes, memoryview or contiguous array, or a
    list of them that fill the field one after the other) beside it.

    One copy of the bulk bytes; the result is ordinary protobuf wire format."""
    return pack(msg, {_NUMBERS[type(msg)][k]: v for k, v in bulk.items()})


def frame_pieces(msg: Any, **bulk: Any) -> Packed:
    """``frame``'s message as its pieces (no copy: views of the bulk buffers, which must not change
    until it is sent). The PS's stubs and servers send it over either transport: tessera.bulk as
    is, gRPC joined (``tessera.codec.as_bytes`` as the serializer)."""
    return pack(msg, {_NUMBERS[type(msg)][k]: v for k, v in bulk.items()}, joined=False)  # type: ignore[no-any-return]


def unframe(cls: type[M], raw: bytes) -> tuple[M, dict[str, memoryview]]:
    """Parse ``raw`` as ``cls``: (header message, {bulk field name: zero-copy view} for those present).

    Raises CodecError on malformed input."""
    numbers = _NUMBERS.get(cls)
    if numbers is None:
        return unpack(cls, raw)[0], {}
    msg, payloads = unpack(cls, raw, tuple(numbers.values()))
    return msg, {_NAMES[cls][k]: v for k, v in payloads.items()}


_KIND_TO_PB = {DENSE: pb.TABLE_KIND_DENSE, SPARSE: pb.TABLE_KIND_SPARSE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def spec_to_proto(spec: TableSpec) -> pb.TableSpec:
    o, i, a, e = spec.optimizer, spec.initializer, spec.admission, spec.eviction
    return _to_proto(
        pb.TableSpec, spec, kind=_KIND_TO_PB[spec.kind], optimizer=pb.OptimizerSpec(name=o.name, hparams=dict(o.hparams)),
        initializer=pb.InitializerSpec(name=i.name, params=dict(i.params)),
        admission=pb.AdmissionSpec(min_count=a.min_count, probability=a.probability),
        eviction=pb.EvictionSpec(ttl_steps=e.ttl_steps, max_rows=e.max_rows),
    )


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """Raises InvalidArgumentError naming the table and the bad field."""
    if msg.kind not in _KIND_FROM_PB:
        raise InvalidArgumentError(f"table {msg.name!r}: kind must be dense or sparse")
    o, i, a, e = msg.optimizer, msg.initializer, msg.admission, msg.eviction
    try:
        return _from_proto(
            TableSpec, msg, kind=_KIND_FROM_PB[msg.kind], shape=tuple(msg.shape), dtype=msg.dtype or "float32",
            optimizer=OptimizerSpec(o.name or "sgd", dict(o.hparams)), initializer=InitializerSpec(i.name or "zeros", dict(i.params)),
            admission=AdmissionSpec(a.min_count, a.probability), eviction=EvictionSpec(e.ttl_steps, e.max_rows),
            num_slots=msg.num_slots or 4096,
        )
    except InvalidArgumentError as err:
        raise with_table(msg.name, err) from None


@functools.cache
def _names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _to_proto(cls: type[M], value: Any, **given: Any) -> M:
    """The dataclass ``value`` as a ``cls`` message, field by field of the same name (the two are
    written to match); ``given``: the fields the caller converted."""
    return cls(**{n: getattr(value, n) for n in _names(value.__class__) if n not in given}, **given)


def _from_proto(cls: type[T], msg: Message, **given: Any) -> T:
    """The message ``msg`` as the dataclass ``cls``, as ``_to_proto`` the other way."""
    return cls(**{n: getattr(msg, n) for n in _names(cls) if n not in given}, **given)  # type: ignore[arg-type, call-arg]


def info_to_proto(info: TableInfo) -> pb.TableInfo:
    return _to_proto(pb.TableInfo, info, spec=spec_to_proto(info.spec))


def info_from_proto(msg: pb.TableInfo) -> TableInfo:
    return _from_proto(TableInfo, msg, spec=spec_from_proto(msg.spec))


def stats_to_proto(s: ShardStats) -> pb.StatsReply:
    return _to_proto(
        pb.StatsReply, s, tables=[_to_proto(pb.TableStats, t, kind=_KIND_TO_PB[t.kind]) for t in s.tables],
        workers=[_to_proto(pb.WorkerStats, w) for w in s.workers],
    )


def stats_from_proto(msg: pb.StatsReply) -> ShardStats:
    return _from_proto(
        ShardStats, msg, tables=[_from_proto(TableStats, t, kind=_KIND_FROM_PB.get(t.kind, "?")) for t in msg.tables],
        workers=[_from_proto(WorkerStats, w) for w in msg.workers], requests=dict(msg.requests), errors=dict(msg.errors),
    )


def policy_to_proto(p: SyncPolicy) -> pb.SyncSpec:
    return _to_proto(pb.SyncSpec, p)


def policy_from_proto(msg: pb.SyncSpec, present: bool = True) -> SyncPolicy:
    """``present``: whether the request carried a SyncSpec at all (absent: plain async)."""
    if not present:
        return ASYNC
    if msg.backup_workers < 0:
        raise InvalidArgumentError(f"sync.backup_workers must be >= 0, got {msg.backup_workers}")
    if msg.sync and msg.clock < 0:
        raise InvalidArgumentError(f"sync.clock must be >= 0 for a BSP request, got {msg.clock}")
    return _from_proto(SyncPolicy, msg)


def membership_to_proto(v: MembershipView) -> pb.MembershipReply:
    return _to_proto(pb.MembershipReply, v)


def membership_from_proto(msg: pb.MembershipReply) -> MembershipView:
    return _from_proto(MembershipView, msg, live=tuple(msg.live))


# the PS's two-way error table: error class <-> status code (the first match along an error's MRO
# wins; a code maps back to the first class listed for it). PSClient raises these from the codes.
ERRORS = ErrorTable(
    {
        TableNotFoundError: grpc.StatusCode.NOT_FOUND,
        TableExistsError: grpc.StatusCode.ALREADY_EXISTS,
        InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
        FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
        DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
        ShardUnavailableError: grpc.StatusCode.UNAVAILABLE,
        UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
        PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
        InternalError: grpc.StatusCode.INTERNAL,
    },
    default=InternalError,
    family=PSError,
)


def wire_float_dtype(dtype: str, table: str, field: str) -> str:
    """A request's float dtype field ("" : float32); DtypeError naming ``table`` and ``field`` if not one the wire carries."""
    dtype = dtype or "float32"
    if dtype not in WIRE_FLOAT_DTYPES:
        raise DtypeError(f"table {table!r}: {field} {dtype!r} not accepted; use one of {list(WIRE_FLOAT_DTYPES)}")
    return dtype


# ---------------------------------------------------------------------- Step
_STEP_OPS = {
    pb.STEP_OP_PUSH_DENSE: PUSH_DENSE,
    pb.STEP_OP_PUSH_SPARSE: PUSH_SPARSE,
    pb.STEP_OP_PULL_DENSE: PULL_DENSE,
    pb.STEP_OP_PULL_SPARSE: PULL_SPARSE,
}
_STEP_OPS_PB = {v: k for k, v in _STEP_OPS.items()}


def _span(data: memoryview, at: int, dtype: str, shape: tuple[int, ...], what: str, error: type = MalformedMessageError) -> Any:
    """The array of ``dtype`` and ``shape`` that starts ``at`` bytes into ``data`` (a view; bfloat16: a copy)."""
    npdt = DTYPES.get(dtype)
    count = math.prod(shape)  # exact (Python ints): a huge shape cannot wrap around
    n = count * (npdt.itemsize if npdt is not None else 0)
    if at < 0 or min(shape, default=0) < 0 or at + n > len(data):
        raise error(f"{what}: bytes [{at}, {at + n}) lie outside the message's {len(data)} data bytes")
    if npdt is None or dtype == "bfloat16":  # (an unknown dtype: from_wire names it)
        return from_wire(data[at : at + n], dtype, shape, what=what)
    return np.frombuffer(data, npdt, count, at).reshape(shape)  # (read-only where ``data`` is, as from_wire's)


_GAPS = [bytes(k) for k in range(ALIGN)]


def _put(pieces: list[Any], at: int, *new: memoryview) -> tuple[int, int]:
    """Append ``new`` (byte views, one array's bytes) to a bulk field's ``pieces``, which end ``at``
    bytes in, after zero bytes up to a multiple of codec.ALIGN (the field starts aligned, so every
    array in it is): (where ``new`` starts, where it ends)."""
    start = at + -at % ALIGN
    if start > at:
        pieces.append(_GAPS[start - at])
    pieces.extend(new)
    return start, start + sum(b.nbytes for b in new)


def step_parts_from_proto(req: pb.StepRequest, data: memoryview) -> list[StepPart]:
    """A StepRequest's parts as domain values (views of ``data``). Raises InvalidArgumentError naming the table."""
    dtype = wire_float_dtype(req.dtype, req.parts[0].table if req.parts else "", "dtype")
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


def step_parts_to_proto(parts: Sequence[StepPart], worker: str, client: str, dtype: str) -> Packed:
    """A shard's step parts as a StepRequest (``step_parts_from_proto`` the other way): pushed values
    already cast to ``dtype`` (the wire dtype, also the replies'), laid out one after the other in its
    bulk ``data`` (views of the parts' arrays, not copied: they must not change until it is sent)."""
    head = pb.StepRequest(worker=worker, client=client, dtype=dtype)
    pieces: list[Any] = []
    at = 0
    specs: dict[SyncPolicy, pb.SyncSpec] = {}  # each policy converted once (a step's parts share one or two)
    add = head.parts.add
    for p in parts:
        m = add(table=p.table, op=_STEP_OPS_PB[p.op], seq=p.seq, base_version=p.base_version, base_at=-1)
        if p.policy is not ASYNC and p.policy != ASYNC:
            if p.policy not in specs:
                specs[p.policy] = policy_to_proto(p.policy)
            m.sync.CopyFrom(specs[p.policy])
        if p.ids is not None:
            m.count = len(p.ids)
            m.ids_at, at = _put(pieces, at, byte_view(p.ids))
        if p.values is not None:
            if p.ids is None:
                m.count = len(p.values)
            if p.op == PUSH_SPARSE:
                m.dim = p.values.shape[1]
            m.data_at, at = _put(pieces, at, byte_view(p.values))
        if p.base_versions is not None:
            m.base_at, at = _put(pieces, at, byte_view(p.base_versions))
    return frame_pieces(head, data=pieces)


def step_reply_from_proto(msg: pb.StepReply, data: memoryview, dtype: str) -> list[StepOutcome]:
    """A StepReply as outcomes (``step_reply_to_proto`` the other way): a dense pull's values as its
    one block, a sparse pull's rows and versions (float32 numpy, views where the dtype allows); a
    push's result. Raises InternalError if the reply's parts point outside its data."""
    out = []
    for r in msg.parts:
        op = _STEP_OPS.get(r.op, "")
        what = f"table {r.table!r}: the shard's Step reply"
        push = blocks = rows = versions = None
        if op in (PUSH_DENSE, PUSH_SPARSE):
            res = PushResult(r.applied, r.dropped, r.mean_staleness, r.max_staleness, r.version, int(r.late), r.clock)
            push = SyncPush(res, r.late, r.clock, r.duplicate)
        elif op == PULL_DENSE:
            blocks = [_span(data, r.data_at, dtype, (r.count,), what, InternalError)]
        elif op == PULL_SPARSE:
            rows = _span(data, r.data_at, r.dtype or dtype, (r.count, r.dim), what, InternalError)
            versions = _span(data, r.versions_at, "int64", (r.count,), what, InternalError)
        else:
            raise InternalError(f"{what} has a part of unknown op {r.op}")
        out.append(StepOutcome(r.table, op, push, r.version, r.clock, blocks, rows, versions, r.dtype or dtype))
    return out


def step_reply_to_proto(outcomes: Sequence[StepOutcome], dtype: str) -> tuple[pb.StepReply, list[Any]]:
    """A step's outcomes as a StepReply and the pieces of its bulk ``data`` (views, not copied):
    dense blocks in ``dtype``, sparse rows in their outcome's ``dtype`` (named in the part when it
    is not ``dtype``), each followed by its int64 versions."""
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
            r.count = sum(int(b.numel()) for b in o.blocks)
            r.data_at, at = _put(pieces, at, *(to_wire(b, dtype)[1] for b in o.blocks))
        elif o.rows is not None and o.versions is not None:
            r.count, r.dim = o.rows.shape[0], o.rows.shape[1]
            rdtype = o.dtype or dtype
            if rdtype != dtype:
                r.dtype = rdtype
            r.data_at, at = _put(pieces, at, to_wire(o.rows, rdtype)[1])
            r.versions_at, at = _put(pieces, at, byte_view(o.versions))
    return reply, pieces


# ---------------------------------------------------------------------- PushDense
def dense_push_from_proto(msg: pb.DenseChunk) -> tuple[DensePush, str]:
    """A push stream's first DenseChunk as the push it starts and its reply dtype."""
    name = msg.table
    reply_dtype = wire_float_dtype(msg.reply_dtype, name, "reply_dtype")
    if msg.op not in (pb.DENSE_OP_GRADIENT, pb.DENSE_OP_ASSIGN):
        raise InvalidArgumentError(f"table {name!r}: unknown op {msg.op}; use DENSE_OP_GRADIENT (0) or DENSE_OP_ASSIGN (1)")
    return DensePush(
        name, ASSIGN if msg.op == pb.DENSE_OP_ASSIGN else GRADIENT, policy_from_proto(msg.sync, msg.HasField("sync")), msg.worker,
        msg.client, msg.seq, msg.base_version, tuple(int(d) for d in msg.shape), msg.flat_view, msg.return_params,
        msg.return_params and msg.early,
    ), reply_dtype


def push_chunk_from_proto(msg: pb.DenseChunk, pl: dict[str, memoryview], table: str, head: DensePush | None = None) -> PushChunk:
    """A pushed DenseChunk of a push to ``table`` (its values: a float32 view of the request's bytes)."""
    dtype = wire_float_dtype(msg.dtype, table, "dtype")
    values = as_float32(from_wire(pl.get("data", b""), dtype, None, what=f"table {table!r}: chunk at offset {msg.offset}"))
    return PushChunk(msg.offset, values, msg.last, msg.table, head)


def dense_reply_to_proto(item: DenseBlock | DensePushOutcome, dtype: str) -> Packed | bytes:
    """One message of a push stream's reply: a block (in ``dtype``) or the final status."""
    if isinstance(item, DenseBlock):
        return frame_pieces(pb.DenseChunk(offset=item.offset, dtype=dtype, early=item.early), data=to_wire(item.block, dtype)[1])
    p = item.push
    return pb.DenseChunk(
        table=item.table, version=item.version, staleness=p.result.max_staleness, clock=p.clock, late=p.late,
        duplicate=p.duplicate, early=item.early,
    ).SerializeToString()
