"""Built-in federated tasks: data, model, initial weights, client factory, central evaluation.

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10
  classes; no download), an MLP 64-64-10, a fixed 20 % central test split.
* ``digits_logreg``: the same data with multinomial logistic regression (64-10).

A client of partition ``i/N`` holds the i-th of N parts of the training split
(``federated.partition``) and evaluates on that same local data; the server
evaluates centrally on the test split.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from federated.errors import ConfigError
from federated.partition import PartitionSpec, partition
from federated.strategy import Weights
from federated.torch_client import TensorBatches, TorchClient, evaluate_model

__all__ = ["FedTask", "TASKS", "get_task", "load_digits"]


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(x float32 (1797, 64) scaled to [0, 1], y int64 (1797,)) from scikit-learn's bundled CSV.

    Reads the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``)
    without importing scikit-learn (a second of start-up); falls back to
    ``sklearn.datasets.load_digits`` when the file is not where expected."""
    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    if path and os.path.exists(path):
        data = np.loadtxt(path, delimiter=",", dtype=np.float32)
        x, y = data[:, :-1], data[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits as sk_load

        d = sk_load()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
    return np.ascontiguousarray(x / 16.0, dtype=np.float32), y


def _mlp(hidden: int) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    return make


def _logreg() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 10))


@dataclass
class FedTask:
    """A task: ``model_fn`` builds the model; ``client_config`` holds the local
    training defaults the server sends (``epochs``, ``lr``, ``batch_size``)."""

    name: str
    model_fn: Callable[[], torch.nn.Module]
    client_config: dict[str, float | int] = field(default_factory=dict)
    test_fraction: float = 0.2
    split_seed: int = 0
    _local: threading.local = field(default_factory=threading.local, repr=False)

    # ------------------------------------------------------------------ data
    @functools.cached_property
    def split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, y_train, x_test, y_test), fixed by ``split_seed``."""
        x, y = load_digits()
        perm = np.random.default_rng(self.split_seed).permutation(len(y))
        n_test = int(round(self.test_fraction * len(y)))
        test, train = perm[:n_test], perm[n_test:]
        return x[train], y[train], x[test], y[test]

    def partitions(self, num_parts: int, spec: PartitionSpec | str = "iid", seed: int = 0) -> list[np.ndarray]:
        """Index arrays into the training split, one per part."""
        return partition(self.split[1], num_parts, spec, seed)

    # ------------------------------------------------------------------ model
    def initial_weights(self, seed: int = 0) -> Weights:
        """The model's floating-point state as numpy arrays (state_dict order), initialised by torch under ``seed``."""
        torch.manual_seed(seed)
        m = self.model_fn()
        return [v.detach().numpy().copy() for v in m.state_dict().values() if torch.is_floating_point(v)]

    def _model(self) -> torch.nn.Module:
        """One model per thread, reused by every client that thread serves (fit and
        evaluate load the weights first), so thousands of clients cost no memory."""
        m = getattr(self._local, "model", None)
        if m is None:
            m = self._local.model = self.model_fn()
        return m

    def client(self, indices: np.ndarray, seed: int = 0, shared_model: bool = True) -> TorchClient:
        """A TorchClient over the training samples ``indices``. ``shared_model``: it trains the calling
        thread's model (one per thread, reused by every client made on that thread: for clients made
        and used on one thread, as the simulation's runtime does); False for a client kept and run
        from other threads (``keep_clients``), which needs a model of its own."""
        x_tr, y_tr, _, _ = self.split
        if len(indices) == 0:
            raise ConfigError(f"task {self.name}: a client needs at least one example")
        x, y = torch.from_numpy(x_tr[indices]), torch.from_numpy(y_tr[indices])
        bs = int(self.client_config.get("batch_size", 16))
        loader = TensorBatches(x, y, batch_size=bs, shuffle=True, seed=seed)
        model = self._model() if shared_model else self.model_fn()
        return TorchClient(model, loader, lr=float(self.client_config.get("lr", 0.1)),
                           epochs=int(self.client_config.get("epochs", 1)),
                           test_loader=TensorBatches(x, y, batch_size=256, shuffle=False))

    def evaluator(self) -> Callable[[Weights], tuple[float, dict[str, float]]]:
        """Central evaluation on the test split: weights -> (loss, {"accuracy": ...})."""
        _, _, x_te, y_te = self.split
        model = self.model_fn()
        probe = TorchClient(model, [], test_loader=TensorBatches(torch.from_numpy(x_te), torch.from_numpy(y_te), 4096, False))

        def evaluate(weights: Weights) -> tuple[float, dict[str, float]]:
            probe.set_weights(weights)
            loss, _, metrics = evaluate_model(probe.model, probe.test_loader, probe.loss_fn, probe.metric_fn, probe.device)
            return loss, metrics

        return evaluate

    def describe(self) -> dict[str, Any]:
        """Sizes for reports: ``task``, ``train``, ``test``, ``classes``, ``params``."""
        x_tr, _, x_te, _ = self.split
        return {"task": self.name, "train": len(x_tr), "test": len(x_te), "classes": 10,
                "params": int(sum(w.size for w in self.initial_weights()))}


TASKS: dict[str, Callable[[], FedTask]] = {
    "digits": lambda: FedTask("digits", _mlp(64), {"epochs": 5, "lr": 0.3, "batch_size": 8}),
    "digits_logreg": lambda: FedTask("digits_logreg", _logreg, {"epochs": 5, "lr": 0.3, "batch_size": 8}),
}


def get_task(name: str) -> FedTask:
    """A fresh task by name (ConfigError for an unknown one)."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built in: {', '.join(sorted(TASKS))}")
    return TASKS[name]()
