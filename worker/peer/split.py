"""Pipeline stages for any model: the model cut into consecutive pieces at split points.

``pipeline_layers(model, split)`` returns modules whose composition is ``model.forward`` (they share
the model's parameters: nothing is copied). Where the pieces come from, in order:

1. ``layers`` given (a task's own layer list): those modules.
2. An ``nn.Sequential`` model: its children.
3. Any other model: its ``forward`` traced with ``torch.fx`` at the top level only (every submodule a
   leaf; an ``nn.Sequential`` is traced through), then cut before the calls of the modules named in
   ``split`` (``blocks.2`` starts a new piece), or before every top-level module call when ``split``
   is None (the finest cut; ``worker.peer.pipeline.partition`` then balances P x V stages over them
   by ``layer_costs``).

Between two pieces exactly one tensor must flow (the pipeline sends one activation): a cut that
more values cross (a mask built once in ``forward`` and passed to every block, say) is refused with a
``PeerConfigError`` naming the split point and the values; a model's buffers and parameters used
after a cut are not values crossing it (each piece reads its own).

``pipeline_io(task)`` derives the first stage's input and the last stage's loss from the task's
``loss(model, batch)``, which must call ``model(x)`` once with one tensor and compute the loss from
that output only (the usual ``loss = F.cross_entropy(model(batch.x), batch.y)``).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from worker.peer.mesh import PeerConfigError

__all__ = ["PipelineSource", "act_shapes", "layer_costs", "pipeline_io", "pipeline_layers", "pipeline_source",
           "shared_parameters", "split_points"]


class _TopLevel(fx.Tracer):
    """Every submodule a leaf, except ``nn.Sequential`` (traced through, so its children are cut points)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, nn.Sequential)


def _trace(model: nn.Module) -> fx.Graph:
    sig = inspect.signature(model.forward)
    concrete = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    try:
        return _TopLevel().trace(model, concrete_args=concrete or None)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds; the user needs the reason and a way out
        raise PeerConfigError(
            f"pipeline split: {type(model).__name__}.forward cannot be traced ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "give the task a layer list (Task.layers) or make the model an nn.Sequential"
        ) from None


