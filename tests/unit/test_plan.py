"""The client's planner (ps/plan.py) without a server: grouping ids by owning shard, the per-shard
id limit, reply placement, NaN/Inf as sent, summing duplicate ids, a step's route; and the Step converters
(ps/wire.py) both ways, client parts to the shard's parts and the shard's outcomes back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import TableSpec
from ps.errors import InvalidArgumentError, NonFiniteError, ResourceExhaustedError
from ps.partition import SlotMap
from ps.consistency import SyncPolicy
from ps.plan import (
    DenseOut, SparseOut, fuse_dense, group, iota, is_identity, placed, placement, policy_for, step_fits, stream_dense, sum_duplicates, wire_checked,
)
from ps.shard import PULL_DENSE, PULL_SPARSE, PUSH_DENSE, PUSH_SPARSE, StepOutcome, StepPart, SyncPush
from ps.table import PushResult
from ps.wire import frame_pieces, step_parts_from_proto, step_parts_to_proto, step_reply_from_proto, step_reply_to_proto, unframe
from tessera.codec import as_bytes
from tessera.v1 import ps_pb2 as pb


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


def test_iota_is_known_as_the_identity_and_only_where_it_is_one() -> None:
    """The reference: ``np.arange``. An iota view is the identity without a pass over it; a view of
    the shared array that is not 0..n-1 (a later start, a stride) is checked element by element."""
    a = iota(120)
    assert a.tolist() == list(range(120)) and not a.flags.writeable
    assert is_identity(a, 120) and is_identity(a.reshape(10, 12), 120) and not is_identity(a, 121)
    shared = iota(300)  # views of one array: their own values decide
    assert not is_identity(shared[5:125], 120) and not is_identity(shared[::2][:120], 120)
    assert is_identity(shared[:120], 120) and is_identity(iota(0), 0)
    assert is_identity(a, 120)  # a view of an array iota has since replaced: checked, still the identity
    assert is_identity(np.arange(120), 120) and not is_identity(np.array([1, 0]), 2)


def test_nonfinite_on_the_wire_is_refused_before_sending() -> None:
    spec = TableSpec("w", "dense", shape=(2,))
    with pytest.raises(NonFiniteError, match="as float16 on the wire"):
        wire_checked(spec, np.array([1.0, 1e6], np.float32), "float16")  # 1e6 is Inf in float16
    assert wire_checked(spec, np.array([1.0, 1e6], np.float32), "float32")[0] == "float32"



def test_sum_duplicates_matches_a_numpy_sum_and_keeps_the_newest_base() -> None:
    """Reference: np.add.at over the caller's rows (float32 sums of at most 3 rows: exact to 1e-6)."""
    spec = TableSpec("e", "sparse", dim=4, num_slots=64)
    ids = np.array([5, 3, 5, 9, 3, 5])
    grads = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed, base, place = sum_duplicates(spec, uniq, inverse, grads, np.array([1, 7, 4, 2, 6, 3]))
    want = np.zeros((3, 4), np.float32)
    np.add.at(want, inverse, grads)
    assert place is None  # the sums are in uniq's order
    np.testing.assert_allclose(summed, want, rtol=0, atol=1e-6)
    assert base is not None and base.tolist() == [7, 4, 2]  # ids 3, 5, 9: the newest version each
    with pytest.raises(InvalidArgumentError, match="does not end in the table's dim 4"):
        sum_duplicates(spec, uniq, inverse, np.zeros((6, 3), np.float32), None)
    with pytest.raises(InvalidArgumentError, match="5 gradient rows for 6 ids"):
        sum_duplicates(spec, uniq, inverse, np.zeros((5, 4), np.float32), None)


@pytest.mark.parametrize("ids", [[9, 3, 5, 1], [1, 3, 5, 9]], ids=["distinct", "sorted"])
def test_sum_duplicates_of_distinct_ids_places_the_callers_rows(ids: list[int]) -> None:
    """Distinct ids are not scattered into uniq's order: rows[placed(place, idx)] are the rows of
    uniq[idx], as the scatter (the reference) would have put them there."""
    spec = TableSpec("e", "sparse", dim=3, num_slots=64)
    grads = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    uniq, inverse = np.unique(ids, return_inverse=True)
    rows, base, place = sum_duplicates(spec, uniq, inverse, grads, np.array([10, 11, 12, 13]))
    assert (place is None) == (ids == sorted(ids))  # sorted: already in uniq's order
    want = np.zeros((4, 3), np.float32)
    want[inverse] = grads
    want_base = np.zeros(4, np.int64)
    want_base[inverse] = [10, 11, 12, 13]
    for idx in (np.array([2, 0]), np.arange(4), np.zeros(0, np.int64)):
        assert np.array_equal(rows[placed(place, idx)], want[idx])
        assert base is not None and np.array_equal(base[placed(place, idx)], want_base[idx])


