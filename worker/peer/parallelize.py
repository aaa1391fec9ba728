"""Tensor parallelism by plan, for any model: ``parallelize(model, mesh, plan)``.

A plan maps module names (or ``fnmatch`` patterns matched dot by dot, as
``torch.distributed.tensor.parallel.parallelize_module`` matches its plans: ``blocks.*.attn.q``) to a
style:

- ``colwise``: an ``nn.Linear``'s output features split over the T ranks of the TP group
  (``ColumnParallelLinear``: the input replicated, the output this rank's slice). ``colwise:N``: the
  output is N equal fused segments (``qkv`` = ``colwise:3``: q, k and v each split by heads). On an
  ``nn.MultiheadAttention``: its heads split (``TPMultiheadAttention``; ``attention`` is a synonym).
- ``rowwise``: an ``nn.Linear``'s input features split; the partial products summed over the group
  (``RowParallelLinear``); the bias added once after the sum.
- ``vocab``: an ``nn.Embedding``'s rows split (``VocabParallelEmbedding``: whole output, summed), or an
  LM head ``nn.Linear``'s outputs (the vocabulary) split and all-gathered back, so the task's own loss
  sees the whole logits. A head tied to the embedding stays one parameter (the same rows).
- ``sequence``: a region (a block, a norm) run on this rank's chunk of the sequence (Megatron's
  sequence parallelism): the first ``sequence`` module in the model's module order splits the stream
  (dimension ``seq_dim``, batch-first by default); column-parallel (and vocab) layers from there on
  all-gather the sequence, row-parallel ones reduce-scatter it. The TP-replicated parameters of the
  regions and the row-parallel biases then hold partial gradients: ``tp_sum_parameters()``.
- ``replicate``: held whole on every rank (what a plan does not name is replicated too).
- ``experts``: an MoE layer (``worker.peer.moe.MoE``): every expert's MLP split by its hidden size
  (``fc`` column-, ``out`` row-parallel), the router replicated (``MoE.tensor_parallel``); the auto
  plan picks it for every MoE layer and leaves the layer's insides alone.

The head-count attribute (``heads``, ``n_heads``, ``num_heads``, ``n_head``, ``nhead``,
``num_attention_heads``; and ``kv_heads`` and its spellings) of the module whose ``nn.Linear`` children
are split column-wise is divided by T, so the model's own ``view(b, s, self.heads, -1)`` keeps working.

``plan="auto"`` finds the plan by structure and name: MoE layers, ``nn.MultiheadAttention`` (and the attention and
``linear1``/``linear2`` MLP of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``),
attention written with separate (``q``/``k``/``v``, ``q_proj``...) or fused (``qkv``, ``c_attn``,
``in_proj``...) projections and an output projection, two- and three-matrix MLPs (``fc1``/``fc2``,
``fc``/``out``, ``up``/``gate``/``down``, ``w1``/``w2``/``w3``...), token embeddings (names with ``pos``
stay replicated) and an LM head (tied or not). It prints the plan, and what it replicates and why.

Weights are copied, never viewed: ``parallelize`` returns a deep copy of ``model`` whose planned
modules hold this rank's shards; ``model`` keeps its own tensors (a single-process reference).
Every size is checked before anything is split: a ``PeerConfigError`` naming the module.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.peer.mesh import PeerConfigError
from worker.peer.moe import MoE
from worker.peer.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, ShardSpec, TPMultiheadAttention,
                                         VocabParallelEmbedding, _SplitToSeq, gather_whole, load_whole)

__all__ = ["STYLES", "TPLayout", "auto_plan", "describe", "load_plan", "parallelize", "plan_arg", "resolve_plan"]

STYLES = ("colwise", "rowwise", "vocab", "sequence", "replicate", "attention", "experts")
HEAD_ATTRS = ("heads", "n_heads", "num_heads", "n_head", "nhead", "num_attention_heads")
KV_HEAD_ATTRS = ("kv_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads")

# names the automatic plan recognises (a module's direct nn.Linear children)
_Q, _K, _V = ("q", "q_proj", "query", "wq", "to_q"), ("k", "k_proj", "key", "wk", "to_k"), ("v", "v_proj", "value", "wv", "to_v")
_FUSED = ("qkv", "qkv_proj", "wqkv", "Wqkv", "c_attn", "in_proj", "to_qkv", "query_key_value")
_ATT_OUT = ("o", "o_proj", "out_proj", "proj", "wo", "dense", "c_proj", "to_out", "out")
_UP = ("fc1", "fc", "up", "up_proj", "gate", "gate_proj", "w1", "w3", "c_fc", "linear1", "dense_h_to_4h", "wi", "wi_0", "wi_1")
_DOWN = ("fc2", "down", "down_proj", "w2", "c_proj", "linear2", "dense_4h_to_h", "out", "proj", "wo")
_HEAD = ("head", "lm_head", "output", "out_head", "logits", "decoder", "classifier", "unembed")
_NORMS = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


# ---------------------------------------------------------------------------------------------------- plans
def _style(value: Any, where: str) -> tuple[str, int]:
    """(style, fused segments) of a plan value such as ``colwise:3``."""
    if not isinstance(value, str):
        raise PeerConfigError(f"tensor-parallel plan: {where}: style must be a string, got {value!r}")
    base, _, n = value.partition(":")
    if base not in STYLES or (n and (base != "colwise" or not n.isdigit() or int(n) < 1)):
        raise PeerConfigError(f"tensor-parallel plan: {where}: unknown style {value!r} (use one of {', '.join(STYLES)}, or colwise:N)")
    return ("colwise" if base == "attention" else base), int(n or 1)


def load_plan(plan: Mapping[str, str] | str | None) -> dict[str, str] | str:
    """A plan as given: ``"auto"``, a dict, ``None`` (empty: replicate everything), or the path of a JSON
    file holding a dict ``{module name or pattern: style}``."""
    if plan is None:
        return {}
    if isinstance(plan, str):
        if plan == "auto":
            return "auto"
        try:
            with open(plan) as f:
                data = json.load(f)
        except OSError as e:
            raise PeerConfigError(f"tensor-parallel plan file {plan!r}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise PeerConfigError(f"tensor-parallel plan file {plan!r}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict):
            raise PeerConfigError(f"tensor-parallel plan file {plan!r}: expected an object {{module: style}}, got {type(data).__name__}")
        plan = data
    out = {}
    for k, v in plan.items():
        _style(v, repr(k))
        out[str(k)] = str(v)
    return out


def _matches(pattern: str, name: str) -> bool:
    """Dot-separated atoms matched one by one (``blocks.*.q`` matches ``blocks.3.q``, not ``blocks.3.x.q``)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def _heads_of(m: nn.Module, attrs: Iterable[str]) -> tuple[str, int] | None:
    for a in attrs:
        v = getattr(m, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return a, v
    return None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _mha_problem(m: nn.MultiheadAttention, t: int) -> str | None:
    if m.bias_k is not None or m.add_zero_attn:
        return "add_bias_kv / add_zero_attn are not split"
    if m.num_heads % t:
        return f"num_heads {m.num_heads} not divisible by tp {t}"
    return None


def auto_plan(model: nn.Module, t: int, sequence_parallel: bool = False) -> tuple[dict[str, str], list[str]]:
    """(plan, notes): the plan ``plan="auto"`` uses for ``model`` at TP size ``t``, and one note per
    module with parameters it leaves replicated, saying why. Pure: reads the model, changes nothing."""
    plan: dict[str, str] = {}
    notes: list[str] = []
    named = dict(model.named_modules())
    inside_mha: set[str] = set()  # and inside MoE layers: split as a whole
    for name, m in named.items():
        if isinstance(m, MoE):
            inside_mha.update(f"{name}.{c}" for c, _ in m.named_modules() if c)
            plan[name] = "experts"
        if isinstance(m, nn.MultiheadAttention):
            inside_mha.update(f"{name}.{c}" for c, _ in m.named_modules() if c)
            why = _mha_problem(m, t)
            if why:
                notes.append(f"{name}: replicated ({why})")
            else:
                plan[name] = "colwise"
        if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            hidden = m.linear1.out_features
            if hidden % t:
                notes.append(f"{name}.linear1/linear2: replicated (feed-forward size {hidden} not divisible by tp {t})")
            else:
                plan[f"{name}.linear1"], plan[f"{name}.linear2"] = "colwise", "rowwise"
    for name, m in named.items():
        if name in inside_mha or isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            continue
        lin = {c: x for c, x in m.named_children() if isinstance(x, nn.Linear)}
        if not lin:
            continue
        pre = f"{name}." if name else ""
        used: set[str] = set()
        heads = _heads_of(m, HEAD_ATTRS)
        q, k, v = (next((c for c in names if c in lin), None) for names in (_Q, _K, _V))
        fused = next((c for c in _FUSED if c in lin), None)
        att = [q, k, v] if q and k and v else [fused] if fused else []
        if att:
            out = next((c for c in _ATT_OUT if c in lin and c not in att), None)
            if heads is None:
                notes.append(f"{pre}{'/'.join(att)}: replicated (attention without a head-count attribute: {', '.join(HEAD_ATTRS)})")
            elif out is None:
                notes.append(f"{pre}{'/'.join(att)}: replicated (no output projection among {', '.join(_ATT_OUT)})")
            elif heads[1] % t:
                notes.append(f"{pre}{'/'.join(att)}: replicated ({name}.{heads[0]} = {heads[1]} not divisible by tp {t})")
            elif fused and lin[fused].out_features % (3 * t) == 0 and lin[fused].out_features == 3 * lin[out].in_features:
                plan[pre + fused], plan[pre + out] = "colwise:3", "rowwise"
                used |= {fused, out}
            elif not fused:
                kv = _heads_of(m, KV_HEAD_ATTRS)
                if kv is not None and kv[1] % t:
                    notes.append(f"{pre}{q}/{k}/{v}: replicated ({name}.{kv[0]} = {kv[1]} not divisible by tp {t})")
                else:
                    for c in (q, k, v):
                        plan[pre + c] = "colwise"  # type: ignore[operator]
                    plan[pre + out] = "rowwise"
                    used |= {q, k, v, out}  # type: ignore[arg-type]
            else:
                notes.append(f"{pre}{fused}: replicated (fused projection of {lin[fused].out_features} features is not 3 x "
                             f"{lin[out].in_features} split by tp {t})")
        ups = [c for c in _UP if c in lin and c not in used]
        down = next((c for c in _DOWN if c in lin and c not in used and c not in ups), None)
        if ups and down:
            hidden = lin[down].in_features
            shaped = all(lin[u].out_features == hidden and lin[u].in_features == lin[down].out_features for u in ups)
            if not shaped:
                pass  # not an MLP by shape
            elif hidden % t:
                notes.append(f"{pre}{'/'.join(ups)}/{down}: replicated (hidden size {hidden} not divisible by tp {t})")
            else:
                for u in ups:
                    plan[pre + u] = "colwise"
                plan[pre + down] = "rowwise"
    # embeddings and the LM head
    vocab_sizes: set[int] = set()
    for name, m in named.items():
        if isinstance(m, nn.Embedding):
            if "pos" in name.rsplit(".", 1)[-1].lower():
                notes.append(f"{name}: replicated (a position embedding)")
            elif m.max_norm is not None or m.sparse:
                notes.append(f"{name}: replicated (max_norm/sparse embeddings are not split)")
            elif m.num_embeddings % t:
                notes.append(f"{name}: replicated (vocabulary {m.num_embeddings} not divisible by tp {t})")
            else:
                plan[name] = "vocab"
                vocab_sizes.add(m.num_embeddings)
    tied = {id(m.weight): n for n, m in named.items() if isinstance(m, nn.Embedding) and plan.get(n) == "vocab"}
    for name, m in named.items():
        if not isinstance(m, nn.Linear) or name in plan or name in inside_mha:
            continue
        headish = name.rsplit(".", 1)[-1] in _HEAD or m.out_features in vocab_sizes or id(m.weight) in tied
        if not headish:
            continue
        if m.out_features % t:
            notes.append(f"{name}: replicated (output size {m.out_features} not divisible by tp {t})")
        else:
            plan[name] = "vocab"
    if sequence_parallel:
        lists = [(n, m) for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.Sequential)) and n]
        blocks = max(lists, key=lambda nm: len(nm[1]), default=None)
        if blocks is None:
            raise PeerConfigError("sequence parallelism (auto plan): the model has no ModuleList/Sequential of blocks to split")
        order = list(named)
        for i in range(len(blocks[1])):
            plan[f"{blocks[0]}.{i}"] = "sequence"
        last = order.index(f"{blocks[0]}.{len(blocks[1]) - 1}")
        for n in order[last + 1 :]:  # the final norm(s), beside the block list
            if isinstance(named[n], _NORMS) and _parent(n) == _parent(blocks[0]):
                plan[n] = "sequence"
    # what stays whole, and why (norms are replicated by design, and are not listed)
    split_roots = [p for p, st in plan.items() if st != "sequence"]
    noted = " ".join(notes)
    for name, m in named.items():
        if not any(True for _ in m.parameters(recurse=False)) or isinstance(m, _NORMS) or name in inside_mha:
            continue
        if name in split_roots or any(name.startswith(p + ".") for p in split_roots) or (name and name in noted):
            continue
        own = ", ".join(f"{name}.{n}" if name else n for n, _ in m.named_parameters(recurse=False))
        notes.append(f"{own}: replicated ({type(m).__name__}'s own parameters: not a recognised block)")
    return plan, notes


