"""``ctr``: synthetic click-through data whose best achievable AUC is known.

Each example has 26 categorical fields and 13 dense features. Field f's value
is a Zipf-like rank r in [0, vocab) (log-uniform: P(r) ~ 1/(r+1), so a few ids
are frequent and most are rare), encoded as the global id ``f << 40 | r``.
Labels come from a hidden ground-truth model:

    logit = bias + sum_f sigma_f * h(f, r_f) + beta . dense,   click ~ Bernoulli(sigmoid(logit))

with h a hash of (field, rank) uniform in [-sqrt 3, sqrt 3]. The best any model
can do is to predict the true probability, so the AUC of the true
probabilities on the test set (``info["best_auc"]``) is the ceiling.

Data is a pure function of (seed, step): worker i's batch at step t is slice i
of the step's global batch, so sync mode can be checked against one process.

Model: one PSEmbedding table for all fields (dim 16; rows stored in ``row_dtype``)
+ an MLP on the concatenated embeddings and dense features.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.binding import PSEmbedding
from worker.tasks import Task

__all__ = ["make_task", "CTRData", "CTRBatch", "CTRModel", "auc"]

FIELDS = 26
DENSE = 13
ROW_BLOCK = 64  # rows drawn from one generator (CTRData.rows)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer (uint64 -> uint64)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


class CTRBatch(NamedTuple):
    ids: torch.Tensor  # int64 (B, 26) global ids
    dense: torch.Tensor  # float32 (B, 13)
    label: torch.Tensor  # float32 (B,)
    prob: torch.Tensor  # float32 (B,) the true click probability


class CTRData:
    def __init__(self, vocab: int = 1_000_000, seed: int = 0, bias: float = -1.2) -> None:
        if not 10 <= vocab < 1 << 40:
            raise ValueError("vocab must be in [10, 2^40)")
        self.vocab, self.seed, self.bias = vocab, seed, bias
        rng = np.random.default_rng([seed, 7])
        self.sigma = (0.8 * 0.9 ** np.arange(FIELDS)).astype(np.float64)
        self.beta = rng.normal(0, 0.25, DENSE)
        self._salt = np.uint64(int(rng.integers(0, 2**63)))

    def _weight(self, field: np.ndarray, rank: np.ndarray) -> np.ndarray:
        h = _mix((field.astype(np.uint64) << np.uint64(40)) ^ rank.astype(np.uint64) ^ self._salt)
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return (2 * u - 1) * np.sqrt(3.0)

    def sample(self, rng: np.random.Generator, n: int) -> CTRBatch:
        return self._build(*self._draw(rng, n))

    @staticmethod
    def _draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The random numbers of ``n`` rows: id quantiles (n, 26), dense features (n, 13), label draws (n,)."""
        return rng.random((n, FIELDS)), rng.normal(0, 1, (n, DENSE)), rng.random(n)

    def _build(self, u: np.ndarray, dense: np.ndarray, coin: np.ndarray) -> CTRBatch:
        n = len(u)
        rank = np.minimum(np.floor(np.exp(u * np.log(self.vocab + 1.0))) - 1, self.vocab - 1).astype(np.int64)
        field = np.broadcast_to(np.arange(FIELDS), (n, FIELDS))
        logit = self.bias + (self.sigma * self._weight(field, rank)).sum(1) + dense @ self.beta
        prob = 1 / (1 + np.exp(-logit))
        label = (coin < prob).astype(np.float32)
        ids = (field.astype(np.int64) << 40) | rank
        return CTRBatch(
            torch.from_numpy(ids), torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(label),
            torch.from_numpy(prob.astype(np.float32)),
        )

    def global_batch(self, step: int, n: int) -> CTRBatch:
        return self.rows(step, 0, n)

    def rows(self, step: int, lo: int, hi: int) -> CTRBatch:
        """Rows ``lo:hi`` of step ``step``'s global batch (of any size >= ``hi``), drawing only
        those: each block of ``ROW_BLOCK`` rows has its own generator (seed, step, block). A worker
        draws its own part of the global batch, not all of it (W workers used to draw W x the rows)."""
        b0, b1 = lo // ROW_BLOCK, -(-hi // ROW_BLOCK)
        blocks = [self._draw(np.random.default_rng([self.seed, 1, step, b]), ROW_BLOCK) for b in range(b0, b1)]
        a = lo - b0 * ROW_BLOCK
        return self._build(*(np.concatenate([blk[i] for blk in blocks])[a : a + hi - lo] for i in range(3)))

    def test_set(self, n: int) -> CTRBatch:
        return self.sample(np.random.default_rng([self.seed, 2]), n)


class CTRModel(nn.Module):
    def __init__(
        self, dim: int = 16, hidden: tuple[int, ...] = (128, 64), table: str = "ctr/emb", emb_lr: float = 0.05,
        row_dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.emb = PSEmbedding(table, dim, optimizer="adagrad", lr=emb_lr, initial_accumulator=0.1, row_dtype=row_dtype)
        layers: list[nn.Module] = []
        width = FIELDS * dim + DENSE
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids).flatten(1)
        return self.mlp(torch.cat([e, dense], dim=1)).squeeze(1)


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic, ties averaged)."""
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s), np.float64)
    i = 0
    while i < len(s):  # average ranks of ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2 + 1
        i = j + 1
    r = np.empty_like(ranks)
    r[order] = ranks
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return 0.5
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def make_task(
    seed: int = 0, vocab: int = 1_000_000, test_size: int = 20_000, dim: int = 16, lr: float = 1e-3,
    emb_lr: float = 0.05, hidden: tuple[int, ...] = (128, 64), row_dtype: str = "float32", **_: object,
) -> Task:
    """Options (``--task-opt KEY=VALUE``): seed, vocab, test_size, dim, lr (dense Adam), emb_lr (row
    Adagrad), hidden, row_dtype (how the shards store the embedding rows: float32, float16, bfloat16)."""
    data = CTRData(vocab, seed)
    torch.manual_seed(seed)
    model = CTRModel(dim, hidden, emb_lr=emb_lr, row_dtype=row_dtype)
    test = data.test_set(test_size)
    best = auc(test.prob.numpy(), test.label.numpy())

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[CTRBatch]:
        step = start_step
        lo, hi = worker_index * batch_size, (worker_index + 1) * batch_size
        while True:
            yield data.rows(step, lo, hi)  # (this worker's part of the global batch of num_workers x batch_size)
            step += 1

    def loss(m: nn.Module, b: CTRBatch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(m(b.ids, b.dense), b.label)

    def evaluate(m: nn.Module) -> dict[str, float]:
        dev = next(m.parameters()).device
        scores = []
        m.eval()
        with torch.no_grad():
            for i in range(0, test_size, 8192):
                scores.append(m(test.ids[i : i + 8192].to(dev), test.dense[i : i + 8192].to(dev)).cpu())
        m.train()
        s = torch.cat(scores)
        return {
            "auc": auc(s.numpy(), test.label.numpy()),
            "test_loss": float(F.binary_cross_entropy_with_logits(s, test.label)),
        }

    return Task(
        "ctr", model, batches, loss, evaluate, metric="auc", higher_is_better=True,
        sparse_ids=lambda b: {"emb": b.ids},
        dense_optimizer=OptimizerSpec("adam", {"lr": lr}),
        info={"best_auc": best, "vocab": vocab, "fields": FIELDS},
    )
