"""Federated learning: a server that runs rounds over clients that dial out, a client
SDK (:class:`Client`, :class:`TorchClient`, :func:`start_client`), aggregation
strategies, secure aggregation, differential privacy, compression, partitioners and
simulation. See the README's "Federated mode" section."""
from __future__ import annotations

from typing import Any

__all__ = [
    "Client",
    "TorchClient",
    "TensorBatches",
    "start_client",
    "start_node",
    "ClientNode",
    "FedServer",
    "ServerConfig",
    "NodeConfig",
    "SecAggSettings",
    "Strategy",
    "ClientUpdate",
    "make_strategy",
    "FedError",
    "ServerTask",
]

_WHERE = {
    "Client": "federated.runtime",
    "TorchClient": "federated.torch_client",
    "TensorBatches": "federated.torch_client",
    "start_client": "federated.client",
    "start_node": "federated.client",
    "ClientNode": "federated.client",
    "FedServer": "federated.server",
    "ServerConfig": "federated.config",
    "NodeConfig": "federated.config",
    "SecAggSettings": "federated.config",
    "Strategy": "federated.strategy",
    "ClientUpdate": "federated.strategy",
    "make_strategy": "federated.strategy",
    "FedError": "federated.errors",
    "ServerTask": "federated.server_task",
}


def __getattr__(name: str) -> Any:
    # lazy, so `import federated.strategy` (pure numpy) does not pull in grpc or torch
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'federated' has no attribute {name!r}")
