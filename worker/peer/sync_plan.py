"""One way to choose a peer ``ParamSync``: ``make_sync(plan, model, mesh_or_client)``.

The mode (``plan.mode``) is looked up in the registry (``worker.modes``); the rest of the plan says
how the mode's dense parameters meet the layout: over every rank (no mesh), over the DP dimension
of a ``ParallelMesh`` (tensor parallelism: the model is a tensor-parallel one, its ``specs`` and
``replicated_parameters()`` say what is split; pipeline parallelism: ``plan.pipeline`` names the
stages, and the sync runs their schedule inside the trainer's loop), and, given a ``PSClient``
(``hybrid``), beside PS embeddings: the same dense sync, the rows on the PS. What a plan cannot run raises ``PeerConfigError`` with one line saying what and why,
the same on every rank (nothing collective happens before it).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from worker.modes import check_mode
from worker.peer.mesh import PeerConfigError
from worker.sync_api import ParamSync

__all__ = ["SyncPlan", "make_sync"]


@dataclass(frozen=True)
class SyncPlan:
    """How a run synchronises. ``mode``: a peer mode of ``worker.modes`` (dp, zero1-3, hybrid).
    ``optimizer``: a task's ``OptimizerSpec`` or a factory ``params -> torch.optim.Optimizer``.
    ``bucket_mb``/``compress``: the all-reduce's buckets and 16-bit gradients on the wire (every
    stage and layout).
    ``sequence_parallel``: the TP model's replicated parameters' gradients are partial per TP rank.
    ``ep``: expert-parallel ranks (models with MoE layers). ``sparse_mode``/``sparse_ids``: hybrid's
    PS side. ``zero``: ``--zero`` (None: the mode's own stage; ``dp`` at 2 is ``zero2``; ``hybrid``'s
    dense part takes any). ``device``; ``settings``: fields every rank must agree on. ``pipeline``: a
    ``worker.peer.pipeline.PipelinePlan`` (stages, schedule, micro-batches) for a pipeline over the
    mesh's PP dimension (None: no pipeline)."""

    mode: str = "dp"
    optimizer: Any = None
    bucket_mb: float = 25.0
    compress: str | None = None
    sequence_parallel: bool = False
    ep: int = 1
    device: Any = "cpu"
    sparse_mode: str = "async"
    sparse_ids: Any = None
    prefix: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    pipeline: Any = None
    zero: int | None = None

    def __post_init__(self) -> None:
        try:
            check_mode(self.mode, "peer", zero=self.zero)
        except ValueError as e:
            raise PeerConfigError(str(e)) from None
        if self.ep < 1:
            raise PeerConfigError(f"--ep must be >= 1, got {self.ep}")

    @property
    def stage(self) -> int:
        """The ZeRO stage of the dense parameters (``worker.modes.check_mode``'s for ``mode`` at ``zero``)."""
        return int(check_mode(self.mode, "peer", zero=self.zero).stage or 0)


