"""ZeRO stages 1, 2 and 3 as ``ParamSync``s: optimizer state, gradients and parameters sharded
over the data-parallel ranks.

Layout. Every module that owns parameters directly (a Linear, a LayerNorm, an Embedding: a
"unit") gets one flat buffer of its parameters, padded to a multiple of the world size and split
evenly: rank r owns chunk r of every unit. The rank's chunks, concatenated, are its *shard*: one
``nn.Parameter`` (fp32 master values, with its gradient) that any ``torch.optim`` optimizer
steps, so optimizer state is 1/D of plain DP at every stage.

- Stage 1: every unit's full gradient is kept; when a unit's gradients are all in (post-accumulate-
  grad hooks), its reduce-scatter is launched (async, overlapping the rest of backward) into the
  rank's shard gradient. After the optimizer step, the updated chunks are all-gathered.
- Stage 2: as stage 1, but a unit's full gradient exists only from its backward until its
  reduce-scatter is done; between steps a rank keeps only its shard's gradient.
- Stage 3: parameters too: a unit's full values are all-gathered just before its forward (forward
  pre-hook) and freed after it, gathered again just before its backward (a hook on its output's
  gradient) and freed when its gradients are in. Between steps a rank keeps only its shard.

Freeing is ``untyped_storage().resize_(0)`` on the unit buffer: the parameters and gradients stay
views of it (autograd's saved references stay valid) and are refilled in place.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worker.peer.checkpoint import (
    Checkpointing,
    CheckpointReader,
    Piece,
    optimizer_pieces,
    state_keys,
)
from worker.peer.data_parallel import optimizer_state_bytes
from worker.peer.debug import fingerprint
from worker.peer.mesh import (
    PeerConfigError,
    all_gather_into,
    check_agreement,
    reduce_scatter_into,
    torch_optimizer,
)
from worker.sync_api import Fetched, Grads, ParamSync, PushResult

__all__ = ["ZeroSync"]


@dataclass
class _Unit:
    module: nn.Module
    params: list[nn.Parameter]
    numel: int
    chunk: int  # elements per rank
    offset: int  # of this unit's chunk in the rank's shard
    full: torch.Tensor  # world * chunk: the unit's parameters (views into it)
    grad: torch.Tensor  # world * chunk: the unit's gradients (views into it)
    pending: int = 0
    works: list[Any] = field(default_factory=list)
    gathered: bool = True
    grad_alive: bool = True


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    want = t.numel() * t.element_size()
    if t.untyped_storage().size() != want:
        t.untyped_storage().resize_(want)


class ZeroSync(ParamSync, Checkpointing):
    """ZeRO ``stage`` 1, 2 or 3 over the default process group (initialised before construction).

    ``model`` is moved to ``device``; ``optimizer`` is a task's ``OptimizerSpec`` or a factory
    ``params -> torch.optim.Optimizer`` (called with the one shard parameter). ``settings``: extra
    fields every rank must agree on. Not thread-safe; collectives on the calling thread.
    """

    pipelined = False

    def __init__(
        self, model: nn.Module, optimizer: Any, *, stage: int, device: torch.device | str = "cpu",
        settings: dict[str, Any] | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise PeerConfigError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        if not dist.is_initialized():
            raise PeerConfigError("ZeroSync needs an initialised process group (worker.peer.init_mesh)")
        self.stage = stage
        self.name = f"zero{stage}"
        self.device = torch.device(device)
        self.settings = dict(settings or {})
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.model = model.to(self.device)
        self.flat = None  # type: ignore[assignment]  # sharded: see parameters()
        self.units: list[_Unit] = []
        offset = 0
        names = {id(p): n for n, p in model.named_parameters()}
        for m in model.modules():
            ps = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not ps:
                continue
            n = sum(p.numel() for p in ps)
            chunk = -(-n // self.world)
            dtype = ps[0].dtype
            full = torch.zeros(chunk * self.world, dtype=dtype, device=self.device)
            grad = torch.zeros_like(full)
            off = 0
            with torch.no_grad():
                for p in ps:
                    full[off : off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = full[off : off + p.numel()].view(p.shape)
                    p.grad = grad[off : off + p.numel()].view(p.shape)
                    off += p.numel()
            self.units.append(_Unit(m, ps, n, chunk, offset, full, grad))
            offset += chunk
        self.params = [p for u in self.units for p in u.params]
        self.numel = sum(u.numel for u in self.units)
        dtype = self.units[0].full.dtype if self.units else torch.float32
        self.shard = nn.Parameter(torch.zeros(offset, dtype=dtype, device=self.device))
        self.shard_grad = self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = torch_optimizer(optimizer)([self.shard])
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._names = names
        self._hooks: list[Any] = []
        self.tracer: Any = None  # a worker.peer.trace.Tracer: reduce-scatters and all-gathers on the timeline
        self._syncing = True
        self._inflight: list[_Unit] = []  # stage 2/3: units whose reduce-scatter may still run
        self.comm_wait_s = 0.0
        self.peak_grad_bytes = 0

    # ------------------------------------------------------------------ membership
    def join(self) -> int:
        check_agreement({
            "mode": self.name, "numel": self.numel, "units": len(self.units), "shard": self.shard.numel(), **self.settings,
        }, self.device if dist.get_backend() == "nccl" else torch.device("cpu"))
        with torch.no_grad():
            for u in self.units:
                fingerprint("broadcast", u.full)
                dist.broadcast(u.full, 0)  # rank 0's initial values everywhere
                self._my_chunk_of(u.full, u, into_shard=True)
        start = self._resume()  # the newest checkpoint, if checkpointing is on and there is one
        if start:
            self._share_chunks()
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._ready))
            if self.stage == 3:
                self._hooks.append(u.module.register_forward_pre_hook(self._before_forward))
            if self.stage >= 2:  # stage 2: the output's gradient hook allocates the unit's gradient
                self._hooks.append(u.module.register_forward_hook(self._after_forward))
        if self.stage >= 2:
            for u in self.units:
                _free(u.grad)
                u.grad_alive = False
        if self.stage == 3:
            for u in self.units:
                _free(u.full)
                u.gathered = False
        self._reset()
        return start

    def leave(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _my_chunk_of(self, full: torch.Tensor, u: _Unit, into_shard: bool) -> torch.Tensor:
        mine = full[self.rank * u.chunk : (self.rank + 1) * u.chunk]
        if into_shard:
            self.shard.data[u.offset : u.offset + u.chunk].copy_(mine)
        return mine

    # ------------------------------------------------------------------ stage 3: parameters just in time
    def _gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        _alloc(u.full)
        fingerprint("all_gather", u.full)
        with torch.no_grad(), self._span(f"all_gather {self._label(u)}"):
            all_gather_into(u.full, self.shard.data[u.offset : u.offset + u.chunk])
        u.gathered = True

    def _label(self, u: _Unit) -> str:
        return self._names.get(id(u.params[0]), "?").rsplit(".", 1)[0]

    def _span(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.tracer.span(name, "comm") if self.tracer is not None else contextlib.nullcontext()

    def _release(self, u: _Unit) -> None:
        if self.stage == 3 and u.gathered:
            _free(u.full)
            u.gathered = False

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(self._unit_of[id(next(p for p in module.parameters(recurse=False) if p.requires_grad))])

    def _after_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        u = self._unit_of[id(next(p for p in module.parameters(recurse=False) if p.requires_grad))]
        if torch.is_grad_enabled():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            hooked = False
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u: self._before_backward(u))
                    hooked = True
            if not hooked:
                return  # nothing will flow back through it: keep it (rare)
        self._release(u)

    def _before_backward(self, u: _Unit) -> None:
        self._gather(u)
        self._grad_alloc(u)

    # ------------------------------------------------------------------ gradients
    def _grad_alloc(self, u: _Unit) -> None:
        if not u.grad_alive:
            _alloc(u.grad)
            u.grad.zero_()
            u.grad_alive = True
            self._track_grad_bytes()

    def _track_grad_bytes(self) -> None:
        alive = sum(u.grad.numel() * u.grad.element_size() for u in self.units if u.grad_alive)
        self.peak_grad_bytes = max(self.peak_grad_bytes, alive + self.shard_grad.numel() * self.shard_grad.element_size())

    def zero_grad(self) -> None:
        for u in self.units:
            if self.stage == 1:
                u.grad.zero_()
            elif u.grad_alive:  # stage 2/3: allocated lazily, in each unit's backward
                _free(u.grad)
                u.grad_alive = False
        self.shard_grad.zero_()
        self._reset()

    def _reset(self) -> None:
        for u in self.units:
            u.pending, u.works = len(u.params), []
        self._inflight = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation micro-batches: full gradients add up locally (stage 2/3 keep them for the step)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _ready(self, p: torch.Tensor) -> None:
        u = self._unit_of[id(p)]
        if not self._syncing:
            return
        u.pending -= 1
        if u.pending == 0:
            self._launch(u)

    def _launch(self, u: _Unit) -> None:
        """The unit's gradients are in: reduce-scatter them (mean over ranks) into the shard gradient."""
        if not u.grad_alive:  # no gradient reached it this step (stage 2/3): zeros, still exchanged
            self._grad_alloc(u)
        u.grad.div_(self.world)
        fingerprint("reduce_scatter", u.grad)
        u.works = [reduce_scatter_into(self._scratch(u), u.grad, async_op=True)]
        if self.tracer is not None:
            self.tracer.work(f"reduce_scatter {self._label(u)}", u.works[0], bytes=u.grad.numel() * u.grad.element_size())
        if self.stage == 3:
            self._release(u)  # its values are not needed again until the next forward
        u.pending = -1  # launched
        if self.stage >= 2:
            # at most 2 reduce-scatters in flight: the older ones are waited for and their full gradients freed
            self._inflight.append(u)
            while len(self._inflight) > 2:
                self._retire(self._inflight.pop(0))

    def _retire(self, u: _Unit) -> None:
        for w in u.works:
            w.wait()
        u.works = []
        if self._syncing and u.grad_alive:
            _free(u.grad)
            u.grad_alive = False

    def _scratch(self, u: _Unit) -> torch.Tensor:
        return self.shard_grad[u.offset : u.offset + u.chunk]

    def fetch(self, step: int, batch: Any) -> Fetched:
        return Fetched(step, batch, step)

    def gradients(self, step: int) -> Grads:
        return Grads(None)

    def push(self, step: int, grads: Grads) -> PushResult:
        """Finish every unit's reduce-scatter (launching those backward never reached, in unit
        order), step the optimizer on the shard, share the updated chunks (stage 1/2)."""
        t0 = time.perf_counter()
        for u in self.units:
            if u.pending != -1:
                self._launch(u)
        for u in self.units:
            for w in u.works:
                w.wait()
            u.works = []
            if self.stage >= 2 and u.grad_alive:
                _free(u.grad)
                u.grad_alive = False
        self._inflight.clear()
        self.comm_wait_s += time.perf_counter() - t0
        self.optimizer.step()
        if self.stage < 3:
            self._share_chunks()
        self._maybe_save(step + 1)
        return PushResult()

    def _share_chunks(self) -> None:
        """Every unit's full values from the ranks' updated chunks (stage 1/2; stage 3 gathers just in time)."""
        with torch.no_grad(), self._span("all_gather updated chunks"):
            for u in self.units:
                if u.gathered:
                    fingerprint("all_gather", u.full)
                    all_gather_into(u.full, self.shard.data[u.offset : u.offset + u.chunk])

    # ------------------------------------------------------------------ checkpoints
    def _owned(self) -> list[tuple[str, int, int, int]]:
        """(parameter name, its first element this rank owns, how many, where they are in the shard)."""
        out = []
        for u in self.units:
            mine_lo, mine_hi = self.rank * u.chunk, (self.rank + 1) * u.chunk
            a = 0
            for p in u.params:
                lo, hi = max(a, mine_lo), min(a + p.numel(), mine_hi)
                if lo < hi:
                    out.append((self._names[id(p)], lo - a, hi - lo, u.offset + lo - mine_lo))
                a += p.numel()
        return out

    def checkpoint_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        """Each rank saves the elements of each parameter (and of its optimizer state) in its chunks."""
        pieces: list[Piece] = []
        scalars: dict[str, float] = {}
        st = self.optimizer.state.get(self.shard, {})
        for name, at, n, s0 in self._owned():
            pieces.append(Piece(f"param/{name}", at, self.shard.detach()[s0 : s0 + n]))
            ps, sc = optimizer_pieces(st, name, self.shard.numel(), s0, s0 + n, at)
            pieces += ps
            scalars.update(sc)
        return pieces, scalars

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        """This rank's chunks of every parameter and (if saved) of its optimizer state from ``reader``."""
        owned = self._owned()
        keys = state_keys(reader, owned[0][0]) if owned else []
        with torch.no_grad():
            self.shard.data.zero_()
            state = {k: torch.zeros_like(self.shard) for k in keys}
            for name, at, n, s0 in owned:
                reader.read(f"param/{name}", at, n, out=self.shard.data[s0 : s0 + n])
                for k in keys:
                    reader.read(f"state/{k}/{name}", at, n, out=state[k][s0 : s0 + n])
        # every rank loads optimizer state if any rank has some (ranks with empty shards too)
        has = torch.tensor([1 if keys else 0], dtype=torch.int64)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        if int(has):
            full = {**state, **{k: torch.tensor(v, dtype=torch.float32) for k, v in reader.scalars.items()}}
            sd = self.optimizer.state_dict()
            self.optimizer.load_state_dict({"state": {0: full}, "param_groups": sd["param_groups"]})

    def parameters(self) -> torch.Tensor:
        """The whole model's parameters, flat in parameter order (stage 3: gathered; every rank calls it)."""
        out = []
        with torch.no_grad():
            for u in self.units:
                was = u.gathered
                self._gather(u)
                out.append(u.full[: u.numel].clone())
                if not was:
                    self._release(u)
        return torch.cat(out) if out else torch.zeros(0)

    def evaluate(self, step: int, final: bool, fn: Any) -> tuple[dict[str, float], dict[str, Any]]:
        return fn(), {}  # stage 3: the forward hooks gather each unit (every rank evaluates)

    def memory(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters (stage 3: the shard), gradients (stage 2/3:
        the shard's), optimizer state (the shard's); plus the peak of gradient bytes during backward."""
        shard = self.shard.numel() * self.shard.element_size()
        full = sum(u.full.numel() * u.full.element_size() for u in self.units)
        return {
            "param_bytes": (shard if self.stage == 3 else full + shard),
            "grad_bytes": (shard if self.stage >= 2 else full + shard),
            "state_bytes": optimizer_state_bytes(self.optimizer),
            "peak_grad_bytes": self.peak_grad_bytes if self.stage >= 2 else full + shard,
        }

    def stats(self) -> dict[str, Any]:
        return {"stage": self.stage, "units": len(self.units), "comm_wait_s": self.comm_wait_s, **self.memory()}
