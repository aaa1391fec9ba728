"""Server-side optimizers on a slice of a table (plain torch, in place).

Each optimizer updates ``param`` in place from ``grad`` and its own state
tensors, following torch.optim's single-tensor update order so a dense slice
matches torch.optim to float32 rounding. ``step`` is the 1-based update count:
a Python int for a dense slice, or an (n, 1) float64 tensor of per-row counts
for sparse rows (the lazy variants: a row's moments and bias correction
advance only when that row is pushed).

State is either elementwise (same shape as the param) or row-wise (one value
per row: ``rowwise_adagrad``).
"""
from __future__ import annotations

from typing import Callable, Mapping, Union

import numpy as np
import torch

__all__ = ["Optimizer", "make_optimizer", "scaled_lr"]

Step = Union[int, torch.Tensor]


class Optimizer:
    """An update rule with named state. ``rowwise`` names the states that hold one value per row."""

    name: str = ""
    elementwise_state: tuple[str, ...] = ()
    rowwise_state: tuple[str, ...] = ()

    def __init__(self, hparams: Mapping[str, float]) -> None:
        self.h = dict(hparams)

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh state for ``param`` ((n,) for dense slices, (n, dim) for rows)."""
        fill = self.h.get("initial_accumulator", 0.0)
        state = {k: torch.full_like(param, fill if k in ("sum", "n") else 0.0) for k in self.elementwise_state}
        return {**state, **{k: torch.full((param.shape[0],), fill, dtype=param.dtype) for k in self.rowwise_state}}

    def update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: Step) -> None:
        raise NotImplementedError

    def update_into(
        self, out: torch.Tensor, out_state: dict[str, torch.Tensor], param: torch.Tensor, grad: torch.Tensor,
        state: dict[str, torch.Tensor], step: Step,
    ) -> None:
        """``update`` written into ``out`` and ``out_state`` (same shapes), leaving ``param`` and
        ``state`` as they are (a dense table computes a push into spare blocks). The values are
        those ``update`` gives. Here: copy, then update in place; a rule that reads the old values
        and writes the new ones in one pass overrides it."""
        out.copy_(param)
        for k, v in state.items():
            out_state[k].copy_(v)
        self.update(out, grad, out_state, step)


def _decayed(grad: torch.Tensor, param: torch.Tensor, wd: float) -> torch.Tensor:
    return grad.add(param, alpha=wd) if wd else grad


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a CPU tensor (numpy's; a new tensor). torch's goes to
    MKL's vector math: within an ulp, not correctly rounded (1 float32 in 6 differs here) and its code
    path depends on the CPU, so no other implementation (ps/_rowkernel.c) can match it."""
    return torch.from_numpy(np.sqrt(x.numpy(force=True)))


def _powi(base: float, k: np.ndarray) -> np.ndarray:
    """``base ** k`` (float64) for integers ``k >= 0``, by repeated squaring: IEEE double multiplies
    only, so ps/_rowkernel.c gets the same bits. (torch.pow of a float64 tensor is SLEEF's 1-ulp
    vector pow, its scalar tail libm's; numpy's is SVML's on AVX-512: none is correctly rounded, and
    the three differ in the last bit for a few in 1,000 steps.) Error: at most ~2 log2(k) double
    ulps, far below the float32 the result is cast to."""
    out = np.ones(k.shape, np.float64)
    k = k.astype(np.int64)
    b = float(base)
    while k.any():
        out = np.where(k & 1, out * b, out)
        b = b * b
        k = k >> 1
    return out


def _row_steps(step: torch.Tensor) -> np.ndarray:
    """Per-row steps ((n, 1) float64 tensor of integers) as (n,) int64."""
    return step.numpy(force=True).reshape(-1).astype(np.int64)


class SGD(Optimizer):
    name = "sgd"

    def update(self, param, grad, state, step):
        param.add_(_decayed(grad, param, self.h["weight_decay"]), alpha=-self.h["lr"])

    def update_into(self, out, out_state, param, grad, state, step):
        # one pass (read param and grad, write out) instead of a copy and an in-place add; the same kernel
        torch.add(param, _decayed(grad, param, self.h["weight_decay"]), alpha=-self.h["lr"], out=out)


class Momentum(Optimizer):
    """Heavy-ball momentum (torch.optim.SGD with momentum, dampening 0); Nesterov if ``nesterov``."""

    name = "momentum"
    elementwise_state = ("momentum_buffer",)
    nesterov = False

    def update(self, param, grad, state, step):
        mu = self.h["momentum"]
        g = _decayed(grad, param, self.h["weight_decay"])
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(g)  # buf starts at 0, so step 1 gives buf = g as in torch
        param.add_(g.add(buf, alpha=mu) if self.nesterov else buf, alpha=-self.h["lr"])


class Nesterov(Momentum):
    name = "nesterov"
    nesterov = True


# the CPU kernel behind torch.optim.Adagrad(fused=True)
_FUSED_ADAGRAD = hasattr(torch, "_fused_adagrad_")


