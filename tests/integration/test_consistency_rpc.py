"""Membership and consistency requests over a real gRPC server: each bad request gets a clear status,
changes nothing, and the shard keeps serving. Waits that cannot be satisfied end at the deadline."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from ps import SyncPolicy
from ps.client import PSClient
from ps.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from tessera.v1 import ps_pb2 as pb


def _raw(cluster, method: str, msg) -> grpc.RpcError:
    ch = grpc.insecure_channel(cluster.addresses[0])
    try:
        ch.unary_unary(f"/tessera.v1.ParameterServer/{method}")(msg if isinstance(msg, bytes) else msg.SerializeToString(), timeout=5)
    except grpc.RpcError as e:
        return e
    finally:
        ch.close()
    raise AssertionError(f"{method} accepted a bad request")


@pytest.mark.parametrize(
    "method,msg,code,text",
    [
        ("Join", pb.JoinRequest(worker=""), grpc.StatusCode.INVALID_ARGUMENT, "worker name is empty"),
        ("Join", pb.JoinRequest(worker="w", lease_ms=-5), grpc.StatusCode.INVALID_ARGUMENT, "lease_ms must be >= 0"),
        ("Heartbeat", pb.HeartbeatRequest(worker=""), grpc.StatusCode.INVALID_ARGUMENT, "worker name is empty"),
        ("Heartbeat", pb.HeartbeatRequest(worker="w", clock=-1), grpc.StatusCode.INVALID_ARGUMENT, "clock must be >= 0"),
        ("Join", b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "JoinRequest"),
    ],
)
def test_bad_membership_requests(inproc_cluster, method, msg, code, text) -> None:
    cluster = inproc_cluster(1)
    e = _raw(cluster, method, msg)
    assert e.code() == code and text in e.details(), e.details()
    assert cluster.shards[0].membership.live() == frozenset()
    c = cluster.client(worker="ok")
    assert c.join()[0].live == ("ok",)  # still serving


def _sync_client(cluster, name: str) -> PSClient:
    c = cluster.client(worker=name, timeout=5)
    c.create_dense("t", 8, "sgd", lr=1.0)
    c.create_sparse("s", 4, "sgd", lr=1.0)
    c.join()
    return c


def test_bsp_push_for_a_future_clock_is_refused_and_changes_nothing(inproc_cluster) -> None:
    cluster = inproc_cluster(2)
    a = _sync_client(cluster, "a")
    before = a.pull_dense("t")
    with pytest.raises(FailedPreconditionError, match=r"table 't': push for clock 3, but the table is at clock 0"):
        a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=3, sync=True))
    with pytest.raises(FailedPreconditionError, match="clock 3"):
        a.push_sparse("s", [1, 2], np.ones((2, 4), np.float32), policy=SyncPolicy(clock=3, sync=True))
    np.testing.assert_array_equal(a.pull_dense("t"), before)
    assert all(r.pending() == 0 for sh in cluster.shards for r in sh.rounds.values())
    r = a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))  # still serving
    assert r.clock == 1 and r.late == 0


def test_bsp_push_needs_a_worker_name(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    _sync_client(cluster, "a")
    anon = cluster.client()
    with pytest.raises(InvalidArgumentError, match="must name its worker"):
        anon.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))
    with pytest.raises(InvalidArgumentError, match="must name its worker"):
        anon.push_sparse("s", [1], np.ones((1, 4), np.float32), policy=SyncPolicy(clock=0, sync=True))


def test_negative_backup_workers_is_refused(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    a = _sync_client(cluster, "a")
    with pytest.raises(InvalidArgumentError, match="backup_workers must be >= 0"):
        a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True, backup_workers=-1))


def test_waits_end_at_the_deadline_with_a_message(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    a = _sync_client(cluster, "a")
    b = cluster.client(worker="b", timeout=1.0)
    b.join()
    a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))  # held: b has not pushed
    with pytest.raises(DeadlineExceededError):
        b.pull_dense("t", policy=SyncPolicy(clock=1, sync=True))
    with pytest.raises(DeadlineExceededError):  # b is at clock 0; a at 1 wants the slowest within 0
        cluster.client(worker="a", timeout=1.0).pull_dense("t", policy=SyncPolicy(clock=1, staleness=0))
    b.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))
    np.testing.assert_allclose(a.pull_dense("t", policy=SyncPolicy(clock=1, sync=True)), -np.ones(8))  # mean of two 1s, lr 1


def test_a_retried_bsp_push_is_late_not_applied_twice(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    a = _sync_client(cluster, "a")
    r1 = a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))
    r2 = a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=0, sync=True))
    assert (r1.late, r2.late) == (0, 1)
    np.testing.assert_allclose(a.pull_dense("t"), -np.ones(8))
    stats = a.stats()[0]
    assert [w.name for w in stats.workers if w.live] == ["a"]


def test_a_late_joiner_declares_its_start_clock_so_ssp_does_not_wait_on_it(inproc_cluster) -> None:
    cluster = inproc_cluster(1)
    a = _sync_client(cluster, "a")
    for c in range(5):
        a.push_dense("t", np.ones(8, np.float32), policy=SyncPolicy(clock=c, staleness=2))
    b = cluster.client(worker="b", timeout=1.0)
    view = b.join()[0]
    assert view.min_clock == 5  # where the others are
    b.heartbeat(5)  # b starts at step 5
    a.pull_dense("t", policy=SyncPolicy(clock=7, staleness=2))  # slowest (b) is at 5 = 7 - 2: no wait