def test_dense_and_sparse_outs_place_shard_replies() -> None:
    spec = TableSpec("w", "dense", shape=(2, 3))
    out = np.zeros((2, 3), np.float32)
    d = DenseOut(spec, out)  # written into out directly
    d.put(0, np.array([1, 2], np.float32))
    d.put(2, np.array([3, 4, 5, 6], np.float32))
    assert d.result() is out and out.ravel().tolist() == [1, 2, 3, 4, 5, 6]
    fresh = DenseOut(spec, None)
    fresh.put(0, np.arange(6, dtype=np.float32))
    assert fresh.result().shape == (2, 3)
    ids = np.array([[9, 2], [2, 5]])  # a repeated id, as a batch holds them
    uniq, inverse = np.unique(ids, return_inverse=True)
    s = SparseOut(1, uniq, inverse.reshape(-1), ids)
    s.put(np.array([2, 0]), np.array([[90.0], [20.0]], np.float32), np.array([3, 1]))  # two shards' replies
    s.put(np.array([1]), np.array([[50.0]], np.float32), np.array([2]))
    rows, versions = s.result()
    assert rows.shape == (2, 2, 1) and rows[..., 0].tolist() == [[90, 20], [20, 50]]
    assert versions.tolist() == [[3, 1], [1, 2]]
    assert policy_for({"a": SyncPolicy(clock=1, sync=True)}, "b") == SyncPolicy()


def test_step_route_is_chosen_without_a_server() -> None:
    """Which dense tables go by the streams (a slice over the inline bytes as sent), whether one Step
    call per shard fits (request or reply of any shard over the limit), which pushes are fused."""
    assert stream_dense({"a": 1 << 18, "b": (1 << 18) + 1, "empty": 0}, 4, 1 << 20) == {"b"}
    assert stream_dense({"b": (1 << 18) + 1}, 2, 1 << 20) == set()  # float16 on the wire: half the bytes
    part = StepPart("e", PUSH_SPARSE, seq=1, values=np.zeros((10, 4), np.float32), ids=np.arange(10), base_versions=np.zeros(10, np.int64))
    assert step_fits([[part], []], [0, 0], 160 + 80 + 80 + 4096)
    assert not step_fits([[], [part]], [0, 0], 160 + 80 + 80 + 4095)
    assert not step_fits([[part], []], [0, 5000], 8191) and step_fits([[part], []], [0, 5000], 9096)
    bsp, ssp, async_ = SyncPolicy(clock=1, sync=True), SyncPolicy(clock=1, staleness=2), SyncPolicy(clock=1)
    assert fuse_dense(["a", "b", "c"], {"a", "b"}, None, None) == ["a", "b"]  # "c" is not pulled
    assert fuse_dense(["a", "b", "c"], {"a", "b", "c"}, {"a": bsp}, {"b": ssp, "c": async_}) == ["c"]
    assert fuse_dense(["a"], {"a"}, async_, ssp) == [] and fuse_dense(["a"], {"a"}, ssp, None) == []


def test_step_converters_round_trip() -> None:
    """What the client lays out is what the shard reads (values cast to float16 on the wire), and what
    the shard answers is what the client reads back; the reference is the parts themselves."""
    g = np.arange(5, dtype=np.float16)
    rows = np.ones((2, 3), np.float16)
    bsp = SyncPolicy(clock=2, sync=True)
    parts = [
        StepPart("w", PUSH_DENSE, bsp, seq=7, base_version=3, values=g),
        StepPart("e", PUSH_SPARSE, seq=8, values=rows, ids=np.array([4, 9]), base_versions=np.array([1, 2])),
        StepPart("w", PULL_DENSE, bsp),
        StepPart("e", PULL_SPARSE, ids=np.array([4, 9, 11])),
    ]
    req, pl = unframe(pb.StepRequest, as_bytes(step_parts_to_proto(parts, "w0", "c", "float16")))
    back = step_parts_from_proto(req, pl["data"])
    assert req.worker == "w0" and req.client == "c"
    for a, b in zip(parts, back):
        assert (a.table, a.op, a.policy, a.seq, a.base_version) == (b.table, b.op, b.policy, b.seq, b.base_version)
        for x, y in ((a.values, b.values), (a.ids, b.ids), (a.base_versions, b.base_versions)):
            assert (x is None) == (y is None) and (x is None or np.array_equal(np.asarray(x, y.dtype), y))
    outcomes = [
        StepOutcome("w", PUSH_DENSE, SyncPush(PushResult(1, 0, 0.0, 2, 5, 0, 3), False, 3), version=5, clock=3),
        StepOutcome("w", PULL_DENSE, version=5, clock=3, blocks=[torch.arange(5, dtype=torch.float32)]),  # the shard holds tensors
        StepOutcome("e", PULL_SPARSE, clock=3, rows=np.full((3, 2), 0.5, np.float32), versions=np.array([1, 0, 4]), dtype="float32"),
    ]
    reply, pieces = step_reply_to_proto(outcomes, "float16")
    msg, rpl = unframe(pb.StepReply, as_bytes(frame_pieces(reply, data=pieces)))
    got = step_reply_from_proto(msg, rpl["data"], "float16")
    assert got[0].push is not None and got[0].push.result.version == 5 and got[0].push.result.max_staleness == 2
    assert got[1].blocks is not None and got[1].blocks[0].tolist() == list(range(5))
    assert got[2].rows.tolist() == [[0.5, 0.5]] * 3 and got[2].versions.tolist() == [1, 0, 4] and got[2].dtype == "float32"