class Adagrad(Optimizer):
    name = "adagrad"
    elementwise_state = ("sum",)
    fused = True  # use torch's fused kernel where it applies (tests turn it off to compare)

    def update(self, param, grad, state, step):
        lr, decay = self.h["lr"], self.h["lr_decay"]
        acc = state["sum"]
        if (
            self.fused and _FUSED_ADAGRAD and param.device.type == "cpu" and param.dtype == torch.float32
            and acc.dtype == torch.float32 and param.is_contiguous() and acc.is_contiguous()
            and (not isinstance(step, torch.Tensor) or decay == 0)
        ):
            # one pass over p, g and the sum instead of ~5 passes and 3 temporaries. Per-row steps
            # (sparse rows) only matter through lr_decay: with none, every row's step is the same to it
            fused_step = float(step) if not isinstance(step, torch.Tensor) else 1.0
            torch._fused_adagrad_(
                [param], [grad.to(param.dtype).contiguous()], [acc], [torch.tensor(fused_step)],
                lr=lr, lr_decay=decay, weight_decay=self.h["weight_decay"], eps=self.h["eps"], maximize=False,
            )
            return
        g = _decayed(grad, param, self.h["weight_decay"])
        state["sum"].addcmul_(g, g, value=1)
        if isinstance(step, torch.Tensor):  # per-row steps (sparse rows; ps/_rowkernel.c does the same ops)
            k = _row_steps(step).astype(np.float64)
            clr = torch.from_numpy((lr / (1.0 + (k - 1.0) * decay)).astype(np.float32))[:, None]
            std = _sqrt(state["sum"]).add_(self.h["eps"])
            param.sub_(g / std * clr)
        else:
            std = state["sum"].sqrt().add_(self.h["eps"])
            param.addcdiv_(g, std, value=-(lr / (1 + (step - 1) * decay)))


class RowwiseAdagrad(Optimizer):
    """One accumulator per row: acc += mean(g^2 over the row); p -= lr g / (sqrt(acc) + eps)."""

    name = "rowwise_adagrad"
    rowwise_state = ("sum",)

    def update(self, param, grad, state, step):
        g = _decayed(grad, param, self.h["weight_decay"])
        acc = state["sum"]
        acc.add_(torch.linalg.vector_norm(g, dim=1).square_().div_(g.shape[1]) if g.shape[1] else 0.0)
        # no (rows, dim) temporary: p -= g * (lr / (sqrt(acc) + eps)) per row; the square root correctly
        # rounded (_sqrt), as ps/_rowkernel.c's
        param.addcmul_(g, _sqrt(acc).add_(self.h["eps"]).reciprocal_().mul_(self.h["lr"])[:, None], value=-1.0)


# the CPU kernel behind torch.optim.Adam(fused=True) (torch >= 2.4)
_FUSED_ADAM = hasattr(torch, "_fused_adam_") and hasattr(torch, "_fused_adamw_")


class Adam(Optimizer):
    name = "adam"
    elementwise_state = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def update(self, param, grad, state, step):
        lr, b1, b2, eps, wd = (self.h[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if _FUSED_ADAM and not isinstance(step, torch.Tensor) and param.device.type == "cpu":
            # one pass over p, g, m, v (torch.optim.Adam(fused=True)'s kernel) instead of ~8 passes
            # and 3 temporaries. Rows with per-row steps (sparse lazy Adam) keep the general path.
            fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
            fused(
                [param], [grad.to(param.dtype).contiguous()], [m], [v], [], [torch.tensor(float(step))],
                amsgrad=False, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps, maximize=False,
            )
            return
        if self.decoupled:
            param.mul_(1 - lr * wd)
            g = grad
        else:
            g = _decayed(grad, param, wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if isinstance(step, torch.Tensor):
            # per-row steps (sparse lazy Adam): bias corrections in float64, each cast to float32 once;
            # powers and square roots exactly reproducible (ps/_rowkernel.c does the same ops)
            k = _row_steps(step)
            step_size = torch.from_numpy((lr / (1.0 - _powi(b1, k))).astype(np.float32))[:, None]
            bc2_sqrt = torch.from_numpy(np.sqrt(1.0 - _powi(b2, k)).astype(np.float32))[:, None]
            denom = (_sqrt(v) / bc2_sqrt).add_(eps)
            param.sub_(m / denom * step_size)
        else:
            denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
            param.addcdiv_(m, denom, value=-(lr / (1 - b1**step)))


class AdamW(Adam):
    name = "adamw"
    decoupled = True


class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al., KDD 2013, Algorithm 1), per coordinate.

    n += g^2; sigma = (sqrt(n_new) - sqrt(n_old)) / lr; z += g - sigma * w;
    w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n)) / lr + l2).
    """

    name = "ftrl"
    elementwise_state = ("z", "n")

    def update(self, param, grad, state, step):
        lr, beta, l1, l2 = (self.h[k] for k in ("lr", "beta", "l1", "l2"))
        z, n = state["z"], state["n"]
        n_new = n + grad * grad
        # the correctly rounded square root on the CPU (ps/_rowkernel.c matches it), torch's elsewhere
        sqrt = _sqrt if param.device.type == "cpu" else torch.sqrt
        root_new = sqrt(n_new)
        sigma = (root_new - sqrt(n)) / lr
        z.add_(grad - sigma * param)
        n.copy_(n_new)
        w = -(z - torch.sign(z) * l1) / ((beta + root_new) / lr + l2)
        param.copy_(torch.where(z.abs() <= l1, torch.zeros_like(w), w))


_OPTIMIZERS: dict[str, Callable[[Mapping[str, float]], Optimizer]] = {
    c.name: c for c in (SGD, Momentum, Nesterov, Adagrad, RowwiseAdagrad, Adam, AdamW, FTRL)
}


def make_optimizer(name: str, hparams: Mapping[str, float]) -> Optimizer:
    """The optimizer called ``name`` (already validated by OptimizerSpec)."""
    return _OPTIMIZERS[name](hparams)


def scaled_lr(opt: Optimizer, factor: float) -> Optimizer:
    """A copy of ``opt`` whose learning rate is multiplied by ``factor`` (same state layout)."""
    return type(opt)({**opt.h, "lr": opt.h["lr"] * factor})
