"""Protobuf messages <-> PS domain values (pure and symmetric), and the framing of messages
whose bulk bytes travel beside them (``frame`` / ``unframe``)."""
from __future__ import annotations

from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from ps.config import (
    DENSE,
    SPARSE,
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    OptimizerSpec,
    TableSpec,
)
from ps.consistency import SyncPolicy
from ps.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    PermissionDeniedError,
    PSError,
    ResourceExhaustedError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
    UnauthenticatedError,
    with_table,
)
from ps.shard import MembershipView, ShardStats, TableInfo, TableStats, WorkerStats
from tessera.codec import CodecError, Packed, pack, unpack
from tessera.service import ErrorTable
from tessera.v1 import ps_pb2 as pb

M = TypeVar("M", bound=Message)

__all__ = [
    "ERRORS",
    "BULK",
    "frame",
    "frame_pieces",
    "unframe",
    "spec_to_proto",
    "spec_from_proto",
    "info_to_proto",
    "info_from_proto",
    "stats_to_proto",
    "stats_from_proto",
    "policy_to_proto",
    "policy_from_proto",
    "membership_to_proto",
    "membership_from_proto",
]

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
    numbers = _NUMBERS[type(msg)]
    return pack(msg, {numbers[k]: v for k, v in bulk.items()})


def frame_pieces(msg: Any, **bulk: Any) -> Packed:
    """``frame``'s message as its pieces (no copy: views of the bulk buffers, which must not change
    until it is sent). The PS's stubs and servers send it over either transport: tessera.bulk as
    is, gRPC joined (``tessera.codec.as_bytes`` as the serializer)."""
    numbers = _NUMBERS[type(msg)]
    return pack(msg, {numbers[k]: v for k, v in bulk.items()}, joined=False)  # type: ignore[no-any-return]


def unframe(cls: type[M], raw: bytes) -> tuple[M, dict[str, memoryview]]:
    """Parse ``raw`` as ``cls``: (header message, {bulk field name: zero-copy view} for those present).

    Raises CodecError on malformed input."""
    numbers = _NUMBERS.get(cls)
    if numbers is None:
        return unpack(cls, raw)[0], {}
    msg, payloads = unpack(cls, raw, tuple(numbers.values()))
    names = _NAMES[cls]
    return msg, {names[k]: v for k, v in payloads.items()}


