"""The client's planner (ps/plan.py) without a server: grouping ids by owning shard, the per-shard
id limit, reply placement, NaN/Inf as sent."""
from __future__ import annotations

import numpy as np
import pytest

from ps.config import TableSpec
from ps.errors import NonFiniteError, ResourceExhaustedError
from ps.partition import SlotMap
from ps.plan import group, placed, placement, wire_checked


def test_group_gives_each_shard_its_own_ids_in_slices() -> None:
    slots = SlotMap(4096, 3)
    uniq = np.arange(1000, dtype=np.int64) * 7919
    groups = group("e", uniq, slots, 3, [0, 0, 0], per_req=100)
    owner = slots.shard_of(uniq)
    seen = np.concatenate([idx for g in groups for idx in g])
    assert sorted(seen.tolist()) == list(range(1000))  # every unique id once
    for i, g in enumerate(groups):
        assert all(len(idx) <= 100 for idx in g)
        assert all((owner[idx] == i).all() for idx in g)
    with pytest.raises(ResourceExhaustedError, match="exceed its limit of 10 ids per request"):
        group("e", uniq, slots, 3, [10, 0, 0], per_req=100)


def test_placement_writes_replies_in_the_callers_order() -> None:
    ids = np.array([30, 10, 20])
    uniq, inverse = np.unique(ids, return_inverse=True)
    place, in_order = placement(inverse, len(uniq))
    assert in_order and place is not None
    out = np.empty(3, np.int64)
    out[placed(place, np.arange(3))] = uniq  # rows of the unique ids land where the caller asked
    assert out.tolist() == ids.tolist()
    assert placement(np.arange(3), 3) == (None, True)  # already unique and sorted
    assert placement(np.array([0, 0, 1]), 2) == (None, False)  # duplicates: gathered afterwards


def test_nonfinite_on_the_wire_is_refused_before_sending() -> None:
    spec = TableSpec("w", "dense", shape=(2,))
    with pytest.raises(NonFiniteError, match="as float16 on the wire"):
        wire_checked(spec, np.array([1.0, 1e6], np.float32), "float16")  # 1e6 is Inf in float16
    assert wire_checked(spec, np.array([1.0, 1e6], np.float32), "float32")[0] == "float32"

