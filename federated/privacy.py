"""Client-level differential privacy for federated averaging (pure numpy).

DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018): every sampled client clips its model
delta to L2 norm ``C`` (over all arrays together); Gaussian noise of standard
deviation ``z * C`` is added to the *sum* of the clipped deltas, either

* ``mode="central"``: once, by the server, to the sum (or the secure-aggregation
  sum), which is then divided by the number of clients; or
* ``mode="local"``: by every client to its own clipped delta (each update is then
  (epsilon, delta)-DP on its own; the aggregate's guarantee is at least the
  central one, which is what the accountant reports).

The mean is unweighted (each client's sensitivity is ``C``; example weights would
break that bound).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021): ``C <- C * exp(-lr * (b - gamma))``
where ``b`` is the (optionally noised) fraction of clients whose update norm was at
most ``C`` and ``gamma`` the target quantile.

Accounting: the Renyi-DP of the sampled Gaussian mechanism (Mironov, Talwar,
Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", 2019),
composed over rounds, converted to (epsilon, delta) with the conversion of Balle
et al., "Hypothesis Testing Interpretations and Renyi Differential Privacy"
(AISTATS 2020, Theorem 21) -- the one TF-Privacy's ``compute_eps`` and Opacus's
``get_privacy_spent`` use -- or, on request, the classic
``eps = rdp + log(1/delta)/(alpha - 1)`` (Mironov 2017, Prop. 3). Client sampling
is treated as Poisson sampling with rate ``sample_rate`` = expected clients per
round / all clients, as in McMahan et al. 2018.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Sequence, Union

import numpy as np

__all__ = [
    "PrivacyError",
    "DPConfig",
    "clip_update",
    "global_norm",
    "gaussian_noise",
    "secure_rng",
    "privatize_update",
    "noised_mean",
    "AdaptiveClip",
    "adjusted_noise_multiplier",
    "DEFAULT_ORDERS",
    "compute_rdp",
    "rdp_to_epsilon",
    "RDPAccountant",
]

Weights = list[np.ndarray]
Orders = Union[Sequence[float], np.ndarray, float]


class PrivacyError(ValueError):
    """Bad DP parameters or inputs (non-positive clip norm, non-finite update, ...)."""


def _pos(name: str, v: object, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise PrivacyError(f"{name} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
        raise PrivacyError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {v!r}")
    return f


@dataclass(frozen=True)
class DPConfig:
    """Client-level DP settings.

    ``clip_norm``: C, the L2 bound on each client's delta (initial value when
    ``adaptive``). ``noise_multiplier``: z; the noise std on the sum is ``z * C``.
    ``mode``: ``"central"`` (server noises the sum) or ``"local"`` (clients noise their
    own update). ``delta``: the target delta reported by the accountant.
    ``adaptive``: adapt C to the ``target_quantile`` of update norms with geometric
    step ``clip_lr`` (Andrew et al. 2021); ``count_stddev`` is the std of the noise
    on the count of unclipped clients (0: no noise, not private for the count)."""

    clip_norm: float
    noise_multiplier: float
    mode: Literal["central", "local"] = "central"
    delta: float = 1e-5
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_stddev: float = 0.0

    def __post_init__(self) -> None:
        _pos("clip_norm", self.clip_norm)
        _pos("noise_multiplier", self.noise_multiplier, allow_zero=True)
        if self.mode not in ("central", "local"):
            raise PrivacyError(f"mode must be 'central' or 'local', got {self.mode!r}")
        d = _pos("delta", self.delta)
        if d >= 1:
            raise PrivacyError(f"delta must be in (0, 1), got {self.delta!r}")
        if not isinstance(self.adaptive, bool):
            raise PrivacyError(f"adaptive must be a bool, got {self.adaptive!r}")
        q = _pos("target_quantile", self.target_quantile, allow_zero=True)
        if q > 1:
            raise PrivacyError(f"target_quantile must be in [0, 1], got {self.target_quantile!r}")
        _pos("clip_lr", self.clip_lr)
        _pos("count_stddev", self.count_stddev, allow_zero=True)
        if self.adaptive and self.count_stddev > 0 and self.noise_multiplier > 0:
            adjusted_noise_multiplier(self.noise_multiplier, self.count_stddev)  # raises if impossible


# ---------------------------------------------------------------------------
# clipping and noise


def _check_weights(what: str, ws: object) -> list[np.ndarray]:
    if not isinstance(ws, (list, tuple)) or not ws:
        raise PrivacyError(f"{what} must be a non-empty list of numpy arrays")
    for i, a in enumerate(ws):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            raise PrivacyError(f"{what}[{i}] must be a float numpy array")
        if not np.isfinite(a).all():
            raise PrivacyError(f"{what}[{i}] holds non-finite values (NaN or Inf)")
    return list(ws)


def global_norm(ws: Sequence[np.ndarray]) -> float:
    """L2 norm of all arrays together, computed in float64."""
    return math.sqrt(sum(float(np.dot(a.ravel().astype(np.float64), a.ravel().astype(np.float64))) for a in ws))


def clip_update(delta: Weights, max_norm: float) -> tuple[Weights, float]:
    """Scale ``delta`` (all arrays together) so its global L2 norm is at most ``max_norm``.

    Returns ``(clipped, norm)`` where ``norm`` is the norm *before* clipping; arrays
    keep their dtypes and are new (the input is not modified)."""
    ws = _check_weights("delta", delta)
    c = _pos("max_norm", max_norm)
    norm = global_norm(ws)
    scale = min(1.0, c / norm) if norm > 0 else 1.0
    return [(a.astype(np.float64) * scale).astype(a.dtype) for a in ws], norm


def secure_rng() -> np.random.Generator:
    """A generator seeded with 128 bits from the OS CSPRNG (``secrets``), fresh on every
    call: nobody, not even whoever knows every config value, can predict its draws.

    DP noise and DP client sampling take a new one per draw, so the outputs of one draw
    (which a colluding client might estimate) say nothing about the next."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def gaussian_noise(shapes: Sequence[tuple[int, ...]], std: float, rng: np.random.Generator,
                   dtype: type | np.dtype = np.float64) -> Weights:
    """Independent N(0, std^2) arrays of the given shapes, drawn from ``rng`` in order."""
    s = _pos("std", std, allow_zero=True)
    if not isinstance(rng, np.random.Generator):
        raise PrivacyError("rng must be a numpy.random.Generator")
    return [(rng.standard_normal(tuple(shape)) * s).astype(dtype) for shape in shapes]


