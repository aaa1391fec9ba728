"""Shared pieces of the gRPC fuzzers: settings, message mutators, a generic raw caller, RSS.

The mutators walk the generated descriptors, so a field (or an RPC) added to proto/ is fuzzed
without touching this file. Requests travel as raw bytes on a plain gRPC channel: the servers
decode them themselves, which is exactly what the fuzz targets.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor, ServiceDescriptor
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# ------------------------------------------------------------------------------------ settings
# Examples per (method, input kind). The defaults keep tests/fuzz under a minute on 2 cores;
# FUZZ_EXAMPLES=2000 runs a long local campaign (derandomized: the same inputs every run, so a
# failure in CI reproduces locally; set FUZZ_RANDOM=1 to draw fresh inputs instead).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
DERANDOMIZE = os.environ.get("FUZZ_RANDOM", "") == ""


def fuzz_settings(default_examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default_examples,
        deadline=None,
        derandomize=DERANDOMIZE,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


# Codes a server may answer bad input with: anything but these two.
FORBIDDEN_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
# Client-side ends of a call that are not the server's answer to the input (our short deadline,
# our own cancel after the first message of an open-ended stream).
NOT_AN_ANSWER = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})

# ------------------------------------------------------------------------------------ RSS
RSS_SLACK_MIB = 200  # growth of this process's VmRSS allowed over the whole fuzz run
_rss_start: list[int] = []


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0


def rss_baseline() -> int:
    """VmRSS when the first fuzz test started (MiB)."""
    if not _rss_start:
        _rss_start.append(rss_mib())
    return _rss_start[0]


def check_rss(where: str) -> None:
    start, now = rss_baseline(), rss_mib()
    assert now - start <= RSS_SLACK_MIB, f"{where}: VmRSS grew from {start} MiB to {now} MiB (slack {RSS_SLACK_MIB} MiB)"


# ------------------------------------------------------------------------------------ calls
def methods(service: ServiceDescriptor) -> list[MethodDescriptor]:
    return list(service.methods)


def request_class(method: MethodDescriptor) -> type:
    return message_factory.GetMessageClass(method.input_type)


@dataclass
class Outcome:
    code: grpc.StatusCode  # OK for an answered call
    details: str
    replies: int


def call_raw(channel: grpc.Channel, method: MethodDescriptor, requests: Sequence[bytes], timeout: float,
             max_replies: int | None = None, metadata: Sequence[tuple[str, str]] | None = None) -> Outcome:
    """Call ``method`` with raw request bytes (a stream for client-streaming methods, else the first
    message, or b"" when none). ``max_replies``: read at most this many replies of a server stream,
    then cancel (for streams that stay open by design)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kw: dict[str, Any] = {"timeout": timeout}
    if metadata:
        kw["metadata"] = list(metadata)
    one = requests[0] if requests else b""
    try:
        if method.client_streaming and method.server_streaming:
            it = channel.stream_stream(path)(iter(list(requests)), **kw)
        elif method.server_streaming:
            it = channel.unary_stream(path)(one, **kw)
        elif method.client_streaming:
            channel.stream_unary(path)(iter(list(requests)), **kw)
            return Outcome(grpc.StatusCode.OK, "", 1)
        else:
            channel.unary_unary(path)(one, **kw)
            return Outcome(grpc.StatusCode.OK, "", 1)
        n = 0
        for _ in it:
            n += 1
            if max_replies is not None and n >= max_replies:
                it.cancel()
                return Outcome(grpc.StatusCode.OK, "cancelled by the fuzzer after its first reply", n)
        return Outcome(grpc.StatusCode.OK, "", n)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", 0)


