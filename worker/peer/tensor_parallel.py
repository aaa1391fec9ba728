"""Tensor parallelism (Megatron-LM) and sequence parallelism for peer mode.

Layers, over the ``tp_group`` of a ``ParallelMesh`` (T ranks):

- ``ColumnParallelLinear``: the weight's output rows split over T; the input is replicated (``f``:
  identity forward, all-reduce of the gradient backward), the output stays split.
- ``RowParallelLinear``: the weight's input columns split; each rank's partial product is summed
  (``g``: all-reduce forward, identity backward); the bias is replicated and added after the sum.
- Attention split by heads (q, k, v of heads ``[r*A/T, (r+1)*A/T)`` on rank r: a column-parallel
  ``qkv`` and a row-parallel ``proj``), the MLP by its hidden dimension (column ``fc``, row ``out``).
- ``VocabParallelEmbedding``: rank r holds vocabulary rows ``[r*V/T, (r+1)*V/T)``; ids outside it
  look up zeros and the partial embeddings are summed. The LM head is column-parallel over the
  vocabulary and ``vocab_parallel_cross_entropy`` computes the loss from the split logits (max,
  sum of exponentials and target logit each all-reduced: never the full ``(tokens, vocab)`` logits
  on one rank).

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al. 2022): the residual stream,
LayerNorms and dropout between the TP regions are split along the sequence (each TP rank holds
``S/T`` positions); ``f`` becomes an all-gather along the sequence (its backward a reduce-scatter)
and ``g`` a reduce-scatter (its backward an all-gather): the same bytes as the all-reduces, and the
activations outside the TP regions are 1/T per rank. The column-parallel linear under SP keeps only
its local sequence chunk for backward and gathers it again there (as Megatron does), so the
gathered input is not an activation held between forward and backward. Gradients of the replicated
parameters (LayerNorms, row-parallel biases, position embedding) are partial under SP (each rank
saw S/T positions) and are all-reduced over the TP group before the optimizer step.

Activations are kept sequence-first ``(S, B, H)`` inside the model, as Megatron keeps them, so a
split along the sequence is a contiguous chunk for the collectives.

Why hand-written rather than ``torch.distributed.tensor`` (DTensor) with its ``parallelize_module``
plans: (1) our ZeRO (worker/peer/core.py) and the ``ParamSync`` seam work on plain tensors in a
``FlatParams`` buffer; DTensor parameters would need every one of them to learn DTensor's
placements, and mixing a flat-buffer view with a DTensor is not supported; (2) the vocab-parallel
cross-entropy and the sequence-parallel linear that re-gathers its input in backward are not
DTensor plans (``loss_parallel`` materialises a DTensor of the logits, and its SP plans keep the
gathered input); (3) every collective here is an explicit ``torch.distributed`` call on a group
we created, which the peer debug fingerprints and traces already understand, and the whole
forward/backward is ~15 collectives per layer anyone can read. The cost is that each layer type
must be written by hand (four linears, an embedding, a loss).

- ``TPMultiheadAttention``: ``nn.MultiheadAttention`` with its heads split (same parameter names,
  forward signature and results), what ``worker.peer.parallelize`` puts in its place.

These layers serve two users: ``worker.peer.parallelize`` (any model, split by a plan: the layers
work on any layout, the sequence dimension given as ``seq_dim``, batch-first there) and
``TensorParallelGPT``, the ``gpt`` task's hand-written split, built from a plain
``worker.tasks.gpt.GPT``'s weights: every rank slices the same full model (copies, never views), so
the single-process reference is that very model, and ``full_parameters()`` gathers the shards back
in the plain model's parameter order.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.peer.mesh import ParallelMesh, PeerConfigError, check_divisibility

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardSpec", "TPMultiheadAttention", "TensorParallelGPT",
           "VocabParallelEmbedding", "activation_bytes", "tensor_parallel_task", "vocab_parallel_cross_entropy"]


# ---------------------------------------------------------------------------------------------- conjugate ops
def _world(group: Any) -> int:
    return dist.get_world_size(group)


def _gather_seq(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` (the sequence), in group-rank order."""
    t = _world(group)
    if t == 1:
        return x
    if dim:  # the collective concatenates along dim 0: gather sequence-first, then move it back
        return _gather_seq(x.movedim(dim, 0), group).movedim(0, dim)
    x = x.contiguous()
    out = torch.empty((x.shape[0] * t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """Sum over the group, this rank keeps its chunk of ``dim`` (the sequence)."""
    t = _world(group)
    if t == 1:
        return x
    if dim:
        return _reduce_scatter_seq(x.movedim(dim, 0), group).movedim(0, dim)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if _world(group) == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """``f``: identity forward; all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g, None


class _SplitToSeq(torch.autograd.Function):
    """SP entry: keep this rank's chunk of ``dim`` (no communication); all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return x.chunk(_world(group), dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _gather_seq(g, ctx.group, ctx.dim), None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    """SP ``g``: reduce-scatter along the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_seq(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return _gather_seq(g, ctx.group, ctx.dim), None, None


class _GatherFeatures(torch.autograd.Function):
    """A column-parallel output made whole: all-gather of the last dimension (or of ``dim``: an MoE
    layer's sequences under SP); backward keeps this rank's slice of the gradient (every rank holds
    the whole gradient of the whole output: what follows runs alike on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim % x.dim()
        return _gather_seq(x, group, ctx.dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return g.chunk(_world(ctx.group), ctx.dim)[dist.get_rank(ctx.group)].contiguous(), None, None


class _ColumnLinearSP(torch.autograd.Function):
    """``linear(all_gather_seq(x), w, b)`` keeping only the local ``x`` for backward (gathered again
    there), so the full-sequence input is not held between forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any, dim: int = 0) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.has_bias, ctx.dim = group, b is not None, dim
        ctx.save_for_backward(x, w)
        return F.linear(_gather_seq(x, group, dim), w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        full = _gather_seq(x, ctx.group, ctx.dim)
        g = g.contiguous()
        gx = _reduce_scatter_seq(g @ w, ctx.group, ctx.dim)
        gw = g.reshape(-1, g.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb, None, None


# -------------------------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class ShardSpec:
    """How a plain parameter maps to this rank's shard: the full tensor viewed as ``view`` (None:
    its own shape) is split into T equal chunks along ``dim`` (None: replicated, not split)."""

    name: str  # the plain model's parameter name
    full_shape: tuple[int, ...]
    view: tuple[int, ...] | None
    dim: int | None

    def shard(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This rank's shard as a new tensor (a copy: training the shard never changes ``full``)."""
        full = full.detach()
        if self.dim is None:
            return full.clone()
        if self.view is None:
            return full.chunk(world, self.dim)[rank].clone(memory_format=torch.contiguous_format)
        chunk = full.reshape(self.view).chunk(world, self.dim)[rank]
        return chunk.reshape(-1, *self.full_shape[1:]).clone(memory_format=torch.contiguous_format)  # the split runs inside dim 0

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        if self.dim is None:
            return shards[0].reshape(self.full_shape)
        if self.view is None:
            return torch.cat(shards, self.dim)
        part = list(self.view)
        part[self.dim] //= len(shards)
        return torch.cat([s.reshape(part) for s in shards], self.dim).reshape(self.full_shape)


def _param(t: torch.Tensor) -> nn.Parameter:
    """``t`` as a parameter: a given ``nn.Parameter`` is kept as is (a tied weight stays one object)."""
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group: ``(..., in) -> (..., out/T)``; input replicated
    (or, under sequence parallelism, split along dimension ``seq_dim`` and gathered here).
    ``gather_output``: the output all-gathered back to ``(..., out)`` (an LM head whose loss needs
    the whole logits; the backward keeps this rank's slice)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, sequence_parallel: bool,
                 seq_dim: int = 0, gather_output: bool = False) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.seq_dim, self.gather_output = seq_dim, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _ColumnLinearSP.apply(x, self.weight, self.bias, self.group, self.seq_dim)
        else:
            y = F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)
        return _GatherFeatures.apply(y, self.group) if self.gather_output else y  # type: ignore[no-any-return]


class RowParallelLinear(nn.Module):
    """Input features split over the TP group: ``(..., in/T) -> (..., out)`` summed over the group
    (under sequence parallelism: reduce-scattered along ``seq_dim``); the bias is replicated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, sequence_parallel: bool,
                 seq_dim: int = 0) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias) if bias is not None else None
        self.group, self.sequence_parallel, self.seq_dim = group, sequence_parallel, seq_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = _ReduceScatterToSeq.apply(y, self.group, self.seq_dim) if self.sequence_parallel else _ReduceFromTP.apply(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + V/T)`` of the embedding; ids ``(...)`` -> ``(..., dim)`` summed over the
    group (under sequence parallelism reduce-scattered along dim 0: ``(S, B)`` ids -> ``(S/T, B, dim)``).
    ``padding_idx``: the full-vocabulary padding row (its gradient stays zero), as ``nn.Embedding``'s."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any, sequence_parallel: bool,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.start, self.stop = start, start + weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel
        self.local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < self.stop else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        e = F.embedding(local, self.weight, self.local_padding).masked_fill(outside.unsqueeze(-1), 0.0)
        return (_ReduceScatterToSeq if self.sequence_parallel else _ReduceFromTP).apply(e, self.group)  # type: ignore[no-any-return]


class TPMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its heads split over the TP group: this rank holds heads
    ``[r*H/T, (r+1)*H/T)`` of q, k and v (column-parallel rows of ``in_proj_weight``, or of
    ``q/k/v_proj_weight`` when key/value dimensions differ) and the matching input columns of
    ``out_proj`` (row-parallel, bias replicated). Same parameter names, same ``forward`` signature and
    result as the module it replaces (``attn_mask`` 2-D or per-head 3-D, ``key_padding_mask``,
    ``need_weights`` with averaged or per-head weights, ``is_causal``, batch-first or not, unbatched
    inputs). Under sequence parallelism the inputs are this rank's chunk of the sequence (gathered
    here) and the output is reduce-scattered back to a chunk. ``_qkv_same_embed_dim`` is False so
    ``nn.TransformerEncoderLayer``'s fused inference kernel (which needs the whole ``in_proj_weight``)
    is never taken."""

    _qkv_same_embed_dim = False

    def __init__(self, *, embed_dim: int, num_heads: int, in_proj_weight: torch.Tensor | None,
                 qkv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, in_proj_bias: torch.Tensor | None,
                 out_weight: torch.Tensor, out_bias: torch.Tensor | None, dropout: float, batch_first: bool,
                 group: Any, sequence_parallel: bool) -> None:
        super().__init__()
        t = _world(group)
        self.embed_dim, self.num_heads, self.local_heads = embed_dim, num_heads, num_heads // t
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first, self.group, self.sequence_parallel = dropout, batch_first, group, sequence_parallel
        if in_proj_weight is not None:
            self.in_proj_weight: nn.Parameter | None = _param(in_proj_weight)
        else:
            assert qkv_weights is not None
            self.in_proj_weight = None
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight = (_param(w) for w in qkv_weights)
        self.in_proj_bias = _param(in_proj_bias) if in_proj_bias is not None else None
        # the residual stream is batch-first inside (N, L, E): the sequence is dim 1
        self.out_proj = RowParallelLinear(out_weight, out_bias, group, sequence_parallel, seq_dim=1)

    def _project(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """q (i=0), k (1) or v (2) of this rank's heads: ``(N, L, E_in) -> (N, heads, L, head_dim)``."""
        n = self.local_heads * self.head_dim
        w = self.in_proj_weight[i * n : (i + 1) * n] if self.in_proj_weight is not None else (
            self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[i]
        b = self.in_proj_bias[i * n : (i + 1) * n] if self.in_proj_bias is not None else None
        if self.sequence_parallel:
            y = _ColumnLinearSP.apply(x, w, b, self.group, 1)
        else:
            y = F.linear(_CopyToTP.apply(x, self.group), w, b)
        return y.unflatten(-1, (self.local_heads, self.head_dim)).transpose(1, 2)  # type: ignore[no-any-return]

    def _mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """One additive float mask ``(N or 1, heads or 1, L, S)`` (boolean True: masked out), this rank's heads."""
        out = None
        if attn_mask is not None:
            m = attn_mask
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(m, float("-inf"))
            m = m.to(q.dtype)
            if m.dim() == 3:  # (N * H, L, S): keep this rank's heads
                r = dist.get_rank(self.group)
                m = m.view(-1, self.num_heads, *m.shape[1:])[:, r * self.local_heads : (r + 1) * self.local_heads]
            out = m
        if key_padding_mask is not None:
            k = key_padding_mask
            if k.dtype == torch.bool:
                k = torch.zeros(k.shape, dtype=q.dtype, device=q.device).masked_fill(k, float("-inf"))
            k = k.to(q.dtype)[:, None, None, :]
            out = k if out is None else out + k
        return out

    def forward(  # noqa: D102 - nn.MultiheadAttention.forward's contract
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True, attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if unbatched or not self.batch_first:  # inputs (L, N, E): computed batch-first
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        q = self._project(query, 0)
        k = self._project(key, 1)
        v = self._project(value, 2)
        mask = self._mask(attn_mask, key_padding_mask, q)
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * (1.0 / self.head_dim) ** 0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            probs = torch.softmax(scores, dim=-1)
            a = F.dropout(probs, p) @ v if p else probs @ v
            if average_attn_weights:
                weights = _ReduceFromTP.apply(probs.sum(1), self.group) / self.num_heads
            else:
                weights = _GatherFeatures.apply(probs.movedim(1, -1), self.group).movedim(-1, 1)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = self.out_proj(a.transpose(1, 2).flatten(2))  # (N, L, E)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group: Any) -> torch.Tensor:  # type: ignore[override]
        m = logits.detach().max(-1).values
        if _world(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + logits.shape[-1])
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        e = z.exp()
        total = e.sum(-1)
        both = torch.stack([picked, total])
        if _world(group) > 1:
            dist.all_reduce(both, group=group)
        picked, total = both[0], both[1]
        ctx.save_for_backward(e.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, group: Any) -> torch.Tensor:
    """Per-token cross-entropy from logits split over the vocabulary: ``logits`` ``(..., V/T)`` holds
    columns ``[start, start + V/T)`` of this rank, ``target`` ``(...)`` the full-vocabulary ids. The
    same on every rank of ``group``; never gathers the logits (three all-reduces of ``(...)``)."""
    return _VocabParallelCE.apply(logits, target, start, group)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------- the model
RECOMPUTE = ("none", "selective")


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout keeping a one-byte (bool) mask for backward, as the fused CUDA kernel does
    and Megatron's accounting assumes (``F.dropout`` on CPU keeps a mask of ``x``'s dtype: 4 bytes
    per element in fp32). Draws one uniform number per element from the current random stream."""
    keep = torch.rand(x.shape, dtype=torch.float32, device=x.device) >= p
    return x * keep * (1.0 / (1.0 - p))


def _core_attention(y: torch.Tensor, heads: int, p: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Megatron's "core attention": ``(S, B, 3 * heads * hd)`` q, k, v -> ``(S, B, heads * hd)``.
    Without attention dropout (``p == 0``) one fused ``scaled_dot_product_attention`` (its flash
    kernel keeps only its output and the log-sum-exp for backward, never the ``heads x S x S``
    scores); with dropout the unfused form, as Megatron writes it: ``softmax(q k^T / sqrt(hd))`` under
    the causal ``mask``, dropout, then the product with v; autograd keeps the probabilities, the
    dropout mask and the dropped probabilities (the ``5 a s^2 b`` of Korthikanti et al.)."""
    s, b, n = y.shape
    hd = n // (3 * heads)
    q, k, v = y.view(s, b, 3, heads, hd).permute(2, 1, 3, 0, 4)  # each (B, heads, S, hd)
    if p == 0.0:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        assert mask is not None
        scores = (q @ k.transpose(-2, -1)) * (1.0 / hd**0.5)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        a = _dropout(probs, p) @ v
    return a.permute(2, 0, 1, 3).reshape(s, b, heads * hd)


class _TPBlock(nn.Module):
    """The ``gpt`` block split over the TP group, with the plain block's parameter names: attention
    by heads (``qkv`` column-, ``proj`` row-parallel), the MLP by hidden (``fc`` column, ``out`` row)."""

    def __init__(self, ln1: nn.LayerNorm, qkv: ColumnParallelLinear, proj: RowParallelLinear, ln2: nn.LayerNorm,
                 fc: ColumnParallelLinear | None, out: RowParallelLinear | None, local_heads: int, owner: Any,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj, self.ln2 = ln1, qkv, proj, ln2
        if mlp is None:
            self.fc: Any = fc
            self.out: Any = out
        self.mlp: Any = mlp  # an MoE layer (worker.peer.moe.MoE.tensor_parallel) in place of fc/out
        self.local_heads = local_heads
        self._owner = [owner]  # not a submodule

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qkv(x)  # (S, B, 3 * heads/T * head_dim): the full sequence
        return self.proj(self._owner[0].core_attention(y, self.local_heads))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = self._owner[0].drop
        x = x + drop(self.attention(self.ln1(x)))
        if self.mlp is not None:  # MoE: routing groups are sequences, so batch-first inside the layer
            return x + drop(self.mlp(self.ln2(x).transpose(0, 1)).transpose(0, 1))
        return x + drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TensorParallelGPT(nn.Module):
    """The ``gpt`` task's model split over a TP group, built from a plain ``GPT``'s weights (every TP
    rank passes the same full model and keeps its shards). ``forward(ids (B, S))`` returns this rank's
    vocabulary slice of the logits ``(B, S, V/T)``; ``loss(batch (B, S+1))`` the mean next-token
    cross-entropy (vocab-parallel, the same value on every TP rank).

    ``sequence_parallel``: split the residual stream, LayerNorms and dropout along the sequence
    (S divisible by T). ``dropout``: residual dropout (after the embedding, attention and MLP; the
    plain model has none, so the equivalence checks run without). ``rng``: the mesh's
    ``RNGStreams``; dropout on split activations (sequence-parallel regions) draws from its ``tp``
    stream, on replicated ones from the default stream (so the TP ranks' replicas stay equal).
    ``attention_dropout``: dropout on the attention probabilities (Megatron's; heads are split, so
    the ``tp`` stream); with it the attention core is the unfused softmax, whose scores autograd
    keeps. ``recompute="selective"``: the attention core is recomputed in backward instead of kept
    (``core_attention``); ``"none"``: everything kept.
    """

    def __init__(
        self, gpt: Any, group: Any, sequence_parallel: bool = False, rng: Any = None, dropout: float = 0.0,
        attention_dropout: float = 0.0, recompute: str = "none",
    ) -> None:
        super().__init__()
        if recompute not in RECOMPUTE:
            raise PeerConfigError(f"tensor-parallel recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}"
                                  " (full recompute is per layer, in the pipeline's stages)")
        for name, v in (("dropout", dropout), ("attention dropout", attention_dropout)):
            if not 0.0 <= v < 1.0:
                raise PeerConfigError(f"{name} must be in [0, 1), got {v}")
        t, r = _world(group), dist.get_rank(group)
        vocab, dim = int(gpt.tok.num_embeddings), int(gpt.tok.embedding_dim)
        seq, heads = int(gpt.pos.num_embeddings), int(gpt.blocks[0].heads) if len(gpt.blocks) else 1
        check_divisibility(1, t, 1, heads=heads, dim=dim, vocab=vocab, seq=seq, sequence_parallel=sequence_parallel)
        self.group, self.tp, self.tp_rank, self.sequence_parallel, self.rng = group, t, r, sequence_parallel, rng
        self.vocab, self.seq, self.dim, self.heads = vocab, seq, dim, heads
        self.vocab_start: int = r * (vocab // t)
        hd = dim // heads
        full = dict(gpt.named_parameters())
        specs: dict[str, ShardSpec] = {}

        def spec(name: str, view: tuple[int, ...] | None = None, d: int | None = None) -> torch.Tensor:
            p = full[name]
            specs[name] = ShardSpec(name, tuple(p.shape), view, d)
            return specs[name].shard(p, r, t)

        sp = sequence_parallel
        self.tok = VocabParallelEmbedding(spec("tok.weight", None, 0), self.vocab_start, group, sp)
        self.pos = nn.Parameter(spec("pos.weight"))
        blocks = []
        for i, blk in enumerate(gpt.blocks):
            pre = f"blocks.{i}."
            from worker.peer.moe import MoE  # (moe imports this module's collectives)

            moe = getattr(blk, "mlp", None)
            if moe is not None and not isinstance(moe, MoE) or moe is None and not hasattr(blk, "fc"):
                raise PeerConfigError(f"tensor parallelism: block {i}'s MLP is neither the plain fc/out MLP nor an MoE layer")
            ln1 = nn.LayerNorm(dim, eps=blk.ln1.eps).to(full[pre + "ln1.weight"].dtype)
            ln1.weight.data, ln1.bias.data = spec(pre + "ln1.weight"), spec(pre + "ln1.bias")
            qkv = ColumnParallelLinear(spec(pre + "qkv.weight", (3, heads, hd, dim), 1),
                                       spec(pre + "qkv.bias", (3, heads, hd), 1), group, sp)
            proj = RowParallelLinear(spec(pre + "proj.weight", None, 1), spec(pre + "proj.bias"), group, sp)
            ln2 = nn.LayerNorm(dim, eps=blk.ln2.eps).to(full[pre + "ln2.weight"].dtype)
            ln2.weight.data, ln2.bias.data = spec(pre + "ln2.weight"), spec(pre + "ln2.bias")
            if moe is not None:
                layer = moe.tensor_parallel(group, lambda n, d=None, pre=pre: spec(pre + "mlp." + n, None, d))
                layer.sp_group = group if sp else None  # (B, S/T, H) in and out: the layer gathers whole sequences
                blocks.append(_TPBlock(ln1, qkv, proj, ln2, None, None, heads // t, self, mlp=layer))
                continue
            fc = ColumnParallelLinear(spec(pre + "fc.weight", None, 0), spec(pre + "fc.bias", None, 0), group, sp)
            out = RowParallelLinear(spec(pre + "out.weight", None, 1), spec(pre + "out.bias"), group, sp)
            blocks.append(_TPBlock(ln1, qkv, proj, ln2, fc, out, heads // t, self))
        self.blocks = nn.ModuleList(blocks)
        self.ln = nn.LayerNorm(dim, eps=gpt.ln.eps).to(full["ln.weight"].dtype)
        self.ln.weight.data, self.ln.bias.data = spec("ln.weight"), spec("ln.bias")
        self.head = ColumnParallelLinear(spec("head.weight", None, 0), None, group, sp)
        self.dropout, self.attention_dropout, self.recompute = float(dropout), float(attention_dropout), recompute
        self._masks: dict[tuple[int, str], torch.Tensor] = {}
        missing = set(full) - set(specs)
        if missing:
            raise PeerConfigError(f"tensor parallelism: parameters with no shard rule: {sorted(missing)}")
        # the plain model's order, and which local parameter holds each
        local = dict(self.named_parameters())
        self.specs: list[tuple[ShardSpec, nn.Parameter]] = [
            (specs[name], local["pos" if name == "pos.weight" else name]) for name in full
        ]
        self._replicated = [p for s, p in self.specs if s.dim is None]

    # --------------------------------------------------------------------------------- forward pieces
    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the residual stream: split along the sequence under SP (the ``tp`` stream: each
        rank masks different positions), replicated otherwise (the default stream: masks agree)."""
        if not self.training or self.dropout == 0.0:
            return x
        ctx = self.rng.fork("tp") if (self.sequence_parallel and self.rng is not None) else contextlib.nullcontext()
        with ctx:
            return _dropout(x, self.dropout)

    def core_attention(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        """The attention core of a block (``_core_attention``) on this rank's ``heads``: attention
        dropout draws from the ``tp`` stream (the heads are split over TP), and with ``recompute ==
        "selective"`` (Korthikanti et al. 2022, section 4.2) the core's activations are not kept:
        only its input (q, k, v) is, and the core runs again in backward (``torch.utils.checkpoint``,
        which replays the random state, so the same dropout mask). The stream is forked outside the
        checkpoint: the recomputation then sees the state the forward saw, not the advanced stream."""
        p = self.attention_dropout if self.training else 0.0
        mask = None
        if p:
            key = (y.shape[0], str(y.device))
            if key not in self._masks:  # one (S, S) causal mask, shared by the layers
                self._masks[key] = torch.ones(y.shape[0], y.shape[0], dtype=torch.bool, device=y.device).triu(1)
            mask = self._masks[key]
        fork = self.rng.fork("tp") if (p and self.rng is not None) else contextlib.nullcontext()
        with fork:
            if self.recompute == "selective" and torch.is_grad_enabled():
                return checkpoint(_core_attention, y, heads, p, mask, use_reentrant=False)  # type: ignore[no-any-return]
            return _core_attention(y, heads, p, mask)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` ids -> the residual stream ``(S, B, dim)``: vocab-parallel embedding plus position
        (under SP: this rank's ``S/T`` positions, the embedding reduce-scattered)."""
        n, r = (ids.shape[1] // self.tp, self.tp_rank) if self.sequence_parallel else (ids.shape[1], 0)
        return self.drop(self.tok(ids.t()) + self.pos[r * n : (r + 1) * n].unsqueeze(1))

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` ids -> the final LayerNorm's output ``(S, B, dim)`` (``(S/T, B, dim)`` under SP)."""
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x)  # type: ignore[no-any-return]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids)).transpose(0, 1)  # type: ignore[no-any-return]

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``batch`` ``(B, S+1)``, as the ``gpt`` task's loss."""
        ids, target = batch[:, :-1], batch[:, 1:]
        if self.sequence_parallel and ids.shape[1] % self.tp:
            raise PeerConfigError(f"sequence parallel: sequence length {ids.shape[1]} not divisible by tp {self.tp}")
        return self.stage_loss(self.head(self.hidden(ids)), target)

    def stage_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token cross-entropy from this rank's vocabulary slice of the logits ``(S, B, V/T)`` and
        targets ``(B, S)`` (``vocab_parallel_cross_entropy``: never the full logits on one rank; a
        pipeline's last stage computes it too)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return vocab_parallel_cross_entropy(logits, targets.t(), self.vocab_start, self.group).mean()

    # --------------------------------------------------------------------------------- shards
    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every TP rank holds whole (LayerNorms, row-parallel biases, position embedding)."""
        return list(self._replicated)

    def full_parameters(self) -> list[torch.Tensor]:
        """The plain model's parameters, gathered from the TP group, in its order (a collective)."""
        return gather_whole(self.specs, self.group, self.tp)

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set this rank's shards from the plain model's named parameters."""
        load_whole(self.specs, tensors, self.tp_rank, self.tp)


def gather_whole(specs: list[tuple[ShardSpec, nn.Parameter]], group: Any, tp: int) -> list[torch.Tensor]:
    """The plain model's tensors from this rank's ``(ShardSpec, parameter)`` pairs, gathered over the TP
    ``group`` (``tp`` ranks), in the pairs' order: new tensors, never views of the parameters (a collective)."""
    out = []
    for s, p in specs:
        if s.dim is None or tp == 1:
            out.append(s.unshard([p.detach().clone()]))
            continue
        shards = [torch.empty_like(p) for _ in range(tp)]
        dist.all_gather(shards, p.detach().contiguous(), group=group)
        out.append(s.unshard(shards))
    return out


def load_whole(specs: list[tuple[ShardSpec, nn.Parameter]], tensors: Any, rank: int, tp: int) -> None:
    """Set each parameter of ``specs`` to rank ``rank``'s shard of the whole tensor ``tensors[name]``."""
    with torch.no_grad():
        for s, p in specs:
            p.copy_(s.shard(tensors[s.name].to(p), rank, tp))


# ---------------------------------------------------------------------------------------------- training
def tensor_parallel_task(
    task: Any, mesh: ParallelMesh, sequence_parallel: bool = False, dropout: float = 0.0, attention_dropout: float = 0.0,
    recompute: str = "none", rng: Any = None,
) -> Any:
    """The ``gpt`` task with its model replaced by this rank's ``TensorParallelGPT`` (built from the
    task's model; ``rng``: its random streams, default the mesh's); the task's loss and evaluation
    call the split model's own (vocab-parallel) loss. Batches: the trainer asks for worker
    ``mesh.dp_idx`` of ``mesh.dp``; every TP rank of a replica reads the same batch."""
    model = TensorParallelGPT(task.model, mesh.tp_group, sequence_parallel, rng if rng is not None else mesh.rng, dropout,
                              attention_dropout, recompute).to(mesh.device)
    return replace(task, model=model)


# ---------------------------------------------------------------------------------------------- measuring
@contextlib.contextmanager
def activation_bytes(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Count what autograd saves for backward inside the block (distinct storages, parameters
    excluded): the activation memory of a forward. Yields a dict filled at exit: ``bytes`` (total)
    and ``shapes`` (the shape of the first tensor seen on each storage)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}
    out: dict[str, Any] = {"bytes": 0, "shapes": []}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (st.nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    out["bytes"] = sum(n for n, _ in seen.values())
    out["shapes"] = [s for _, s in seen.values()]