def privatize_update(delta: Weights, config: DPConfig, rng: np.random.Generator,
                     clip_norm: float | None = None) -> tuple[Weights, float]:
    """Client side: clip ``delta`` to ``clip_norm`` (default ``config.clip_norm``; the
    server sends the current one when clipping is adaptive) and, in local mode, add
    N(0, (z C)^2) noise. Returns ``(update, norm_before_clipping)``; the caller reports
    ``norm <= C`` (one bit) when clipping is adaptive."""
    c = config.clip_norm if clip_norm is None else _pos("clip_norm", clip_norm)
    clipped, norm = clip_update(delta, c)
    if config.mode == "local" and config.noise_multiplier > 0:
        noise = gaussian_noise([a.shape for a in clipped], config.noise_multiplier * c, rng)
        clipped = [(a.astype(np.float64) + n).astype(a.dtype) for a, n in zip(clipped, noise)]
    return clipped, norm


def noised_mean(clipped_sum: Weights, num_clients: int, config: DPConfig, rng: np.random.Generator,
                clip_norm: float | None = None) -> Weights:
    """Server side: the DP mean ``(sum + N(0, (z C)^2)) / num_clients`` in float64 (central
    mode), or ``sum / num_clients`` (local mode: clients noised already).

    ``clipped_sum`` is the plain or securely aggregated sum of clipped updates."""
    ws = _check_weights("clipped_sum", clipped_sum)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise PrivacyError(f"num_clients must be an int >= 1, got {num_clients!r}")
    c = config.clip_norm if clip_norm is None else _pos("clip_norm", clip_norm)
    out = [a.astype(np.float64) for a in ws]
    if config.mode == "central" and config.noise_multiplier > 0:
        noise = gaussian_noise([a.shape for a in out], config.noise_multiplier * c, rng)
        out = [a + n for a, n in zip(out, noise)]
    return [a / num_clients for a in out]


