"""Aggregation strategies for federated mode (pure numpy; no grpc, no protobuf).

A strategy turns the global weights of round ``rnd`` and the clients' updates into
the global weights of round ``rnd + 1``. Weights are a list of numpy arrays in a
fixed order (the model's parameters); every client update carries the *full*
locally trained weights, not a delta.

Contracts shared by every strategy:

* ``aggregate`` validates first (count, shapes, dtype equal to the global's,
  finite values, ``num_examples >= 1``) and raises :class:`StrategyError`
  naming the client and the array index; a rejected call changes no state.
* Arithmetic runs in float64; the result has the global weights' dtypes.
* ``aggregate_mean_delta`` is the entry point under secure aggregation, where the
  server learns only the example-weighted mean of ``w_k - w``. Strategies that
  need more (robust aggregators, SCAFFOLD's control variates, FedBuff's
  per-update staleness) raise :class:`StrategyError`; they say so up front with
  ``supports_secure_aggregation = False``.
* ``state_dict`` holds numpy arrays and Python scalars only, in a *flat* dict
  (keys like ``"m.0"``), so it checkpoints with ``np.savez`` or msgpack.
* Strategies are not thread-safe: the server calls them from one thread.

Round numbering: ``aggregate(rnd, global_weights, ...)`` receives the weights
that round ``rnd``'s clients started from; a client's ``base_round`` names the
round of the weights it started from (FedBuff's staleness is ``rnd - base_round``).
"""
from __future__ import annotations

import importlib
import math
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: the server needs none of it
    import torch

__all__ = [
    "Weights",
    "ClientUpdate",
    "StrategyError",
    "Strategy",
    "STRATEGIES",
    "register_strategy",
    "make_strategy",
    "validate_update",
    "weighted_mean_delta",
]

Weights = list[np.ndarray]
"""Model parameters in a fixed order (float32 or float64 arrays)."""


@dataclass(frozen=True)
class ClientUpdate:
    """One client's answer to a fit request.

    ``weights``: the locally trained weights (full model, same shapes and dtypes as
    the global). ``base_round``: the round of the global weights the client started
    from (-1 when unknown; FedBuff requires it). ``extras``: strategy-specific
    arrays, e.g. SCAFFOLD's ``{"delta_c": [...]}``.
    """

    client_id: str
    weights: Weights
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    base_round: int = -1
    extras: dict[str, Weights] = field(default_factory=dict)


class StrategyError(ValueError):
    """Bad strategy parameters, or an update that does not fit the global weights
    (count, shape, dtype, non-finite values, missing extras). The message names
    the client and the array index."""


# ---------------------------------------------------------------------------
# validation and small helpers


def _check_arrays(who: str, what: str, arrays: object, reference: Weights) -> None:
    """Raise StrategyError unless ``arrays`` matches ``reference`` in count, shape and
    dtype and is finite. ``who``/``what`` name the sender and the field in messages."""
    if not isinstance(arrays, (list, tuple)):
        raise StrategyError(f"{who}: {what} must be a list of numpy arrays, got {type(arrays).__name__}")
    if len(arrays) != len(reference):
        raise StrategyError(f"{who}: {what} has {len(arrays)} arrays, the global model has {len(reference)}")
    for i, (a, ref) in enumerate(zip(arrays, reference)):
        if not isinstance(a, np.ndarray):
            raise StrategyError(f"{who}: {what}[{i}] is a {type(a).__name__}, not a numpy array")
        if a.shape != ref.shape:
            raise StrategyError(f"{who}: {what}[{i}] has shape {a.shape}, expected {ref.shape}")
        if a.dtype != ref.dtype:
            raise StrategyError(f"{who}: {what}[{i}] has dtype {a.dtype}, expected {ref.dtype}")
        if a.dtype.kind != "f":
            raise StrategyError(f"{who}: {what}[{i}] has non-float dtype {a.dtype}")
        if not np.isfinite(a).all():
            raise StrategyError(f"{who}: {what}[{i}] holds non-finite values (NaN or Inf)")


def _check_global(global_weights: object) -> None:
    if not isinstance(global_weights, (list, tuple)) or not global_weights:
        raise StrategyError("global weights must be a non-empty list of numpy arrays")
    for i, g in enumerate(global_weights):
        if not isinstance(g, np.ndarray) or g.dtype.kind != "f":
            raise StrategyError(f"global weights[{i}] must be a float numpy array")


def validate_update(global_weights: Weights, update: ClientUpdate, extras: Sequence[str] = ()) -> None:
    """Raise :class:`StrategyError` unless ``update`` fits ``global_weights``: same number
    of arrays, same shapes and dtypes, finite values, an int ``num_examples >= 1``,
    and each named extra present and shaped like the global weights."""
    who = f"client {update.client_id!r}"
    n = update.num_examples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise StrategyError(f"{who}: num_examples must be an int >= 1, got {n!r}")
    _check_arrays(who, "weights", update.weights, global_weights)
    for name in extras:
        if name not in update.extras:
            raise StrategyError(f"{who}: missing extras[{name!r}]")
        _check_arrays(who, f"extras[{name!r}]", update.extras[name], global_weights)


