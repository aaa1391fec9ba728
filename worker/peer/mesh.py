"""The peer group: ``torch.distributed`` set up from torchrun's environment, and the start checks.

Transport is ``torch.distributed`` (NCCL on CUDA, Gloo on CPU); this module only starts it,
picks the device, and makes every rank agree on the run before the first collective of training:
a rank configured differently (batch, model size, mode) stops every rank at start with one
message naming the field and each rank's value, never a hang in a mismatched collective.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Mesh", "ParallelMesh", "PeerConfigError", "PeerError", "RNGStreams", "check_agreement",
           "check_divisibility", "init_mesh", "torch_optimizer"]


class PeerError(RuntimeError):
    """Peer mode failed (a collective, a rank)."""


class PeerConfigError(PeerError, ValueError):
    """The ranks' configurations do not fit together (raised on every rank, at start)."""


@dataclass(frozen=True)
class Mesh:
    """This process's place in the peer group: ``rank`` of ``world`` (data-parallel ranks),
    ``local_rank`` on its node, its ``device`` and the ``backend``."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str


def init_mesh(backend: str = "auto", device: str = "auto", timeout_s: float = 300.0) -> Mesh:
    """Join the process group described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), or reuse one already initialised.

    ``backend``: ``auto`` (NCCL if the device is CUDA, else Gloo), ``gloo`` or ``nccl``.
    ``device``: ``auto`` (``cuda:LOCAL_RANK`` if CUDA is available, else CPU), ``cpu`` or ``cuda``.
    ``timeout_s`` bounds every collective: a dead peer makes the others fail within it.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PeerConfigError("--device cuda: CUDA is not available on this machine")
        dev = torch.device("cuda", local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise PeerConfigError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "nccl" and dev.type != "cuda":
        raise PeerConfigError("backend nccl needs a CUDA device")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise PeerConfigError(
                "peer mode runs under torchrun: use `tessera peer --nproc-per-node N ...` or "
                "`torchrun --nproc-per-node N -m worker.peer ...` (RANK/WORLD_SIZE are not set)"
            )
        kw: dict[str, Any] = {}
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and os.environ.get("MASTER_PORT"):
            # under torchrun: the agent's store, with keys of this attempt only (after a restart the
            # store still holds the dead attempt's addresses, and Gloo would dial them)
            base = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            kw = {
                "store": dist.PrefixStore(f"tessera/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", base),
                "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            }
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if backend == "nccl" else None, **kw,
        )
    return Mesh(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend())


def _code(value: Any) -> float:
    """A number that is equal on two ranks iff their values are (exact for ints/floats, a hash otherwise)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return float(int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=6).digest(), "big"))


def check_agreement(fields: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
    """Every rank calls this with the same field names; raises ``PeerConfigError`` on every rank if
    any field differs between ranks, naming the field and each rank's value (numbers) or the
    ranks that differ (other values). One all-gather of a small float64 vector; no pickle."""
    names = sorted(fields)
    world = dist.get_world_size()
    mine = torch.tensor([float(len(names))] + [_code(fields[n]) for n in names], dtype=torch.float64, device=device)
    # the field names themselves are part of the check (a rank from another version of the program)
    mine = torch.cat([mine, torch.tensor([_code(tuple(names))], dtype=torch.float64, device=device)])
    lengths = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(lengths, mine[:1].clone())
    if len({float(x) for x in lengths}) > 1:
        raise PeerConfigError(f"ranks disagree on the set of peer settings: counts {[int(x) for x in lengths]}")
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [g.cpu().tolist() for g in gathered]
    if len({r[-1] for r in rows}) > 1:
        raise PeerConfigError("ranks disagree on the names of the peer settings (different program versions?)")
    for i, n in enumerate(names, start=1):
        values = [r[i] for r in rows]
        if len(set(values)) > 1:
            v = fields[n]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                shown = ", ".join(f"rank {r}: {int(x) if float(x).is_integer() else x}" for r, x in enumerate(values))
            else:
                groups: dict[float, list[int]] = {}
                for r, x in enumerate(values):
                    groups.setdefault(x, []).append(r)
                shown = "; ".join(f"ranks {rs}" for rs in groups.values()) + f" (this rank: {v!r})"
            raise PeerConfigError(f"peer ranks disagree on {n!r}: {shown}")


_TORCH_OPTIMIZERS: dict[str, Callable[[Iterable[Any], Mapping[str, float]], torch.optim.Optimizer]] = {
    "sgd": lambda p, h: torch.optim.SGD(p, lr=h["lr"], weight_decay=h.get("weight_decay", 0.0)),
    "momentum": lambda p, h: torch.optim.SGD(p, lr=h["lr"], momentum=h["momentum"], weight_decay=h.get("weight_decay", 0.0)),
    "nesterov": lambda p, h: torch.optim.SGD(
        p, lr=h["lr"], momentum=h["momentum"], nesterov=True, weight_decay=h.get("weight_decay", 0.0)
    ),
    "adagrad": lambda p, h: torch.optim.Adagrad(
        p, lr=h["lr"], lr_decay=h.get("lr_decay", 0.0), weight_decay=h.get("weight_decay", 0.0),
        initial_accumulator_value=h.get("initial_accumulator", 0.0), eps=h.get("eps", 1e-10),
    ),
    "adam": lambda p, h: torch.optim.Adam(
        p, lr=h["lr"], betas=(h.get("beta1", 0.9), h.get("beta2", 0.999)), eps=h.get("eps", 1e-8),
        weight_decay=h.get("weight_decay", 0.0),
    ),
    "adamw": lambda p, h: torch.optim.AdamW(
        p, lr=h["lr"], betas=(h.get("beta1", 0.9), h.get("beta2", 0.999)), eps=h.get("eps", 1e-8),
        weight_decay=h.get("weight_decay", 0.01),
    ),
}


def torch_optimizer(spec: Any) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """A factory ``params -> torch.optim.Optimizer`` for a task's ``OptimizerSpec`` (name + hparams)
    or for a callable (returned as is: any ``torch.optim`` optimizer works on a ZeRO shard)."""
    if callable(spec) and not hasattr(spec, "hparams"):
        return spec  # type: ignore[no-any-return]
    name, h = spec.name, dict(spec.hparams)
    if name not in _TORCH_OPTIMIZERS:
        raise PeerConfigError(f"optimizer {name!r} has no torch.optim equivalent here: use one of {sorted(_TORCH_OPTIMIZERS)}")
    make = _TORCH_OPTIMIZERS[name]
    return lambda params: make(params, h)


class Liveness:
    """Heartbeats through the rendezvous store, to name the rank that died when a collective fails.

    Every rank's background thread bumps its counter (``tessera/alive/<rank>``) every ``period_s``.
    After a failure, ``dead(wait_s)`` reads every counter twice, ``wait_s`` apart: ranks whose
    counter did not move are named. The store is torchrun's agent store (or rank 0's, when
    launched without torchrun); if it is unreachable, that is said instead. Connects its own
    client (``MASTER_ADDR``/``MASTER_PORT``), so it never blocks the process group's store.
    """

    def __init__(self, rank: int, world: int, period_s: float = 0.5) -> None:
        self.rank, self.world, self.period_s = rank, world, period_s
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
        self.store: Any = None
        if port:
            base = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self.store = dist.PrefixStore(f"tessera/alive/{attempt}/", base)
            self.store.set(str(rank), "0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tessera-liveness", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        n = 0
        while not self._stop.wait(self.period_s):
            n += 1
            try:
                if self.store is not None:
                    self.store.set(str(self.rank), str(n))
            except Exception:  # noqa: BLE001 - the store's host is gone; dead() says so
                return

    def _read(self) -> dict[int, str]:
        out = {}
        for r in range(self.world):
            if r != self.rank and self.store.check([str(r)]):
                out[r] = self.store.get(str(r)).decode()
        return out

    def dead(self, wait_s: float = 2.0) -> str:
        """A sentence naming the ranks that stopped beating (blocking about ``wait_s``)."""
        if self.store is None:
            return "no rendezvous store to ask which rank is gone"
        try:
            first = self._read()
            time.sleep(wait_s)
            second = self._read()
        except Exception as e:  # noqa: BLE001 - the store lives with torchrun's agent or rank 0
            return f"the rendezvous store (torchrun's agent, or rank 0 without torchrun) is unreachable: {type(e).__name__}"
        gone = sorted(r for r in range(self.world) if r != self.rank and (r not in second or first.get(r) == second.get(r)))
        if not gone:
            return "every rank is still alive: one is stalled (or the ranks issued different collectives)"
        return f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped responding"

    def close(self) -> None:
        self._stop.set()


def shutdown_group(barrier: bool = True) -> None:
    """Leave the process group cleanly: every rank reaches this point (``barrier``: after a run
    that succeeded, so rank 0, which may host the store, is not gone while another rank still
    tears down), collectives' work handles are freed (``gc.collect``: a Gloo work object that
    outlives the group is destroyed during interpreter finalisation and aborts the process, as
    "terminate called without an active exception"), then the group is destroyed."""
    import gc

    if not dist.is_initialized():
        return
    try:
        if barrier:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


# ---------------------------------------------------------------------------------------------------- 3D mesh
def check_divisibility(
    dp: int, tp: int, pp: int, *, heads: int | None = None, dim: int | None = None, layers: int | None = None,
    global_batch: int | None = None, vocab: int | None = None, seq: int | None = None,
    sequence_parallel: bool = False, micro_batches: int = 1,
) -> None:
    """Raise one ``PeerConfigError`` listing every size that the layout (``dp``, ``tp``, ``pp``) does
    not divide: heads and hidden size and vocabulary by T (attention split by heads, MLP by hidden,
    embedding by vocabulary), the sequence by T under sequence parallelism, layers by P, the global
    batch by D x micro-batches. Pure arithmetic: every rank reaches the same verdict without a collective."""
    bad: list[str] = []
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("micro_batches", micro_batches)):
        if v < 1:
            bad.append(f"{name} must be >= 1, got {v}")
    if bad:
        raise PeerConfigError("parallel layout: " + "; ".join(bad))
    if heads is not None and heads % tp:
        bad.append(f"heads {heads} not divisible by tp {tp}")
    if dim is not None and dim % tp:
        bad.append(f"hidden size {dim} not divisible by tp {tp}")
    if vocab is not None and vocab % tp:
        bad.append(f"vocab {vocab} not divisible by tp {tp}")
    if sequence_parallel and seq is not None and seq % tp:
        bad.append(f"sequence length {seq} not divisible by tp {tp} (--sequence-parallel splits it)")
    if layers is not None and layers % pp:
        bad.append(f"layers {layers} not divisible by pp {pp}")
    if global_batch is not None and global_batch % (dp * micro_batches):
        bad.append(f"global batch {global_batch} not divisible by dp {dp} x micro-batches {micro_batches}")
    if bad:
        raise PeerConfigError(f"parallel layout dp={dp} tp={tp} pp={pp} does not fit the model: " + "; ".join(bad))


class RNGStreams:
    """Per-group random streams, as Megatron's RNG tracker keeps them.

    ``replicated``: the default stream, seeded ``seed + 100 * pp_idx``: equal on every TP rank (and DP
    rank) of a stage, so dropout on replicated activations (the residual stream without sequence
    parallelism) agrees across TP ranks. ``tp``: seeded ``seed + 2718 + 100 * pp_idx + tp_idx``: differs
    across the TP ranks of a stage, for dropout on TP-split activations (attention heads, MLP hidden,
    sequence-parallel chunks). ``with streams.fork("tp"):`` swaps the global CPU (and current CUDA) RNG
    state to that stream and back, as ``CudaRNGStatesTracker.fork`` does.
    """

    def __init__(self, seed: int, tp_idx: int, pp_idx: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seeds = {"replicated": seed + 100 * pp_idx, "tp": seed + 2718 + 100 * pp_idx + tp_idx}
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name, s in self.seeds.items():
            with self._saved():
                torch.manual_seed(s)
                self.states[name] = self._get()
        # the default stream starts as the replicated one
        self._set(self.states["replicated"])

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set(self, st: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(st[0])
        if st[1] is not None:
            torch.cuda.set_rng_state(st[1], self.device)

    @contextlib.contextmanager
    def _saved(self) -> Iterator[None]:
        st = self._get()
        try:
            yield
        finally:
            self._set(st)

    def snapshot(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The streams' states now (``restore`` puts them back): what a recomputation in backward
        (activation checkpointing) replays, so a forked stream draws the same masks again."""
        return dict(self.states)

    def restore(self, snap: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.states = dict(snap)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Draw from stream ``name`` (``tp`` or ``replicated``) inside the block; the stream advances."""
        if name not in self.states:
            raise PeerConfigError(f"no random stream {name!r}: use one of {sorted(self.states)}")
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)


@dataclass
class ParallelMesh:
    """This rank's place in a D x T x P mesh (data, tensor, pipeline parallel) and its process groups.

    Rank layout (fixed; TP innermost, PP outermost, as Megatron orders it, so a TP group stays
    inside a node): ``rank = pp_idx * (D * T) + dp_idx * T + tp_idx``. ``tp_group``: the T ranks
    holding the shards of one layer; ``dp_group``: the D replicas of one (tp, pp) shard; ``pp_group``:
    the P stages of one (dp, tp) slice. With a size of 1 the group is still a real group (of one
    rank), so code can call collectives on it unconditionally.
    """

    dp: int
    tp: int
    pp: int
    rank: int
    world: int
    dp_idx: int
    tp_idx: int
    pp_idx: int
    tp_group: Any
    dp_group: Any
    pp_group: Any
    tp_ranks: list[int]
    dp_ranks: list[int]
    pp_ranks: list[int]
    device: torch.device
    rng: RNGStreams | None = None

    @staticmethod
    def coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
        """(dp_idx, tp_idx, pp_idx) of ``rank``."""
        return (rank // tp) % dp, rank % tp, rank // (dp * tp)

    @staticmethod
    def rank_of(dp_idx: int, tp_idx: int, pp_idx: int, dp: int, tp: int) -> int:
        return pp_idx * dp * tp + dp_idx * tp + tp_idx

    @classmethod
    def build(
        cls, dp: int, tp: int, pp: int, *, device: torch.device | str = "cpu", seed: int | None = None,
        check: dict[str, Any] | None = None,
    ) -> ParallelMesh:
        """The mesh over the initialised default group (``init_mesh`` first). Raises
        ``PeerConfigError`` on every rank if D*T*P is not the world size or ``check``'s sizes
        (keyword arguments of ``check_divisibility``) do not fit, or if the ranks were given
        different layouts. Every rank creates every group, in the same order (``dist.new_group``
        is collective). ``seed``: set up ``rng`` (``RNGStreams``)."""
        if not dist.is_initialized():
            raise PeerConfigError("ParallelMesh needs an initialised process group (worker.peer.init_mesh)")
        world, rank = dist.get_world_size(), dist.get_rank()
        check_divisibility(dp, tp, pp, **(check or {}))
        if dp * tp * pp != world:
            raise PeerConfigError(f"parallel layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the world size is {world}")
        dev = torch.device(device)
        check_agreement({"mesh_dp": dp, "mesh_tp": tp, "mesh_pp": pp},
                        dev if dist.get_backend() == "nccl" else torch.device("cpu"))
        d_i, t_i, p_i = cls.coords(rank, dp, tp, pp)
        groups: dict[str, tuple[Any, list[int]]] = {}
        # creation order: every TP group, then every DP group, then every PP group (same on all ranks);
        # each group: the ranks along one axis, the other two coordinates fixed
        sizes = {"dp": dp, "tp": tp, "pp": pp}
        for axis, (outer, inner) in (("tp", ("pp", "dp")), ("dp", ("pp", "tp")), ("pp", ("dp", "tp"))):
            for a in range(sizes[outer]):
                for b in range(sizes[inner]):
                    at = {f"{outer}_idx": a, f"{inner}_idx": b}
                    ranks = [cls.rank_of(**{**at, f"{axis}_idx": i}, dp=dp, tp=tp) for i in range(sizes[axis])]
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        groups[axis] = (g, ranks)
        rng = RNGStreams(seed, t_i, p_i, dev) if seed is not None else None
        return cls(
            dp, tp, pp, rank, world, d_i, t_i, p_i, groups["tp"][0], groups["dp"][0], groups["pp"][0],
            groups["tp"][1], groups["dp"][1], groups["pp"][1], dev, rng,
        )

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.world}: dp {self.dp_idx}/{self.dp} tp {self.tp_idx}/{self.tp} "
                f"pp {self.pp_idx}/{self.pp}")