def adjusted_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """Andrew et al. 2021, Thm. 1: noising the unclipped count with std ``sigma_b`` costs
    privacy; using ``z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` for the update keeps the
    total at multiplier ``z``. Needs ``2 sigma_b > z``."""
    z = _pos("noise_multiplier", noise_multiplier)
    sb = _pos("count_stddev", count_stddev, allow_zero=True)
    if sb == 0:
        return z
    inv = z ** -2 - (2 * sb) ** -2
    if inv <= 0:
        raise PrivacyError(f"count_stddev {sb} too small for noise_multiplier {z}: need 2*count_stddev > z")
    return inv ** -0.5


class AdaptiveClip:
    """Geometric quantile tracking of the clip norm (Andrew et al. 2021, Alg. 1):
    ``C <- C * exp(-lr * (b_frac - target_quantile))`` with ``b_frac`` the fraction of
    clients whose update norm was ``<= C``, noised with N(0, count_stddev^2) on the
    count when ``count_stddev > 0``. Not thread-safe."""

    def __init__(self, initial_clip: float, target_quantile: float = 0.5, lr: float = 0.2,
                 count_stddev: float = 0.0, rng: np.random.Generator | None = None) -> None:
        self.clip_norm = _pos("initial_clip", initial_clip)
        self.target_quantile = _pos("target_quantile", target_quantile, allow_zero=True)
        if self.target_quantile > 1:
            raise PrivacyError(f"target_quantile must be in [0, 1], got {target_quantile!r}")
        self.lr = _pos("lr", lr)
        self.count_stddev = _pos("count_stddev", count_stddev, allow_zero=True)
        self._rng = rng if rng is not None else np.random.default_rng()

    @classmethod
    def from_config(cls, config: DPConfig, rng: np.random.Generator | None = None) -> "AdaptiveClip":
        """The adaptive clip of ``config`` (its clip norm as the start, target quantile, learning
        rate and count noise); ``rng`` draws the count noise (None: the OS CSPRNG)."""
        return cls(config.clip_norm, config.target_quantile, config.clip_lr, config.count_stddev, rng)

    def update_from_count(self, unclipped_count: float, num_clients: int) -> float:
        """Update from the (secure-)summed count of clients with norm ``<= C``; returns the new C."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise PrivacyError(f"num_clients must be an int >= 1, got {num_clients!r}")
        if not math.isfinite(float(unclipped_count)):
            raise PrivacyError("unclipped_count must be finite")
        noisy = float(unclipped_count)
        if self.count_stddev > 0:
            noisy += float(self._rng.normal(0.0, self.count_stddev))
        b_frac = noisy / num_clients
        self.clip_norm *= math.exp(-self.lr * (b_frac - self.target_quantile))
        return self.clip_norm

    def update(self, norms: Sequence[float]) -> float:
        """Update from the clients' pre-clipping norms (they are compared with the current C)."""
        if len(norms) == 0:
            raise PrivacyError("no norms to update the clip from")
        count = sum(1 for n in norms if float(n) <= self.clip_norm)
        return self.update_from_count(count, len(norms))

    def state_dict(self) -> dict[str, Any]:
        """``{"clip_norm": C}``: what a checkpoint keeps."""
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (PrivacyError for a non-positive norm)."""
        self.clip_norm = _pos("clip_norm", state["clip_norm"])


# ---------------------------------------------------------------------------
# RDP accountant for the sampled Gaussian mechanism


DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
"""Orders alpha: 1.1, 1.2, ..., 10.9, 12, 13, ..., 63 (the default of Opacus and of the
TF-Privacy tutorials), so results compare one to one."""


def _log_add(a: float, b: float) -> float:
    lo, hi = min(a, b), max(a, b)
    if lo == -math.inf:
        return hi
    return hi + math.log1p(math.exp(lo - hi))


def _log_sub(a: float, b: float) -> float:
    """log(exp(a) - exp(b)) for a >= b (rounding may make them equal: then -inf)."""
    if b == -math.inf:
        return a
    if a <= b:
        return -math.inf
    return a + math.log1p(-math.exp(b - a))


def _log_erfc(x: float) -> float:
    """log(erfc(x)), stable for large x where erfc underflows (asymptotic series)."""
    if x < 25.0:
        return math.log(math.erfc(x))
    x2 = x * x
    # erfc(x) = exp(-x^2)/(x sqrt(pi)) * (1 - 1/(2x^2) + 3/(4x^4) - 15/(8x^6) + 105/(16x^8) - ...)
    series = 1 - 1 / (2 * x2) + 3 / (4 * x2 ** 2) - 15 / (8 * x2 ** 3) + 105 / (16 * x2 ** 4)
    return -x2 - math.log(x) - 0.5 * math.log(math.pi) + math.log(series)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for integer alpha (Mironov et al. 2019, Sec. 3.3, integer case):
    A_alpha = sum_{k=0}^{alpha} C(alpha,k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2))."""
    log_a = -math.inf
    for k in range(alpha + 1):
        log_coef = (math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
                    + k * math.log(q) + (alpha - k) * math.log1p(-q))
        log_a = _log_add(log_a, log_coef + (k * k - k) / (2 * sigma ** 2))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha for fractional alpha (Mironov et al. 2019, Sec. 3.3): two
    convergent series split at z0 = sigma^2 log(1/q - 1) + 1/2, with generalized
    binomial coefficients (which change sign past alpha)."""
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma ** 2 * math.log(1 / q - 1) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    log_coef, sign = 0.0, 1.0  # binom(alpha, 0) = 1
    i = 0
    while True:
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log_1mq
        log_t1 = log_coef + j * log_q + i * log_1mq
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma ** 2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma ** 2) + log_e1
        if sign > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        if max(log_s0, log_s1) < -30 and i > alpha:
            break
        # binom(alpha, i+1) = binom(alpha, i) * (alpha - i) / (i + 1)
        factor = (alpha - i) / (i + 1)
        if factor == 0:
            break
        sign *= 1.0 if factor > 0 else -1.0
        log_coef += math.log(abs(factor))
        i += 1
        if i > 100_000:  # cannot happen for valid inputs; guards an infinite loop
            raise PrivacyError(f"RDP series did not converge for q={q}, sigma={sigma}, alpha={alpha}")
    return _log_add(log_a0, log_a1)


def _rdp_one(q: float, sigma: float, alpha: float) -> float:
    """RDP at order alpha of one application of the sampled Gaussian mechanism."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1.0:
        return alpha / (2 * sigma ** 2)
    if math.isinf(alpha):
        return math.inf
    if float(alpha).is_integer():
        return _log_a_int(q, sigma, int(alpha)) / (alpha - 1)
    return _log_a_frac(q, sigma, alpha) / (alpha - 1)