def _piece(model: nn.Module, graph: fx.Graph, nodes: list[fx.Node], inputs: list[fx.Node], output: Any) -> fx.GraphModule:
    """A GraphModule running ``nodes`` on ``inputs`` and returning ``output`` (a node or the model's
    output structure); parameters and buffers read through ``get_attr`` are re-read here."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)

    def get(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op != "get_attr":
                raise AssertionError(f"value {a.name} used before it is defined in this piece")
            env[a] = g.node_copy(a)
        return env[a]

    for n in nodes:
        env[n] = g.node_copy(n, get)
    g.output(fx.node.map_arg(output, get))
    return fx.GraphModule(model, g)


def split_points(model: nn.Module) -> list[str]:
    """The names ``split`` may use: the top-level module calls of ``model.forward``, in order."""
    graph = _trace(model)
    return [str(n.target) for n in graph.nodes if n.op == "call_module"]


def pipeline_layers(model: nn.Module, split: Sequence[str] | None = None, *,
                    layers: Sequence[nn.Module] | None = None) -> list[nn.Module]:
    """Consecutive pieces of ``model`` (see the module docstring), sharing its parameters. ``split``:
    module names, each the first module of a new piece (with ``layers`` or an ``nn.Sequential``: also
    indices into it). Raises ``PeerConfigError`` naming a split point that is not a top-level module
    call of the forward, that leaves a piece empty, or that more than one value crosses."""
    if layers is not None or isinstance(model, nn.Sequential):
        units = list(layers) if layers is not None else list(model.children())
        names = [str(i) for i in range(len(units))] if layers is not None else [n for n, _ in model.named_children()]
        if not split:
            return units
        cuts = []
        for s in split:
            if s not in names:
                raise PeerConfigError(f"pipeline split point {s!r}: not one of the {len(units)} layers ({', '.join(names)})")
            cuts.append(names.index(s))
        return [nn.Sequential(*units[a:b]) for a, b in _ranges(cuts, len(units), split)]
    graph = _trace(model)
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    places = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    calls = [i for i, n in enumerate(body) if n.op == "call_module"]
    pos = {n: i for i, n in enumerate(body)}
    targets = [str(body[i].target) for i in calls]
    if split:
        cuts = []
        for s in split:
            if s not in targets:
                raise PeerConfigError(
                    f"pipeline split point {s!r}: not a module the model's forward calls at the top level "
                    f"(those are: {', '.join(targets)})"
                )
            cuts.append(calls[targets.index(s)])
        ranges = _ranges(cuts, len(body), split)
    if not split:  # before every top-level call that one value crosses (a cut that several cross is skipped)
        starts = [0] + [c for c in calls[1:] if len(_crossing(body, pos, c, places)) == 1]
        ranges = list(zip(starts, starts[1:] + [len(body)]))
    pieces: list[nn.Module] = []
    for k, (a, b) in enumerate(ranges):
        if k == 0:
            inputs = places
        else:
            crossing = _crossing(body, pos, a, places)
            if len(crossing) != 1:
                where = repr(str(body[a].target)) if body[a].op == "call_module" else f"#{k}"
                raise PeerConfigError(
                    f"pipeline split point {where}: {len(crossing)} values cross it ({', '.join(n.name for n in crossing)}); "
                    "the pipeline sends one tensor between stages: split elsewhere or compute those values inside the blocks"
                )
            inputs = crossing
        if k == len(ranges) - 1:
            output: Any = out_node.args[0]
        else:
            nxt = _crossing(body, pos, ranges[k + 1][0], places)
            output = nxt[0] if len(nxt) == 1 else None
            if output is None:
                continue  # the next iteration raises, naming the cut
        pieces.append(_piece(model, graph, body[a:b], inputs, output))
    return pieces


def _ranges(cuts: list[int], n: int, names: Sequence[str]) -> list[tuple[int, int]]:
    if sorted(cuts) != cuts or len(set(cuts)) != len(cuts):
        raise PeerConfigError(f"pipeline split points must be distinct and in the model's order: {', '.join(names)}")
    if cuts and cuts[0] == 0:
        raise PeerConfigError(f"pipeline split point {names[0]!r} is the first layer: the first stage would be empty")
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


def _crossing(body: list[fx.Node], pos: dict[fx.Node, int], cut: int, places: list[fx.Node]) -> list[fx.Node]:
    """Values defined before position ``cut`` (or model inputs) and used at or after it, except
    parameter/buffer reads (``get_attr``: each piece reads its own)."""
    out = []
    for n in [*places, *body[:cut]]:
        if n.op == "get_attr":
            continue
        if any(u.op == "output" or pos.get(u, -1) >= cut for u in n.users):
            out.append(n)
    return out


def layer_costs(layers: Sequence[nn.Module], how: str = "params", sample: torch.Tensor | None = None,
                repeats: int = 3) -> list[float]:
    """One cost per layer for balancing stages: ``params`` (parameter count; a tied parameter counts
    once, in its first layer) or ``time`` (the measured forward time of each layer on ``sample``, the
    first layer's input, best of ``repeats``; no gradients)."""
    if how == "params":
        seen: set[int] = set()
        costs = []
        for m in layers:
            c = 0
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    c += p.numel()
            costs.append(float(c))
        return costs
    if how != "time":
        raise PeerConfigError(f"layer costs: 'params' or 'time', got {how!r}")
    if sample is None:
        raise PeerConfigError("layer costs by time need a sample input")
    costs, x = [], sample
    with torch.no_grad():
        for m in layers:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = m(x)
                best = min(best, time.perf_counter() - t0)
            costs.append(best)
            x = y
    return costs


def act_shapes(layers: Sequence[nn.Module], sample: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each layer's output but the last's, for ``sample`` (one micro-batch of the
    first layer's input): what one stage sends the next. One forward without gradients; every rank of
    a tensor-parallel group must call it together (the layers' collectives run)."""
    out = []
    with torch.no_grad():
        x = sample
        for m in layers[:-1]:
            x = m(x)
            if not isinstance(x, torch.Tensor):
                raise PeerConfigError(f"pipeline: a layer returned {type(x).__name__}, not one tensor")
            out.append((x.shape, x.dtype))
    return out


class _Called(Exception):
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("model called")
        self.args_, self.kwargs_ = args, kwargs


class _Probe(nn.Module):
    """Stands in for the model inside ``task.loss``: records what the loss passes to it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Called(args, kwargs)


class _Returns(nn.Module):
    """Stands in for the model inside ``task.loss`` on the last stage: returns the stage's output."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.out


def pipeline_io(loss: Callable[[nn.Module, Any], torch.Tensor]) -> tuple[Callable[[Any], torch.Tensor],
                                                                          Callable[[torch.Tensor, Any], torch.Tensor]]:
    """``(inputs, loss_fn)`` for a pipeline from a task's ``loss(model, batch)``: ``inputs(batch)`` is the
    tensor the loss passes to ``model(...)`` (what the first stage takes), ``loss_fn(output, batch)``
    the loss computed from the last stage's output. Raises ``PeerConfigError`` if the loss does not
    call the model with exactly one tensor."""

    def inputs(batch: Any) -> torch.Tensor:
        try:
            loss(_Probe(), batch)
        except _Called as c:
            if len(c.args_) != 1 or c.kwargs_ or not isinstance(c.args_[0], torch.Tensor):
                raise PeerConfigError("pipeline: the task's loss must call model(x) with one tensor "
                                      f"(got {len(c.args_)} positional and {sorted(c.kwargs_)} keyword arguments)") from None
            return c.args_[0]
        raise PeerConfigError("pipeline: the task's loss(model, batch) never called model(...)")

    def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return loss(_Returns(out), batch)

    return inputs, loss_fn


@dataclass
class PipelineSource:
    """What a pipeline needs from a task, for any model: ``layers`` (the pieces; the engine balances
    its P x V stages over them by ``costs``), ``inputs(batch)`` (the first stage's input),
    ``loss_fn(output, batch)`` (the last stage's loss; give the engine the micro-batches as targets),
    and the activation one stage sends the next (``act_shape``, ``act_dtype``: one micro-batch's)."""

    layers: list[nn.Module]
    costs: list[float]
    inputs: Callable[[Any], torch.Tensor]
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]
    act_shape: tuple[int, ...]
    act_dtype: torch.dtype


def pipeline_source(loss: Callable[[nn.Module, Any], torch.Tensor], model: nn.Module, stages: int,
                    sample: Any, split: Sequence[str] | None = None) -> PipelineSource:
    """The ``PipelineSource`` of ``model`` (plain or ``parallelize()``d) trained with the task's ``loss``,
    for ``stages`` pipeline stages; ``sample``: one micro-batch (for the activation's shape: one forward
    without gradients, every rank together). ``split``: ``stages - 1`` module names where stages start
    (None: every cut, balanced by parameter count). Raises ``PeerConfigError`` naming what does not fit."""
    layers = pipeline_layers(model, split)
    if split and len(layers) != stages:
        raise PeerConfigError(f"--pp-split gives {len(layers)} stages ({len(split)} split points), but the pipeline has {stages}")
    if len(layers) < stages:
        raise PeerConfigError(f"the model cuts into {len(layers)} pieces ({', '.join(split_points(model))}): too few for {stages} stages")
    inputs, loss_fn = pipeline_io(loss)
    with _rows_as_zeros(model):
        cut = act_shapes(layers, inputs(sample))
    if not split and len(set(cut)) > 1:
        # the finest cut: keep the cuts that pass the most common activation (under sequence parallelism the
        # stream is whole before the first split region and a chunk after it); merge the pieces around the others
        common = max(set(cut), key=cut.count)
        merged: list[list[nn.Module]] = [[layers[0]]]
        for piece, shape in zip(layers[1:], cut):
            if shape == common:
                merged.append([piece])
            else:
                merged[-1].append(piece)
        layers = [group[0] if len(group) == 1 else nn.Sequential(*group) for group in merged]
        cut = [common] * (len(layers) - 1)
        if len(layers) < stages:
            raise PeerConfigError(f"the model cuts into {len(layers)} pieces that pass one activation shape: too few for {stages} stages")
    shapes = set(cut)
    if len(shapes) != 1:
        raise PeerConfigError("pipeline: the pieces pass activations of different shapes "
                              f"({', '.join(str(tuple(sh)) for sh, _ in shapes)}): give --pp-split where the same activation flows")
    (size, dtype), = shapes
    return PipelineSource(layers, layer_costs(layers), inputs, loss_fn, tuple(size), dtype)


@contextlib.contextmanager
def _rows_as_zeros(model: nn.Module) -> Iterator[None]:
    """Inside: the model's ``PSEmbedding`` layers answer zeros of their output's shape without asking the
    PS (the probe of the activation shapes runs before the hybrid's tables exist)."""
    binding = sys.modules.get("worker.binding")  # loaded iff the model has PSEmbedding layers (it imports grpc)
    rows = [m for m in model.modules() if binding is not None and isinstance(m, binding.PSEmbedding)]
    for m in rows:
        m.forward = lambda ids, m=m: torch.zeros((*ids.shape[: -1 if m.mode else None], m.dim), device=ids.device)
    try:
        yield
    finally:
        for m in rows:
            del m.forward


def shared_parameters(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]]) -> list[nn.Parameter]:
    """Parameters two or more stages hold (a head tied to the embedding): after backward each holder
    has a partial gradient, to be summed over the pipeline group (ranks not holding one add zeros)."""
    holders: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, (a, b) in enumerate(bounds):
        for piece in layers[a:b]:
            for p in piece.parameters():
                holders.setdefault(id(p), set()).add(s)
                params[id(p)] = p
    return [params[i] for i, h in holders.items() if len(h) > 1]
