"""ps.wire's domain <-> message converters are symmetric: every field of a value with no field at
its default comes back equal (the converters go field by field by name, so a field added to one
side only fails here). No server: the converters alone; the reference is the value itself."""
from __future__ import annotations

import dataclasses

from ps.config import AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.consistency import SyncPolicy
from ps.shard import MembershipView, ShardStats, TableInfo, TableStats, WorkerStats
from ps.wire import (
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