def _validate_all(global_weights: Weights, updates: Sequence[ClientUpdate], extras: Sequence[str] = ()) -> None:
    _check_global(global_weights)
    if not updates:
        raise StrategyError("no client updates to aggregate")
    seen: set[str] = set()
    for u in updates:
        if not isinstance(u, ClientUpdate):
            raise StrategyError(f"expected ClientUpdate, got {type(u).__name__}")
        if u.client_id in seen:
            raise StrategyError(f"client {u.client_id!r} sent two updates in one aggregation")
        seen.add(u.client_id)
        validate_update(global_weights, u, extras)


def _f64(ws: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(w, dtype=np.float64) for w in ws]


def _cast_like(ws: Sequence[np.ndarray], like: Weights) -> Weights:
    return [np.asarray(w, dtype=g.dtype).reshape(g.shape) for w, g in zip(ws, like)]


def weighted_mean_delta(global_weights: Weights, updates: Sequence[ClientUpdate]) -> list[np.ndarray]:
    """Example-weighted mean of ``w_k - w`` in float64 (what secure aggregation yields)."""
    total = float(sum(int(u.num_examples) for u in updates))
    g64 = _f64(global_weights)
    out = [np.zeros_like(g) for g in g64]
    for u in updates:
        n = float(u.num_examples)
        for acc, w, g in zip(out, u.weights, g64):
            acc += n * (np.asarray(w, dtype=np.float64) - g)
    return [acc / total for acc in out]


def _weighted_mean(updates: Sequence[ClientUpdate]) -> list[np.ndarray]:
    """sum_k n_k w_k / sum_k n_k in float64, accumulated in client order (the hand formula)."""
    total = float(sum(int(u.num_examples) for u in updates))
    acc = [float(updates[0].num_examples) * np.asarray(w, dtype=np.float64) for w in updates[0].weights]
    for u in updates[1:]:
        n = float(u.num_examples)
        for a, w in zip(acc, u.weights):
            a += n * np.asarray(w, dtype=np.float64)
    return [a / total for a in acc]


