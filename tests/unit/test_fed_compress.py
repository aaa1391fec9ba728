"""Uplink compression: error bounds, byte counts, top-k error feedback, and decode's
refusal of malformed encodings. Pure numpy, plus the wire framing without sockets."""
from __future__ import annotations

import numpy as np
import pytest

from federated.compress import CompressionSpec, Compressor, EncodedTensor, decode, encode_raw, parse_compression
from federated.errors import ConfigError, DtypeError, MalformedMessageError, NonFiniteError, ShapeMismatchError
from federated.protocol import FIT, Answer
from federated.wire import answer_chunks, answer_from_chunks

RNG = np.random.default_rng(0)
UPDATE = [RNG.normal(size=(30, 20)).astype(np.float32), RNG.normal(size=(7,)).astype(np.float32) * 1e-3,
          np.zeros((2, 3), np.float32)]


def test_parse() -> None:
    assert parse_compression("") == CompressionSpec() and parse_compression("none").encoding == "raw"
    assert parse_compression("fp16").encoding == "fp16" and parse_compression("int8").encoding == "int8"
    assert parse_compression("topk:0.05") == CompressionSpec("topk", 0.05)
    assert str(parse_compression("topk:0.05")) == "topk:0.05" and str(parse_compression("int8")) == "int8"
    for bad in ("zip", "topk:0", "topk:1.5", "topk:x", "topk:nan"):
        with pytest.raises(ConfigError):
            parse_compression(bad)


def _roundtrip(spec: str) -> tuple[list[np.ndarray], int]:
    enc = Compressor(spec).encode(UPDATE)
    return [decode(t) for t in enc], sum(t.nbytes for t in enc)


def test_fp16_halves_bytes_within_half_precision() -> None:
    out, nbytes = _roundtrip("fp16")
    assert nbytes * 2 == sum(u.nbytes for u in UPDATE)
    for o, u in zip(out, UPDATE):
        assert o.dtype == np.float32
        np.testing.assert_allclose(o, u, rtol=1e-3, atol=1e-7)


def test_int8_quarter_bytes_error_at_most_half_a_step() -> None:
    enc = Compressor("int8").encode(UPDATE)
    assert sum(t.nbytes for t in enc) * 4 == sum(u.nbytes for u in UPDATE)
    for t, u in zip(enc, UPDATE):
        step = np.abs(u).max() / 127 if np.abs(u).max() > 0 else 1.0
        assert t.scale == pytest.approx(step)
        assert np.abs(decode(t) - u).max() <= step / 2 + 1e-7
    assert not decode(enc[2]).any()  # an all-zero tensor stays zero


def test_topk_sends_the_largest_and_feeds_back_the_rest() -> None:
    comp = Compressor("topk:0.1")
    enc = comp.encode(UPDATE)
    big = enc[0]
    idx, vals = big.parts
    assert idx.dtype == np.int32 and len(idx) == 60  # ceil(0.1 * 600)
    flat = UPDATE[0].ravel()
    assert set(idx.tolist()) == set(np.argsort(-np.abs(flat))[:60].tolist())
    np.testing.assert_array_equal(vals, flat[idx])
    # error feedback: what was sent over T rounds + what is still held == the sum of the updates
    sent = [decode(t).astype(np.float64) for t in enc]
    for _ in range(9):
        for s, t in zip(sent, comp.encode(UPDATE)):
            s += decode(t)
    assert comp.residual is not None
    for s, r, u in zip(sent, comp.residual, UPDATE):
        np.testing.assert_allclose(s + r, 10 * u.astype(np.float64), rtol=1e-6, atol=1e-6)
    # and the residual stays bounded: every entry gets its turn
    assert np.abs(comp.residual[0]).max() < 10 * np.abs(UPDATE[0]).max()


def test_non_finite_update_is_refused_before_compression() -> None:
    bad = [UPDATE[0].copy()]
    bad[0][0, 0] = np.inf
    for spec in ("fp16", "int8", "topk:0.5"):
        with pytest.raises(NonFiniteError, match="update\\[0\\]"):
            Compressor(spec).encode(bad)


