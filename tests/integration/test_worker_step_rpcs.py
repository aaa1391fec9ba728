"""The worker's PS data path in steady state is one Step call per shard per step.

Two workers (threads, each with its own PSClient) train the ctr task (a dense MLP table and a sparse
embedding table) against 2 real gRPC shards; the shards' own per-method request counters are read
after the run. Every step t sends one Step call per shard carrying step t's dense and sparse
gradients and the values for step t + lookahead; only the first lookahead steps fetch with the
separate PullDense/PullSparse calls, and no separate push is made (but worker 0's write of the
initial dense values, and in async/SSP each worker's clock record when it leaves). Each exchange is
sent and completed on the worker's own training thread (``push_fetch_begin``: no hand-off to a pool
thread). Numerical reference: none here (test_worker_sync_exact checks that the same path in sync
mode equals one process).
"""
from __future__ import annotations

import threading

import pytest

from worker import TrainConfig, Trainer, load_task

pytestmark = pytest.mark.timeout(120)

W, B, STEPS = 2, 16, 8
DATA = ("Step", "PullDense", "PushDense", "PullSparse", "PushSparse")


@pytest.mark.parametrize("mode,lookahead", [("sync", 1), ("async", 2), ("ssp", 2)])
def test_one_step_call_per_shard_per_step(inproc_cluster, train_workers, mode: str, lookahead: int) -> None:
    cluster = inproc_cluster(2)
    tasks = [load_task("ctr", vocab=2000, test_size=100) for _ in range(W)]

    def make(i: int) -> Trainer:
        cfg = TrainConfig(
            mode=mode, steps=STEPS, batch_size=B, worker_index=i, num_workers=W, progress=False, evaluate=False,
            lease_s=120, staleness=2,  # heartbeats (and their clock records) every 30 s: none in this run
        )
        tr = Trainer(tasks[i], cluster.client(timeout=60), cfg)
        assert tr.sync.lookahead == lookahead
        completed = tr.sync._push_fetched  # type: ignore[attr-defined]

        def observed(*a, **k):  # (observes the thread only; the exchange itself runs unchanged)
            threads[i].add(threading.current_thread().name)
            return completed(*a, **k)

        tr.sync._push_fetched = observed  # type: ignore[attr-defined]
        return tr

    threads: dict[int, set[str]] = {i: set() for i in range(W)}
    out = train_workers(W, make, timeout=100)
    assert all(s.steps == STEPS for s in out.values())
    assert threads == {i: {f"test-worker-{i}"} for i in range(W)}, threads  # every exchange on the training thread
    records = 0 if mode == "sync" else W  # async/SSP: each worker reads and records its clock once (join, leave)
    for shard in cluster.shards:
        got = {k: shard.requests.get(k, 0) for k in DATA}
        assert got["Step"] == W * STEPS, got  # every step's push (the last ones push only)
        assert got["PushDense"] == 1, got  # worker 0 writing the initial values
        assert got["PullDense"] == W * lookahead, got  # the first lookahead steps' own fetches
        assert got["PullSparse"] <= W * lookahead + records, got
    assert sum(s.requests.get("PushSparse", 0) for s in cluster.shards) == records
