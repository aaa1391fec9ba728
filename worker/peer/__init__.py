"""Peer mode: workers form a ``torch.distributed`` group (under torchrun) and synchronise by
collectives instead of a PS. One data-parallel core (``worker.peer.core``: ``GroupReducer``,
``ShardedOptimizer``) under every layout; ``make_sync(plan, model, mesh_or_client)`` chooses the
``ParamSync`` the trainer runs (``DataParallelSync`` for DP / ZeRO 1-3 / the DP dimension of a
mesh, ``MoESync`` for MoE models, ``HybridSync`` beside PS embeddings).

Importing this package loads neither torch nor grpc: every name is re-exported lazily and loads its
module on first use (``HybridSync``, PS embeddings, loads the PS client and so grpc)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.peer.core import GroupReducer, ShardedOptimizer
    from worker.peer.data_parallel import DataParallelSync
    from worker.peer.hybrid import HybridSync
    from worker.peer.mesh import Mesh, PeerConfigError, PeerError, check_agreement, init_mesh, shutdown_group, torch_optimizer
    from worker.peer.parallelize import parallelize
    from worker.peer.sync_plan import SyncPlan, make_sync

# every name is loaded on first use: ``tessera`` builds its parser (worker.peer.cli) without torch,
# and a dense rank never loads HybridSync's PS client (grpc)
_LAZY = {
    "GroupReducer": "worker.peer.core", "ShardedOptimizer": "worker.peer.core",
    "DataParallelSync": "worker.peer.data_parallel", "HybridSync": "worker.peer.hybrid",
    "SyncPlan": "worker.peer.sync_plan", "make_sync": "worker.peer.sync_plan", "parallelize": "worker.peer.parallelize",
    **{n: "worker.peer.mesh" for n in ("Mesh", "PeerConfigError", "PeerError", "check_agreement", "init_mesh",
                                       "shutdown_group", "torch_optimizer")},
}

__all__ = ["DataParallelSync", "GroupReducer", "HybridSync", "Mesh", "PeerConfigError", "PeerError", "ShardedOptimizer",
           "SyncPlan", "check_agreement", "init_mesh", "make_sync", "parallelize", "shutdown_group", "torch_optimizer"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