@pytest.mark.parametrize(
    "t,err,needle",
    [
        (EncodedTensor("int8", (3,), "float32", (np.zeros(3, np.int8),), scale=0.0), NonFiniteError, "scale"),
        (EncodedTensor("int8", (3,), "float32", (np.zeros(3, np.int16),), scale=1.0), DtypeError, "int16"),
        (EncodedTensor("fp16", (3,), "float32", (np.zeros(4, np.float16),)), ShapeMismatchError, "shape"),
        (EncodedTensor("raw", (3,), "float32", ()), MalformedMessageError, "1 part"),
        (EncodedTensor("topk", (3,), "float32", (np.array([0, 3]), np.ones(2, np.float32))), ShapeMismatchError, "range"),
        (EncodedTensor("topk", (3,), "float32", (np.array([2, 1]), np.ones(2, np.float32))), MalformedMessageError, "increasing"),
        (EncodedTensor("topk", (3,), "float32", (np.array([0.0]), np.ones(1, np.float32))), DtypeError, "int32"),
        (EncodedTensor("zstd", (3,), "float32", (np.zeros(3, np.float32),)), DtypeError, "unknown encoding"),
        (EncodedTensor("raw", (3,), "int64", (np.zeros(3, np.int64),)), DtypeError, "float"),
    ],
)
def test_decode_refuses_malformed(t: EncodedTensor, err: type, needle: str) -> None:
    with pytest.raises(err, match=needle):
        decode(t, "update[0]")


@pytest.mark.parametrize("spec", ["", "fp16", "int8", "topk:0.3"])
def test_encoded_tensors_survive_the_wire_exactly(spec: str) -> None:
    enc = Compressor(spec).encode(UPDATE) + encode_raw([np.arange(4.0)], group="delta_c")
    a = Answer("t9", "c1", 3, FIT, num_examples=5, metrics={"loss": 0.5}, tensors=tuple(enc), is_delta=bool(spec))
    chunks = list(answer_chunks(a, chunk_bytes=512))
    assert len(chunks) > 1
    b = answer_from_chunks(iter(chunks), limit=1 << 20)
    assert (b.task_id, b.client_id, b.round, b.kind, b.num_examples, b.metrics, b.is_delta) == \
        ("t9", "c1", 3, FIT, 5, {"loss": 0.5}, bool(spec))
    assert b.bytes_sent == sum(len(c) for c in chunks)
    assert len(b.tensors) == len(enc)
    for x, y in zip(enc, b.tensors):
        assert (x.encoding, x.shape, x.dtype, x.scale, x.group) == (y.encoding, y.shape, y.dtype, y.scale, y.group)
        for p, q in zip(x.parts, y.parts):
            assert p.dtype == q.dtype
            np.testing.assert_array_equal(p, q)
    with pytest.raises(MalformedMessageError, match="limit"):
        answer_from_chunks(iter(chunks), limit=100)


def test_task_with_inline_tensors_round_trips() -> None:
    from federated.protocol import SECAGG, Task
    from federated.wire import make_blob, task_from_proto, task_to_proto
    from tessera.v1 import fed_pb2 as pb

    blob = make_blob(encode_raw([np.arange(6, dtype=np.float32).reshape(2, 3)]) + encode_raw([np.ones(2)], group="c"))
    t = Task("t1", "c1", 4, SECAGG, {"lr": 0.1, "epochs": 3, "mode": "x", "on": True}, timeout_s=2.5,
             compress="int8", secagg_stage=2, inline=blob)
    raw = task_to_proto(t).SerializeToString()
    msg = pb.ServerMessage()
    msg.ParseFromString(raw)
    u = task_from_proto(msg.task)
    assert (u.task_id, u.client_id, u.round, u.kind, u.timeout_s, u.compress, u.secagg_stage) == \
        ("t1", "c1", 4, SECAGG, 2.5, "int8", 2)
    assert u.config == {"lr": 0.1, "epochs": 3, "mode": "x", "on": True}
    assert type(u.config["epochs"]) is int and type(u.config["on"]) is bool
    assert u.inline is not None and [x.group for x in u.inline.tensors] == ["weights", "c"]
    np.testing.assert_array_equal(u.inline.tensors[0].parts[0], np.arange(6, dtype=np.float32).reshape(2, 3))
