"""Tensor codec: bytes framing is plain protobuf wire format; arrays round-trip exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.codec import ALIGN, CodecError, from_wire, pack, tensor_from_proto, tensor_to_proto, to_wire, unpack
from tessera.v1 import ps_pb2 as pb


def test_pack_is_standard_protobuf() -> None:
    """A packed message parses with stock protobuf, and a stock-serialized one unpacks."""
    ids = np.arange(10, dtype=np.int64)
    data = np.linspace(0, 1, 30, dtype=np.float32)
    raw = pack(pb.PushSparseRequest(table="t", dim=3, dtype="float32"), {14: ids, 15: data})
    stock = pb.PushSparseRequest()
    stock.ParseFromString(raw)
    assert stock.table == "t" and stock.dim == 3 and stock.ids == ids.tobytes() and stock.data == data.tobytes()
    msg, pl = unpack(pb.PushSparseRequest, stock.SerializeToString(), (13, 14, 15))
    assert msg.table == "t" and msg.dim == 3 and not msg.ids
    assert bytes(pl[14]) == ids.tobytes() and bytes(pl[15]) == data.tobytes() and 13 not in pl


def test_pack_fills_one_field_from_several_pieces() -> None:
    """A list of pieces is one field holding their bytes in order: the same bytes as packing them joined
    (and stock protobuf reads it), so a reply assembled from parts is copied once, not joined first."""
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    versions = np.array([7, 8, 9], np.int64)
    head = pb.StepReply(parts=[pb.StepPartReply(table="t", data_at=0, versions_at=rows.nbytes)])
    pieces = [rows, memoryview(versions.tobytes()), b"xy"]
    joined = rows.tobytes() + versions.tobytes() + b"xy"
    raw = pack(head, {15: pieces})
    assert raw == pack(head, {15: joined})
    _, pl = unpack(pb.StepReply, raw, (15,))
    assert bytes(pl[15]) == joined
    assert pack(head, {15: []}) == pack(head, {15: b""})  # no pieces: an empty field


@pytest.mark.parametrize("table", ["", "t", "ab", "abc", "a" * 5, "a" * 6, "a" * 7, "a" * 200])
def test_every_bulk_field_starts_aligned_and_stock_protobuf_still_reads_it(table: str) -> None:
    """Whatever the header's length, each bulk field's bytes start a multiple of ALIGN (8) bytes into
    the message, so int64/float32 views of a received buffer are aligned (numpy's BLAS copies
    unaligned arrays). The gap is a pad field: stock protobuf skips it, ``unpack`` drops it."""
    ids = np.arange(3, dtype=np.int64)
    data = np.ones((3, 5), np.float32)  # 60 bytes: the next field starts misaligned unless padded
    head = pb.PushSparseRequest(table=table, dim=5, dtype="float32")
    raw = bytearray(pack(head, {15: data, 14: ids}))
    msg, pl = unpack(pb.PushSparseRequest, raw, (14, 15))
    base = np.frombuffer(raw, np.uint8).ctypes.data
    for field in (14, 15):
        assert (np.frombuffer(pl[field], np.uint8).ctypes.data - base) % ALIGN == 0, field
    assert bytes(pl[14]) == ids.tobytes() and bytes(pl[15]) == data.tobytes()
    assert msg == head and msg.SerializeToString() == head.SerializeToString()  # no unknown field kept
    stock = pb.PushSparseRequest()
    stock.ParseFromString(bytes(raw))
    assert stock.table == table and stock.ids == ids.tobytes() and stock.data == data.tobytes()


def test_unpack_is_zero_copy() -> None:
    data = np.arange(1 << 16, dtype=np.float32)
    raw = pack(pb.DenseChunk(table="x", offset=5), {15: data})
    _, pl = unpack(pb.DenseChunk, raw, (15,))
    assert pl[15].obj is raw  # a view into the received buffer


@pytest.mark.parametrize(
    "raw",
    [b"\x0a\xff", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x7a\x10abc", b"\x0b\x00", b"\x00\x01"],
    ids=["truncated-string", "bad-varint", "truncated-payload", "group-wire-type", "field-zero"],
)
def test_malformed_bytes_raise(raw: bytes) -> None:
    with pytest.raises(CodecError, match="malformed"):
        unpack(pb.DenseChunk, raw, (15,))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"])
def test_roundtrip_dtypes(dtype: str) -> None:
    x = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    name, data = to_wire(x)
    assert name == dtype
    np.testing.assert_array_equal(from_wire(data, name, (2, 3, 4)), x)
    np.testing.assert_array_equal(tensor_from_proto(tensor_to_proto(x)), x)


def test_bfloat16_and_casts() -> None:
    t = torch.randn(100)
    name, data = to_wire(t, "bfloat16")
    assert name == "bfloat16" and len(data) == 200
    np.testing.assert_array_equal(from_wire(data, "bfloat16"), t.bfloat16().float().numpy())
    name, data = to_wire(t.bfloat16())
    assert name == "bfloat16"
    name, data = to_wire(t, "float16")
    np.testing.assert_array_equal(from_wire(data, name), t.half().numpy())


def test_big_endian_input_is_sent_little_endian() -> None:
    x = np.arange(5, dtype=">f4")
    name, data = to_wire(x)
    assert name == "float32" and bytes(data) == np.arange(5, dtype="<f4").tobytes()


def test_length_and_dtype_checks() -> None:
    with pytest.raises(CodecError, match="truncated or malformed"):
        from_wire(b"\x00" * 10, "float32", (3,), what="table 't': rows")
    with pytest.raises(CodecError, match="whole number"):
        from_wire(b"\x00" * 10, "float32")
    with pytest.raises(CodecError, match="unknown dtype"):
        from_wire(b"", "complex64")
    with pytest.raises(CodecError, match="no wire encoding"):
        to_wire(np.zeros(2, np.complex64))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("src", ["numpy", "torch"])
def test_float16_cast_through_torch_rounds_as_numpy(src: str) -> None:
    """The float16 wire cast goes through torch (2-3x numpy's astype): same bits as numpy's
    round-to-nearest-even, overflow to Inf included; and as_float32 decodes it back exactly."""
    from tessera.codec import as_float32

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 1e3, np.array([65504, 65520, 1e6, -1e6, 6e-8, 0.0], np.float32)])
    name, data = to_wire(torch.from_numpy(x) if src == "torch" else x, "float16")
    assert name == "float16"
    got = from_wire(data, "float16")
    np.testing.assert_array_equal(got.view(np.uint16), x.astype(np.float16).view(np.uint16))
    back = as_float32(got)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))


def test_pack_frames_empty_arrays() -> None:
    """An empty bulk field (a BSP step's empty part for a shard) frames as a zero-length field."""
    from tessera.v1 import ps_pb2 as pb

    raw = pack(pb.PushSparseRequest(table="t"), {14: np.zeros(0, np.int64), 15: np.zeros((0, 4), np.float32)})
    msg, pl = unpack(pb.PushSparseRequest, raw, (14, 15))
    assert msg.table == "t" and len(pl[14]) == 0 and len(pl[15]) == 0


def test_a_packed_message_counts_its_bytes_and_joins_to_packs_bytes() -> None:
    """``pack(..., joined=False)`` joins to exactly ``pack``'s bytes (reference); ``nbytes`` counts
    bytes, also for a piece given as a typed buffer (7 float32 = 28 bytes, not 7)."""
    import numpy as np

    from tessera.codec import Packed, as_bytes, pack
    from tessera.v1 import ps_pb2 as pb

    msg = pb.DenseChunk(offset=3, dtype="float32")
    data = np.arange(1000, dtype=np.float32)
    p = pack(msg, {15: data}, joined=False)
    assert isinstance(p, Packed) and as_bytes(p) == pack(msg, {15: data}) and p.nbytes == len(pack(msg, {15: data}))
    assert Packed([b"ab", np.arange(7, dtype=np.float32)]).nbytes == 30
    assert as_bytes(b"xy") == b"xy"
