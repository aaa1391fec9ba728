"""Workers: a model's flat parameters, a ``ParamSync`` (the PS in sync, async, SSP or dense-sync
mode; peer mode in ``worker.peer``), and the trainer's step pipeline.

The names below are re-exported lazily, as ``ps`` does: importing a domain module
(``worker.netem``, ``worker.flat``, ...) loads no grpc; ``worker.PSSync`` loads it on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "PSEmbedding", "FlatParams", "ParamSync", "PSSync", "Task", "load_task", "TrainConfig", "Trainer", "Summary",
    "MODES", "PEER_MODES",
]

_WHERE = {
    "PSEmbedding": "worker.binding",
    "FlatParams": "worker.flat",
    "ParamSync": "worker.paramsync",
    "PSSync": "worker.paramsync",
    "Task": "worker.tasks",
    "load_task": "worker.tasks",
    **{name: "worker.trainer" for name in ("TrainConfig", "Trainer", "Summary", "MODES", "PEER_MODES")},
}

if TYPE_CHECKING:  # the names, for type checkers and IDEs
    from worker.binding import PSEmbedding
    from worker.flat import FlatParams
    from worker.paramsync import ParamSync, PSSync
    from worker.tasks import Task, load_task
    from worker.trainer import MODES, PEER_MODES, Summary, TrainConfig, Trainer


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