def resolve_plan(model: nn.Module, plan: Mapping[str, str] | str | None, t: int,
                 sequence_parallel: bool = False) -> tuple[dict[str, str], list[str]]:
    """(module name -> style for every planned module, notes): patterns expanded, the auto plan found,
    every size checked against ``t``. Raises ``PeerConfigError`` naming the module or pattern; pure."""
    given = load_plan(plan)
    notes: list[str] = []
    if given == "auto":
        resolved, notes = auto_plan(model, t, sequence_parallel)
    else:
        assert isinstance(given, dict)
        names = [n for n, _ in model.named_modules() if n]
        resolved = {}
        for pattern, style in given.items():
            hits = [n for n in names if _matches(pattern, n)]
            if not hits:
                sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise PeerConfigError(f"tensor-parallel plan: {pattern!r} names no module of the model (its modules: {sample})")
            for n in hits:
                if n in resolved and resolved[n] != style:
                    raise PeerConfigError(f"tensor-parallel plan: module {n!r} planned twice ({resolved[n]} and {style})")
                resolved[n] = style
        if sequence_parallel and "sequence" not in resolved.values():
            raise PeerConfigError("sequence parallelism with an explicit plan: mark the blocks (and final norm) 'sequence'")
    _check(model, resolved, t)
    return resolved, notes


