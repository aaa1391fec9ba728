"""Peer mode: workers form a ``torch.distributed`` group (under torchrun) and synchronise by
collectives instead of a PS. ``AllReduceDP`` (bucketed all-reduce from backward hooks) and
``ZeroSync`` (ZeRO stages 1-3) are ``ParamSync``s the trainer runs like ``PSSync``."""
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
    from worker.binding import PSEmbedding

    if any(isinstance(m, PSEmbedding) for m in model.modules()):
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