def make_sync(plan: SyncPlan, model: nn.Module, mesh_or_client: Any = None, client: Any = None) -> ParamSync:
    """The ``ParamSync`` of ``plan`` for ``model``: ``mesh_or_client`` None (every rank one data-parallel
    replica), a ``ParallelMesh`` (DP x TP (x PP with ``plan.pipeline``: a ``PipelineSync`` over this
    rank's stages); ``model`` its tensor-parallel model) or a ``PSClient``; ``client`` a ``PSClient``
    beside a mesh. With a client (``hybrid``): a ``HybridSync``, the rows on the PS beside the dense
    sync of the same layout without them. The process group must be initialised."""
    from worker.peer.moe import moe_layers

    client_mod = sys.modules.get("ps.client")
    if client_mod is not None and isinstance(mesh_or_client, client_mod.PSClient):
        mesh_or_client, client = None, mesh_or_client
    # a model with PSEmbedding layers has imported worker.binding (which loads the PS client, so grpc):
    # look the class up only then, so a dense model's rank never imports it
    binding = sys.modules.get("worker.binding")
    has_rows = binding is not None and any(isinstance(m, binding.PSEmbedding) for m in model.modules())
    if plan.ep > 1 and not moe_layers(model):
        raise PeerConfigError(f"--ep {plan.ep} needs a model with MoE layers: add --moe-experts E (gpt)")
    if (plan.mode == "hybrid") != (client is not None):
        raise PeerConfigError("--mode hybrid needs --ps HOST:PORT,... (the shards holding the embeddings), and a PS client needs --mode hybrid")
    if has_rows and client is None:
        raise PeerConfigError("the model has PSEmbedding layers (rows on a PS): use --mode hybrid with --ps")
    dense = _dense_sync(plan, model, mesh_or_client)
    if client is None:
        return dense
    import torch.distributed as dist

    from worker.peer.hybrid import HybridSync

    # rows pushed by the first TP rank of each DP replica whose part of the model holds them (in a pipeline, their
    # stage's; the others read them); a pipeline's micro-batches pull their rows in the forward (no prefetch)
    mesh = mesh_or_client
    part = nn.ModuleList(dense.engine.stages.values()) if plan.pipeline is not None else model  # type: ignore[attr-defined]
    holds = any(isinstance(m, binding.PSEmbedding) for m in part.modules())  # type: ignore[union-attr]
    return HybridSync(model, client, plan.prefix, plan.optimizer, rank=mesh.dp_idx if mesh else dist.get_rank(),
                      world=mesh.dp if mesh else dist.get_world_size(), device=plan.device, sparse_mode=plan.sparse_mode,
                      sparse_ids=plan.sparse_ids if plan.pipeline is None else None, dense=dense,
                      pushes=holds and (mesh is None or mesh.tp_idx == 0))


def _dense_sync(plan: SyncPlan, model: nn.Module, mesh: Any) -> ParamSync:
    """The sync of ``model``'s dense parameters over every rank (``mesh`` None) or ``mesh``."""
    from worker.peer.data_parallel import DataParallelSync
    from worker.peer.moe import moe_layers

    compress = None if plan.compress == "none" else plan.compress
    settings = {**plan.settings, **({"sparse_mode": plan.sparse_mode} if plan.mode == "hybrid" else {})}
    if plan.pipeline is not None:
        from worker.peer.pipeline import PipelineSync

        if mesh is None:
            raise PeerConfigError("a pipeline needs its ParallelMesh (the PP, DP and TP groups)")
        return PipelineSync(plan.pipeline, model, mesh, plan.optimizer, stage=plan.stage,
                            sequence_parallel=plan.sequence_parallel, compress=compress, ep=plan.ep)
    if moe_layers(model):
        from worker.peer.moe import MoESync

        return MoESync(model, plan.optimizer, mesh, ep=plan.ep, stage=plan.stage, device=plan.device,
                       bucket_mb=plan.bucket_mb, compress=compress, settings=settings)
    if mesh is None:
        return DataParallelSync(model, plan.optimizer, stage=plan.stage, device=plan.device, bucket_mb=plan.bucket_mb,
                                compress=compress, settings=settings)
    # the gradients to sum over the TP group: a parallelize()d model says which; the gpt task's split, under SP,
    # its replicated parameters (each TP rank saw S/T positions)
    if hasattr(model, "tp_sum_parameters"):
        replicated = model.tp_sum_parameters()  # type: ignore[operator]
    else:
        replicated = model.replicated_parameters() if plan.sequence_parallel and hasattr(model, "replicated_parameters") else []  # type: ignore[operator]
    return DataParallelSync(
        model, plan.optimizer, stage=plan.stage, group=mesh.dp_group, device=mesh.device, overlap=False, compress=compress,
        tp_group=mesh.tp_group if mesh.tp > 1 else None, tp_replicated=replicated,
        settings={"pp": mesh.pp, "sequence_parallel": plan.sequence_parallel, **settings},
    )