def wait_until(pred: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


# ------------------------------------------------------------------------------------ values
INT64_EDGES = [0, 1, -1, 2, 3, 7, 8, 9, 17, 18, 35, 100, 4096, 1 << 20, 1 << 31, -(1 << 31), (1 << 31) - 1,
               1 << 32, 1 << 40, (1 << 62), (1 << 63) - 1, -(1 << 63)]
INT32_EDGES = [v for v in INT64_EDGES if -(1 << 31) <= v < (1 << 31)]
UINT64_EDGES = [0, 1, 2, 7, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
UINT32_EDGES = [v for v in UINT64_EDGES if v < (1 << 32)]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, -1e300, 3.4e38, float("inf"), float("-inf"), float("nan"), 0.5, 2.0]

# Strings worth trying in any string field: dtypes (wrong, odd, near-miss), table and client names
# (known, unknown, empty, long), encodings, addresses.
STRINGS = [
    "", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool", "complex64",
    "<f4", "f4", "float", "FLOAT32", "float32\x00", " float32", "object", "str", "V8",
    "weights", "emb", "nope", "weights\x00", "Weights", "x" * 300, "x" * 70_000, "é€😀", "../../etc/passwd",
    "raw", "fp16", "int8", "topk", "topk:0.1", "sgd", "adam", "momentum", "adagrad", "ftrl", "zeros", "normal",
    "uniform", "constant", "lr", "eps", "beta1", "std", "low", "high", "value",
    "127.0.0.1:1", "localhost:0", "[::1]:1", "w1", "w2", "fuzz-a", "fuzz-b", "client-1", "primary", "backup",
]


def _int_strategy(edges: Sequence[int], lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def scalar_strategy(field: FieldDescriptor, words: Sequence[str] = ()) -> st.SearchStrategy[Any]:
    """Values for one scalar field; ``words`` (names the server knows: tables, workers, clients)
    keep a share of the mutated strings valid, so mutations reach past the name lookup."""
    t = field.type
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return _int_strategy(INT64_EDGES, -(1 << 63), (1 << 63) - 1)
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return _int_strategy(INT32_EDGES, -(1 << 31), (1 << 31) - 1)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _int_strategy(UINT64_EDGES, 0, (1 << 64) - 1)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _int_strategy(UINT32_EDGES, 0, (1 << 32) - 1)
    if t == FieldDescriptor.TYPE_ENUM:
        # proto3 enums are open: unknown numbers reach the server as they are
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 9),
                         st.sampled_from([(1 << 31) - 1, -(1 << 31)]))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(allow_nan=True, allow_infinity=True))
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from(FLOAT_EDGES[:8] + FLOAT_EDGES[9:]), st.floats(width=32))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        known = [st.sampled_from(list(words))] if words else []
        return st.one_of(*known, st.sampled_from(STRINGS), st.text(max_size=24))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=256)
    raise AssertionError(f"no strategy for field type {t} ({field.full_name})")


def mutate_bytes(data: st.DataObject, b: bytes, label: str = "bytes") -> bytes:
    """Flip, truncate, extend, duplicate, misalign or replace ``b``."""
    op = data.draw(st.sampled_from(["flip", "truncate", "drop_tail", "append", "duplicate", "replace", "huge", "insert"]),
                   label=f"{label} op")
    if op == "flip" and b:
        i = data.draw(st.integers(0, len(b) - 1), label="at")
        x = data.draw(st.integers(1, 255), label="xor")
        return b[:i] + bytes([b[i] ^ x]) + b[i + 1 :]
    if op == "truncate":
        return b[: data.draw(st.integers(0, len(b)), label="keep")]
    if op == "drop_tail":  # breaks multiples of the item size
        return b[: max(0, len(b) - data.draw(st.integers(1, 7), label="drop"))]
    if op == "append":
        return b + data.draw(st.binary(min_size=1, max_size=16), label="tail")
    if op == "duplicate":
        return b + b
    if op == "huge":  # far more bytes than any table here holds
        return b"\x7f" * data.draw(st.sampled_from([1 << 16, (1 << 20) + 3]), label="huge size")
    if op == "insert" and b:
        i = data.draw(st.integers(0, len(b)), label="at")
        return b[:i] + data.draw(st.binary(min_size=1, max_size=8), label="ins") + b[i:]
    return data.draw(st.binary(max_size=256), label="replacement")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _repeated(field: FieldDescriptor) -> bool:
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else field.label == FieldDescriptor.LABEL_REPEATED


