"""``mf``: a recommender, matrix factorisation on synthetic ratings from a hidden low-rank model.

Ratings come from a hidden model of rank ``rank``::

    r(u, i) = mu + b_u + c_i + p_u . q_i + noise,    noise ~ N(0, noise^2)

with p_u, q_i ~ N(0, rank^-1/2) per element (so p . q has variance 1), biases ~ N(0, 0.3^2) and
mu = 3.5. The best any model can do is predict the noise-free rating, so the test RMSE of the
true means (``info["best_rmse"]``, about ``noise``) is the floor.

Data is a pure function of the seed: a fixed training set of ``train_size`` (user, item, rating)
triples, uniform users and items drawn with a mild popularity skew (P(item of rank k) ~ (k + 10)^-0.7),
read as one endless stream of epochs, each a permutation seeded by (seed, epoch). Stream position
p is the same example whatever the batch size: worker i's batch at step t is positions
``[t W b + i b, t W b + (i + 1) b)``, so W workers with batch b see, over T steps, exactly the
examples one process with batch b sees over W T steps (or with batch W b over T steps). The test
set is ``test_size`` fresh draws from the same model (seeded apart).

Model (:class:`MFModel`): a user and an item embedding (``PSEmbedding``: rows on the PS, Adagrad
on the shards) and a small MLP on their concatenation (dense, Adam on the shards)::

    prediction = <u, v> + MLP([u; v])

:func:`torch_reference` builds the same model for one torch process: ``nn.Embedding(sparse=True)``
tables holding the rows the shards create, the same MLP weights, ``torch.optim.Adagrad`` with the
tables' hyperparameters and ``torch.optim.Adam`` with the dense table's (``bench/recommender.py``
compares the two; ``tests/integration/test_mf_task.py`` checks that one sync worker equals it).
"""
from __future__ import annotations

import copy
from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.binding import PSEmbedding
from worker.tasks import Task

__all__ = ["make_task", "MFData", "MFBatch", "MFModel", "torch_reference"]

MU = 3.5
BIAS_STD = 0.3
ITEM_SKEW = 0.7  # P(item of popularity rank k) ~ (k + 10)^-ITEM_SKEW


class MFBatch(NamedTuple):
    users: torch.Tensor  # int64 (B,)
    items: torch.Tensor  # int64 (B,)
    rating: torch.Tensor  # float32 (B,) observed (noisy) rating
    mean: torch.Tensor  # float32 (B,) the hidden model's noise-free rating


