"""Protobuf messages <-> federated protocol values. Pure and symmetric.

Bulk tensors never go through protobuf objects: a blob or an answer is a header
(``TensorSpec`` s saying how to cut the bytes) followed by the parts' raw bytes laid
end to end and cut into chunks of at most ``chunk_bytes`` (``tessera.codec.pack``
appends each chunk as field 15). The receiver reassembles and checks the byte count
of every part against its dtype and shape before anything is decoded.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import grpc

import numpy as np

from federated.compress import EncodedTensor
from federated.errors import (
    ConfigError,
    FedError,
    InvalidUpdateError,
    MalformedMessageError,
    PermissionDeniedError,
    ResourceExhaustedError,
    ServerUnavailableError,
    ShapeMismatchError,
    TaskClosedError,
    UnauthenticatedError,
    UnknownTaskError,
)
from federated.protocol import EVALUATE, FIT, SECAGG, Answer, Blob, Scalar, Task
from tessera.codec import CodecError, from_wire, pack, to_wire, unpack
from tessera.service import ErrorTable
from tessera.v1 import fed_pb2 as pb

__all__ = [
    "ERRORS",
    "DEFAULT_CHUNK_BYTES",
    "config_to_proto",
    "config_from_proto",
    "task_to_proto",
    "task_from_proto",
    "specs_to_proto",
    "tensors_from_bytes",
    "make_blob",
    "blob_chunks",
    "blob_from_chunks",
    "answer_chunks",
    "answer_from_chunks",
    "decode_message",
]

DEFAULT_CHUNK_BYTES = 1 << 20

_KIND_TO_PB = {FIT: pb.TASK_KIND_FIT, EVALUATE: pb.TASK_KIND_EVALUATE, SECAGG: pb.TASK_KIND_SECAGG}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def decode_message(cls: type, raw: bytes, payloads: tuple[int, ...] = ()) -> tuple:
    """``tessera.codec.unpack`` raising MalformedMessageError (INVALID_ARGUMENT) on bad bytes."""
    try:
        return unpack(cls, raw, payloads)
    except CodecError as e:
        raise MalformedMessageError(f"{cls.__name__}: {e}") from None


# --------------------------------------------------------------------------- config
def config_to_proto(config: Mapping[str, Scalar], out: object) -> None:
    """Fill the ``map<string, Scalar>`` field ``out`` from a dict of scalars."""
    for k, v in config.items():
        s = out[k]  # type: ignore[index]
        if isinstance(v, bool):
            s.b = v
        elif isinstance(v, (int, np.integer)):
            s.i = int(v)
        elif isinstance(v, (float, np.floating)):
            s.f = float(v)
        elif isinstance(v, str):
            s.s = v
        else:
            raise TypeError(f"config[{k!r}] = {v!r}: only float, int, str and bool travel to clients")


def config_from_proto(cfg: Mapping[str, pb.Scalar]) -> dict[str, Scalar]:
    """A task config message map -> dict of str -> float/int/str/bool (inverse of ``config_to_proto``)."""
    out: dict[str, Scalar] = {}
    for k, s in cfg.items():
        which = s.WhichOneof("value")
        out[k] = getattr(s, which) if which else 0.0
    return out


# --------------------------------------------------------------------------- tasks
def task_to_proto(t: Task) -> pb.ServerMessage:
    """A :class:`~federated.protocol.Task` as the ServerMessage that carries it (inverse of ``task_from_proto``)."""
    msg = pb.ServerMessage()
    m = msg.task
    m.task_id, m.client_id, m.round, m.kind = t.task_id, t.client_id, t.round, _KIND_TO_PB[t.kind]
    config_to_proto(t.config, m.config)
    m.blob, m.blob_bytes, m.timeout_s, m.compress = t.blob, t.blob_bytes, t.timeout_s, t.compress
    m.secagg_stage, m.secagg = t.secagg_stage, t.secagg
    if t.inline is not None:
        specs, _ = specs_to_proto(t.inline.tensors)
        m.specs.extend(specs)
        m.data = t.inline.data
    return msg


def task_from_proto(m: pb.Task) -> Task:
    """A Task message -> :class:`~federated.protocol.Task`; MalformedMessageError for an unknown kind or bad inline tensors."""
    if m.kind not in _KIND_FROM_PB:
        raise MalformedMessageError(f"task {m.task_id!r}: unknown kind {m.kind}")
    inline = None
    if len(m.specs) or m.data:
        inline = Blob(tensors_from_bytes(list(m.specs), m.data, f"task {m.task_id!r}"), m.data)
    return Task(
        task_id=m.task_id, client_id=m.client_id, round=m.round, kind=_KIND_FROM_PB[m.kind],
        config=config_from_proto(m.config), blob=m.blob, blob_bytes=m.blob_bytes, timeout_s=m.timeout_s,
        compress=m.compress, secagg_stage=m.secagg_stage, secagg=m.secagg, inline=inline,
    )


# --------------------------------------------------------------------------- tensors
def specs_to_proto(tensors: Iterable[EncodedTensor]) -> tuple[list[pb.TensorSpec], list[memoryview]]:
    """(specs, the parts' bytes in order). No copy of the data."""
    specs, views = [], []
    for t in tensors:
        parts = []
        for p in t.parts:
            name, view = to_wire(p)
            parts.append(pb.Part(dtype=name, shape=list(p.shape)))
            views.append(view)
        specs.append(pb.TensorSpec(group=t.group, encoding=t.encoding, shape=list(t.shape), dtype=t.dtype,
                                   scale=t.scale, parts=parts))
    return specs, views


def tensors_from_bytes(specs: Iterable[pb.TensorSpec], data: memoryview | bytes, what: str) -> tuple[EncodedTensor, ...]:
    """Cut ``data`` by ``specs``. Raises MalformedMessageError when the bytes do not add up.

    The arrays are read-only views into ``data``.
    """
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    pos = 0
    out = []
    for i, s in enumerate(specs):
        parts = []
        for j, p in enumerate(s.parts):
            shape = tuple(int(x) for x in p.shape)
            if any(x < 0 for x in shape):
                raise ShapeMismatchError(f"{what}: tensor {i} part {j}: negative dimension in {shape}")
            if p.dtype not in _NP:
                raise MalformedMessageError(f"{what}: tensor {i} part {j}: unknown dtype {p.dtype!r}")
            itemsize = np.dtype(_NP[p.dtype]).itemsize
            n = int(np.prod(shape, dtype=np.int64)) * itemsize
            if pos + n > len(mv):
                raise MalformedMessageError(f"{what}: tensor {i} part {j} needs {n} bytes at offset {pos}, only {len(mv)} in all (truncated)")
            try:
                parts.append(from_wire(mv[pos : pos + n], p.dtype, shape, what=f"{what}: tensor {i} part {j}"))
            except CodecError as e:
                raise MalformedMessageError(str(e)) from None
            pos += n
        out.append(EncodedTensor(s.encoding, tuple(int(x) for x in s.shape), s.dtype, tuple(parts), s.scale, s.group))
    if pos != len(mv):
        raise MalformedMessageError(f"{what}: {len(mv) - pos} bytes left over after the last tensor")
    return tuple(out)


_NP = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int8": "i1", "uint8": "u1", "bool": "?"}


def make_blob(tensors: Iterable[EncodedTensor]) -> Blob:
    """One contiguous copy of the tensors' bytes, shared by every Fetch of it."""
    tensors = tuple(tensors)
    _, views = specs_to_proto(tensors)
    return Blob(tensors, b"".join(views))


def _chunks(data: memoryview | bytes, chunk_bytes: int) -> Iterator[tuple[int, memoryview, bool]]:
    mv = memoryview(data)
    n = len(mv)
    if n == 0:
        yield 0, mv, True
        return
    for off in range(0, n, chunk_bytes):
        yield off, mv[off : off + chunk_bytes], off + chunk_bytes >= n


def blob_chunks(blob: Blob, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Fetch reply messages for ``blob``: the first carries the specs and the total size."""
    specs, _ = specs_to_proto(blob.tensors)
    for off, piece, last in _chunks(blob.data, chunk_bytes):
        head = pb.BlobChunk(offset=off, last=last)
        if off == 0:
            head.total = len(blob.data)
            head.specs.extend(specs)
        yield pack(head, {15: piece})


class _Assembler:
    """Reassembles a byte stream from (offset, bytes) chunks; checks order and size."""

    def __init__(self, total: int, limit: int, what: str) -> None:
        if total < 0 or total > limit:
            raise MalformedMessageError(f"{what}: announces {total} bytes; the limit is {limit}")
        self.total, self.what = total, what
        self.buf: bytearray | None = None
        self.single: memoryview | None = None
        self.pos = 0

    def add(self, offset: int, piece: memoryview) -> None:
        if offset != self.pos:
            raise MalformedMessageError(f"{self.what}: chunk at offset {offset}, expected {self.pos}")
        n = len(piece)
        if self.pos + n > self.total:
            raise MalformedMessageError(f"{self.what}: more than the announced {self.total} bytes")
        if self.pos == 0 and n == self.total:
            self.single = piece  # the common case: one chunk, no copy
        else:
            if self.buf is None:
                self.buf = bytearray(self.total)
            self.buf[self.pos : self.pos + n] = piece
        self.pos += n

    def done(self) -> memoryview:
        if self.pos != self.total:
            raise MalformedMessageError(f"{self.what}: stream ended after {self.pos} of {self.total} bytes (truncated)")
        if self.single is not None:
            return self.single
        return memoryview(self.buf if self.buf is not None else b"")


def blob_from_chunks(raws: Iterable[bytes], limit: int, what: str = "blob") -> tuple[tuple[EncodedTensor, ...], int]:
    """Client side of Fetch: (tensors, bytes received)."""
    asm: _Assembler | None = None
    specs: list[pb.TensorSpec] = []
    received = 0
    for raw in raws:
        received += len(raw)
        head, pl = decode_message(pb.BlobChunk, raw, (15,))
        if asm is None:
            asm = _Assembler(head.total, limit, what)
            specs = list(head.specs)
        asm.add(head.offset, pl.get(15, memoryview(b"")))
        if head.last:
            return tensors_from_bytes(specs, asm.done(), what), received
    raise MalformedMessageError(f"{what}: stream ended without its last chunk")


def answer_chunks(a: Answer, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Submit request messages for ``a``: a header then the tensors' bytes in chunks.

    The header rides on the first chunk."""
    specs, views = specs_to_proto(a.tensors)
    h = pb.UpdateHeader(
        task_id=a.task_id, client_id=a.client_id, round=a.round, kind=_KIND_TO_PB[a.kind],
        num_examples=a.num_examples, loss=a.loss, is_delta=a.is_delta, error=a.error,
        secagg_stage=a.secagg_stage, bytes_received=a.bytes_received,
    )
    h.metrics.update({k: float(v) for k, v in a.metrics.items()})
    h.specs.extend(specs)
    data: bytes | memoryview = views[0] if len(views) == 1 else b"".join(views)
    h.total = len(memoryview(data).cast("B")) if not isinstance(data, bytes) else len(data)
    flat = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    first = True
    for off, piece, last in _chunks(flat, chunk_bytes):
        msg = pb.SubmitChunk(offset=off, last=last)
        if first:
            msg.header.CopyFrom(h)
            first = False
        yield pack(msg, {15: piece})


def answer_from_chunks(raws: Iterable[bytes], limit: int,
                       on_header: Callable[[str, str], None] | None = None) -> Answer:
    """Server side of Submit. Raises MalformedMessageError (header missing, kind unknown,
    chunks out of order, truncated, bytes that do not match the specs).

    ``on_header(task_id, client_id)`` runs as soon as the header is decoded, before
    any buffer is allocated or a further chunk read; what it raises ends the call (a
    Submit for someone else's task, or one never issued, costs the server nothing)."""
    asm: _Assembler | None = None
    h: pb.UpdateHeader | None = None
    size = 0
    for raw in raws:
        size += len(raw)
        msg, pl = decode_message(pb.SubmitChunk, raw, (15,))
        if h is None:
            if not msg.HasField("header"):
                raise MalformedMessageError("Submit: the first message has no header")
            h = msg.header
            if h.kind not in _KIND_FROM_PB:
                raise MalformedMessageError(f"task {h.task_id!r}: unknown kind {h.kind}")
            if on_header is not None:
                on_header(h.task_id, h.client_id)
            asm = _Assembler(h.total, limit, f"task {h.task_id!r} from client {h.client_id!r}")
        assert asm is not None
        asm.add(msg.offset, pl.get(15, memoryview(b"")))
        if msg.last:
            what = f"task {h.task_id!r} from client {h.client_id!r}"
            tensors = tensors_from_bytes(list(h.specs), asm.done(), what)
            return Answer(
                task_id=h.task_id, client_id=h.client_id, round=h.round, kind=_KIND_FROM_PB[h.kind],
                num_examples=h.num_examples, metrics=dict(h.metrics), loss=h.loss, tensors=tensors,
                is_delta=h.is_delta, error=h.error, secagg_stage=h.secagg_stage,
                bytes_received=h.bytes_received, bytes_sent=size,
            )
    if h is None:
        raise MalformedMessageError("Submit: empty stream (no header)")
    raise MalformedMessageError(f"task {h.task_id!r}: Submit stream ended without its last chunk (truncated)")


# federated mode's two-way error table: error class <-> status code. Classes that share a code
# (TaskClosedError, ConfigError) are told apart by the class name the server sends along.
ERRORS = ErrorTable(
    {
        InvalidUpdateError: grpc.StatusCode.INVALID_ARGUMENT,
        CodecError: grpc.StatusCode.INVALID_ARGUMENT,
        UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
        PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
        UnknownTaskError: grpc.StatusCode.NOT_FOUND,
        TaskClosedError: grpc.StatusCode.FAILED_PRECONDITION,
        ConfigError: grpc.StatusCode.FAILED_PRECONDITION,
        ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ServerUnavailableError: grpc.StatusCode.UNAVAILABLE,
    },
    default=FedError,
    family=FedError,
)
