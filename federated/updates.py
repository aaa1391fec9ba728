"""Turning a client's answer into something the round may use, or a clear rejection.

Every check here runs on remote input before it reaches a strategy: tensor count,
shapes and dtypes against the global model, decodability of compressed tensors,
finiteness, ``num_examples``. A failure raises an :class:`InvalidUpdateError`
subclass naming the client, the group and the tensor index; the servicer turns it
into INVALID_ARGUMENT and the update is not aggregated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from federated.compress import EncodedTensor, decode
from federated.errors import DtypeError, InvalidUpdateError, NonFiniteError, ShapeMismatchError
from federated.protocol import WEIGHTS, Answer
from federated.strategy import ClientUpdate, Strategy, StrategyError, Weights, validate_update

__all__ = ["Received", "Evaluation", "decode_group", "accept_fit", "accept_evaluation"]


@dataclass(frozen=True)
class Received:
    """A valid fit answer: the update as the strategy wants it (full weights), and the
    raw float64 delta when the client sent one (DP path: clipped deltas are summed)."""

    update: ClientUpdate
    delta: list[np.ndarray] | None
    seconds: float = 0.0


@dataclass(frozen=True)
class Evaluation:
    client_id: str
    loss: float
    num_examples: int
    metrics: dict[str, float]


def _who(a: Answer) -> str:
    return f"client {a.client_id!r}"


def _check_metrics(a: Answer) -> dict[str, float]:
    for k, v in a.metrics.items():
        if not math.isfinite(v):
            raise NonFiniteError(f"{_who(a)}: metric {k!r} is {v}")
    return dict(a.metrics)


def decode_group(tensors: Sequence[EncodedTensor], like: Weights, who: str, group: str) -> list[np.ndarray]:
    """Decode ``tensors`` and check them against ``like`` (count, shape, dtype, finite)."""
    if len(tensors) != len(like):
        raise ShapeMismatchError(f"{who}: {group} has {len(tensors)} tensors, the global model has {len(like)}")
    out = []
    for i, (t, g) in enumerate(zip(tensors, like)):
        what = f"{who}: {group}[{i}]"
        if tuple(t.shape) != tuple(g.shape):
            raise ShapeMismatchError(f"{what} has shape {tuple(t.shape)}, expected {tuple(g.shape)}")
        if t.dtype != g.dtype.name:
            raise DtypeError(f"{what} has dtype {t.dtype}, expected {g.dtype.name}")
        arr = decode(t, what)
        if not np.isfinite(arr).all():
            raise NonFiniteError(f"{what} holds NaN or Inf")
        out.append(arr)
    return out


def accept_fit(answer: Answer, rnd: int, global_weights: Weights, strategy: Strategy, keep_delta: bool = False,
               strategy_check: bool = True) -> Received:
    """Validate a FIT answer for the weights of round ``rnd``. Deltas (``is_delta``) are
    added to the global weights; ``keep_delta`` also keeps them in float64.

    ``strategy_check``: also run ``strategy.validate_update`` (strategies are not
    thread-safe: pass False when the caller's thread may race an aggregation, and
    check in the round loop instead)."""
    who = _who(answer)
    n = answer.num_examples
    if n < 1:
        raise InvalidUpdateError(f"{who}: num_examples must be >= 1, got {n}")
    metrics = _check_metrics(answer)
    arrays = decode_group(answer.group(WEIGHTS), global_weights, who, WEIGHTS)
    delta = None
    if answer.is_delta:
        delta = [np.asarray(d, dtype=np.float64) for d in arrays]
        weights = [(g.astype(np.float64) + d).astype(g.dtype) for g, d in zip(global_weights, delta)]
        if not all(np.isfinite(w).all() for w in weights):
            raise NonFiniteError(f"{who}: weights overflow when the delta is applied")
    else:
        weights = [np.asarray(w) for w in arrays]
        if keep_delta:
            delta = [w.astype(np.float64) - g.astype(np.float64) for w, g in zip(weights, global_weights)]
    extras = {}
    for name in strategy.required_extras:
        group = answer.group(name)
        if not group:
            raise InvalidUpdateError(f"{who}: strategy {strategy.name!r} needs extras {name!r}, the answer has none")
        extras[name] = decode_group(group, global_weights, who, name)
    update = ClientUpdate(answer.client_id, weights, int(n), metrics, base_round=rnd, extras=extras)
    try:
        if strategy_check:
            strategy.validate_update(rnd, global_weights, update)
        else:
            validate_update(global_weights, update, strategy.required_extras)
    except StrategyError as e:
        raise InvalidUpdateError(str(e)) from None
    return Received(update, delta, float(metrics.get("fit_seconds", 0.0)))


def accept_evaluation(answer: Answer) -> Evaluation:
    """Check an evaluate answer (non-negative example count, finite loss and metrics);
    InvalidUpdateError otherwise."""
    who = _who(answer)
    if answer.num_examples < 0:
        raise InvalidUpdateError(f"{who}: num_examples must be >= 0, got {answer.num_examples}")
    if not math.isfinite(answer.loss):
        raise NonFiniteError(f"{who}: loss is {answer.loss}")
    return Evaluation(answer.client_id, float(answer.loss), int(answer.num_examples), _check_metrics(answer))
