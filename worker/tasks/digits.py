"""``digits``: scikit-learn's bundled 8x8 handwritten digits (no download), an MLP, accuracy."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.tasks import Task

__all__ = ["make_task", "load_split"]


def load_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 1437/360 split by a fixed permutation; pixels scaled to [0, 1].
    The data is read by ``federated.tasks.load_digits`` (scikit-learn's bundled file, without importing
    scikit-learn: 1.3 CPU-s less in every worker process)."""
    from federated.tasks import load_digits

    x, y = load_digits()
    perm = np.random.default_rng(seed).permutation(len(x))
    n_test = 360
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


class MLP(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_task(seed: int = 0, hidden: int = 64, lr: float = 0.005, **_: object) -> Task:
    x_tr, y_tr, x_te, y_te = load_split()
    n = len(x_tr)
    torch.manual_seed(seed)
    model = MLP(hidden)

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = num_workers * batch_size
        perms: dict[int, np.ndarray] = {}
        step = start_step
        while True:
            # step t's global batch: positions [t*g, (t+1)*g) of an endless sequence of epoch permutations
            pos = np.arange(step * g + worker_index * batch_size, step * g + (worker_index + 1) * batch_size)
            epochs = pos // n
            for e in np.unique(epochs):
                if e not in perms:
                    perms[int(e)] = np.random.default_rng([seed, int(e)]).permutation(n)
            idx = np.array([perms[int(e)][p % n] for e, p in zip(epochs, pos)])
            for e in [e for e in perms if e < epochs.min()]:
                del perms[e]
            yield torch.from_numpy(x_tr[idx]), torch.from_numpy(y_tr[idx])
            step += 1

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(m(x), y)

    xt, yt = torch.from_numpy(x_te), torch.from_numpy(y_te)

    def evaluate(m: nn.Module) -> dict[str, float]:
        dev = next(m.parameters()).device
        with torch.no_grad():
            logits = m(xt.to(dev)).cpu()
        return {
            "accuracy": float((logits.argmax(1) == yt).float().mean()),
            "test_loss": float(F.cross_entropy(logits, yt)),
        }

    return Task(
        "digits", model, batches, loss, evaluate, metric="accuracy", higher_is_better=True,
        dense_optimizer=OptimizerSpec("adam", {"lr": lr}),
    )
