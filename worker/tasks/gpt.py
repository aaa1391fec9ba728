"""``gpt``: a small decoder-only transformer on a generated corpus (no download).

Model: token + learned position embeddings, ``layers`` pre-norm blocks (causal self-attention
through ``torch.nn.functional.scaled_dot_product_attention``, a 4x GELU MLP), a final LayerNorm
and an untied output head. Sizes come from the task options (``vocab``, ``seq``, ``dim``,
``layers``, ``heads``).

Corpus: an endless stream of sequences from a fixed random Markov chain over ``vocab`` tokens in
which every token has 4 possible successors with probabilities 0.55/0.25/0.12/0.08, so the best
achievable loss is the chain's entropy (``info["best_loss"]``, about 1.14 nats) against ln(vocab)
at the start. Sequence ``n`` of the stream depends only on (seed, n): step t's global batch is
sequences ``[t*g, (t+1)*g)`` and worker i's batch is slice i of it (the trainer's contract).

``info`` carries ``tokens_per_example`` and ``flops_per_token`` (forward + backward: 6 x the
non-embedding parameters + 12 x layers x dim x seq for attention, as in PaLM's MFU accounting), so
a run reports tokens/s and model FLOPs utilisation.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.peer.moe import MoE, MoEConfig, aux_loss
from worker.tasks import Task

__all__ = ["GPT", "MarkovCorpus", "make_task"]

_PROBS = np.array([0.55, 0.25, 0.12, 0.08])


class MarkovCorpus:
    """Sequences of ``seq + 1`` tokens (inputs and shifted targets) from a seeded Markov chain."""

    def __init__(self, vocab: int, seq: int, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, 7])
        self.vocab, self.seq, self.seed = vocab, seq, seed
        self.succ = np.stack([rng.choice(vocab, size=4, replace=False) for _ in range(vocab)]).astype(np.int64)
        self.cum = np.cumsum(_PROBS)
        self.entropy = float(-(_PROBS * np.log(_PROBS)).sum())

    def block(self, start: int, count: int, stream: int = 0) -> torch.Tensor:
        """Sequences ``start .. start+count`` of stream ``stream`` (0: training, 1: test): int64 (count, seq+1).
        Generated in blocks of 64 sequences keyed by (seed, stream, block), so any slice is reproducible."""
        first, last = start // 64, (start + count - 1) // 64
        parts = [self._block64(b, stream) for b in range(first, last + 1)]
        allrows = np.concatenate(parts)
        off = start - first * 64
        return torch.from_numpy(allrows[off : off + count])

    def _block64(self, b: int, stream: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream, b])
        out = np.empty((64, self.seq + 1), np.int64)
        out[:, 0] = rng.integers(0, self.vocab, 64)
        u = rng.random((64, self.seq))
        choice = np.searchsorted(self.cum, u, side="right").clip(max=3)
        for t in range(self.seq):
            out[:, t + 1] = self.succ[out[:, t], choice[:, t]]
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = mlp  # another MLP (an MoE layer) in place of fc/out
        if mlp is None:
            self.fc = nn.Linear(dim, 4 * dim)
            self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shapes from the projections, not from x: split by worker.peer.parallelize, qkv holds this rank's
        # heads (self.heads is divided by T) and, under sequence parallelism, the whole sequence
        y = self.qkv(self.ln1(x))
        b, t = y.shape[:2]
        q, k, v = y.view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        if self.mlp is not None:
            return x + self.mlp(self.ln2(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: ``(B, T) int64 -> (B, T, vocab)`` logits; ``T <= seq``."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int, moe: MoEConfig | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"gpt: dim {dim} is not divisible by heads {heads}")
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, MoE(dim, moe) if moe is not None and moe.is_moe(i) else None) for i in range(layers)
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_task(
    seed: int = 0, vocab: int = 256, seq: int = 64, dim: int = 64, layers: int = 2, heads: int = 4,
    lr: float = 3e-3, test_size: int = 64, dtype: str = "float32", moe_experts: int = 0, moe_top_k: int = 2,
    moe_every: int = 1, moe_hidden: int = 0, moe_capacity: float = 1.25, moe_aux: float = 0.01, moe_z: float = 0.001,
    **_: object,
) -> Task:
    torch.manual_seed(seed)
    moe = MoEConfig(moe_experts, moe_top_k, moe_every, moe_hidden, moe_capacity, moe_aux, moe_z) if moe_experts else None
    model = GPT(vocab, seq, dim, layers, heads, moe)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    corpus = MarkovCorpus(vocab, seq, seed)

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[torch.Tensor]:
        g = num_workers * batch_size
        step = start_step
        while True:
            yield corpus.block(step * g + worker_index * batch_size, batch_size)
            step += 1

    def cross_entropy(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        own = getattr(m, "loss", None)
        if callable(own):  # a split model (worker.peer.tensor_parallel) computes its own, vocab-parallel
            return own(batch)  # type: ignore[no-any-return]
        logits = m(batch[:, :-1])  # in fp32 at least (a float64 model keeps float64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        ce = cross_entropy(m, batch)
        return ce + aux_loss(m) if moe is not None else ce  # MoE: + the layers' balance and z-losses

    test = corpus.block(0, test_size, stream=1)

    def evaluate(m: nn.Module) -> dict[str, float]:
        dev = next(m.parameters()).device if any(True for _ in m.parameters()) else torch.device("cpu")
        with torch.no_grad():
            test_loss = float(cross_entropy(m, test.to(dev)))
        return {"test_loss": test_loss, "perplexity": math.exp(min(test_loss, 50.0))}

    n_params = sum(p.numel() for p in model.parameters())
    non_embedding = n_params - model.tok.weight.numel() - model.pos.weight.numel()
    if moe is not None:  # a token runs top_k of the experts: count the active expert parameters only
        expert_params = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
        non_embedding -= expert_params - expert_params * moe.top_k // moe.experts
    flops_per_token = 6 * non_embedding + 12 * layers * dim * seq
    return Task(
        "gpt", model, batches, loss, evaluate, metric="test_loss", higher_is_better=False,
        dense_optimizer=OptimizerSpec("adam", {"lr": lr}),
        info={
            "best_loss": corpus.entropy, "tokens_per_example": float(seq), "flops_per_token": float(flops_per_token),
            "params": float(n_params),
        },
    )
