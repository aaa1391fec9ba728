"""The pipeline path's command-line flags and the names they accept, without torch: ``tessera``
builds its parser (``--help``, a mistyped flag) without loading torch. Import them from here (``worker.peer.pipeline``
does not re-export them)."""
from __future__ import annotations

import argparse

__all__ = ["KINDS", "PRECISIONS", "RECOMPUTE_MODES", "add_pipeline_args", "recompute_mode", "takes_pipeline_path"]

KINDS = ("gpipe", "1f1b", "interleaved")
RECOMPUTE_MODES = ("none", "full", "selective")
PRECISIONS = ("fp32", "bf16")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--pp``, ``--schedule``, ``--micro-batches``, ``--virtual-stages``, ``--recompute``,
    ``--precision`` (those not defined already by the mesh's flags)."""
    have = set(p._option_string_actions)
    if "--pp" not in have:
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (stages); world = D x T x P")
    if "--schedule" not in have:
        p.add_argument("--schedule", default="1f1b", choices=list(KINDS), help="pipeline schedule")
    if "--micro-batches" not in have:
        p.add_argument("--micro-batches", type=int, default=0, help="micro-batches per step in the pipeline (0: --accumulate if given, else 2 x pp)")
    if "--virtual-stages" not in have:
        p.add_argument("--virtual-stages", type=int, default=2, help="interleaved: model chunks per pipeline rank")
    if "--recompute" not in have:
        p.add_argument("--recompute", nargs="?", const="full", default="none", choices=list(RECOMPUTE_MODES),
                       help="activation recomputation in backward: full (per layer; the default of a bare --recompute) "
                            "or selective (only the attention core: q k^T, softmax, dropout, product with v)")
    if "--precision" not in have:
        p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                       help="bf16: bf16 compute (autocast), fp32 master weights and gradient reduction")


def recompute_mode(args: argparse.Namespace) -> str:
    """``none``, ``full`` or ``selective`` from ``--recompute`` (a bare flag, or True, is ``full``)."""
    v = getattr(args, "recompute", "none")
    if v is True:
        return "full"
    if v is None or v is False:
        return "none"
    return str(v)


def takes_pipeline_path(args: argparse.Namespace) -> bool:
    """Whether ``tessera peer`` runs this as a pipeline, a ``PipelineSync`` (--pp > 1, --recompute or --precision bf16)."""
    return (int(getattr(args, "pp", 1) or 1) > 1 or recompute_mode(args) != "none"
            or getattr(args, "precision", "fp32") != "fp32")
