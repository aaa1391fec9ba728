"""Training tasks: a model, per-worker data, a loss and a test metric.

Built in: ``ctr`` (synthetic click-through data with a known best AUC) and
``digits`` (scikit-learn's bundled 8x8 digits). A user task is any function
``package.module:function(**options) -> Task``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ps import OptimizerSpec

__all__ = ["Task", "load_task", "TASKS"]

Batch = Any


@dataclass
class Task:
    """What the trainer needs to know about a training job.

    - ``batches(worker_index, num_workers, batch_size, start_step)``: this worker's batches, one per
      step from ``start_step``. For sync mode to equal one process with batch ``num_workers *
      batch_size``, worker i's batch at step t must be slice i of that global batch.
    - ``loss(model, batch)``: scalar loss, the *mean* over the batch.
    - ``evaluate(model)``: test metrics; ``metric`` names the main one.
    - ``sparse_ids(batch)``: {PSEmbedding module name: ids tensor the model will look up}, so the
      trainer can prefetch rows during the previous step (optional: rows are pulled on first use).
    - ``to_device(batch, device)``: move a batch (default: tensors, tuples, lists, dicts).
    """

    name: str
    model: nn.Module
    batches: Callable[[int, int, int, int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    metric: str = "loss"
    higher_is_better: bool = True
    sparse_ids: Callable[[Batch], dict[str, torch.Tensor]] | None = None
    dense_optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("adam", {"lr": 1e-3}))
    to_device: Callable[[Batch, torch.device], Batch] | None = None
    info: dict[str, float] = field(default_factory=dict)  # e.g. {"best_auc": 0.81}


def move(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # NamedTuple
        return type(batch)(*(move(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move(v, device) for k, v in batch.items()}
    return batch


def _ctr(**kw: Any) -> Task:
    from worker.tasks.ctr import make_task

    return make_task(**kw)


def _digits(**kw: Any) -> Task:
    from worker.tasks.digits import make_task

    return make_task(**kw)


TASKS: dict[str, Callable[..., Task]] = {"ctr": _ctr, "digits": _digits}


def load_task(spec: str, **options: Any) -> Task:
    """A built-in task by name, or ``package.module:function`` called with ``options``."""
    if spec in TASKS:
        fn = TASKS[spec]
    elif ":" in spec:
        mod, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"task {spec!r}: cannot load {attr!r} from {mod!r}: {e}") from None
    else:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(TASKS)} or package.module:function")
    task = fn(**options)
    if not isinstance(task, Task):
        raise TypeError(f"task {spec!r}: {fn!r} returned {type(task).__name__}, not worker.tasks.Task")
    return task
