"""Training tasks: a model, per-worker data, a loss and a test metric.

Built in: ``ctr`` (synthetic click-through data with a known best AUC),
``digits`` (scikit-learn's bundled 8x8 digits) and ``mf`` (matrix factorisation of
ratings from a hidden low-rank model). A user task is any function
``package.module:function(**options) -> Task``.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ps import OptimizerSpec

__all__ = ["Task", "load_task", "resolve_task", "lower_is_better", "TaskLoadError", "TASKS"]

Batch = Any


@dataclass
class Task:
    """What the trainer needs to know about a training job: a model, this worker's data, a loss,
    and optionally an evaluation. ``tessera worker --task mod:fn`` calls ``fn(seed=..., **task_opts)``,
    which returns one of these.

    An evaluation is ``evaluate`` + ``metric``: worker 0 calls ``evaluate(model)`` every
    ``--eval-every`` steps and at the end, on the latest parameters (pulled from the shards
    then); it returns ``{metric name: value}`` and ``metric`` names the main one. Example (a
    test split held by the task)::

        @torch.no_grad()
        def evaluate(model):
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
            return {"accuracy": acc}

        Task("my", model, batches, loss, evaluate=evaluate, metric="accuracy")

    A task without one (``evaluate=None``) trains only; ``--eval-every`` then warns once.

    Attributes:
        name: the task's name: the dense PS table is ``NAME/dense``, and ``NAME/ready`` is worker
            0's mark that the tables are seeded (each ``PSEmbedding`` names its own table).
        model: a ``torch.nn.Module``; its ``PSEmbedding`` modules keep their rows on the PS,
            every other parameter becomes part of one flat dense PS table.
        batches: ``batches(worker_index, num_workers, batch_size, start_step)`` -> an iterator of
            this worker's batches, one per step from ``start_step`` (a restarted or late worker
            starts at the cluster's clock). For sync mode to equal one process with batch
            ``num_workers * batch_size``, worker i's batch at step t must be slice i of that
            global batch.
        loss: ``loss(model, batch)`` -> a scalar tensor, the *mean* over the batch.
        evaluate: ``evaluate(model)`` -> ``{metric: float}`` on test data, or None (no evaluation).
        metric: the main metric's key in ``evaluate``'s result (progress, experiments, targets);
            default ``"loss"``.
        higher_is_better: whether a larger ``metric`` is better. Default None: decided from
            ``metric``'s name (:func:`lower_is_better`): False for a loss or an error
            (``loss``, ``test_loss``, ``mse``, ``rmse``, ``mae``, ``perplexity``, ``error``,
            names ending in ``_loss``/``_error``), True for anything else (``accuracy``,
            ``auc``, ...). Give it for a metric the rule gets wrong; after construction it is
            always a bool.
        sparse_ids: ``sparse_ids(batch)`` -> ``{the PSEmbedding's module name in the model, as in
            ``model.named_modules()`` (e.g. "emb"): the ids tensor it will be called with}``, so the trainer can
            prefetch those rows during the previous step. Optional: without it rows are pulled
            on first use in the forward.
        dense_optimizer: the shards' optimizer for the dense table (Adam, lr 1e-3 by default).
        to_device: ``to_device(batch, device)`` -> the batch on ``device`` (default: tensors,
            tuples, named tuples, lists and dicts of tensors are moved).
        info: extra facts about the task, e.g. ``{"best_auc": 0.866}`` (``tessera demo``
            reports the metric against it).
    """

    name: str
    model: nn.Module
    batches: Callable[[int, int, int, int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    metric: str = "loss"
    higher_is_better: bool | None = None  # None: from the metric's name (see above); a bool after __post_init__
    sparse_ids: Callable[[Batch], dict[str, torch.Tensor]] | None = None
    dense_optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec("adam", {"lr": 1e-3}))
    to_device: Callable[[Batch, torch.device], Batch] | None = None
    info: dict[str, float] = field(default_factory=dict)  # e.g. {"best_auc": 0.81}

    def __post_init__(self) -> None:
        if self.higher_is_better is None:
            self.higher_is_better = not lower_is_better(self.metric)


_LOWER_IS_BETTER = frozenset({"loss", "mse", "rmse", "mae", "perplexity", "ppl", "error", "nll", "logloss"})


def lower_is_better(metric: str) -> bool:
    """Whether a metric of this name is better when smaller: a loss or an error (``loss``,
    ``test_loss``, ``mse``, ``rmse``, ``mae``, ``perplexity``, ``error``, ``nll``, any name
    ending in ``_loss`` or ``_error``, case-insensitive). The default of
    :attr:`Task.higher_is_better` is its negation."""
    m = metric.lower()
    return m in _LOWER_IS_BETTER or m.endswith(("_loss", "_error", "_mse", "_rmse", "_mae", "_perplexity"))


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


def _gpt(**kw: Any) -> Task:
    from worker.tasks.gpt import make_task

    return make_task(**kw)


def _mf(**kw: Any) -> Task:
    from worker.tasks.mf import make_task

    return make_task(**kw)


TASKS: dict[str, Callable[..., Task]] = {"ctr": _ctr, "digits": _digits, "gpt": _gpt, "mf": _mf}


class TaskLoadError(ValueError):
    """A ``--task`` that cannot be loaded: unknown name, module not found, no such function, or
    the function did not return a :class:`Task`. The message says how to fix it."""


def _import(module: str, spec: str) -> Any:
    """Import ``module`` as ``python -m`` would find it: from the current directory too."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name not in (top, module) and not module.startswith(f"{e.name}."):
            raise TaskLoadError(
                f"task {spec!r}: importing {module!r} failed: {e} (a module your task imports is missing: pip install it)"
            ) from None
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after the installed packages: a file here never shadows one of them
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name not in (module.split(".")[0], module):
                raise TaskLoadError(f"task {spec!r}: importing {module!r} failed: {e}") from None
    path = module.replace(".", os.sep)
    raise TaskLoadError(
        f"task {spec!r}: no module {module!r} in the current directory ({cwd}) or on PYTHONPATH: run from the "
        f"directory that holds {path}.py, or set PYTHONPATH=/path/to/that/directory"
    )


