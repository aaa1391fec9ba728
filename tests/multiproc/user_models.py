"""Two user models the peer tests did not know before issue 29, as tasks (``module:function``):

- ``mha_task``: a pre-norm transformer tagger written with ``nn.MultiheadAttention`` (its own block)
  and ``nn.TransformerEncoderLayer(norm_first=True)`` layers, a learned position parameter, an untied
  head; each position is tagged with the running maximum of the tokens so far.
- ``gated_task``: a causal language model written with plain ``nn.Linear`` q/k/v/o projections (the
  head count in ``n_heads``), a gated MLP ``up``/``gate``/``down`` (SiLU), RMSNorm, a ``pos``
  embedding and a head tied to the token embedding.

Batches follow the Task contract: worker i's batch at step t is slice i of the global batch of step
t, so any data-parallel layout sees the global batch one process sees.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.tasks import Task


class MHABlock(nn.Module):
    """Pre-norm block written with nn.MultiheadAttention."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class MHATagger(nn.Module):
    """(B, S) ids -> (B, S, tags) logits."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int, tags: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.layers = nn.ModuleList([MHABlock(dim, heads, 2 * dim)] + [
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers - 1)
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.position[:, : ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, s = q.shape[:2]  # from the projection: under sequence parallelism x holds a chunk of the sequence
        q, k, v = (t.view(b, s, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GatedBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), Attention(dim, n_heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), GatedMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GatedLM(nn.Module):
    """(B, S) ids -> (B, S, vocab) next-token logits; the head shares the token embedding's weight."""

    def __init__(self, vocab: int, seq: int, dim: int, n_heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GatedBlock(dim, n_heads, 3 * dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def _data(vocab: int, seq: int, seed: int, tagger: bool) -> Any:
    """batches(i, n, b, start): slice i of a global batch of n*b sequences drawn for each step."""

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[torch.Tensor]:
        step = start_step
        while True:
            g = torch.Generator().manual_seed(seed * 100_003 + step)
            ids = torch.randint(0, vocab, (num_workers * batch_size, seq + 1), generator=g)
            if tagger:  # tags: running maximum of the tokens (mod the tag count is applied by the loss)
                ids[:, 1:] = ids[:, :-1].cummax(1).values
            yield ids[worker_index * batch_size : (worker_index + 1) * batch_size]
            step += 1

    return batches


def _optimizer(opt: str, lr: float) -> OptimizerSpec:
    return OptimizerSpec("adamw", {"lr": lr, "weight_decay": 0.01}) if opt == "adamw" else OptimizerSpec(opt, {"lr": lr})


def mha_task(seed: int = 0, vocab: int = 32, seq: int = 8, dim: int = 16, heads: int = 4, layers: int = 2,
             dtype: str = "float32", opt: str = "sgd", lr: float = 0.1, **_: Any) -> Task:
    torch.manual_seed(seed)
    tags = vocab
    model = MHATagger(vocab, seq, dim, heads, layers, tags).to(getattr(torch, dtype))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = m(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return Task("mha", model, _data(vocab, seq, seed, True), loss, metric="loss", higher_is_better=False,
                dense_optimizer=_optimizer(opt, lr))


def gated_task(seed: int = 0, vocab: int = 32, seq: int = 8, dim: int = 16, heads: int = 4, layers: int = 2,
               dtype: str = "float32", opt: str = "sgd", lr: float = 0.1, **_: Any) -> Task:
    torch.manual_seed(seed)
    model = GatedLM(vocab, seq, dim, heads, layers).to(getattr(torch, dtype))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = m(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return Task("gated", model, _data(vocab, seq, seed, False), loss, metric="loss", higher_is_better=False,
                dense_optimizer=_optimizer(opt, lr))


def _rows(vocab: int, dim: int, rows_here: bool, table: str) -> nn.Module:
    """Token rows: a ``PSEmbedding`` (on the PS in the hybrid; Adagrad lr 0.05, initial accumulator 0.1) or,
    ``rows_here``, an ``nn.Embedding`` the test sets to the rows' initial values (the one-process reference)."""
    if rows_here:
        return nn.Embedding(vocab, dim)
    from worker.binding import PSEmbedding

    return PSEmbedding(table, dim, optimizer="adagrad", lr=0.05, initial_accumulator=0.1)


class RowsMoELM(nn.Module):
    """(B, S) ids -> (B, S, vocab) next-token logits: token rows (``_rows``), a learned position, one MoE
    MLP (residual), a norm and a head."""

    def __init__(self, vocab: int, seq: int, dim: int, experts: int, rows_here: bool, table: str) -> None:
        super().__init__()
        from worker.peer.moe import MoE, MoEConfig

        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.norm1 = nn.LayerNorm(dim)
        self.moe = MoE(dim, MoEConfig(experts=experts, top_k=2, hidden=2 * dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.tok = _rows(vocab, dim, rows_here, table)  # built last: the dense parts draw the same initial values either way

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        x = x + self.moe(self.norm1(x))
        return self.head(self.norm(x))


class RowsLM(nn.Module):
    """(B, S) ids -> (B, S, vocab) next-token logits: token rows (``_rows``), a position embedding, gated
    blocks (q/k/v/o attention, up/gate/down MLP, RMSNorm), a final norm and an untied head."""

    def __init__(self, vocab: int, seq: int, dim: int, n_heads: int, layers: int, rows_here: bool, table: str) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GatedBlock(dim, n_heads, 2 * dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.tok = _rows(vocab, dim, rows_here, table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _rows_task(name: str, model: nn.Module, vocab: int, seq: int, seed: int, lr: float, rows_here: bool) -> Task:
    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        from worker.peer.moe import aux_loss

        logits = m(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)) + aux_loss(m)

    return Task(name, model, _data(vocab, seq, seed, False), loss, metric="loss", higher_is_better=False,
                dense_optimizer=_optimizer("sgd", lr), sparse_ids=None if rows_here else lambda b: {"tok": b[:, :-1]})


def rows_moe_task(seed: int = 0, vocab: int = 32, seq: int = 8, dim: int = 16, experts: int = 4, lr: float = 0.1,
                  rows_here: bool = False, name: str = "rowsmoe", **_: Any) -> Task:
    """A model with both PS rows and MoE layers (the hybrid with experts); SGD on the dense part. ``name``:
    the task's, and its table's prefix (runs on the same shards take different names)."""
    torch.manual_seed(seed)
    return _rows_task(name, RowsMoELM(vocab, seq, dim, experts, bool(rows_here), f"{name}/tok"), vocab, seq, seed, lr,
                      bool(rows_here))


def rows_task(seed: int = 0, vocab: int = 32, seq: int = 8, dim: int = 16, heads: int = 4, layers: int = 2, lr: float = 0.1,
              rows_here: bool = False, name: str = "rows", **_: Any) -> Task:
    """A transformer with PS token rows (``RowsLM``; the hybrid with --tp, --sequence-parallel, ZeRO); SGD on the
    dense part."""
    torch.manual_seed(seed)
    return _rows_task(name, RowsLM(vocab, seq, dim, heads, layers, bool(rows_here), f"{name}/tok"), vocab, seq, seed, lr,
                      bool(rows_here))


def rows_reference(task_fn: Any, steps: int, batch: int, **opts: Any) -> list[float]:
    """One process for a hybrid run of ``task_fn`` (``rows_task``, ``rows_moe_task``): the model with its rows
    in an ``nn.Embedding`` starting from the PS table's initial rows, Adagrad on them (the table's lr 0.05,
    initial accumulator 0.1), the task's SGD on the rest, the global batch; the loss of every step."""
    import numpy as np

    from ps.initializers import init_rows, table_key

    task, emb = task_fn(rows_here=True, **opts), task_fn(**opts).model.tok
    model = task.model
    with torch.no_grad():
        ids = np.arange(model.tok.num_embeddings)
        model.tok.weight.copy_(torch.from_numpy(init_rows(emb.init, table_key(emb.table, emb.seed), ids, emb.dim)))
    opt_d = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("tok.")], lr=task.dense_optimizer.hparams["lr"])
    opt_s = torch.optim.Adagrad([model.tok.weight], lr=0.05, initial_accumulator_value=0.1, eps=1e-10)
    data, out = task.batches(0, 1, batch, 0), []
    for _ in range(steps):
        opt_d.zero_grad()
        opt_s.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt_d.step()
        opt_s.step()
        out.append(float(loss.detach()))
    return out


# the explicit plans the automatic one is checked against
MHA_PLAN = {"tok": "vocab", "layers.0.attn": "colwise", "layers.0.fc1": "colwise", "layers.0.fc2": "rowwise",
            "layers.*.self_attn": "colwise", "layers.*.linear1": "colwise", "layers.*.linear2": "rowwise",
            "head": "vocab"}
GATED_PLAN = {"tok": "vocab", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
              "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
              "blocks.*.mlp.down": "rowwise", "lm_head": "vocab"}


def one_process_losses(task: Task, steps: int, batch: int) -> list[float]:
    """The tests' one-process reference: a copy of ``task``'s model trained with the task's own optimizer
    on the global ``batch`` (the task's data, seed 0), the loss of every step."""
    import copy

    from worker.peer.mesh import torch_optimizer

    model = copy.deepcopy(task.model)
    opt = torch_optimizer(task.dense_optimizer)(model.parameters())
    data, out = task.batches(0, 1, batch, 0), []
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out
