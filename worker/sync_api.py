"""The grpc-free half of the ``ParamSync`` seam: the ``ParamSync`` base class, what its methods pass
around (``Fetched``, ``Grads``, ``PushResult``) and the PS mode names.

``ParamSync``: how a worker's parameters and gradients meet the other workers'. The trainer owns
the step pipeline (prefetch, compute, the push window, metrics); a ``ParamSync`` owns everything
else: where the values for step t come from, where step t's gradients go, and membership. One
step, as the trainer drives it::

    start = sync.join()                  # once: tables/process group, membership; the first step
    f = sync.fetch(t, batch)             # values for step t (may block; may run in a thread if pipelined)
    sync.load(f)                         # main thread: those values into the model
    sync.zero_grad()
    loss = sync.forward_backward(model, batch, task.loss, k)  # k micro-batches (a pipeline: its schedule)
    g = sync.gradients(t)                # main thread: step t's gradients, safe to push in the background
    sync.push(t, g)                      # send them (may run in a thread if pipelined)
    sync.global_loss(loss)               # the step's loss, mean over the data-parallel ranks (peer: a collective)
    sync.leave()                         # once, also after an error

Implementations: ``worker.paramsync.PSSync`` (the PS through ``PSClient``, over gRPC) and, in
``worker.peer``, the all-reduce data parallelism, ZeRO, tensor parallelism, MoE and pipeline
parallelism (collectives over ``torch.distributed``; ``PipelineSync``'s ``forward_backward`` runs
the pipeline's schedule over the step's micro-batches). This module imports no grpc and no ``ps``
client, so a peer rank, which imports it through ``worker.peer`` and ``worker.trainer``, never loads grpc
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
import torch.distributed as dist

from worker.flat import FlatParams
from worker.modes import PS_MODES, check_mode

__all__ = ["PS_MODES", "Fetched", "Grads", "ParamSync", "PushResult", "check_ps_mode"]  # split_batch: via worker.trainer

def check_ps_mode(mode: str) -> str:
    """``mode`` if it is a PS mode (``worker.modes``); the old name ``hybrid`` gets an error naming its new one."""
    return check_mode(mode, "ps").name


def split_batch(batch: Any, k: int) -> list[Any]:
    """``batch`` (tensors, or tuples / NamedTuples / lists / dicts of them) cut into ``k`` equal parts
    along dimension 0; other leaves are repeated."""
    if k == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % k:
            raise ValueError(f"a batch of {batch.shape[0]} cannot be cut into {k} equal micro-batches")
        return list(batch.chunk(k))
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return [type(batch)(*parts) for parts in zip(*(split_batch(b, k) for b in batch))]
    if isinstance(batch, (tuple, list)):
        return [type(batch)(parts) for parts in zip(*(split_batch(b, k) for b in batch))]
    if isinstance(batch, dict):
        cols = {key: split_batch(v, k) for key, v in batch.items()}
        return [{key: cols[key][i] for key in batch} for i in range(k)]
    return [batch] * k


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

    def forward_backward(self, model: torch.nn.Module, batch: Any, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                         micro_batches: int) -> torch.Tensor:
        """Main thread: forward and backward of this worker's ``batch`` in ``micro_batches`` equal parts
        (all but the last under ``no_sync()``, each loss scaled by 1/k, so the gradients are those of
        the batch's mean loss). Returns the batch's mean loss (detached). A pipeline sync overrides it
        with its schedule (it owns forward and backward of its micro-batches)."""
        k = micro_batches
        total: torch.Tensor | None = None
        for j, micro in enumerate(split_batch(batch, k)):
            with self.no_sync() if j < k - 1 else contextlib.nullcontext():
                loss = loss_fn(model, micro)
                if k > 1:
                    loss = loss / k
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def global_loss(self, loss: torch.Tensor) -> float:
        """Main thread, after ``push``: the step's loss as one process training on the global batch
        would report it: the mean of ``loss`` over the workers that share a step (peer mode: the
        data-parallel ranks, a collective every rank calls). Default (the PS): this worker's own."""
        return float(loss)

    def agree_stop(self, stop: bool) -> bool:
        """Main thread, before a step, when the run may end early (``--max-seconds``): whether to stop,
        decided alike by the workers that must (a sync whose push is a collective, ``pipelined``
        False: stop if any rank would, an all-reduce over every rank, so none waits in a collective
        the others left). Default for a pipelined sync (the PS): this worker's own ``stop``."""
        if self.pipelined or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return stop
        nccl = dist.get_backend() == "nccl"
        flag = torch.tensor([int(stop)], device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def window_metrics(self) -> dict[str, Any]:
        """A sync's own metrics since the last call (MoE: tokens per expert, drops), for the step records."""
        return {}

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

    def push_fetch_begin(
        self, step: int, grads: Grads, next_step: int | None, next_batch: Any,
    ) -> Callable[[], tuple[PushResult, Fetched | None]] | None:
        """``push_fetch`` in two halves, where the sync can: the exchange is sent now and the function
        returned completes it on the thread that calls it (a pipelined trainer then needs no thread for
        it). None (the default): the trainer runs ``push_fetch`` in the background."""
        return None

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