class MFData:
    """The hidden model and its ratings: deterministic from ``seed`` (see the module docstring)."""

    def __init__(
        self, users: int = 1000, items: int = 500, rank: int = 8, train_size: int = 200_000, noise: float = 0.5,
        seed: int = 0,
    ) -> None:
        if users < 1 or items < 1 or rank < 1 or train_size < 1 or noise < 0:
            raise ValueError(
                f"mf: users, items, rank and train_size must be >= 1 and noise >= 0, got users={users} items={items} "
                f"rank={rank} train_size={train_size} noise={noise}"
            )
        self.users, self.items, self.rank, self.train_size, self.noise, self.seed = users, items, rank, train_size, noise, seed
        rng = np.random.default_rng([seed, 11])
        scale = rank ** -0.25
        self.p = rng.normal(0, scale, (users, rank))
        self.q = rng.normal(0, scale, (items, rank))
        self.bu = rng.normal(0, BIAS_STD, users)
        self.bi = rng.normal(0, BIAS_STD, items)
        w = (np.arange(items) + 10.0) ** -ITEM_SKEW
        self._item_cdf = np.cumsum(w / w.sum())
        self._item_order = rng.permutation(items)  # popularity rank -> item id: popular ids are scattered
        self.train = self._draw(np.random.default_rng([seed, 1]), train_size)
        self._perms: dict[int, np.ndarray] = {}

    def _draw(self, rng: np.random.Generator, n: int) -> MFBatch:
        u = rng.integers(0, self.users, n)
        rank = np.minimum(np.searchsorted(self._item_cdf, rng.random(n)), self.items - 1)
        i = self._item_order[rank]
        mean = MU + self.bu[u] + self.bi[i] + np.einsum("nk,nk->n", self.p[u], self.q[i])
        rating = mean + rng.normal(0, self.noise, n)
        return MFBatch(
            torch.from_numpy(u.astype(np.int64)), torch.from_numpy(i.astype(np.int64)),
            torch.from_numpy(rating.astype(np.float32)), torch.from_numpy(mean.astype(np.float32)),
        )

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            if len(self._perms) >= 2:  # a stream moves forward: keep the current and the next epoch
                self._perms.pop(min(self._perms))
            p = self._perms[epoch] = np.random.default_rng([self.seed, 3, epoch]).permutation(self.train_size)
        return p

    def stream(self, lo: int, hi: int) -> MFBatch:
        """Training examples at stream positions ``[lo, hi)`` (epoch e: positions
        ``[e N, (e + 1) N)`` in the order of permutation e)."""
        n = self.train_size
        idx = np.concatenate([self._perm(e)[max(lo, e * n) - e * n : min(hi, (e + 1) * n) - e * n]
                              for e in range(lo // n, -(-hi // n))]) if hi > lo else np.empty(0, np.int64)
        t = torch.from_numpy(idx)
        return MFBatch(*(x[t] for x in self.train))

    def test_set(self, n: int) -> MFBatch:
        return self._draw(np.random.default_rng([self.seed, 2]), n)


class MFModel(nn.Module):
    """``forward(users, items)`` (int64 (B,)) -> predicted ratings (float32 (B,)):
    ``<u, v> + MLP([u; v])`` with ``u = user(users)``, ``v = item(items)``. ``user`` and ``item``
    are any embedding modules of width ``dim`` (``PSEmbedding`` for the PS, ``nn.Embedding`` for
    one process); ``num_users``/``num_items`` are the id ranges."""

    def __init__(self, user: nn.Module, item: nn.Module, dim: int, hidden: tuple[int, ...], num_users: int, num_items: int) -> None:
        super().__init__()
        self.user, self.item = user, item
        self.dim, self.num_users, self.num_items = dim, num_users, num_items
        layers: list[nn.Module] = []
        width = 2 * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        out = nn.Linear(width, 1)
        with torch.no_grad():
            out.bias.fill_(MU)  # start at the ratings' scale, not 0 (the MLP learns the biases)
        self.mlp = nn.Sequential(*layers, out)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u, v = self.user(users), self.item(items)
        return (u * v).sum(1) + self.mlp(torch.cat([u, v], 1)).squeeze(1)


def torch_reference(model: MFModel, dense_optimizer: OptimizerSpec) -> tuple[MFModel, list[torch.optim.Optimizer]]:
    """The same model in one torch process: (a copy of ``model`` whose ``PSEmbedding`` tables are
    ``nn.Embedding(sparse=True)`` holding exactly the rows the shards create for ids ``0..n-1``,
    ``[torch.optim.Adagrad over the two tables, torch.optim.Adam over the MLP]``) with the tables'
    and ``dense_optimizer``'s hyperparameters. One step is ``zero_grad`` on both, backward, ``step``
    on both: what a sync worker and the shards do (``tests/integration/test_mf_task.py``)."""
    from ps.initializers import init_rows, table_key

    ref = copy.deepcopy(model)
    embs: list[nn.Embedding] = []
    hp = None
    for name, n in (("user", model.num_users), ("item", model.num_items)):
        m = getattr(model, name)
        if not isinstance(m, PSEmbedding) or m.optimizer.name != "adagrad":
            raise ValueError(f"torch_reference: model.{name} must be a PSEmbedding with the adagrad optimizer")
        e = nn.Embedding(n, m.dim, sparse=True)
        with torch.no_grad():
            e.weight.copy_(torch.from_numpy(init_rows(m.init, table_key(m.table, m.seed), np.arange(n, dtype=np.int64), m.dim)))
        setattr(ref, name, e)
        embs.append(e)
        if hp is not None and hp != m.optimizer.hparams:
            raise ValueError("torch_reference: the user and item tables must share their Adagrad hyperparameters")
        hp = m.optimizer.hparams
    assert hp is not None
    adagrad = torch.optim.Adagrad(
        [e.weight for e in embs], lr=hp["lr"], lr_decay=hp["lr_decay"], weight_decay=hp["weight_decay"],
        initial_accumulator_value=hp["initial_accumulator"], eps=hp["eps"],
    )
    if dense_optimizer.name != "adam":
        raise ValueError(f"torch_reference: the dense optimizer must be adam, got {dense_optimizer.name!r}")
    h = dense_optimizer.hparams
    adam = torch.optim.Adam(
        ref.mlp.parameters(), lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
    )
    return ref, [adagrad, adam]


def make_task(
    seed: int = 0, users: int = 1000, items: int = 500, rank: int = 8, train_size: int = 200_000, test_size: int = 20_000,
    noise: float = 0.5, dim: int = 16, hidden: tuple[int, ...] | list[int] = (64,), lr: float = 3e-3, emb_lr: float = 0.1,
    initial_accumulator: float = 0.0, row_dtype: str = "float32", **_: object,
) -> Task:
    """Options (``--task-opt KEY=VALUE``): seed, users, items, rank (of the hidden model), train_size,
    test_size, noise (std of the rating noise), dim (embedding width), hidden (MLP widths, e.g.
    ``[64]``), lr (dense Adam), emb_lr and initial_accumulator (the tables' Adagrad), row_dtype (how
    the shards store the rows: float32, float16, bfloat16). Metric: test ``rmse`` (lower is better)."""
    data = MFData(users, items, rank, train_size, noise, seed)
    torch.manual_seed(seed)
    emb = dict(optimizer="adagrad", lr=emb_lr, initial_accumulator=initial_accumulator, row_dtype=row_dtype)
    model = MFModel(
        PSEmbedding("mf/user", dim, seed=seed, **emb),  # type: ignore[arg-type]
        PSEmbedding("mf/item", dim, seed=seed, **emb),  # type: ignore[arg-type]
        dim, tuple(hidden), users, items,
    )
    test = data.test_set(test_size)
    best = float(torch.sqrt(F.mse_loss(test.mean, test.rating)))

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[MFBatch]:
        step = start_step
        while True:
            lo = (step * num_workers + worker_index) * batch_size
            yield data.stream(lo, lo + batch_size)
            step += 1

    def loss(m: nn.Module, b: MFBatch) -> torch.Tensor:
        return F.mse_loss(m(b.users, b.items), b.rating)

    def evaluate(m: nn.Module) -> dict[str, float]:
        dev = next(m.parameters()).device
        m.eval()
        with torch.no_grad():
            pred = torch.cat([
                m(test.users[a : a + 8192].to(dev), test.items[a : a + 8192].to(dev)).cpu() for a in range(0, test_size, 8192)
            ])
        m.train()
        mse = float(F.mse_loss(pred, test.rating))
        return {"rmse": mse ** 0.5, "mse": mse}

    return Task(
        "mf", model, batches, loss, evaluate, metric="rmse", higher_is_better=False,
        sparse_ids=lambda b: {"user": b.users, "item": b.items},
        dense_optimizer=OptimizerSpec("adam", {"lr": lr}),
        info={"best_rmse": best, "users": users, "items": items, "rank": rank, "train_size": train_size},
    )