def _check_orders(orders: Orders) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if arr.ndim != 1 or arr.size == 0 or np.isnan(arr).any() or (arr <= 1).any():
        raise PrivacyError("orders must be a non-empty list of numbers > 1")
    return arr


def compute_rdp(q: float, noise_multiplier: float, steps: int, orders: Orders) -> np.ndarray:
    """RDP of ``steps`` compositions of the sampled Gaussian mechanism with sampling
    rate ``q`` and noise multiplier ``noise_multiplier``, at each order (float64 array)."""
    qq = _pos("q", q, allow_zero=True)
    if qq > 1:
        raise PrivacyError(f"q must be in [0, 1], got {q!r}")
    z = _pos("noise_multiplier", noise_multiplier, allow_zero=True)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise PrivacyError(f"steps must be an int >= 0, got {steps!r}")
    return np.array([_rdp_one(qq, z, float(a)) for a in _check_orders(orders)], dtype=np.float64) * steps


def rdp_to_epsilon(orders: Orders, rdp: Orders, delta: float,
                   conversion: Literal["improved", "classic"] = "improved") -> tuple[float, float]:
    """Smallest epsilon over the orders, and the order that gives it.

    ``"improved"``: Balle et al. 2020, Thm. 21 (as TF-Privacy ``compute_eps`` and
    Opacus ``get_privacy_spent``):
    ``eps = rdp + log1p(-1/alpha) - log(delta * alpha) / (alpha - 1)`` (used for
    alpha > 1.01; eps = 0 when ``delta^2 + expm1(-rdp) >= 0``, the KL bound).
    ``"classic"``: ``eps = rdp + log(1/delta) / (alpha - 1)`` (Mironov 2017, Prop. 3;
    what TF-Privacy used before 2020 and its published tutorial numbers)."""
    if conversion not in ("improved", "classic"):
        raise PrivacyError(f"conversion must be 'improved' or 'classic', got {conversion!r}")
    a = _check_orders(orders)
    r = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if r.shape != a.shape:
        raise PrivacyError(f"{a.size} orders but {r.size} RDP values")
    if np.isnan(r).any() or (r < 0).any():
        raise PrivacyError("RDP values must be >= 0")
    d = _pos("delta", delta)
    if d >= 1:
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    eps = np.full(a.shape, math.inf)
    for k, (alpha, rr) in enumerate(zip(a.tolist(), r.tolist())):
        if math.isinf(rr):
            continue
        if conversion == "classic":
            eps[k] = rr + math.log(1 / d) / (alpha - 1)
        elif conversion == "improved":
            if d ** 2 + math.expm1(-rr) >= 0:
                eps[k] = 0.0
            elif alpha > 1.01:
                eps[k] = rr + math.log1p(-1 / alpha) - math.log(d * alpha) / (alpha - 1)
    k = int(np.argmin(eps))
    return float(max(eps[k], 0.0)), float(a[k])