def mutate_message(data: st.DataObject, msg: Any, depth: int = 0, words: Sequence[str] = ()) -> None:
    """Change 1-4 fields of ``msg`` in place (recursing into sub-messages), chosen from its descriptor."""
    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        mutate_field(data, msg, data.draw(st.sampled_from(fields), label="field"), depth, words)


def mutate_field(data: st.DataObject, msg: Any, f: FieldDescriptor, depth: int, words: Sequence[str] = ()) -> None:
    name = f.name
    if _is_map(f):
        m = getattr(msg, name)
        if data.draw(st.booleans(), label="clear map"):
            m.clear()
            return
        kf, vf = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        key = data.draw(scalar_strategy(kf, words), label="key")
        if vf.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                mutate_message(data, m[key], depth + 1, words)
        else:
            m[key] = data.draw(scalar_strategy(vf, words), label="value")
        return
    if _repeated(f):
        r = getattr(msg, name)
        op = data.draw(st.sampled_from(["clear", "add", "set"]), label="repeated op")
        if op == "clear":
            del r[:]
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                mutate_message(data, r.add(), depth + 1, words)
        elif op == "add":
            r.append(data.draw(scalar_strategy(f, words), label="item"))
        else:
            del r[:]
            r.extend(data.draw(st.lists(scalar_strategy(f, words), max_size=6), label="items"))
        return
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= 3 or data.draw(st.integers(0, 4), label="clear msg?") == 0:
            msg.ClearField(name)
        else:
            mutate_message(data, getattr(msg, name), depth + 1, words)
        return
    if f.type == FieldDescriptor.TYPE_BYTES and data.draw(st.booleans(), label="mutate bytes in place?"):
        setattr(msg, name, mutate_bytes(data, getattr(msg, name), name))
        return
    setattr(msg, name, data.draw(scalar_strategy(f, words), label=name))


def mutated_requests(data: st.DataObject, cls: type, seeds: Sequence[Sequence[bytes]], streaming: bool,
                     words: Sequence[str] = ()) -> list[bytes]:
    """A seed request (a list of serialized messages) with structural and/or byte-level mutations."""
    seed = list(data.draw(st.sampled_from(list(seeds)), label="seed"))
    if not seed:
        seed = [b""]
    ops = data.draw(st.lists(st.sampled_from(["field", "field", "field", "bytes", "stream"] if streaming else
                                             ["field", "field", "field", "bytes"]), min_size=1, max_size=3), label="ops")
    for op in ops:
        if not seed:
            break
        i = data.draw(st.integers(0, len(seed) - 1), label="message")
        if op == "field":
            m = cls()
            try:
                m.ParseFromString(seed[i])
            except Exception:  # noqa: BLE001 - already mangled by an earlier byte op: start from empty
                m = cls()
            mutate_message(data, m, words=words)
            seed[i] = m.SerializeToString()
        elif op == "bytes":
            seed[i] = mutate_bytes(data, seed[i], "message")
        else:
            how = data.draw(st.sampled_from(["drop", "dup", "swap", "cut"]), label="stream op")
            if how == "drop":
                del seed[i]
            elif how == "dup":
                seed.insert(i, seed[i])
            elif how == "swap" and len(seed) > 1:
                j = data.draw(st.integers(0, len(seed) - 1), label="with")
                seed[i], seed[j] = seed[j], seed[i]
            else:
                seed = seed[:i]
    return seed


def random_requests(streaming: bool) -> st.SearchStrategy[list[bytes]]:
    one = st.one_of(st.binary(max_size=512), st.sampled_from([b"", b"\x00", b"\xff" * 11, b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"]))
    return st.lists(one, min_size=0, max_size=4) if streaming else st.lists(one, min_size=1, max_size=1)