_KIND_TO_PB = {DENSE: pb.TABLE_KIND_DENSE, SPARSE: pb.TABLE_KIND_SPARSE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def spec_to_proto(spec: TableSpec) -> pb.TableSpec:
    return pb.TableSpec(
        name=spec.name,
        kind=_KIND_TO_PB[spec.kind],
        shape=list(spec.shape),
        dim=spec.dim,
        dtype=spec.dtype,
        optimizer=pb.OptimizerSpec(name=spec.optimizer.name, hparams=dict(spec.optimizer.hparams)),
        initializer=pb.InitializerSpec(name=spec.initializer.name, params=dict(spec.initializer.params)),
        seed=spec.seed,
        admission=pb.AdmissionSpec(min_count=spec.admission.min_count, probability=spec.admission.probability),
        eviction=pb.EvictionSpec(ttl_steps=spec.eviction.ttl_steps, max_rows=spec.eviction.max_rows),
        num_slots=spec.num_slots,
        allow_nonfinite=spec.allow_nonfinite,
    )


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """Raises InvalidArgumentError naming the table and the bad field."""
    if msg.kind not in _KIND_FROM_PB:
        raise InvalidArgumentError(f"table {msg.name!r}: kind must be dense or sparse")
    try:
        return _spec_from_proto(msg)
    except InvalidArgumentError as e:
        raise with_table(msg.name, e) from None


def _spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    return TableSpec(
        name=msg.name,
        kind=_KIND_FROM_PB[msg.kind],
        shape=tuple(msg.shape),
        dim=msg.dim,
        dtype=msg.dtype or "float32",
        optimizer=OptimizerSpec(msg.optimizer.name or "sgd", dict(msg.optimizer.hparams)),
        initializer=InitializerSpec(msg.initializer.name or "zeros", dict(msg.initializer.params)),
        seed=msg.seed,
        admission=AdmissionSpec(msg.admission.min_count, msg.admission.probability),
        eviction=EvictionSpec(msg.eviction.ttl_steps, msg.eviction.max_rows),
        num_slots=msg.num_slots or 4096,
        allow_nonfinite=msg.allow_nonfinite,
    )


def info_to_proto(info: TableInfo) -> pb.TableInfo:
    return pb.TableInfo(
        spec=spec_to_proto(info.spec),
        shard_index=info.shard_index,
        num_shards=info.num_shards,
        offset=info.offset,
        length=info.length,
        chunk_elems=info.chunk_elems,
        version=info.version,
        max_ids_per_request=info.max_ids_per_request,
    )


def info_from_proto(msg: pb.TableInfo) -> TableInfo:
    return TableInfo(
        spec_from_proto(msg.spec), msg.shard_index, msg.num_shards, msg.offset, msg.length, msg.chunk_elems, msg.version,
        msg.max_ids_per_request,
    )


def stats_to_proto(s: ShardStats) -> pb.StatsReply:
    return pb.StatsReply(
        shard_index=s.shard_index,
        num_shards=s.num_shards,
        tables=[
            pb.TableStats(
                name=t.name, kind=_KIND_TO_PB[t.kind], rows=t.rows, elements=t.elements,
                param_bytes=t.param_bytes, state_bytes=t.state_bytes, version=t.version, offset=t.offset,
                length=t.length, evicted=t.evicted, dropped=t.dropped, rejected=t.rejected,
                mean_staleness=t.mean_staleness, max_staleness=t.max_staleness, row_dtype=t.row_dtype,
                bytes_per_row=t.bytes_per_row, payload_bytes_per_row=t.payload_bytes_per_row, index_bytes=t.index_bytes,
                metadata_bytes=t.metadata_bytes, resident_rows=t.resident_rows, cold_rows=t.cold_rows,
                disk_bytes=t.disk_bytes, held_bytes=t.held_bytes, row_path=t.row_path,
            )
            for t in s.tables
        ],
        requests=s.requests,
        errors=s.errors,
        bytes_in=s.bytes_in,
        bytes_out=s.bytes_out,
        uptime_s=s.uptime_s,
        workers=[pb.WorkerStats(name=w.name, clock=w.clock, live=w.live, idle_s=w.idle_s) for w in s.workers],
        leases_expired=s.leases_expired,
        pushes_aborted_idle=s.pushes_aborted_idle,
        duplicates=s.duplicates,
        maintenance_errors=s.maintenance_errors,
        sync_clock=s.sync_clock,
        checkpoints=s.checkpoints,
        last_checkpoint=s.last_checkpoint,
        role=s.role,
        backup=s.backup,
        replicated=s.replicated,
        backups_lost=s.backups_lost,
        epoch=s.epoch,
        backup_of=s.backup_of,
    )


def stats_from_proto(msg: pb.StatsReply) -> ShardStats:
    return ShardStats(
        msg.shard_index,
        msg.num_shards,
        [
            TableStats(
                t.name, _KIND_FROM_PB.get(t.kind, "?"), t.rows, t.elements, t.param_bytes, t.state_bytes, t.version,
                t.offset, t.length, t.evicted, t.dropped, t.rejected, t.mean_staleness, t.max_staleness,
                t.row_dtype, t.bytes_per_row, t.payload_bytes_per_row, t.index_bytes, t.metadata_bytes,
                t.resident_rows, t.cold_rows, t.disk_bytes, t.held_bytes, t.row_path,
            )
            for t in msg.tables
        ],
        dict(msg.requests),
        dict(msg.errors),
        msg.bytes_in,
        msg.bytes_out,
        msg.uptime_s,
        [WorkerStats(w.name, w.clock, w.live, w.idle_s) for w in msg.workers],
        msg.leases_expired,
        msg.pushes_aborted_idle,
        msg.duplicates,
        msg.maintenance_errors,
        msg.sync_clock,
        msg.checkpoints,
        msg.last_checkpoint,
        msg.role,
        msg.backup,
        msg.replicated,
        msg.backups_lost,
        msg.epoch,
        msg.backup_of,
    )


def policy_to_proto(p: SyncPolicy) -> pb.SyncSpec:
    return pb.SyncSpec(
        clock=p.clock, sync=p.sync, staleness=p.staleness, backup_workers=p.backup_workers,
        staleness_aware_lr=p.staleness_aware_lr,
    )


def policy_from_proto(msg: pb.SyncSpec, present: bool = True) -> SyncPolicy:
    """``present``: whether the request carried a SyncSpec at all (absent: plain async)."""
    if not present:
        return SyncPolicy()
    if msg.backup_workers < 0:
        raise InvalidArgumentError(f"sync.backup_workers must be >= 0, got {msg.backup_workers}")
    if msg.sync and msg.clock < 0:
        raise InvalidArgumentError(f"sync.clock must be >= 0 for a BSP request, got {msg.clock}")
    return SyncPolicy(msg.clock, msg.sync, msg.staleness, msg.backup_workers, msg.staleness_aware_lr)


def membership_to_proto(v: MembershipView) -> pb.MembershipReply:
    return pb.MembershipReply(
        shard_index=v.shard_index, live=list(v.live), sync_clock=v.sync_clock, min_clock=v.min_clock, rejoined=v.rejoined
    )


def membership_from_proto(msg: pb.MembershipReply) -> MembershipView:
    return MembershipView(msg.shard_index, tuple(msg.live), msg.sync_clock, msg.min_clock, msg.rejoined)


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
