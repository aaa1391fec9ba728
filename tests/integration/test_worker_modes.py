"""Backup workers, dense-sync mode and staleness-aware learning rates, end to end over real gRPC shards."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ps import SyncPolicy
from worker import TrainConfig, Trainer, load_task


def _run(train_workers, cluster, n: int, task: str, slow: dict[int, float] | None = None, **cfg):
    """n workers in threads; worker i sleeps slow[i] seconds per step (a straggler)."""
    def make(i: int) -> Trainer:
        delay = (slow or {}).get(i, 0.0)
        return Trainer(
            load_task(task, **({"vocab": 10_000, "test_size": 500} if task == "ctr" else {})),
            cluster.client(timeout=60),
            TrainConfig(worker_index=i, num_workers=n, progress=False, **cfg),
            on_step=(lambda step, tr: time.sleep(delay)) if delay else None,
        )

    return train_workers(n, make, timeout=120)


def test_backup_workers_drop_the_stragglers_gradients(inproc_cluster, train_workers) -> None:
    """3 workers, 1 backup, worker 2 sleeps 50 ms per step: each step applies the first 2 gradients;
    the straggler's arrive late (not applied) and it keeps up by skipping to the current clock."""
    cluster = inproc_cluster(2)
    s = _run(train_workers, cluster, 3, "digits", slow={2: 0.05}, mode="sync", backup_workers=1, steps=40, batch_size=16, evaluate=False)
    assert s[2].late_pushes > 0, s[2]
    assert s[0].late_pushes + s[1].late_pushes < s[2].late_pushes
    versions = {t.version for sh in cluster.shards for t in sh.stats().tables if t.name == "digits/dense"}
    assert versions == {40}, versions  # one optimizer step per clock, never more
    assert all(x.final_clock == 40 for x in s.values())


def test_dense_sync_is_sync_for_dense_and_async_for_sparse(inproc_cluster, train_workers) -> None:
    cluster = inproc_cluster(2)
    s = _run(train_workers, cluster, 2, "ctr", mode="dense-sync", steps=30, batch_size=64, evaluate=False)
    stats = {t.name: t for sh in cluster.shards for t in sh.stats().tables}
    assert stats["ctr/dense"].version == 30 and stats["ctr/dense"].max_staleness == 0  # one mean per clock
    assert stats["ctr/emb"].max_staleness >= 1  # rows updated by the other worker in between: async
    assert all(x.final_clock == 30 for x in s.values())


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_staleness_aware_lr_divides_the_step_by_the_staleness(inproc_cluster, kind: str) -> None:
    """SGD lr 0.1: an update computed 4 versions ago moves the values by lr/4 * g (Zhang et al. 2016)."""
    c = inproc_cluster(1).client()
    g = np.ones(8, np.float32)
    policy = SyncPolicy(staleness_aware_lr=True)
    if kind == "dense":
        c.create_dense("t", 8, "sgd", lr=0.1)
        for _ in range(4):
            c.push_dense("t", g)
        before = c.pull_dense("t")
        r = c.push_dense("t", g, base_version=0, policy=policy)
        assert r.staleness == (4,)
        after = c.pull_dense("t")
    else:
        c.create_sparse("t", 8, "sgd", lr=0.1)
        ids = np.array([5])
        c.pull_sparse("t", ids)
        for _ in range(4):
            c.push_sparse("t", ids, g[None])
        before = c.pull_sparse("t", ids)
        r = c.push_sparse("t", ids, g[None], base_versions=np.array([0]), policy=policy)
        assert r.max_staleness == 4
        after = c.pull_sparse("t", ids)
    torch.testing.assert_close(torch.from_numpy(before - after), torch.full(np.shape(after), 0.1 / 4), rtol=1e-6, atol=1e-7)
