"""Plain, frozen configuration objects for tables and shards, checked on creation."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping

from ps.errors import InvalidArgumentError

__all__ = ["OptimizerSpec", "InitializerSpec", "AdmissionSpec", "EvictionSpec", "TableSpec", "ShardConfig",
           "OPTIMIZER_DEFAULTS", "INITIALIZER_DEFAULTS", "DENSE", "SPARSE", "spec_to_dict", "spec_from_dict", "MAX_SLOTS",
           "ROW_DTYPE_NAMES"]

DENSE = "dense"
SPARSE = "sparse"

# optimizer -> hyperparameters it accepts, with defaults (torch.optim's where torch has it)
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "sgd": {"lr": 0.01, "weight_decay": 0.0},
    "momentum": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    "nesterov": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0},
    "adagrad": {"lr": 0.01, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator": 0.0, "eps": 1e-10},
    "rowwise_adagrad": {"lr": 0.01, "weight_decay": 0.0, "initial_accumulator": 0.0, "eps": 1e-10},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
    "ftrl": {"lr": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0, "initial_accumulator": 0.0},
}

# the range each hyperparameter must lie in: (low, low inclusive, high, high inclusive); a value
# outside gives NaN/Inf parameters or an update that diverges by construction (eps=0 divides by 0)
_POSITIVE = (0.0, False, math.inf, False)
_NON_NEGATIVE = (0.0, True, math.inf, False)
_UNIT = (0.0, True, 1.0, False)  # [0, 1): decay rates of moments and momentum
HPARAM_RANGES: dict[str, tuple[float, bool, float, bool]] = {
    **dict.fromkeys(["lr", "eps"], _POSITIVE), **dict.fromkeys(["momentum", "beta1", "beta2"], _UNIT),
    **dict.fromkeys(["weight_decay", "lr_decay", "initial_accumulator", "beta", "l1", "l2"], _NON_NEGATIVE),  # beta: FTRL's
}

# how sparse rows may be stored (TableSpec.dtype, the "row dtype"); dense tables are float32
ROW_DTYPE_NAMES = ("float32", "float16", "bfloat16")

# sparse tables hash ids to at most this many virtual slots (the slot map is 8 bytes per slot on
# every shard and in every client)
MAX_SLOTS = 1 << 20

INITIALIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "zeros": {},
    "constant": {"value": 0.0},
    "uniform": {"low": -0.05, "high": 0.05},
    "normal": {"mean": 0.0, "std": 0.01},
}


def _resolve(kind: str, name: str, given: Mapping[str, float], table: dict[str, dict[str, float]]) -> dict[str, float]:
    if name not in table:
        raise InvalidArgumentError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    unknown = sorted(set(given) - set(table[name]))
    if unknown:
        raise InvalidArgumentError(f"{kind} {name!r}: unknown parameter(s) {unknown}; accepted: {sorted(table[name])}")
    out = dict(table[name])
    for k, v in given.items():
        if not math.isfinite(float(v)):
            raise InvalidArgumentError(f"{kind} {name!r}: parameter {k} must be finite, got {v}")
        out[k] = float(v)
    return out


@dataclass(frozen=True)
class OptimizerSpec:
    """A server-side optimizer by name; missing hyperparameters take their defaults."""

    name: str = "sgd"
    hparams: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        resolved = _resolve("optimizer", self.name, self.hparams, OPTIMIZER_DEFAULTS)
        for k, v in resolved.items():
            lo, lo_in, hi, hi_in = HPARAM_RANGES[k]
            if (v < lo or (v == lo and not lo_in)) or (v > hi or (v == hi and not hi_in)):
                bound = f"{'>=' if lo_in else '>'} {lo:g}" if hi == math.inf else f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
                raise InvalidArgumentError(f"optimizer {self.name!r}: {k} must be {bound}, got {v}")
        object.__setattr__(self, "hparams", resolved)


@dataclass(frozen=True)
class InitializerSpec:
    """How new values are drawn (zeros, constant, uniform, normal): deterministic per element, see
    ps.initializers; missing parameters take their defaults."""

    name: str = "zeros"
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        resolved = _resolve("initializer", self.name, self.params, INITIALIZER_DEFAULTS)
        if self.name == "uniform" and resolved["low"] > resolved["high"]:
            raise InvalidArgumentError("initializer 'uniform': low must be <= high")
        if self.name == "normal" and resolved["std"] < 0:
            raise InvalidArgumentError("initializer 'normal': std must be >= 0")
        object.__setattr__(self, "params", resolved)


@dataclass(frozen=True)
class AdmissionSpec:
    """Create a sparse row only after ``min_count`` sightings, or with ``probability`` per sighting.
    A sighting is a push that names the id (a BSP round's push counts once); pulls are reads and
    count nothing (an id not admitted yet reads as its initial values)."""

    min_count: int = 0
    probability: float = 0.0

    def __post_init__(self) -> None:
        if self.min_count < 0:
            raise InvalidArgumentError(f"admission.min_count must be >= 0, got {self.min_count}")
        if not 0.0 <= self.probability <= 1.0:
            raise InvalidArgumentError(f"admission.probability must be in [0, 1], got {self.probability}")
        if self.min_count > 1 and self.probability > 0:
            raise InvalidArgumentError("admission: set min_count or probability, not both")

    @property
    def enabled(self) -> bool:
        """Whether admission filters anything (min_count > 1 or 0 < probability < 1)."""
        return self.min_count > 1 or 0.0 < self.probability < 1.0


@dataclass(frozen=True)
class EvictionSpec:
    """Evict rows not pushed for ``ttl_steps`` table updates, and/or beyond ``max_rows`` (least
    recently pushed first; pulls touch nothing). A push of more than ``max_rows`` distinct ids is
    refused (RESOURCE_EXHAUSTED)."""

    ttl_steps: int = 0
    max_rows: int = 0

    def __post_init__(self) -> None:
        if self.ttl_steps < 0 or self.max_rows < 0:
            raise InvalidArgumentError("eviction.ttl_steps and eviction.max_rows must be >= 0")


@dataclass(frozen=True)
class TableSpec:
    """What a table is. Two specs are the same table iff they compare equal.

    Dense: ``shape`` is the logical shape of the whole table. Sparse: rows of
    width ``dim`` keyed by int64 ids, hashed to ``num_slots`` virtual slots, stored in ``dtype``
    (the row dtype: float32, float16 or bfloat16; optimizer state stays float32). Dense tables
    are float32.
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    dim: int = 0
    dtype: str = "float32"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    initializer: InitializerSpec = field(default_factory=InitializerSpec)
    seed: int = 0
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)
    eviction: EvictionSpec = field(default_factory=EvictionSpec)
    num_slots: int = 4096
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.name or len(self.name) > 256:
            raise InvalidArgumentError("table name must be 1..256 characters")
        if self.dtype not in ROW_DTYPE_NAMES:
            raise InvalidArgumentError(
                f"table {self.name!r}: storage dtype must be one of {list(ROW_DTYPE_NAMES)}, got {self.dtype!r}"
            )
        if not 0 <= self.seed < 2**64:
            raise InvalidArgumentError(f"table {self.name!r}: seed must fit in uint64")
        if self.kind == DENSE:
            if not self.shape or any(s <= 0 for s in self.shape):
                raise InvalidArgumentError(f"table {self.name!r}: dense shape must be non-empty and positive, got {self.shape}")
            if self.optimizer.name == "rowwise_adagrad":
                raise InvalidArgumentError(f"table {self.name!r}: rowwise_adagrad is for sparse tables")
            if self.dtype != "float32":
                raise InvalidArgumentError(
                    f"table {self.name!r}: dense tables store float32; dtype (row dtype) {self.dtype!r} is for sparse tables"
                )
            if self.admission.enabled or self.eviction.ttl_steps or self.eviction.max_rows:
                raise InvalidArgumentError(f"table {self.name!r}: admission/eviction apply to sparse tables only")
        elif self.kind == SPARSE:
            if self.dim <= 0:
                raise InvalidArgumentError(f"table {self.name!r}: sparse dim must be > 0, got {self.dim}")
            if self.shape:
                raise InvalidArgumentError(f"table {self.name!r}: sparse tables take dim, not shape")
            if not 0 < self.num_slots <= MAX_SLOTS:
                raise InvalidArgumentError(f"table {self.name!r}: num_slots must be in 1..{MAX_SLOTS}, got {self.num_slots}")
        else:
            raise InvalidArgumentError(f"table {self.name!r}: kind must be 'dense' or 'sparse', got {self.kind!r}")

    @property
    def row_dtype(self) -> str:
        """How a sparse table stores its rows (``dtype``): float32, float16 or bfloat16 (see ps.rowdtype)."""
        return self.dtype

    @property
    def numel(self) -> int:
        """Elements of a dense table (the product of ``shape``)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardConfig:
    """One shard server, with the bounds that keep what a request can make it hold finite.

    - ``max_bytes`` (default 8 GiB): everything the tables hold on this shard: params, optimizer
      state, dense spare blocks, sparse row chunks as allocated (rows free included) and their
      free lists, the id index, slot maps and admission sketches. A request that would go beyond
      it is refused (RESOURCE_EXHAUSTED); the check and the allocation it allows are one step for
      all the shard's tables, so the tables never hold more. Pulls hold nothing. 0 lifts the bound
      (explicitly).
    - ``max_resident_bytes`` (default 0: no disk tier): the RAM the sparse tables' rows may take
      (resident chunks); rows beyond it live in a file-backed tier under ``spill_dir``, the most
      recently used stay resident (ps.tier). ``max_bytes`` does not count the tier's disk bytes.
    - ``max_tables`` (default 4096): tables on this shard; one more is RESOURCE_EXHAUSTED.
    - ``max_workers`` (default 4096): members (live or recently dead) this shard remembers; a new
      worker beyond it is RESOURCE_EXHAUSTED (dead members are forgotten first to make room).
    - ``max_lease_s`` (default 60): a Join asking for a longer lease gets this one (capped, not
      refused: a worker only renews more often).
    - ``forget_after_s`` (default 0: 10 x ``lease_s``): a member that has been dead this long is
      forgotten (its clock with it; it starts afresh if it comes back).
    - ``bulk_port`` (default -1: off): also serve the data calls (Step, pulls, pushes, table calls)
      over ``tessera.bulk`` on this port of ``host`` (0: a free one), same auth and limits; the
      shard advertises it in its Role reply and clients use it instead of gRPC for those calls.
    """

    shard_index: int = 0
    num_shards: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    bulk_port: int = -1  # -1: no bulk data plane; 0: a free port
    chunk_elems: int = 1 << 18
    max_message_bytes: int = 64 << 20
    max_ids_per_request: int = 1 << 20
    max_bytes: int = 8 << 30  # 0: unbounded (explicitly)
    max_tables: int = 4096
    max_workers: int = 4096
    max_lease_s: float = 60.0
    forget_after_s: float = 0.0  # 0: 10 x lease_s
    workers: int = 64  # server threads; BSP/SSP pulls block one each while they wait
    lease_s: float = 10.0  # a worker silent this long leaves the live set (BSP/SSP stop waiting for it)
    push_idle_timeout_s: float = 30.0  # a push stream with no chunk for this long is aborted (nothing applied)
    checkpoint_dir: str = ""  # where checkpoints go ("" : none)
    checkpoint_every_s: float = 0.0  # periodic checkpoints (0: only on request and at shutdown)
    checkpoint_keep: int = 3  # newest checkpoints kept
    backup_of: str = ""  # run as the backup of the primary at HOST:PORT (it takes over when that one is gone)
    advertise: str = ""  # HOST:PORT the primary dials to reach this backup (default host:port)
    failover_s: float = 2.0  # a backup takes over after its primary was unreachable this long
    solo_after_s: float = 10.0  # a primary that lost its backup refuses writes this long, then goes on alone
    cut_hold_s: float = 30.0  # a cluster checkpoint's hold on the BSP tables lapses after this long without its cut
    max_resident_bytes: int = 0  # the disk tier (see above; 0: all in RAM)
    spill_dir: str = ""  # where the disk tier's (unlinked) files go ("": the system temp directory)

    @property
    def forget_s(self) -> float:
        """Seconds a dead member is remembered (``forget_after_s``, or 10 x ``lease_s``)."""
        return self.forget_after_s or 10.0 * self.lease_s

    def __post_init__(self) -> None:
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard index {self.shard_index} out of range for {self.num_shards} shards")
        if self.chunk_elems < 1 or self.chunk_elems * 4 + 4096 > self.max_message_bytes:
            raise ValueError("chunk_elems must be >= 1 and a float32 chunk must fit in max_message_bytes")
        if self.checkpoint_every_s < 0 or self.checkpoint_keep < 1:
            raise ValueError("checkpoint_every_s must be >= 0 and checkpoint_keep >= 1")
        if self.checkpoint_every_s and not self.checkpoint_dir:
            raise ValueError("checkpoint_every_s needs a checkpoint_dir")
        if self.failover_s <= 0 or self.solo_after_s < 0:
            raise ValueError("failover_s must be > 0 and solo_after_s >= 0")
        if self.push_idle_timeout_s <= 0:
            raise ValueError(f"push_idle_timeout_s must be > 0, got {self.push_idle_timeout_s}")
        if not -1 <= self.bulk_port < 65536:
            raise ValueError(f"bulk_port must be -1 (off), 0 (any free port) or a port number, got {self.bulk_port}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if not math.isfinite(self.max_lease_s) or self.max_lease_s < self.lease_s:
            raise ValueError(f"max_lease_s must be finite and >= lease_s ({self.lease_s}), got {self.max_lease_s}")
        if not math.isfinite(self.forget_after_s) or self.forget_after_s < 0:
            raise ValueError(f"forget_after_s must be finite and >= 0, got {self.forget_after_s}")
        if self.max_bytes < 0 or self.max_tables < 1 or self.max_workers < 1:
            raise ValueError(
                f"max_bytes must be >= 0 (0: unbounded), max_tables and max_workers >= 1; got "
                f"{self.max_bytes}, {self.max_tables}, {self.max_workers}"
            )
        if self.max_resident_bytes < 0:
            raise ValueError(f"max_resident_bytes must be >= 0 (0: no disk tier), got {self.max_resident_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")


def spec_to_dict(spec: TableSpec) -> dict:
    """``spec`` as plain data (checkpoints): its fields by name, the nested specs as dicts."""
    return {**asdict(spec), "shape": list(spec.shape)}


def spec_from_dict(d: Mapping) -> TableSpec:
    """The inverse of spec_to_dict; every field is checked again (InvalidArgumentError)."""
    try:
        return TableSpec(
            str(d["name"]), str(d["kind"]), tuple(int(x) for x in d["shape"]), int(d["dim"]), str(d["dtype"]),
            OptimizerSpec(str(d["optimizer"]["name"]), {str(k): float(v) for k, v in d["optimizer"]["hparams"].items()}),
            InitializerSpec(str(d["initializer"]["name"]), {str(k): float(v) for k, v in d["initializer"]["params"].items()}),
            int(d["seed"]), AdmissionSpec(int(d["admission"]["min_count"]), float(d["admission"]["probability"])),
            EvictionSpec(int(d["eviction"]["ttl_steps"]), int(d["eviction"]["max_rows"])), int(d["num_slots"]),
            bool(d["allow_nonfinite"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InvalidArgumentError(f"table spec does not decode: {type(e).__name__}: {e}") from None