def _check(model: nn.Module, plan: Mapping[str, str], t: int) -> None:
    """Every planned module fits its style and T divides its split sizes (the message names the module)."""
    named = dict(model.named_modules())
    bad: list[str] = []
    for name, value in plan.items():
        style, n = _style(value, repr(name))
        m = named[name]
        if style in ("sequence", "replicate"):
            continue
        if style == "experts" or isinstance(m, MoE):
            hidden = _expert_hidden(m) if isinstance(m, MoE) else 0
            if not isinstance(m, MoE) or style != "experts":
                bad.append(f"{name}: {type(m).__name__} cannot be {value} (experts is the style of an MoE layer, and its only one)")
            elif hidden % t:
                bad.append(f"{name}: the experts' hidden size {hidden} is not divisible by tp {t}")
            continue
        if style == "colwise" and isinstance(m, nn.MultiheadAttention):
            why = _mha_problem(m, t)
            if why:
                bad.append(f"{name}: {why}")
            continue
        kinds = (nn.Embedding, nn.Linear) if style == "vocab" else (nn.Linear,)
        if not isinstance(m, kinds):
            bad.append(f"{name}: {type(m).__name__} cannot be {value} (needs {' or '.join(k.__name__ for k in kinds)})")
            continue
        if isinstance(m, nn.Embedding):
            if m.num_embeddings % t:
                bad.append(f"{name}: vocabulary {m.num_embeddings} not divisible by tp {t}")
            if m.max_norm is not None or m.sparse:
                bad.append(f"{name}: an embedding with max_norm or sparse gradients cannot be split")
            continue
        if style in ("colwise", "vocab") and m.out_features % (n * t):
            bad.append(f"{name}: {m.out_features} output features not divisible by tp {t}" + (f" x {n} fused segments" if n > 1 else ""))
        if style == "rowwise" and m.in_features % t:
            bad.append(f"{name}: {m.in_features} input features not divisible by tp {t}")
        if style == "colwise":
            parent = named[_parent(name)]
            for attrs in (HEAD_ATTRS, KV_HEAD_ATTRS):
                h = _heads_of(parent, attrs)
                if h is not None and h[1] % t:
                    bad.append(f"{_parent(name) or '(root)'}.{h[0]} = {h[1]} heads not divisible by tp {t}")
    if bad:
        raise PeerConfigError("tensor-parallel plan does not fit: " + "; ".join(dict.fromkeys(bad)))


