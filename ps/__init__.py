"""Parameter server: sharded dense and sparse tables with server-side optimizers."""
from ps.client import DenseResult, PSClient, StepResult
from ps.consistency import SyncPolicy
from ps.config import AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, ShardConfig, TableSpec
from ps.errors import (
    DeadlineExceededError,
    DtypeError,
    FailedPreconditionError,
    InvalidArgumentError,
    NonFiniteError,
    PSError,
    ResourceExhaustedError,
    ShapeMismatchError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
)
from ps.server import build_server, serve

__all__ = [
    "PSClient",
    "DenseResult",
    "StepResult",
    "SyncPolicy",
    "AdmissionSpec",
    "EvictionSpec",
    "InitializerSpec",
    "OptimizerSpec",
    "ShardConfig",
    "TableSpec",
    "PSError",
    "DeadlineExceededError",
    "DtypeError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NonFiniteError",
    "ResourceExhaustedError",
    "ShapeMismatchError",
    "ShardUnavailableError",
    "TableExistsError",
    "TableNotFoundError",
    "build_server",
    "serve",
]
