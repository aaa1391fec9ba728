"""The ctr task's data: a worker draws only its own rows of the global batch.

Reference: the global batch drawn whole (``CTRData.global_batch``), or by one process
(``batches(0, 1, W x B)``): the workers' parts must be exactly its rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.tasks.ctr import ROW_BLOCK, CTRData, make_task


@pytest.mark.parametrize(("lo", "hi"), [(0, 256), (256, 512), (100, 333), (5, 6), (0, 1), (ROW_BLOCK - 1, ROW_BLOCK + 1)])
def test_rows_are_the_global_batchs_rows(lo: int, hi: int) -> None:
    d = CTRData(vocab=10_000, seed=3)
    whole = d.global_batch(7, 512)
    part = d.rows(7, lo, hi)
    for a, b in zip(whole, part):
        assert torch.equal(a[lo:hi], b)


def test_the_workers_batches_make_the_one_process_batch() -> None:
    """3 workers x 100 rows, 2 steps from step 5: their batches side by side are the batches of one
    process that takes 300 rows a step."""
    task = make_task(test_size=10)
    one = task.batches(0, 1, 300, 5)
    workers = [task.batches(w, 3, 100, 5) for w in range(3)]
    for _ in range(2):
        ref = next(one)
        parts = [next(it) for it in workers]
        for i, t in enumerate(ref):
            assert torch.equal(torch.cat([p[i] for p in parts]), t)


def test_a_worker_draws_only_the_blocks_of_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 256:512 of a step take 256 / ROW_BLOCK generators, each drawing ROW_BLOCK rows
    (before: the whole global batch, 512 rows, on every worker)."""
    d = CTRData()
    drawn: list[int] = []
    real = CTRData._draw

    def spy(rng: np.random.Generator, n: int) -> tuple:
        drawn.append(n)
        return real(rng, n)

    monkeypatch.setattr(CTRData, "_draw", staticmethod(spy))
    d.rows(0, 256, 512)
    assert sum(drawn) == 256 and len(drawn) == 256 // ROW_BLOCK


def test_the_data_is_still_the_model_it_was() -> None:
    """Ids are Zipf-like per field (rank 0 the most frequent), labels follow the true probability
    (mean label = mean prob within noise): the generator's distribution, not its stream, is the contract."""
    b = CTRData(vocab=1000, seed=1).global_batch(0, 20_000)
    rank = (b.ids & ((1 << 40) - 1)).numpy()
    counts = np.bincount(rank[:, 0], minlength=1000)
    assert counts[0] > counts[10] > counts[500] and rank.max() < 1000
    assert abs(float(b.label.mean()) - float(b.prob.mean())) < 0.02
    assert (b.ids >> 40).unique().tolist() == list(range(26))
