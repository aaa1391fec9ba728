"""Sync mode is exact: W workers with batch b == one process with batch W*b and the same optimizer.

Reference: a single process (no PS) training a deep copy of the same model with torch.optim
on the concatenation of the workers' batches. Dense parameters are compared at every step
(what each worker computes step t from), sparse rows after the run; fp32 tolerance 1e-5.
Workers are threads of this process, each with its own PSClient, against 2 real gRPC shards.
"""
from __future__ import annotations

import copy
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ps.initializers import init_rows, table_key
from worker import TrainConfig, Trainer, load_task

W, B, STEPS = 2, 16, 6


def _run_workers(train_workers, cluster, task_name: str, overlap: bool = True, **task_kw):
    """Train W sync workers; returns (tasks, per worker {step: the flat parameters it computed that step from})."""
    tasks = [load_task(task_name, **task_kw) for _ in range(W)]
    seen: list[dict[int, torch.Tensor]] = [{} for _ in range(W)]

    def make(i: int) -> Trainer:
        cfg = TrainConfig(
            mode="sync", steps=STEPS, batch_size=B, worker_index=i, num_workers=W, progress=False,
            evaluate=False, overlap=overlap, lease_s=30,
        )
        return Trainer(
            tasks[i], cluster.client(timeout=60), cfg,
            on_step=lambda step, tr: seen[i].__setitem__(step, tr.flat.detach().clone()),
        )

    train_workers(W, make, timeout=120)
    return tasks, seen


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_sync_dense_matches_one_process_with_the_global_batch(inproc_cluster, train_workers, overlap: bool) -> None:
    reference = copy.deepcopy(load_task("digits").model)  # same seed: same initial weights as the workers'
    cluster = inproc_cluster(2)
    tasks, seen = _run_workers(train_workers, cluster, "digits", overlap=overlap)
    opt = torch.optim.Adam(reference.parameters(), lr=tasks[0].dense_optimizer.hparams["lr"])  # the table's optimizer
    data = tasks[0].batches(0, 1, W * B, 0)  # the global batch: worker slices concatenated
    for t in range(STEPS):
        want = _flat(reference.parameters())
        for i in range(W):
            torch.testing.assert_close(seen[i][t], want, rtol=1e-5, atol=1e-6, msg=f"worker {i} step {t}")
        x, y = next(data)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    assert not torch.equal(_flat(reference.parameters()), seen[0][0]), "parameters never moved"


def test_sync_sparse_and_dense_match_one_process(inproc_cluster, train_workers) -> None:
    kw = dict(vocab=2000, test_size=100)  # a small id space, so rows are hit repeatedly
    task0 = load_task("ctr", **kw)
    ref_mlp = copy.deepcopy(task0.model.mlp)
    emb = task0.model.emb
    data = task0.batches(0, 1, W * B, 0)
    batches = [next(data) for _ in range(STEPS)]
    ids_all = np.unique(np.concatenate([b.ids.numpy().reshape(-1) for b in batches]))
    init = init_rows(emb.init, table_key(emb.table, emb.seed), ids_all, emb.dim)
    ref_emb = torch.nn.Parameter(torch.from_numpy(init.copy()))

    cluster = inproc_cluster(2)
    tasks, seen = _run_workers(train_workers, cluster, "ctr", **kw)

    opt_dense = torch.optim.Adam(ref_mlp.parameters(), lr=1e-3)
    # the table's optimizer: Adagrad lr 0.05, initial accumulator 0.1 (rows untouched in a step get a
    # zero gradient, which leaves them and their accumulator unchanged: dense Adagrad == lazy Adagrad)
    opt_sparse = torch.optim.Adagrad([ref_emb], lr=0.05, initial_accumulator_value=0.1, eps=1e-10)
    for t, b in enumerate(batches):
        want = _flat(ref_mlp.parameters())
        for i in range(W):
            torch.testing.assert_close(seen[i][t], want, rtol=1e-5, atol=1e-6, msg=f"worker {i} step {t}")
        rows = F.embedding(torch.from_numpy(np.searchsorted(ids_all, b.ids.numpy())), ref_emb)
        logits = ref_mlp(torch.cat([rows.flatten(1), b.dense], 1)).squeeze(1)
        opt_dense.zero_grad()
        opt_sparse.zero_grad()
        F.binary_cross_entropy_with_logits(logits, b.label).backward()
        opt_dense.step()
        opt_sparse.step()
    got = cluster.client().pull_sparse(emb.table, ids_all)
    torch.testing.assert_close(torch.from_numpy(got), ref_emb.detach(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, init), "rows never moved"
