"""The registry of training modes: every ``--mode`` name, its family (the PS or peer mode), what
builds its ``ParamSync`` and what it needs. The one place a mode name is validated (the worker
and peer command lines, ``TrainConfig``, ``Trainer`` and ``worker.peer.make_sync`` all ask here),
with peer mode's ZeRO stage (``--zero N``): ``dp`` with ``--zero N`` is the entry ``zeroN``,
``--mode zeroN`` is an alias of ``--zero N`` (a ``--zero`` that contradicts it is refused), and
``hybrid`` takes any ``--zero N`` as its dense part's stage.

Pure Python (no torch, no grpc): the ``tessera`` command builds its parsers from it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["MODES", "PEER_MODES", "PS_MODES", "Mode", "check_mode"]


@dataclass(frozen=True)
class Mode:
    """One mode. ``family``: ``ps`` (a ``PSSync`` over a ``PSClient``) or ``peer`` (collectives);
    ``factory``: ``module:name`` of the ``ParamSync`` class that runs it; ``stage``: the ZeRO stage
    of the dense parameters (peer modes; ``any_stage``: the default, ``--zero`` picks any of 0-3); ``needs``:
    what it requires, in words (shown in errors)."""

    name: str
    family: str
    factory: str
    summary: str
    stage: int | None = None
    needs: str = ""
    any_stage: bool = False


_ALL = (
    Mode("sync", "ps", "worker.paramsync:PSSync", "BSP: every worker's push of step t applied before step t+1"),
    Mode("async", "ps", "worker.paramsync:PSSync", "ASP: pushes applied as they arrive"),
    Mode("ssp", "ps", "worker.paramsync:PSSync", "bounded staleness (--staleness)"),
    Mode("dense-sync", "ps", "worker.paramsync:PSSync", "dense tables BSP, sparse tables async (formerly 'hybrid')"),
    Mode("dp", "peer", "worker.peer.data_parallel:DataParallelSync", "bucketed all-reduce, whole optimizer", 0),
    Mode("zero1", "peer", "worker.peer.data_parallel:DataParallelSync", "ZeRO-1: optimizer state sharded over DP", 1),
    Mode("zero2", "peer", "worker.peer.data_parallel:DataParallelSync", "ZeRO-2: and gradients", 2),
    Mode("zero3", "peer", "worker.peer.data_parallel:DataParallelSync", "ZeRO-3: and parameters", 3),
    Mode("hybrid", "peer", "worker.peer.hybrid:HybridSync", "PS embeddings beside the dense part's sync (any --zero)", 0,
         needs="a model with PSEmbedding layers and --ps", any_stage=True),
)
MODES: dict[str, Mode] = {m.name: m for m in _ALL}
PS_MODES = tuple(m.name for m in _ALL if m.family == "ps")
PEER_MODES = tuple(m.name for m in _ALL if m.family == "peer")


def check_mode(name: str, family: str | None = None, zero: int | None = None) -> Mode:
    """The mode ``name`` (of ``family`` if given) at ZeRO stage ``zero`` (None: the mode's own; its
    ``stage`` is the one to run: ``dp`` at ``zero=2`` is ``zero2``, ``hybrid`` at ``zero=2`` is
    ``hybrid`` with stage 2), or ``ValueError`` with one line naming what is wrong: an unknown name
    (the choices), a stage not 0-3, ``--zero`` with a PS mode, or a ``zeroK`` name with another
    ``--zero``. The old PS mode name ``hybrid`` asked of the PS gets an error naming its new one."""
    if family == "ps" and name == "hybrid":
        raise ValueError(
            "mode 'hybrid' was renamed 'dense-sync' (dense tables BSP, sparse tables async, both on the PS); "
            "'hybrid' now means PS embeddings beside an all-reduced dense part (peer mode)"
        )
    mode = MODES.get(name)
    if mode is None or (family is not None and mode.family != family):
        names = PS_MODES if family == "ps" else PEER_MODES if family == "peer" else tuple(MODES)
        raise ValueError(f"{family + ' ' if family else ''}mode must be one of {', '.join(names)}, got {name!r}")
    if zero is None or zero == mode.stage:
        return mode
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    if mode.name == "dp":
        return MODES["dp" if zero == 0 else f"zero{zero}"]
    if mode.any_stage:
        return replace(mode, stage=zero)
    if mode.family != "peer":
        raise ValueError(f"--zero {zero} with --mode {name}: ZeRO is peer mode's data-parallel sharding (--mode dp or hybrid)")
    raise ValueError(f"--mode {name} (ZeRO stage {mode.stage}) and --zero {zero} contradict: give --zero {zero} alone")
