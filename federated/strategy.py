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
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "proximal_term",
    "Scaffold",
    "scaffold_client_update",
    "FedAdagrad",
    "FedYogi",
    "FedAdam",
    "FedBuff",
    "Median",
    "TrimmedMean",
    "Krum",
    "MultiKrum",
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
    """A finite float parameter within [lo, hi] (open ends when asked). Numeric strings
    (from a command line) are accepted."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise StrategyError(f"parameter {name} must be a number, got {value!r}") from None
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
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise StrategyError(f"parameter {name} must be an integer, got {value!r}") from None
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


@register_strategy
class FedAvgM(Strategy):
    """FedAvg with server momentum (Hsu, Qi, Brown 2019, "Measuring the effects of
    non-identical data distribution", FedAvgM).

    With the pseudo-gradient ``Delta = w - FedAvg(w_k) = -mean_delta``:
    ``v <- beta * v + Delta``, ``w <- w - server_lr * v`` (``v`` starts at 0).
    ``momentum=0, server_lr=1`` is FedAvg."""

    name = "fedavgm"

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9) -> None:
        self.server_lr = _num("server_lr", server_lr, lo=0.0, lo_open=True)
        self.momentum = _num("momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
        self._v: list[np.ndarray] | None = None

    def params(self) -> dict[str, float | int | str]:
        return {"server_lr": self.server_lr, "momentum": self.momentum}

    def _apply_mean_delta(self, rnd: int, global_weights: Weights, mean_delta: list[np.ndarray]) -> Weights:
        pseudo_grad = [-d for d in mean_delta]
        if self._v is None:
            v = pseudo_grad
        else:
            _check_state_shapes("v", self._v, global_weights)
            v = [self.momentum * old + d for old, d in zip(self._v, pseudo_grad)]
        out = [g - self.server_lr * vi for g, vi in zip(_f64(global_weights), v)]
        self._v = v
        return _cast_like(out, global_weights)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        _pack("v", self._v, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._v = _unpack("v", state)


@register_strategy
class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020). Aggregation is FedAvg; each client adds
    ``mu/2 * ||w - w_global||^2`` to its local loss (:func:`proximal_term`), driven
    by ``client_config()["proximal_mu"]``."""

    name = "fedprox"

    def __init__(self, proximal_mu: float = 0.01) -> None:
        self.proximal_mu = _num("proximal_mu", proximal_mu, lo=0.0)

    def params(self) -> dict[str, float | int | str]:
        return {"proximal_mu": self.proximal_mu}

    def client_config(self, rnd: int) -> dict[str, float | int | str]:
        return {"proximal_mu": self.proximal_mu}


def proximal_term(params: Sequence["torch.Tensor"], global_params: Sequence["torch.Tensor | np.ndarray"],
                  mu: float) -> "torch.Tensor":
    """FedProx's proximal term ``mu/2 * sum_i ||p_i - g_i||^2`` as a scalar torch tensor.

    ``params``: the model's parameters (in the same order as the global weights);
    ``global_params``: the round's global weights (numpy or torch, treated as
    constants). Add the result to the local loss before ``backward()``; its gradient
    with respect to ``p_i`` is ``mu * (p_i - g_i)``."""
    import torch

    if len(params) != len(global_params):
        raise StrategyError(f"proximal_term: {len(params)} parameters but {len(global_params)} global arrays")
    total = torch.zeros((), dtype=params[0].dtype if params else torch.float32,
                        device=params[0].device if params else None)
    for i, (p, g) in enumerate(zip(params, global_params)):
        gt = torch.as_tensor(g, dtype=p.dtype, device=p.device).detach()
        if gt.shape != p.shape:
            raise StrategyError(f"proximal_term: parameter {i} has shape {tuple(p.shape)}, "
                                f"global weights {tuple(gt.shape)}")
        total = total + (p - gt).pow(2).sum()
    return 0.5 * float(mu) * total


def _check_state_shapes(what: str, state: Sequence[np.ndarray], global_weights: Weights) -> None:
    if len(state) != len(global_weights) or any(s.shape != g.shape for s, g in zip(state, global_weights)):
        raise StrategyError(f"strategy state {what!r} does not match the global weights' shapes "
                            "(state from another model?)")


# ---------------------------------------------------------------------------
# SCAFFOLD


@register_strategy
class Scaffold(Strategy):
    """SCAFFOLD (Karimireddy et al., ICML 2020), server side of Algorithm 1.

    The server keeps the control variate ``c`` and sends it as
    ``client_payload()["c"]``. Each sampled client returns its trained weights
    ``y_i`` and ``extras["delta_c"] = c_i^+ - c_i`` (see :func:`scaffold_client_update`).
    Then, with S the sampled clients and N = ``num_clients``:
    ``x <- x + server_lr * mean_i(y_i - x)`` and ``c <- c + |S|/N * mean_i(delta_c_i)``
    (unweighted means, as in the paper). Before :meth:`setup` (or the first
    aggregation) ``c`` is unknown and ``client_payload`` is ``{}``: clients then use
    ``c = 0``, which is its initial value."""

    name = "scaffold"
    supports_secure_aggregation = False
    required_extras = ("delta_c",)

    def __init__(self, num_clients: int, server_lr: float = 1.0) -> None:
        self.num_clients = _int("num_clients", num_clients, lo=1)
        self.server_lr = _num("server_lr", server_lr, lo=0.0, lo_open=True)
        self._c: list[np.ndarray] | None = None
        self._dtypes: list[np.dtype] | None = None

    def params(self) -> dict[str, float | int | str]:
        return {"num_clients": self.num_clients, "server_lr": self.server_lr}

    def setup(self, global_weights: Weights) -> None:
        _check_global(global_weights)
        if self._c is None:
            self._c = [np.zeros(g.shape, dtype=np.float64) for g in global_weights]
        else:
            _check_state_shapes("c", self._c, global_weights)
        self._dtypes = [g.dtype for g in global_weights]

    def client_payload(self, rnd: int) -> dict[str, Weights]:
        if self._c is None:
            return {}
        dtypes = self._dtypes or [np.dtype(np.float64)] * len(self._c)
        return {"c": [c.astype(dt) for c, dt in zip(self._c, dtypes)]}

    def aggregate(self, rnd: int, global_weights: Weights, updates: list[ClientUpdate]) -> Weights:
        _validate_all(global_weights, updates, self.required_extras)
        if len(updates) > self.num_clients:
            raise StrategyError(f"{len(updates)} updates but num_clients={self.num_clients}; "
                                "num_clients must count every client")
        c = self._c if self._c is not None else [np.zeros(g.shape, dtype=np.float64) for g in global_weights]
        _check_state_shapes("c", c, global_weights)
        s = len(updates)
        x = _f64(global_weights)
        dy = [np.zeros_like(g) for g in x]
        dc = [np.zeros_like(g) for g in x]
        for u in updates:
            for a, w, g in zip(dy, u.weights, x):
                a += np.asarray(w, dtype=np.float64) - g
            for a, d in zip(dc, u.extras["delta_c"]):
                a += np.asarray(d, dtype=np.float64)
        new_x = [g + self.server_lr * (a / s) for g, a in zip(x, dy)]
        self._c = [ci + (s / self.num_clients) * (a / s) for ci, a in zip(c, dc)]
        self._dtypes = [g.dtype for g in global_weights]
        return _cast_like(new_x, global_weights)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        _pack("c", self._c, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._c = _unpack("c", state)


def scaffold_client_update(c_i: Sequence[np.ndarray], c: Sequence[np.ndarray], x: Sequence[np.ndarray],
                           y_i: Sequence[np.ndarray], num_steps: int, lr: float
                           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """SCAFFOLD's client control-variate update, option II (Karimireddy et al. 2020, eq. (4)):
    ``c_i^+ = c_i - c + (x - y_i) / (K * lr)`` where ``x`` is the global model the client
    started from, ``y_i`` its weights after ``K = num_steps`` local SGD steps of size ``lr``.

    Returns ``(c_i^+, delta_c)`` with ``delta_c = c_i^+ - c_i`` (what the client sends as
    ``extras["delta_c"]``). Arrays keep ``c_i``'s dtypes."""
    k = _int("num_steps", num_steps, lo=1)
    eta = _num("lr", lr, lo=0.0, lo_open=True)
    if not (len(c_i) == len(c) == len(x) == len(y_i)):
        raise StrategyError("scaffold_client_update: c_i, c, x and y_i must have the same number of arrays")
    new_c: list[np.ndarray] = []
    delta: list[np.ndarray] = []
    for a, b, xx, yy in zip(c_i, c, x, y_i):
        a64 = np.asarray(a, dtype=np.float64)
        n = a64 - np.asarray(b, dtype=np.float64) + (np.asarray(xx, dtype=np.float64)
                                                     - np.asarray(yy, dtype=np.float64)) / (k * eta)
        new_c.append(n.astype(np.asarray(a).dtype))
        delta.append((n - a64).astype(np.asarray(a).dtype))
    return new_c, delta


# ---------------------------------------------------------------------------
# server-side adaptive optimizers (Reddi et al., ICLR 2021, Algorithm 2)


class _FedOpt(Strategy):
    """Adaptive federated optimization (Reddi et al. 2021, Algorithm 2), on the
    example-weighted mean delta ``Delta_t`` (the paper's unweighted mean when all
    clients hold as many examples):

    ``m_t = beta1 m_{t-1} + (1 - beta1) Delta_t``;
    ``v_t`` by the subclass's rule; ``x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)``;
    ``m_{-1} = 0``, ``v_{-1} = v_init`` (default ``tau**2``, the paper's ``v_{-1} >= tau^2``).

    ``eta_l`` (client learning rate) is optional; when given it is sent to the
    clients as ``client_config()["lr"]``."""

    def __init__(self, eta: float = 0.1, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 eta_l: float | None = None, v_init: float | None = None) -> None:
        self.eta = _num("eta", eta, lo=0.0, lo_open=True)
        self.beta1 = _num("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
        self.beta2 = _num("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
        self.tau = _num("tau", tau, lo=0.0, lo_open=True)
        self.eta_l = None if eta_l is None else _num("eta_l", eta_l, lo=0.0, lo_open=True)
        self.v_init = self.tau ** 2 if v_init is None else _num("v_init", v_init, lo=0.0)
        self._m: list[np.ndarray] | None = None
        self._v: list[np.ndarray] | None = None

    def params(self) -> dict[str, float | int | str]:
        p: dict[str, float | int | str] = {"eta": self.eta, "beta1": self.beta1, "beta2": self.beta2,
                                           "tau": self.tau, "v_init": self.v_init}
        if self.eta_l is not None:
            p["eta_l"] = self.eta_l
        return p

    def client_config(self, rnd: int) -> dict[str, float | int | str]:
        return {} if self.eta_l is None else {"lr": self.eta_l}

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _apply_mean_delta(self, rnd: int, global_weights: Weights, mean_delta: list[np.ndarray]) -> Weights:
        m_prev = self._m if self._m is not None else [np.zeros_like(d) for d in mean_delta]
        v_prev = self._v if self._v is not None else [np.full_like(d, self.v_init) for d in mean_delta]
        _check_state_shapes("m", m_prev, global_weights)
        _check_state_shapes("v", v_prev, global_weights)
        m = [self.beta1 * mp + (1.0 - self.beta1) * d for mp, d in zip(m_prev, mean_delta)]
        v = [self._second_moment(vp, d * d) for vp, d in zip(v_prev, mean_delta)]
        out = [g + self.eta * mi / (np.sqrt(vi) + self.tau) for g, mi, vi in zip(_f64(global_weights), m, v)]
        self._m, self._v = m, v
        return _cast_like(out, global_weights)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        _pack("m", self._m, state)
        _pack("v", self._v, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        m, v = _unpack("m", state), _unpack("v", state)
        self._m, self._v = m, v


@register_strategy
class FedAdagrad(_FedOpt):
    """FedAdagrad: ``v_t = v_{t-1} + Delta_t^2``. Default ``beta1 = 0`` (no momentum,
    as the paper's experiments)."""

    name = "fedadagrad"

    def __init__(self, eta: float = 0.1, beta1: float = 0.0, beta2: float = 0.99, tau: float = 1e-3,
                 eta_l: float | None = None, v_init: float | None = None) -> None:
        super().__init__(eta=eta, beta1=beta1, beta2=beta2, tau=tau, eta_l=eta_l, v_init=v_init)

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v + d2


@register_strategy
class FedYogi(_FedOpt):
    """FedYogi: ``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)``."""

    name = "fedyogi"

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta2) * d2 * np.sign(v - d2)


@register_strategy
class FedAdam(_FedOpt):
    """FedAdam: ``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2`` (no bias correction, as in
    the paper's Algorithm 2)."""

    name = "fedadam"

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1.0 - self.beta2) * d2


# ---------------------------------------------------------------------------
# FedBuff


@register_strategy
class FedBuff(Strategy):
    """FedBuff (Nguyen et al., AISTATS 2022): buffered asynchronous aggregation.

    The server aggregates whenever ``buffer_size`` (K) updates have arrived; each call
    to :meth:`aggregate` is one server step ``rnd``. An update that started from the
    global weights of round ``b = base_round`` has staleness ``tau = rnd - b`` and
    contributes its own delta ``y_k - x_b`` scaled by ``s(tau) = 1/sqrt(1 + tau)``
    (``staleness="sqrt"``; ``"none"`` gives 1):
    ``x_{rnd+1} = x_rnd + server_lr * (1/K') * sum_k s(tau_k) (y_k - x_{b_k})``, K' the
    number of updates passed (normally K). Unweighted by examples, as in the paper.

    The strategy remembers the global weights of the last ``max_staleness`` rounds
    (it sees each as ``global_weights``) to form the deltas; an update older than
    that, from the future, or without ``base_round`` is rejected."""

    name = "fedbuff"
    asynchronous = True
    supports_secure_aggregation = False

    def __init__(self, buffer_size: int = 10, server_lr: float = 1.0, max_staleness: int = 32,
                 staleness: str = "sqrt") -> None:
        self.buffer_size = _int("buffer_size", buffer_size, lo=1)
        self.server_lr = _num("server_lr", server_lr, lo=0.0, lo_open=True)
        self.max_staleness = _int("max_staleness", max_staleness, lo=0)
        if staleness not in ("sqrt", "none"):
            raise StrategyError(f"parameter staleness must be 'sqrt' or 'none', got {staleness!r}")
        self.staleness = staleness
        self._history: dict[int, list[np.ndarray]] = {}

    def params(self) -> dict[str, float | int | str]:
        return {"buffer_size": self.buffer_size, "server_lr": self.server_lr,
                "max_staleness": self.max_staleness, "staleness": self.staleness}

    def staleness_weight(self, staleness: int) -> float:
        """``s(tau)``: ``1/sqrt(1 + tau)`` (or 1 with ``staleness="none"``)."""
        return 1.0 / math.sqrt(1.0 + staleness) if self.staleness == "sqrt" else 1.0

    def _base(self, rnd: int, global_weights: Weights, u: ClientUpdate) -> Weights:
        who = f"client {u.client_id!r}"
        if u.base_round < 0:
            raise StrategyError(f"{who}: FedBuff needs base_round (the round its weights started from)")
        tau = rnd - u.base_round
        if tau < 0:
            raise StrategyError(f"{who}: base_round {u.base_round} is ahead of the server's round {rnd}")
        if tau > self.max_staleness:
            raise StrategyError(f"{who}: staleness {tau} exceeds max_staleness {self.max_staleness}")
        if tau == 0:
            return global_weights
        if u.base_round not in self._history:
            raise StrategyError(f"{who}: the global weights of round {u.base_round} are not known")
        return self._history[u.base_round]

    def validate_update(self, rnd: int, global_weights: Weights, update: ClientUpdate) -> None:
        super().validate_update(rnd, global_weights, update)
        self._base(rnd, global_weights, update)

    def aggregate(self, rnd: int, global_weights: Weights, updates: list[ClientUpdate]) -> Weights:
        _validate_all(global_weights, updates)
        bases = [self._base(rnd, global_weights, u) for u in updates]
        for b in bases:
            _check_state_shapes("history", b, global_weights)
        x = _f64(global_weights)
        acc = [np.zeros_like(g) for g in x]
        for u, base in zip(updates, bases):
            s = self.staleness_weight(rnd - u.base_round)
            for a, y, b0 in zip(acc, u.weights, base):
                a += s * (np.asarray(y, dtype=np.float64) - np.asarray(b0, dtype=np.float64))
        k = len(updates)
        out = [g + self.server_lr * a / k for g, a in zip(x, acc)]
        self._history[rnd] = [np.array(g, copy=True) for g in global_weights]
        for r in [r for r in self._history if r < rnd - self.max_staleness]:
            del self._history[r]
        return _cast_like(out, global_weights)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"history_rounds": np.array(sorted(self._history), dtype=np.int64)}
        for r, ws in self._history.items():
            _pack(f"history.{r}", ws, state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hist: dict[int, list[np.ndarray]] = {}
        for r in np.asarray(state.get("history_rounds", np.zeros(0, np.int64))).tolist():
            ws = _unpack(f"history.{int(r)}", state)
            if ws is None:
                raise StrategyError(f"state dict is missing history.{int(r)}")
            hist[int(r)] = ws
        self._history = hist


# ---------------------------------------------------------------------------
# robust aggregation (individual updates needed: never under secure aggregation)


class _Robust(Strategy):
    needs_individual_updates = True
    supports_secure_aggregation = False

    def aggregate(self, rnd: int, global_weights: Weights, updates: list[ClientUpdate]) -> Weights:
        _validate_all(global_weights, updates)
        self._check_count(len(updates))
        return _cast_like(self._robust([_f64(u.weights) for u in updates]), global_weights)

    def _check_count(self, n: int) -> None:
        pass

    def _robust(self, ws: list[list[np.ndarray]]) -> list[np.ndarray]:
        raise NotImplementedError


@register_strategy
class Median(_Robust):
    """Coordinate-wise median of the clients' weights (Yin et al., ICML 2018)."""

    name = "median"

    def _robust(self, ws: list[list[np.ndarray]]) -> list[np.ndarray]:
        return [np.median(np.stack([w[i] for w in ws]), axis=0) for i in range(len(ws[0]))]


@register_strategy
class TrimmedMean(_Robust):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): per coordinate, drop the
    ``floor(beta * n)`` largest and smallest values and average the rest."""

    name = "trimmed_mean"

    def __init__(self, beta: float = 0.1) -> None:
        self.beta = _num("beta", beta, lo=0.0, hi=0.5, hi_open=True)

    def params(self) -> dict[str, float | int | str]:
        return {"beta": self.beta}

    def _check_count(self, n: int) -> None:
        k = int(math.floor(self.beta * n))
        if n - 2 * k < 1:
            raise StrategyError(f"trimmed_mean: beta={self.beta} trims every one of {n} updates")

    def _robust(self, ws: list[list[np.ndarray]]) -> list[np.ndarray]:
        n = len(ws)
        k = int(math.floor(self.beta * n))
        out = []
        for i in range(len(ws[0])):
            srt = np.sort(np.stack([w[i] for w in ws]), axis=0)
            out.append(srt[k:n - k].mean(axis=0))
        return out


@register_strategy
class Krum(_Robust):
    """Krum / Multi-Krum (Blanchard et al., NeurIPS 2017) for ``f`` Byzantine clients.

    Score of update i: the sum of squared L2 distances (over all arrays) to its
    ``n - f - 2`` nearest other updates. Krum returns the update with the lowest
    score (lowest index on ties); Multi-Krum (``m > 1``) the plain mean of the ``m``
    lowest-scored. Needs ``n > 2f + 2``."""

    name = "krum"

    def __init__(self, f: int = 1, m: int = 1) -> None:
        self.f = _int("f", f, lo=0)
        self.m: int | None = _int("m", m, lo=1)

    def params(self) -> dict[str, float | int | str]:
        return {"f": self.f, "m": self.m if self.m is not None else "n-f"}

    def _num_selected(self, n: int) -> int:
        return self.m if self.m is not None else n - self.f

    def _check_count(self, n: int) -> None:
        if n <= 2 * self.f + 2:
            raise StrategyError(f"{self.name}: needs more than 2f+2 = {2 * self.f + 2} updates, got {n}")
        if self._num_selected(n) > n:
            raise StrategyError(f"{self.name}: m={self._num_selected(n)} exceeds the {n} updates")

    def scores(self, ws: list[list[np.ndarray]]) -> np.ndarray:
        """Krum scores of flattened float64 updates (one list of arrays per client)."""
        x = np.stack([np.concatenate([a.ravel() for a in w]) for w in ws])
        n = x.shape[0]
        d2 = np.empty((n, n))
        for i in range(n):
            diff = x - x[i]
            d2[i] = np.einsum("ij,ij->i", diff, diff)
        nearest = n - self.f - 2
        out = np.empty(n)
        for i in range(n):
            others = np.sort(np.delete(d2[i], i))
            out[i] = others[:nearest].sum()
        return out

    def _robust(self, ws: list[list[np.ndarray]]) -> list[np.ndarray]:
        order = np.argsort(self.scores(ws), kind="stable")
        chosen = order[: self._num_selected(len(ws))]
        return [np.mean(np.stack([ws[int(j)][i] for j in chosen]), axis=0) for i in range(len(ws[0]))]


@register_strategy
class MultiKrum(Krum):
    """Multi-Krum: the mean of the ``m`` updates with the best Krum scores
    (``m`` defaults to ``n - f``)."""

    name = "multikrum"

    def __init__(self, f: int = 1, m: int | None = None) -> None:
        self.f = _int("f", f, lo=0)
        self.m = None if m is None else _int("m", m, lo=1)
