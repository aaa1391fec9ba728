"""The grpc-free half of the ``ParamSync`` seam: the ``ParamSync`` base class, what its methods pass
around (``Fetched``, ``Grads``, ``PushResult``) and the PS mode names.

``ParamSync``: how a worker's parameters and gradients meet the other workers'. The trainer owns
the step pipeline (prefetch, compute, the push window, metrics); a ``ParamSync`` owns everything
else: where the values for step t come from, where step t's gradients go, and membership. One
step, as the trainer drives it::

    start = sync.join()                  # once: tables/process group, membership; the first step
    f = sync.fetch(t, batch)             # values for step t (may block; may run in a thread if pipelined)
    sync.load(f)                         # main thread: those values into the model
    sync.zero_grad(); forward; backward  # (micro-batches under sync.no_sync() but the last)
    g = sync.gradients(t)                # main thread: step t's gradients, safe to push in the background
    sync.push(t, g)                      # send them (may run in a thread if pipelined)
    sync.leave()                         # once, also after an error

Implementations: ``worker.paramsync.PSSync`` (the PS through ``PSClient``, over gRPC) and, in
``worker.peer``, the all-reduce data parallelism, ZeRO, tensor parallelism and MoE (collectives
over ``torch.distributed``). This module imports no grpc and no ``ps`` client, so a peer rank,
which imports it through ``worker.peer`` and ``worker.trainer``, never loads grpc
(``tests/unit/test_wire_contract.py`` checks that). ``worker.paramsync`` re-exports every name here.
``tests/integration/test_paramsync_contract.py`` is the one contract suite all implementations pass.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.flat import FlatParams

__all__ = ["PS_MODES", "Fetched", "Grads", "ParamSync", "PushResult", "check_ps_mode"]

PS_MODES = ("sync", "async", "ssp", "dense-sync")


def check_ps_mode(mode: str) -> str:
    """``mode`` if it is a PS mode; the old name ``hybrid`` gets an error naming its new one."""
    if mode == "hybrid":
        raise ValueError(
            "mode 'hybrid' was renamed 'dense-sync' (dense tables BSP, sparse tables async, both on the PS); "
            "'hybrid' now means PS embeddings beside an all-reduced dense part (peer mode)"
        )
    if mode not in PS_MODES:
        raise ValueError(f"PS mode must be one of {PS_MODES}, got {mode!r}")
    return mode


@dataclass
class Fetched:
    """What ``fetch(step)`` got: ``clock`` is the step the values are for (a BSP worker that fell
    behind may be handed a later one and catches up); ``state`` is the implementation's own."""

    step: int
    batch: Any
    clock: int
    state: Any = None


@dataclass
class Grads:
    """Step t's gradients as ``gradients(t)`` took them: ``dense`` (flat, or None when the sync
    already owns them), ``sparse`` rows of PS embeddings, ``state`` the implementation's own."""

    dense: torch.Tensor | None
    # worker.binding.SparseGrad rows (typed Any: naming the class would import the PS binding, so grpc)
    sparse: list[Any] = field(default_factory=list)
    state: Any = None


@dataclass
class PushResult:
    """What a push measured: the staleness of each applied update (PS async/SSP) and late shards."""

    staleness: list[int] = field(default_factory=list)
    late: int = 0


class ParamSync(ABC):
    """One worker's side of parameter synchronisation.

    Contract (checked by the contract suite):
    - ``flat``: the model's dense parameters as a ``FlatParams`` (their ``.grad`` views into ``flat.grad``).
    - ``join()`` returns the first step; after it, ``fetch(step)`` + ``load`` give every worker the
      same dense values for the same step (for the synchronous implementations).
    - ``push(t, gradients(t))`` applies step t's update (synchronous implementations: the mean of the
      workers' gradients, with the task's optimizer) before ``fetch(t + 1)`` returns.
    - ``pipelined``: True if ``fetch`` and ``push`` may run in background threads while the main
      thread computes (PS); False if they must run in line on the main thread (collectives).
    - ``leave()`` is idempotent and safe after an error.
    """

    name: str = "sync"
    pipelined: bool = False
    flat: FlatParams

    @abstractmethod
    def join(self) -> int:
        """Become a member; returns the step this worker starts at."""

    @abstractmethod
    def fetch(self, step: int, batch: Any) -> Fetched:
        """The values for ``step`` (blocking as the consistency rule requires)."""

    def load(self, fetched: Fetched) -> None:
        """Main thread: put ``fetched``'s values into the model (default: they are already there)."""

    def discard(self) -> None:
        """The values loaded last will not be computed on (the run ends): drop what was fetched for them."""

    def zero_grad(self) -> None:
        """Zero the gradients before a step's first micro-batch."""
        self.flat.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for accumulation micro-batches: their backward sends nothing."""
        return contextlib.nullcontext()

    @abstractmethod
    def gradients(self, step: int) -> Grads:
        """Main thread, after the step's backward: its gradients in a form ``push`` may use later."""

    @abstractmethod
    def push(self, step: int, grads: Grads) -> PushResult:
        """Send step ``step``'s gradients / apply its update."""

    #: > 0: ``push_fetch`` sends step t's gradients and fetches step ``t + lookahead``'s values in one
    #: exchange, and the trainer uses it instead of separate ``push`` and ``fetch`` calls (0: it does not)
    lookahead: int = 0

    def push_fetch(self, step: int, grads: Grads, next_step: int | None, next_batch: Any) -> tuple[PushResult, Fetched | None]:
        """``push(step, grads)`` then, if ``next_step`` is not None, ``fetch(next_step, next_batch)``;
        implementations with ``lookahead`` > 0 do both in one exchange."""
        r = self.push(step, grads)
        return r, (self.fetch(next_step, next_batch) if next_step is not None else None)

    @abstractmethod
    def leave(self) -> None:
        """Stop being a member (idempotent)."""

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        """``fn()`` (test metrics) on the latest parameters; returns (metrics, extra record fields)."""
        return fn(), {}

    def parameters(self) -> torch.Tensor:
        """The whole model's dense parameters as one flat copy, in parameter order (a collective for
        implementations that shard them: every rank calls it)."""
        return self.flat.data.detach().clone()

    def stats(self) -> dict[str, Any]:
        """Counters for the run's summary record."""
        return {}

    def close(self) -> None:
        """Release threads and buffers (after ``leave``)."""
