"""Peer mode: workers form a ``torch.distributed`` group (under torchrun) and synchronise by
collectives instead of a PS. ``AllReduceDP`` (bucketed all-reduce from backward hooks) and
``ZeroSync`` (ZeRO stages 1-3) are ``ParamSync``s the trainer runs like ``PSSync``.

Importing this package loads neither torch nor grpc: every name is re-exported lazily and loads its
module on first use (``HybridSync``, PS embeddings, loads the PS client and so grpc)."""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.peer.data_parallel import AllReduceDP, make_buckets
    from worker.peer.hybrid import HybridSync
    from worker.peer.mesh import (
        Mesh,
        PeerConfigError,
        PeerError,
        check_agreement,
        init_mesh,
        shutdown_group,
        torch_optimizer,
    )
    from worker.peer.zero import ZeroSync

# every name is loaded on first use: ``tessera`` builds its parser (worker.peer.cli) without torch,
# and a dense rank never loads HybridSync's PS client (grpc)
_LAZY = {
    "AllReduceDP": "worker.peer.data_parallel", "make_buckets": "worker.peer.data_parallel",
    "HybridSync": "worker.peer.hybrid", "ZeroSync": "worker.peer.zero",
    **{n: "worker.peer.mesh" for n in ("Mesh", "PeerConfigError", "PeerError", "check_agreement", "init_mesh",
                                       "shutdown_group", "torch_optimizer")},
}

__all__ = [
    "AllReduceDP",
    "HybridSync",
    "Mesh",
    "PeerConfigError",
    "PeerError",
    "ZeroSync",
    "check_agreement",
    "init_mesh",
    "make_buckets",
    "make_sync",
    "shutdown_group",
    "torch_optimizer",
]


def make_sync(mode: str, model, optimizer, *, device, bucket_mb: float = 25.0, compress: str | None = None, settings=None):  # type: ignore[no-untyped-def]
    """The ``ParamSync`` of peer ``mode``: ``dp``, ``zero1``, ``zero2`` or ``zero3``."""
    from worker.peer.data_parallel import AllReduceDP
    from worker.peer.mesh import PeerConfigError
    from worker.peer.zero import ZeroSync

    # a model with PSEmbedding layers has imported worker.binding (which loads the PS client, so grpc):
    # look the class up only then, so a dense model's rank never imports it
    binding = sys.modules.get("worker.binding")
    if binding is not None and any(isinstance(m, binding.PSEmbedding) for m in model.modules()):
        raise PeerConfigError(
            "the model has PSEmbedding layers (rows on a PS): peer mode with PS embeddings (the hybrid) is not built yet"
        )
    if mode == "dp":
        return AllReduceDP(model, optimizer, device=device, bucket_mb=bucket_mb, compress=compress, settings=settings)
    if mode in ("zero1", "zero2", "zero3"):
        if compress not in (None, "none"):
            raise PeerConfigError("gradient compression is implemented for dp only, not ZeRO")
        return ZeroSync(model, optimizer, stage=int(mode[-1]), device=device, settings=settings)
    raise PeerConfigError(f"peer mode must be dp, zero1, zero2 or zero3, got {mode!r}")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