def _expert_hidden(m: MoE) -> int:
    expert: Any = next(iter(m.experts.values()))
    return int(expert.fc.out_features)


# ---------------------------------------------------------------------------------------------------- result
@dataclass
class TPLayout:
    """What ``parallelize`` did: the resolved plan, one ``(ShardSpec, parameter)`` per parameter of the
    source model (its ``named_parameters()`` order and names; ``dim=None``: held whole), and the
    parameters whose gradients are partial sums over the TP ranks (sequence parallelism only)."""

    group: Any
    tp: int
    tp_rank: int
    plan: dict[str, str]
    specs: list[tuple[ShardSpec, nn.Parameter]]
    tp_sum: list[nn.Parameter]
    sequence_parallel: bool
    notes: list[str] = field(default_factory=list)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every TP rank holds whole."""
        return [p for s, p in self.specs if s.dim is None]

    def tp_sum_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradient must be summed over the TP group after backward (empty without
        sequence parallelism: elsewhere the conjugate collectives already make every gradient whole)."""
        return list(self.tp_sum)

    def full_parameters(self) -> list[torch.Tensor]:
        """The source model's tensors, gathered over the TP group, in its order (a collective); new
        tensors, never views of the parameters."""
        return gather_whole(self.specs, self.group, self.tp)

    def load_full(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Set this rank's shards from the source model's whole tensors, by name."""
        load_whole(self.specs, tensors, self.tp_rank, self.tp)


def _tp_of(mesh: Any) -> tuple[Any, int, int]:
    group = getattr(mesh, "tp_group", mesh)
    return group, dist.get_world_size(group), dist.get_rank(group)


def parallelize(model: nn.Module, mesh: Any, plan: Mapping[str, str] | str | None = "auto", *,
                sequence_parallel: bool = False, seq_dim: int = 1, verbose: bool = True) -> nn.Module:
    """A copy of ``model`` split over the TP group of ``mesh`` (a ``ParallelMesh``, or a process group)
    by ``plan`` (see the module's docstring; ``"auto"``, a dict, a JSON file's path, or None).

    Returns a deep copy of ``model`` (same class and forward) whose planned modules hold copies of this
    rank's shards; ``model`` is not changed. The copy carries ``tp_layout`` (a ``TPLayout``) and, for the
    syncs, ``specs``, ``tp``, ``tp_rank``, ``group``, ``sequence_parallel``, ``replicated_parameters()``,
    ``tp_sum_parameters()``, ``full_parameters()`` and ``load_full()``. ``sequence_parallel``: with
    ``plan="auto"``, mark the blocks and the final norm ``sequence`` (an explicit plan marks its own).
    ``seq_dim``: the sequence dimension of the activations (1: batch-first). ``verbose``: global rank 0
    prints the plan (always for ``auto``) and what stays replicated. Every rank of the group must call
    this with the same model and plan; no collective runs here."""
    group, t, r = _tp_of(mesh)
    resolved, notes = resolve_plan(model, plan, t, sequence_parallel)
    styles = {n: _style(v, n) for n, v in resolved.items()}
    sp = any(s == "sequence" for s, _ in styles.values())
    order = [n for n, _ in model.named_modules()]
    first_seq = min((order.index(n) for n, (s, _) in styles.items() if s == "sequence"), default=None)
    regions = [n for n, (s, _) in styles.items() if s == "sequence"]
    src = dict(model.named_modules())
    new = copy.deepcopy(model)
    src_names = {id(p): n for n, p in model.named_parameters()}
    specs: dict[str, ShardSpec] = {}
    made: dict[int, tuple[ShardSpec, nn.Parameter]] = {}
    tp_sum: list[nn.Parameter] = []

    def shard(p: torch.Tensor | None, view: tuple[int, ...] | None, d: int | None) -> nn.Parameter | None:
        """This rank's copy of source parameter ``p`` split along ``d`` of ``view``; a tied parameter once."""
        if p is None:
            return None
        name = src_names[id(p)]
        spec = ShardSpec(name, tuple(p.shape), view, d)
        if id(p) in made:
            old, q = made[id(p)]
            if (old.view, old.dim) != (view, d):
                raise PeerConfigError(f"tensor-parallel plan: {name!r} is shared (tied) by modules split in different ways")
            return q
        q = nn.Parameter(spec.shard(p, r, t), requires_grad=p.requires_grad)
        made[id(p)] = (spec, q)
        specs[name] = spec
        return q

    def seq_on(name: str) -> bool:
        return sp and first_seq is not None and order.index(name) > first_seq

    heads_divided: set[str] = set()
    for name, (style, n) in sorted(styles.items(), key=lambda kv: order.index(kv[0])):
        m = src[name]
        if style in ("sequence", "replicate"):
            continue
        if isinstance(m, MoE):  # its own split (copies), each parameter recorded under the source's name
            moe = m.tensor_parallel(group, lambda sub, d=None, m=m: shard(m.get_parameter(sub), None, d))
            moe.sp_group = group if seq_on(name) else None  # it gathers whole sequences (seq_dim 1, batch-first)
            new_m: nn.Module = moe
        elif isinstance(m, nn.MultiheadAttention):
            e, h = m.embed_dim, m.num_heads
            hd = e // h
            tpm = TPMultiheadAttention(
                embed_dim=e, num_heads=h,
                in_proj_weight=shard(m.in_proj_weight, (3, h, hd, e), 1) if m._qkv_same_embed_dim else None,
                qkv_weights=None if m._qkv_same_embed_dim else (
                    shard(m.q_proj_weight, None, 0), shard(m.k_proj_weight, None, 0), shard(m.v_proj_weight, None, 0)),  # type: ignore[arg-type]
                in_proj_bias=shard(m.in_proj_bias, (3, h, hd), 1), out_weight=shard(m.out_proj.weight, None, 1),  # type: ignore[arg-type]
                out_bias=shard(m.out_proj.bias, None, None), dropout=m.dropout, batch_first=m.batch_first, group=group,
                sequence_parallel=seq_on(name),
            )
            if seq_on(name) and tpm.out_proj.bias is not None:
                tp_sum.append(tpm.out_proj.bias)
            new_m = tpm
        elif isinstance(m, nn.Embedding):
            new_m = VocabParallelEmbedding(shard(m.weight, None, 0), r * (m.num_embeddings // t), group, False,  # type: ignore[arg-type]
                                           m.padding_idx)
        elif style == "rowwise":
            new_m = RowParallelLinear(shard(m.weight, None, 1), shard(m.bias, None, None), group, seq_on(name), seq_dim)  # type: ignore[arg-type]
            if seq_on(name) and new_m.bias is not None:
                tp_sum.append(new_m.bias)
        else:  # colwise (n fused segments) or a vocab head
            o = m.out_features
            view_w = (n, o // n, m.in_features) if n > 1 else None
            view_b = (n, o // n) if n > 1 else None
            d = 1 if n > 1 else 0
            new_m = ColumnParallelLinear(shard(m.weight, view_w, d), shard(m.bias, view_b, d), group, seq_on(name), seq_dim,  # type: ignore[arg-type]
                                         gather_output=style == "vocab")
            parent = _parent(name)
            if style == "colwise" and parent not in heads_divided:
                heads_divided.add(parent)
                holder = new.get_submodule(parent) if parent else new
                for attrs in (HEAD_ATTRS, KV_HEAD_ATTRS):
                    h = _heads_of(holder, attrs)
                    if h is not None:
                        setattr(holder, h[0], h[1] // t)
        holder = new.get_submodule(_parent(name)) if _parent(name) else new
        setattr(holder, name.rpartition(".")[2], new_m)
        if isinstance(m, nn.MultiheadAttention):
            for enc in new.modules():  # the nested-tensor fast path reads in_proj_weight whole
                if isinstance(enc, nn.TransformerEncoder):
                    enc.use_nested_tensor = False
    if sp:
        first = min((n for n in regions), key=order.index)
        mod = new.get_submodule(first)

        def split(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (_SplitToSeq.apply(args[0], group, seq_dim), *args[1:])

        mod.register_forward_pre_hook(split)
        mine = {id(p) for _, p in made.values()}  # and the MoE layers' (their own copies): whole sequences, whole gradients
        mine |= {id(p) for m in new.modules() if isinstance(m, MoE) for p in m.parameters()}
        for region in regions:  # replicated parameters run on a chunk of the sequence: partial gradients
            for p in new.get_submodule(region).parameters():
                if id(p) not in mine and all(p is not q for q in tp_sum):
                    tp_sum.append(p)
    params = dict(new.named_parameters(remove_duplicate=False))
    pairs = []
    for name, p in model.named_parameters():
        spec = specs.get(name) or ShardSpec(name, tuple(p.shape), None, None)
        pairs.append((spec, params[name]))
    extra = {id(p) for p in new.parameters()} - {id(q) for _, q in pairs}
    assert not extra, "parallelize: a parameter of the split model has no source parameter"
    layout = TPLayout(group, t, r, dict(resolved), pairs, tp_sum, sp, notes)
    _attach(new, layout)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(describe(layout, auto=plan == "auto"), file=sys.stderr, flush=True)
    return new


def _attach(m: nn.Module, layout: TPLayout) -> None:
    """The layout on the module, under the names the TP syncs and checkpoints read."""
    object.__setattr__(m, "tp_layout", layout)
    for name in ("replicated_parameters", "tp_sum_parameters", "full_parameters", "load_full"):
        object.__setattr__(m, name, getattr(layout, name))
    for name in ("specs", "group", "tp", "tp_rank", "sequence_parallel"):
        object.__setattr__(m, name, getattr(layout, name))


def describe(layout: TPLayout, auto: bool = False) -> str:
    """The plan as printed: one line per split module, then what stays replicated and why."""
    lines = [f"tessera: tensor-parallel plan ({'auto, ' if auto else ''}tp={layout.tp}"
             f"{', sequence parallel' if layout.sequence_parallel else ''}):"]
    lines += [f"  {n or '(root)'}: {s}" for n, s in layout.plan.items()]
    lines += [f"  {note}" for note in layout.notes]
    if not layout.plan:
        lines.append("  (nothing split: every parameter replicated)")
    return "\n".join(lines)


def plan_arg(value: str) -> Mapping[str, str] | str | None:
    """``--tp-plan`` as given on the command line: ``auto``, a JSON file, or inline JSON."""
    if value.strip().startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise PeerConfigError(f"--tp-plan: not JSON ({e.msg})") from None
        return load_plan(data)
    if value != "auto" and not os.path.exists(value):
        raise PeerConfigError(f"--tp-plan {value!r}: no such file (give auto, a JSON file or inline JSON)")
    return value
