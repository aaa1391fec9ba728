"""Parameter server: sharded dense and sparse tables with server-side optimizers.

The names below are re-exported lazily, so importing a domain module (``ps.table``, ``ps.shard``,
...) loads neither grpc nor the generated protobuf code; ``ps.PSClient`` loads them on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["PSClient", "DenseResult", "StepResult", "SyncPolicy", "AdmissionSpec", "EvictionSpec", "InitializerSpec",
           "OptimizerSpec", "ShardConfig", "TableSpec", "PSError", "DeadlineExceededError", "DtypeError",
           "FailedPreconditionError", "InvalidArgumentError", "NonFiniteError", "ResourceExhaustedError",
           "ShapeMismatchError", "ShardUnavailableError", "TableExistsError", "TableNotFoundError", "build_server", "serve"]

_WHERE = {
    **dict.fromkeys(["PSClient", "DenseResult", "StepResult"], "ps.client"), "SyncPolicy": "ps.consistency",
    **dict.fromkeys(["AdmissionSpec", "EvictionSpec", "InitializerSpec", "OptimizerSpec", "ShardConfig", "TableSpec"],
                    "ps.config"),
    **dict.fromkeys(["build_server", "serve"], "ps.server"),
    **{name: "ps.errors" for name in __all__ if name.endswith("Error")},
}

if TYPE_CHECKING:  # the names, for type checkers and IDEs
    from ps.client import DenseResult, PSClient, StepResult
    from ps.config import AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, ShardConfig, TableSpec
    from ps.consistency import SyncPolicy
    from ps.errors import (DeadlineExceededError, DtypeError, FailedPreconditionError, InvalidArgumentError, NonFiniteError,
                           PSError, ResourceExhaustedError, ShapeMismatchError, ShardUnavailableError, TableExistsError,
                           TableNotFoundError)
    from ps.server import build_server, serve


def __getattr__(name: str) -> Any:
    # lazy: `import ps.table` (plain numpy/torch) must not pull in grpc and the generated stubs
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
