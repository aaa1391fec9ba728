"""Tensor codec: bytes framing is plain protobuf wire format; arrays round-trip exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.codec import CodecError, from_wire, pack, tensor_from_proto, tensor_to_proto, to_wire, unpack
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