def resolve_task(spec: str) -> Callable[..., Task]:
    """The function behind a task spec (a built-in name or ``module:function``), not yet called:
    checks a ``--task`` before anything is started. Raises :class:`TaskLoadError`."""
    if spec in TASKS:
        return TASKS[spec]
    if ":" not in spec:
        raise TaskLoadError(f"unknown task {spec!r}: use one of {', '.join(sorted(TASKS))}, or module:function for your own")
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise TaskLoadError(f"task {spec!r}: expected module:function, e.g. mytask:make for make() in mytask.py")
    module = _import(mod, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise TaskLoadError(
            f"task {spec!r}: {mod!r} ({getattr(module, '__file__', '?')}) has no function {attr!r}"
            + (f"; it has: {', '.join(names[:10])}" if names else "")
        )
    return fn


def load_task(spec: str, **options: Any) -> Task:
    """A built-in task by name (``ctr``, ``digits``), or ``module:function`` called with
    ``options`` (the module is looked for on ``sys.path`` and then in the current directory, as
    ``python -m`` does). Raises :class:`TaskLoadError` naming what is wrong and how to fix it."""
    fn = resolve_task(spec)
    try:
        task = fn(**options)
    except TypeError as e:
        if options and "unexpected keyword argument" in str(e):
            raise TaskLoadError(f"task {spec!r}: {e} (from --task-opt; add **kwargs to the function to ignore unknown options)") from None
        raise
    if not isinstance(task, Task):
        raise TaskLoadError(f"task {spec!r}: {getattr(fn, '__name__', fn)!r} returned {type(task).__name__}, not worker.tasks.Task")
    return task