def _num(name: str, value: object, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite float parameter within [lo, hi] (open ends when asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise StrategyError(f"parameter {name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise StrategyError(f"parameter {name} must be finite, got {v}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise StrategyError(f"parameter {name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise StrategyError(f"parameter {name} must be {'<' if hi_open else '<='} {hi}, got {v}")
    return v


def _int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, float)) or int(value) != value:
        raise StrategyError(f"parameter {name} must be an integer, got {value!r}")
    if int(value) < lo:
        raise StrategyError(f"parameter {name} must be >= {lo}, got {value}")
    return int(value)


def _pack(prefix: str, ws: Sequence[np.ndarray] | None, out: dict[str, Any]) -> None:
    if ws is None:
        return
    out[f"{prefix}.n"] = len(ws)
    for i, w in enumerate(ws):
        out[f"{prefix}.{i}"] = np.array(w, copy=True)


def _unpack(prefix: str, state: dict[str, Any]) -> list[np.ndarray] | None:
    if f"{prefix}.n" not in state:
        return None
    n = int(state[f"{prefix}.n"])
    try:
        return [np.array(state[f"{prefix}.{i}"], dtype=np.float64, copy=True) for i in range(n)]
    except KeyError as e:
        raise StrategyError(f"state dict is missing {e.args[0]!r}") from None


# ---------------------------------------------------------------------------
# the base class and the registry


class Strategy(ABC):
    """How the server turns client updates into new global weights.

    Subclasses that need only the example-weighted mean delta implement
    :meth:`aggregate_mean_delta`; the default :meth:`aggregate` validates and
    reduces the updates to that mean. Others override :meth:`aggregate`.
    """

    name: ClassVar[str] = ""
    needs_individual_updates: ClassVar[bool] = False
    """True for robust aggregators: they cannot run under secure aggregation."""
    supports_secure_aggregation: ClassVar[bool] = True
    """False when :meth:`aggregate_mean_delta` cannot be used (robust, SCAFFOLD, FedBuff)."""
    asynchronous: ClassVar[bool] = False
    """FedBuff: the server aggregates every ``buffer_size`` arrivals instead of per round."""
    required_extras: ClassVar[tuple[str, ...]] = ()
    """Names every update's ``extras`` must hold (SCAFFOLD: ``("delta_c",)``)."""

    def params(self) -> dict[str, float | int | str]:
        """The parameters this strategy was built with (for logs and results.json)."""
        return {}

    def setup(self, global_weights: Weights) -> None:
        """Called once by the server with the initial global weights, before round 0's
        :meth:`client_payload`. Strategies with server state shaped like the model
        (SCAFFOLD's ``c``) allocate it here; the default does nothing."""

    def client_config(self, rnd: int) -> dict[str, float | int | str]:
        """Scalars sent to the clients of round ``rnd`` (e.g. ``{"proximal_mu": 0.01}``)."""
        return {}

    def client_payload(self, rnd: int) -> dict[str, Weights]:
        """Extra arrays sent with the global weights (SCAFFOLD: ``{"c": server control variate}``)."""
        return {}

    def validate_update(self, rnd: int, global_weights: Weights, update: ClientUpdate) -> None:
        """Check one update as it arrives (so a bad one never enters a buffer or aggregate)."""
        _check_global(global_weights)
        validate_update(global_weights, update, self.required_extras)

    def aggregate(self, rnd: int, global_weights: Weights, updates: list[ClientUpdate]) -> Weights:
        """New global weights from the weights of round ``rnd`` and the clients' updates."""
        _validate_all(global_weights, updates, self.required_extras)
        return self._apply_mean_delta(rnd, global_weights, weighted_mean_delta(global_weights, updates))

    def aggregate_mean_delta(self, rnd: int, global_weights: Weights, mean_delta: Weights) -> Weights:
        """New global weights from the example-weighted mean of ``w_k - w`` alone (the
        secure-aggregation path). ``mean_delta`` may be float64 or the global dtype."""
        if not self.supports_secure_aggregation:
            raise StrategyError(f"strategy {self.name!r} needs individual client updates; "
                                "it cannot run on the mean delta alone (secure aggregation)")
        _check_global(global_weights)
        who = "secure aggregate"
        if not isinstance(mean_delta, (list, tuple)) or len(mean_delta) != len(global_weights):
            raise StrategyError(f"{who}: mean_delta must be a list of {len(global_weights)} arrays")
        for i, (d, g) in enumerate(zip(mean_delta, global_weights)):
            if not isinstance(d, np.ndarray) or d.shape != g.shape or d.dtype.kind != "f":
                raise StrategyError(f"{who}: mean_delta[{i}] must be a float array of shape {g.shape}")
            if not np.isfinite(d).all():
                raise StrategyError(f"{who}: mean_delta[{i}] holds non-finite values (NaN or Inf)")
        return self._apply_mean_delta(rnd, global_weights, _f64(mean_delta))

    def _apply_mean_delta(self, rnd: int, global_weights: Weights, mean_delta: list[np.ndarray]) -> Weights:
        """The update rule given a validated float64 mean delta. Must not mutate state
        before it can no longer fail."""
        raise StrategyError(f"strategy {self.name!r} does not implement aggregation from the mean delta")

    def state_dict(self) -> dict[str, Any]:
        """Server-side state as a flat dict of numpy arrays and scalars."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available to :func:`make_strategy` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise StrategyError(f"{cls!r} is not a Strategy subclass")
    if not cls.name:
        raise StrategyError(f"{cls.__name__} has no name")
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise StrategyError(f"a strategy named {cls.name!r} is already registered")
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(name: str, **params: float | int | str) -> Strategy:
    """Build a strategy by registered name (``"fedavg"``) or by ``"package.module:ClassName"``.

    Raises StrategyError for an unknown name, a class that is not a Strategy, an
    unknown parameter or a parameter out of range."""
    if ":" in name:
        mod_name, _, cls_name = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise StrategyError(f"cannot load strategy {name!r}: {e}") from None
        if not (isinstance(obj, type) and issubclass(obj, Strategy)):
            raise StrategyError(f"{name!r} is not a Strategy subclass")
        cls: type[Strategy] = obj
    else:
        key = name.lower()
        if key not in STRATEGIES:
            raise StrategyError(f"unknown strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
        cls = STRATEGIES[key]
    try:
        return cls(**params)
    except TypeError as e:  # unknown keyword
        raise StrategyError(f"strategy {name!r}: {e}") from None


# ---------------------------------------------------------------------------
# FedAvg family


@register_strategy
class FedAvg(Strategy):
    """FedAvg (McMahan et al. 2017): ``w' = sum_k n_k w_k / sum_k n_k``.

    ``aggregate`` evaluates that formula directly (accumulated in client order in
    float64), so it equals the hand-computed weighted mean bit for bit;
    ``aggregate_mean_delta`` computes ``w + mean_delta``."""

    name = "fedavg"

    def aggregate(self, rnd: int, global_weights: Weights, updates: list[ClientUpdate]) -> Weights:
        _validate_all(global_weights, updates, self.required_extras)
        return _cast_like(_weighted_mean(updates), global_weights)

    def _apply_mean_delta(self, rnd: int, global_weights: Weights, mean_delta: list[np.ndarray]) -> Weights:
        return _cast_like([g + d for g, d in zip(_f64(global_weights), mean_delta)], global_weights)
