"""What a federated server trains: the model's initial weights, its central evaluation
and the training settings sent to clients, for a built-in task or for a user's own
model given as ``package.module:function`` (``tessera fed server --task mymod:make``).

A user task is a function returning a :class:`ServerTask`; it is called with the
``--task-opt KEY=VALUE`` options as keyword arguments. The module is looked up as
``python -m`` would: the current directory first, then ``sys.path``. Nothing here
imports torch (a built-in task does, when it is loaded).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from federated.errors import ConfigError
from federated.strategy import Weights

__all__ = ["ServerTask", "load_server_task", "BUILT_IN"]

BUILT_IN = ("digits", "digits_logreg")

EvaluateFn = Callable[[Weights], tuple[float, dict[str, float]]]


@dataclass(frozen=True)
class ServerTask:
    """A model for the federated server.

    ``initial_weights``: the global model as a non-empty list of float numpy arrays
    (any shapes; clients get these arrays, in this order, and must return arrays of the
    same shapes). ``evaluate_fn(weights) -> (loss, {metric: value})``: central
    evaluation on the server's own data after every round (None: none; see
    :data:`federated.orchestrator.EvaluateFn`). ``client_config``: scalars every
    client receives in ``config`` (e.g. ``{"epochs": 1, "lr": 0.1}``; the CLI's
    ``--epochs/--lr/--batch-size`` override them). ``name``: for reports.
    """

    initial_weights: Weights
    evaluate_fn: EvaluateFn | None = None
    client_config: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    name: str = "custom"

    def __post_init__(self) -> None:
        ws = self.initial_weights
        if not isinstance(ws, (list, tuple)) or not ws:
            raise ConfigError(f"task {self.name!r}: initial_weights must be a non-empty list of numpy arrays")
        for i, w in enumerate(ws):
            if not isinstance(w, np.ndarray) or w.dtype.kind != "f":
                raise ConfigError(f"task {self.name!r}: initial_weights[{i}] must be a float numpy array, "
                                  f"got {type(w).__name__}{'' if not isinstance(w, np.ndarray) else ' of ' + str(w.dtype)}")
        if self.evaluate_fn is not None and not callable(self.evaluate_fn):
            raise ConfigError(f"task {self.name!r}: evaluate_fn must be callable (weights -> (loss, metrics))")


def _import(module: str) -> Any:
    # as `python -m` does: the current directory first (the `tessera` script's sys.path lacks it)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module)


def load_server_task(spec: str, seed: int = 0, **options: Any) -> ServerTask:
    """The task named by ``spec``: a built-in name (``digits``, ``digits_logreg``;
    ``seed`` seeds its initial weights) or ``package.module:function``, called with
    ``options`` and returning a :class:`ServerTask`. Raises ConfigError with a message
    that says what to fix (unknown name, module not found, not a ServerTask, ...)."""
    if spec in BUILT_IN:
        if options:
            raise ConfigError(f"task {spec!r} takes no --task-opt options (got {', '.join(sorted(options))})")
        from federated.tasks import get_task

        t = get_task(spec)
        return ServerTask(t.initial_weights(seed), t.evaluator(), dict(t.client_config), spec)
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ConfigError(f"unknown task {spec!r}: use one of {', '.join(BUILT_IN)} or package.module:function")
    try:
        module = _import(mod)
    except ImportError as e:
        raise ConfigError(
            f"task {spec!r}: cannot import module {mod!r} ({e}); run from the directory that holds {mod.replace('.', '/')}.py "
            "or add its directory to PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"task {spec!r}: module {mod!r} has no function {attr!r}")
    try:
        task = fn(**options)
    except TypeError as e:
        raise ConfigError(f"task {spec!r}: calling {attr}({', '.join(f'{k}=...' for k in options)}) failed: {e}") from None
    if not isinstance(task, ServerTask):
        raise ConfigError(f"task {spec!r}: {attr}() returned {type(task).__name__}, not federated.ServerTask")
    return task
