"""TorchClient: a :class:`~federated.runtime.Client` for a torch model, so a user writes
a few lines. FedProx's proximal term and SCAFFOLD's control variates are built in
(switched on by what the server sends: ``proximal_mu`` in the config, ``c`` in the
payload); the client's own control variate ``c_i`` stays on the client.

The weights are the model's floating-point ``state_dict`` entries in order
(parameters and buffers such as BatchNorm statistics).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np
import torch

from federated.runtime import Client
from federated.strategy import Weights, proximal_term, scaffold_client_update

__all__ = ["TorchClient", "TensorBatches", "accuracy"]


class TensorBatches:
    """Mini-batches over in-memory tensors, reshuffled on each pass (a light DataLoader).

    ``seed`` fixes the shuffle order sequence; ``len()`` is the number of batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 32, shuffle: bool = True, seed: int = 0) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} rows, y has {len(y)}")
        self.x, self.y, self.batch_size, self.shuffle = x, y, max(1, int(batch_size)), shuffle
        self.dataset = x  # len(loader.dataset) is the number of examples, as with a DataLoader
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __iter__(self) -> Any:
        n = len(self.x)
        order = torch.randperm(n, generator=self._gen) if self.shuffle else torch.arange(n)
        for i in range(0, n, self.batch_size):
            idx = order[i : i + self.batch_size]
            yield self.x[idx], self.y[idx]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Number of correct argmax predictions (summed; the caller divides)."""
    return float((output.argmax(dim=1) == target).sum())


def _num_examples(loader: Any) -> int:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return sum(len(b[1]) for b in loader)


class TorchClient(Client):
    """Train ``model`` on ``train_loader`` for ``epochs`` local epochs with ``optimizer``.

    ``optimizer``: a callable ``(params, lr) -> torch.optim.Optimizer``, made afresh
    every round; None (default) is plain SGD ``p -= lr * grad`` done in place (what
    FedProx's and SCAFFOLD's analyses assume, and cheaper than ``torch.optim`` for the
    small models federated clients often train). ``lr``, ``epochs`` are defaults the server's
    config may override (``config["lr"]``, ``config["epochs"]``). ``test_loader``:
    data for ``evaluate`` (default: the training data). ``loss_fn(output, target)``
    defaults to cross-entropy; ``metric_fn(output, target)`` returns a *sum* over
    the batch (default: correct predictions, reported as ``accuracy``).

    FedProx: with ``config["proximal_mu"] > 0`` the loss gets ``mu/2 ||w - w_global||^2``.
    SCAFFOLD: when the payload holds ``c``, gradients are corrected by ``c - c_i`` and
    ``extras["delta_c"]`` is returned (option II update of ``c_i``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_loader: Iterable[Any],
        optimizer: Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer] | None = None,
        lr: float = 0.01,
        epochs: int = 1,
        test_loader: Iterable[Any] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        metric_fn: Callable[[torch.Tensor, torch.Tensor], float] | None = accuracy,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model.to(device)
        self.train_loader = train_loader
        self.test_loader = test_loader if test_loader is not None else train_loader
        self.optimizer = optimizer
        self.lr, self.epochs = lr, epochs
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        self.metric_fn = metric_fn
        self.device = torch.device(device)
        self.c_i: list[np.ndarray] | None = None
        state = self.model.state_dict()
        self._keys = [k for k, v in state.items() if torch.is_floating_point(v)]
        param_names = {n for n, _ in self.model.named_parameters()}
        self._is_param = [k in param_names for k in self._keys]
        named = dict(self.model.named_parameters())
        self._params = [named[k] for k, p in zip(self._keys, self._is_param) if p]

    # ------------------------------------------------------------------ weights
    def get_weights(self) -> Weights:
        """Copies of the model's floating-point state (state_dict order) as CPU numpy arrays."""
        state = self.model.state_dict()
        return [state[k].detach().cpu().numpy().copy() for k in self._keys]

    def set_weights(self, weights: Weights) -> None:
        """Load ``weights`` (as :meth:`get_weights` returns them) into the model; ValueError when
        their count or shapes do not match the model."""
        if len(weights) != len(self._keys):
            raise ValueError(f"got {len(weights)} arrays, the model has {len(self._keys)} floating-point entries")
        state = self.model.state_dict()
        with torch.no_grad():
            for k, w in zip(self._keys, weights):
                t = state[k]
                if tuple(t.shape) != tuple(w.shape):
                    raise ValueError(f"{k}: shape {tuple(w.shape)} does not fit {tuple(t.shape)}")
                t.copy_(torch.from_numpy(np.ascontiguousarray(w)))

    def client_state(self) -> dict[str, Weights]:
        return {"c_i": self.c_i} if self.c_i is not None else {}

    def load_client_state(self, state: dict[str, Weights]) -> None:
        if "c_i" in state:
            self.c_i = [np.array(a) for a in state["c_i"]]

    # ------------------------------------------------------------------ Client
    def fit(self, weights: Weights, config: dict[str, Any]) -> Any:
        self.set_weights(weights)
        lr = float(config.get("lr", self.lr))
        epochs = int(config.get("epochs", self.epochs))
        mu = float(config.get("proximal_mu", 0.0))
        c = config.get("c")  # SCAFFOLD's server control variate
        model = self.model
        model.train()
        opt = self.optimizer(self._params, lr) if self.optimizer is not None else None
        global_params = [torch.from_numpy(np.ascontiguousarray(w)).to(self.device)
                         for w, p in zip(weights, self._is_param) if p] if mu > 0 else []
        correction: list[torch.Tensor] = []
        if c is not None:
            if self.c_i is None or len(self.c_i) != len(weights):
                self.c_i = [np.zeros_like(w) for w in weights]
            correction = [torch.from_numpy(np.asarray(c_srv, dtype=w.dtype) - np.asarray(c_own, dtype=w.dtype)).to(self.device)
                          for c_srv, c_own, w, p in zip(c, self.c_i, weights, self._is_param) if p]
        steps, loss_sum, metric_sum, seen = 0, 0.0, 0.0, 0
        for _ in range(epochs):
            for x, y in self.train_loader:
                x, y = x.to(self.device), y.to(self.device)
                for p in self._params:
                    p.grad = None
                out = model(x)
                loss = self.loss_fn(out, y)
                total = loss + proximal_term(self._params, global_params, mu) if mu > 0 else loss
                total.backward()
                if correction:
                    with torch.no_grad():
                        for p, corr in zip(self._params, correction):
                            if p.grad is not None:
                                p.grad.add_(corr)
                if opt is not None:
                    opt.step()
                else:
                    with torch.no_grad():
                        for p in self._params:
                            if p.grad is not None:
                                p.add_(p.grad, alpha=-lr)
                steps += 1
                loss_sum += float(loss.detach()) * len(y)
                if self.metric_fn is not None:
                    metric_sum += self.metric_fn(out.detach(), y)
                seen += len(y)
        new = self.get_weights()
        metrics = {"loss": loss_sum / max(1, seen)}
        if self.metric_fn is not None:
            metrics["accuracy"] = metric_sum / max(1, seen)
        n = _num_examples(self.train_loader)
        if c is None:
            return new, n, metrics
        assert self.c_i is not None
        new_c, delta_c = scaffold_client_update(self.c_i, c, weights, new, max(1, steps), lr)
        # buffers get no gradient and no control variate
        new_c = [nc if p else np.zeros_like(nc) for nc, p in zip(new_c, self._is_param)]
        delta_c = [np.asarray(d, dtype=w.dtype) if p else np.zeros_like(w) for d, w, p in zip(delta_c, weights, self._is_param)]
        self.c_i = new_c
        return new, n, metrics, {"delta_c": delta_c}

    def evaluate(self, weights: Weights, config: dict[str, Any]) -> tuple[float, int, dict[str, float]]:
        self.set_weights(weights)
        return evaluate_model(self.model, self.test_loader, self.loss_fn, self.metric_fn, self.device)


def evaluate_model(model: torch.nn.Module, loader: Iterable[Any], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   metric_fn: Callable[[torch.Tensor, torch.Tensor], float] | None, device: torch.device) -> tuple[float, int, dict[str, float]]:
    """(mean loss, examples, {"accuracy": ...}) of ``model`` over ``loader``."""
    model.eval()
    loss_sum, metric_sum, seen = 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            fn: Any = loss_fn
            loss_sum += float(fn(out, y, reduction="sum")) if _takes_reduction(fn) else float(fn(out, y)) * len(y)
            if metric_fn is not None:
                metric_sum += metric_fn(out, y)
            seen += len(y)
    metrics = {"accuracy": metric_sum / max(1, seen)} if metric_fn is not None else {}
    return loss_sum / max(1, seen), seen, metrics


def _takes_reduction(fn: Any) -> bool:
    return fn in (torch.nn.functional.cross_entropy, torch.nn.functional.mse_loss, torch.nn.functional.nll_loss)