class RDPAccountant:
    """Tracks the RDP of a sequence of sampled Gaussian mechanisms (one per round).

    ``step(n)`` adds ``n`` rounds at the accountant's (or the given) noise multiplier
    and sample rate; ``epsilon(delta)`` converts the total (see :func:`rdp_to_epsilon`).
    RDP per (q, z) is cached, so a step costs a vector add. Not thread-safe."""

    def __init__(self, noise_multiplier: float, sample_rate: float,
                 orders: Orders = DEFAULT_ORDERS) -> None:
        self.noise_multiplier = _pos("noise_multiplier", noise_multiplier, allow_zero=True)
        self.sample_rate = _pos("sample_rate", sample_rate, allow_zero=True)
        if self.sample_rate > 1:
            raise PrivacyError(f"sample_rate must be in [0, 1], got {sample_rate!r}")
        self.orders = _check_orders(orders)
        self.rdp = np.zeros_like(self.orders)
        self.steps = 0
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    def _rdp_per_step(self, q: float, z: float) -> np.ndarray:
        key = (q, z)
        if key not in self._cache:
            self._cache[key] = compute_rdp(q, z, 1, self.orders)
        return self._cache[key]

    def step(self, n: int = 1, noise_multiplier: float | None = None, sample_rate: float | None = None) -> None:
        """Account for ``n`` more rounds (optionally with another z or q, e.g. a round
        that sampled more clients)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise PrivacyError(f"n must be an int >= 0, got {n!r}")
        z = self.noise_multiplier if noise_multiplier is None else _pos("noise_multiplier", noise_multiplier,
                                                                        allow_zero=True)
        q = self.sample_rate if sample_rate is None else _pos("sample_rate", sample_rate, allow_zero=True)
        if q > 1:
            raise PrivacyError(f"sample_rate must be in [0, 1], got {sample_rate!r}")
        self.rdp = self.rdp + n * self._rdp_per_step(q, z)
        self.steps += int(n)

    def epsilon_and_order(self, delta: float,
                          conversion: Literal["improved", "classic"] = "improved") -> tuple[float, float]:
        """``(epsilon, best order)`` spent so far at ``delta``."""
        return rdp_to_epsilon(self.orders, self.rdp, delta, conversion)

    def epsilon(self, delta: float, conversion: Literal["improved", "classic"] = "improved") -> float:
        """Epsilon spent so far at ``delta`` (0 before any step)."""
        return self.epsilon_and_order(delta, conversion)[0]

    def state_dict(self) -> dict[str, Any]:
        """The accumulated privacy loss (RDP orders and values, steps, noise, sample rate), for checkpoints."""
        return {"orders": self.orders.copy(), "rdp": self.rdp.copy(), "steps": self.steps,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; PrivacyError for inconsistent orders and values."""
        orders = _check_orders(state["orders"])
        rdp = np.asarray(state["rdp"], dtype=np.float64)
        if orders.shape != rdp.shape:
            raise PrivacyError("state: orders and rdp differ in length")
        self.orders, self.rdp, self.steps = orders, rdp.copy(), int(state["steps"])
        self.noise_multiplier = float(state["noise_multiplier"])
        self.sample_rate = float(state["sample_rate"])
        self._cache.clear()
