"""The ``mf`` task's data and model (no sockets): deterministic from the seed, a stream whose
positions do not depend on the batch size, and a model that learns in one process.

References: the same task built twice (determinism); ``MFData.stream`` read in one piece (the
workers' batches are its slices); the hidden model's noise-free ratings (the RMSE floor)."""
from __future__ import annotations

import numpy as np
import torch

from worker.tasks import load_task
from worker.tasks.mf import MFData, torch_reference

SMALL = {"users": 200, "items": 100, "train_size": 3000, "test_size": 2000}


def test_the_data_is_a_function_of_the_seed() -> None:
    one, two, other = (MFData(seed=s, users=200, items=100, train_size=3000) for s in (4, 4, 5))
    for x, y in zip(one.stream(2900, 3300), two.stream(2900, 3300)):
        assert torch.equal(x, y)
    for x, y in zip(one.test_set(500), two.test_set(500)):
        assert torch.equal(x, y)
    assert not torch.equal(one.stream(0, 100).rating, other.stream(0, 100).rating)


def test_workers_batches_are_slices_of_one_stream() -> None:
    """3 workers x 64 from step 5 == one process with batch 192 from step 5 == stream positions
    [5 x 192, ...): also across an epoch boundary (train_size 3000, 192 does not divide it)."""
    task = load_task("mf", **SMALL)
    one = task.batches(0, 1, 192, 5)
    workers = [task.batches(w, 3, 64, 5) for w in range(3)]
    data = MFData(users=200, items=100, train_size=3000)
    for step in range(5, 30):
        ref = next(one)
        parts = [next(it) for it in workers]
        want = data.stream(step * 192, (step + 1) * 192)
        for i, t in enumerate(ref):
            assert torch.equal(torch.cat([p[i] for p in parts]), t)
            assert torch.equal(want[i], t)


def test_each_epoch_is_a_permutation_of_the_training_set() -> None:
    d = MFData(users=200, items=100, train_size=3000)
    for epoch in range(3):
        b = d.stream(epoch * 3000, (epoch + 1) * 3000)
        key = lambda x: sorted(zip(x.users.tolist(), x.items.tolist(), x.rating.tolist()))  # noqa: E731
        assert key(b) == key(d.train)
    assert not torch.equal(d.stream(0, 3000).users, d.stream(3000, 6000).users)  # reshuffled per epoch


def test_ratings_follow_the_hidden_model() -> None:
    """Noise-free ratings have variance ~1 + 2 x 0.3^2 around 3.5; the noise is N(0, noise^2): the
    test RMSE of the true means (the floor a model can reach) is about ``noise``."""
    task = load_task("mf", **{**SMALL, "test_size": 20_000}, noise=0.4)
    d = MFData(users=200, items=100, train_size=3000, noise=0.4)
    t = d.test_set(20_000)
    assert abs(float(t.mean.mean()) - 3.5) < 0.1
    assert 0.8 < float(t.mean.var()) < 1.6
    assert abs(task.info["best_rmse"] - 0.4) < 0.01
    assert task.metric == "rmse" and task.higher_is_better is False
    assert int(t.users.max()) < 200 and int(t.items.max()) < 100
    counts = np.bincount(d.train.items.numpy(), minlength=100)
    assert counts.max() > 3 * counts.min()  # a popularity skew, not uniform items


def test_the_reference_starts_from_the_shards_rows_and_learns() -> None:
    """``torch_reference``: the PS tables' initial rows (``ps.initializers``), the same MLP; trained
    in one process its test RMSE falls from the ratings' spread (~1.2) toward the noise (0.5)."""
    from ps.initializers import init_rows, table_key

    task = load_task("mf", **{**SMALL, "train_size": 20_000})
    ref, opts = torch_reference(task.model, task.dense_optimizer)
    want = init_rows(task.model.user.init, table_key("mf/user", 0), np.arange(200, dtype=np.int64), 16)
    assert torch.equal(ref.user.weight.detach(), torch.from_numpy(want))
    assert ref.user.sparse and ref.item.sparse
    for a, b in zip(ref.mlp.parameters(), task.model.mlp.parameters()):
        assert torch.equal(a, b)
    assert task.evaluate is not None
    before = task.evaluate(ref)["rmse"]
    data = task.batches(0, 1, 128, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy machine torch's thread pool on these tiny ops costs 10-50x (measured)
    try:
        for _ in range(600):
            for o in opts:
                o.zero_grad()
            task.loss(ref, next(data)).backward()
            for o in opts:
                o.step()
    finally:
        torch.set_num_threads(threads)
    after = task.evaluate(ref)["rmse"]
    assert before > 1.0 and after < 0.7, (before, after)
