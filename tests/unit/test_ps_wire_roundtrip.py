"""ps.wire's domain <-> message converters are symmetric: every field of a value with no field at
its default comes back equal (the converters go field by field by name, so a field added to one
side only fails here). No server: the converters alone; the reference is the value itself."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ps.config import AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.consistency import SyncPolicy
from ps.shard import (
    PULL_DENSE, PULL_SPARSE, PUSH_DENSE, PUSH_SPARSE, MembershipView, ShardStats, StepOutcome, StepPart, TableInfo, TableStats,
    WorkerStats,
)
from ps.wire import (
    frame_pieces,
    info_from_proto,
    info_to_proto,
    membership_from_proto,
    membership_to_proto,
    policy_from_proto,
    policy_to_proto,
    spec_from_proto,
    spec_to_proto,
    stats_from_proto,
    stats_to_proto,
    step_parts_from_proto,
    step_parts_to_proto,
    step_reply_from_proto,
    step_reply_to_proto,
    unframe,
)
from tessera.v1 import ps_pb2 as pb


def _filled(cls: type, **given: object) -> object:
    """A ``cls`` whose fields are all off their defaults (numbers by position, strings by name)."""
    vals: dict[str, object] = {}
    for k, f in enumerate(dataclasses.fields(cls), start=1):
        if f.name in given:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, bool) or f.type in ("bool",):
            vals[f.name] = True
        elif f.type in ("int",):
            vals[f.name] = k + 1
        elif f.type in ("float",):
            vals[f.name] = k + 0.5
        elif f.type in ("str",):
            vals[f.name] = f"{f.name}-x"
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: give a value for type {f.type}")
    return cls(**vals, **given)


def test_stats_round_trip_every_field() -> None:
    tables = [_filled(TableStats, kind="dense"), _filled(TableStats, kind="sparse")]
    workers = [_filled(WorkerStats)]
    s = _filled(ShardStats, tables=tables, workers=workers, requests={"Step": 3}, errors={"INTERNAL": 1})
    back = stats_from_proto(pb.StatsReply.FromString(stats_to_proto(s).SerializeToString()))
    assert back == s


def test_info_membership_policy_round_trip() -> None:
    spec = TableSpec("e", "sparse", dim=8, num_slots=64)
    info = _filled(TableInfo, spec=spec)
    assert info_from_proto(pb.TableInfo.FromString(info_to_proto(info).SerializeToString())) == info
    view = _filled(MembershipView, live=("a", "b"))
    assert membership_from_proto(pb.MembershipReply.FromString(membership_to_proto(view).SerializeToString())) == view
    policy = SyncPolicy(clock=4, sync=True, staleness=2, backup_workers=1, staleness_aware_lr=True)
    assert policy_from_proto(pb.SyncSpec.FromString(policy_to_proto(policy).SerializeToString())) == policy


def test_table_spec_round_trip() -> None:
    for spec in (
        TableSpec(
            "e", "sparse", dim=8, dtype="bfloat16", optimizer=OptimizerSpec("adam", {"lr": 0.5}),
            initializer=InitializerSpec("normal", {"std": 0.2}), seed=7, admission=AdmissionSpec(3),
            eviction=EvictionSpec(9, 100), num_slots=64, allow_nonfinite=True,
        ),
        TableSpec("w", "dense", shape=(3, 4)),
    ):
        assert spec_from_proto(pb.TableSpec.FromString(spec_to_proto(spec).SerializeToString())) == spec


def test_step_arrays_arrive_aligned_and_equal() -> None:
    """A Step's request and reply lay their arrays out one after another in one bulk field; each
    starts a multiple of 8 bytes into the message (a dense part of 545 float32 would leave the next
    int64 ids 4 bytes off), so the receiver's views are aligned. Reference: the arrays sent."""
    dense = np.arange(545, dtype=np.float32)
    ids = np.array([3, 9, 11], np.int64)
    rows = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    base = np.array([1, 2, 3], np.int64)
    parts = [
        StepPart("d", PUSH_DENSE, seq=1, values=dense),
        StepPart("s", PUSH_SPARSE, seq=2, values=rows, ids=ids, base_versions=base),
        StepPart("s", PULL_SPARSE, ids=ids[:1]),
    ]
    raw = _received(step_parts_to_proto(parts, "w", "w", "float32"))
    req, pl = unframe(pb.StepRequest, raw)
    got = step_parts_from_proto(req, pl["data"])
    arrays = [(got[0].values, dense), (got[1].ids, ids), (got[1].values, rows), (got[1].base_versions, base), (got[2].ids, ids[:1])]
    for a, want in arrays:
        assert _offset(a, raw) % 8 == 0
        np.testing.assert_array_equal(a, want)
    outcomes = [
        StepOutcome("d", PULL_DENSE, version=4, blocks=[torch.from_numpy(dense)]),
        StepOutcome("s", PULL_SPARSE, rows=torch.from_numpy(rows), versions=base, dtype="float32"),
    ]
    reply, pieces = step_reply_to_proto(outcomes, "float32")
    raw = _received(frame_pieces(reply, data=pieces))
    msg, pl = unframe(pb.StepReply, raw)
    back = step_reply_from_proto(msg, pl["data"], "float32")
    for a, want in [(back[0].blocks[0], dense), (back[1].rows, rows), (back[1].versions, base)]:
        assert _offset(a, raw) % 8 == 0
        np.testing.assert_array_equal(a, want)


def _received(packed: Any) -> memoryview:
    """A message's bytes as a receiver holds them: in a fresh buffer (numpy's: 16-byte aligned)."""
    joined = packed.join()
    buf = np.empty(len(joined), np.uint8)
    buf[:] = np.frombuffer(joined, np.uint8)
    return buf.data


def _offset(a: np.ndarray, raw: memoryview) -> int:
    return a.ctypes.data - np.frombuffer(raw, np.uint8).ctypes.data
