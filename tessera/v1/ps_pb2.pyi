from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TABLE_KIND_UNSPECIFIED: _ClassVar[TableKind]
    TABLE_KIND_DENSE: _ClassVar[TableKind]
    TABLE_KIND_SPARSE: _ClassVar[TableKind]

class DenseOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE_OP_GRADIENT: _ClassVar[DenseOp]
    DENSE_OP_ASSIGN: _ClassVar[DenseOp]

class StepOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_OP_UNSPECIFIED: _ClassVar[StepOp]
    STEP_OP_PUSH_DENSE: _ClassVar[StepOp]
    STEP_OP_PUSH_SPARSE: _ClassVar[StepOp]
    STEP_OP_PULL_DENSE: _ClassVar[StepOp]
    STEP_OP_PULL_SPARSE: _ClassVar[StepOp]
TABLE_KIND_UNSPECIFIED: TableKind
TABLE_KIND_DENSE: TableKind
TABLE_KIND_SPARSE: TableKind
DENSE_OP_GRADIENT: DenseOp
DENSE_OP_ASSIGN: DenseOp
STEP_OP_UNSPECIFIED: StepOp
STEP_OP_PUSH_DENSE: StepOp
STEP_OP_PUSH_SPARSE: StepOp
STEP_OP_PULL_DENSE: StepOp
STEP_OP_PULL_SPARSE: StepOp

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "hparams")
    class HparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HPARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    hparams: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., hparams: _Optional[_Mapping[str, float]] = ...) -> None: ...

class InitializerSpec(_message.Message):
    __slots__ = ("name", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdmissionSpec(_message.Message):
    __slots__ = ("min_count", "probability")
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    min_count: int
    probability: float
    def __init__(self, min_count: _Optional[int] = ..., probability: _Optional[float] = ...) -> None: ...

class EvictionSpec(_message.Message):
    __slots__ = ("ttl_steps", "max_rows")
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    ttl_steps: int
    max_rows: int
    def __init__(self, ttl_steps: _Optional[int] = ..., max_rows: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "kind", "shape", "dim", "dtype", "optimizer", "initializer", "seed", "admission", "eviction", "num_slots", "allow_nonfinite")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: TableKind
    shape: _containers.RepeatedScalarFieldContainer[int]
    dim: int
    dtype: str
    optimizer: OptimizerSpec
    initializer: InitializerSpec
    seed: int
    admission: AdmissionSpec
    eviction: EvictionSpec
    num_slots: int
    allow_nonfinite: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[TableKind, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., initializer: _Optional[_Union[InitializerSpec, _Mapping]] = ..., seed: _Optional[int] = ..., admission: _Optional[_Union[AdmissionSpec, _Mapping]] = ..., eviction: _Optional[_Union[EvictionSpec, _Mapping]] = ..., num_slots: _Optional[int] = ..., allow_nonfinite: bool = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec", "num_shards", "validate_only")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    num_shards: int
    validate_only: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., num_shards: _Optional[int] = ..., validate_only: bool = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("spec", "shard_index", "num_shards", "offset", "length", "chunk_elems", "version", "max_ids_per_request")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ELEMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    shard_index: int
    num_shards: int
    offset: int
    length: int
    chunk_elems: int
    version: int
    max_ids_per_request: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., chunk_elems: _Optional[int] = ..., version: _Optional[int] = ..., max_ids_per_request: _Optional[int] = ...) -> None: ...

class CreateTableReply(_message.Message):
    __slots__ = ("created", "info")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    created: bool
    info: TableInfo
    def __init__(self, created: bool = ..., info: _Optional[_Union[TableInfo, _Mapping]] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("tables", "missing_ok")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    missing_ok: bool
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., missing_ok: bool = ...) -> None: ...

class DropTableReply(_message.Message):
    __slots__ = ("shard_index", "dropped", "checkpoint")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    dropped: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: str
    def __init__(self, shard_index: _Optional[int] = ..., dropped: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class SyncSpec(_message.Message):
    __slots__ = ("clock", "sync", "staleness", "backup_workers", "staleness_aware_lr")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_AWARE_LR_FIELD_NUMBER: _ClassVar[int]
    clock: int
    sync: bool
    staleness: int
    backup_workers: int
    staleness_aware_lr: bool
    def __init__(self, clock: _Optional[int] = ..., sync: bool = ..., staleness: _Optional[int] = ..., backup_workers: _Optional[int] = ..., staleness_aware_lr: bool = ...) -> None: ...

class DenseChunk(_message.Message):
    __slots__ = ("table", "offset", "dtype", "op", "base_version", "return_params", "reply_dtype", "version", "staleness", "worker", "last", "clock", "sync", "late", "data", "client", "seq", "duplicate", "shape", "flat_view", "early")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURN_PARAMS_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FLAT_VIEW_FIELD_NUMBER: _ClassVar[int]
    EARLY_FIELD_NUMBER: _ClassVar[int]
    table: str
    offset: int
    dtype: str
    op: DenseOp
    base_version: int
    return_params: bool
    reply_dtype: str
    version: int
    staleness: int
    worker: str
    last: bool
    clock: int
    sync: SyncSpec
    late: bool
    data: bytes
    client: str
    seq: int
    duplicate: bool
    shape: _containers.RepeatedScalarFieldContainer[int]
    flat_view: bool
    early: bool
    def __init__(self, table: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[str] = ..., op: _Optional[_Union[DenseOp, str]] = ..., base_version: _Optional[int] = ..., return_params: bool = ..., reply_dtype: _Optional[str] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., worker: _Optional[str] = ..., last: bool = ..., clock: _Optional[int] = ..., sync: _Optional[_Union[SyncSpec, _Mapping]] = ..., late: bool = ..., data: _Optional[bytes] = ..., client: _Optional[str] = ..., seq: _Optional[int] = ..., duplicate: bool = ..., shape: _Optional[_Iterable[int]] = ..., flat_view: bool = ..., early: bool = ...) -> None: ...

class PullDenseRequest(_message.Message):
    __slots__ = ("table", "dtype", "sync", "worker")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    table: str
    dtype: str
    sync: SyncSpec
    worker: str
    def __init__(self, table: _Optional[str] = ..., dtype: _Optional[str] = ..., sync: _Optional[_Union[SyncSpec, _Mapping]] = ..., worker: _Optional[str] = ...) -> None: ...

class PullSparseRequest(_message.Message):
    __slots__ = ("table", "dtype", "sync", "worker", "known_versions", "known_epoch", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dtype: str
    sync: SyncSpec
    worker: str
    known_versions: bytes
    known_epoch: int
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., dtype: _Optional[str] = ..., sync: _Optional[_Union[SyncSpec, _Mapping]] = ..., worker: _Optional[str] = ..., known_versions: _Optional[bytes] = ..., known_epoch: _Optional[int] = ..., ids: _Optional[bytes] = ...) -> None: ...

class PullSparseReply(_message.Message):
    __slots__ = ("dtype", "dim", "clock", "conditional", "epoch", "versions", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    dim: int
    clock: int
    conditional: bool
    epoch: int
    versions: bytes
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., dim: _Optional[int] = ..., clock: _Optional[int] = ..., conditional: bool = ..., epoch: _Optional[int] = ..., versions: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushSparseRequest(_message.Message):
    __slots__ = ("table", "dtype", "dim", "worker", "sync", "client", "seq", "base_versions", "ids", "data")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    table: str
    dtype: str
    dim: int
    worker: str
    sync: SyncSpec
    client: str
    seq: int
    base_versions: bytes
    ids: bytes
    data: bytes
    def __init__(self, table: _Optional[str] = ..., dtype: _Optional[str] = ..., dim: _Optional[int] = ..., worker: _Optional[str] = ..., sync: _Optional[_Union[SyncSpec, _Mapping]] = ..., client: _Optional[str] = ..., seq: _Optional[int] = ..., base_versions: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushSparseReply(_message.Message):
    __slots__ = ("applied", "dropped", "mean_staleness", "max_staleness", "late", "clock", "duplicate")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    applied: int
    dropped: int
    mean_staleness: float
    max_staleness: int
    late: bool
    clock: int
    duplicate: bool
    def __init__(self, applied: _Optional[int] = ..., dropped: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., late: bool = ..., clock: _Optional[int] = ..., duplicate: bool = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker", "lease_ms", "fresh")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    worker: str
    lease_ms: int
    fresh: bool
    def __init__(self, worker: _Optional[str] = ..., lease_ms: _Optional[int] = ..., fresh: bool = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker", "clock", "leave")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    clock: int
    leave: bool
    def __init__(self, worker: _Optional[str] = ..., clock: _Optional[int] = ..., leave: bool = ...) -> None: ...

class MembershipReply(_message.Message):
    __slots__ = ("shard_index", "live", "sync_clock", "min_clock", "rejoined")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SYNC_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    REJOINED_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    live: _containers.RepeatedScalarFieldContainer[str]
    sync_clock: int
    min_clock: int
    rejoined: bool
    def __init__(self, shard_index: _Optional[int] = ..., live: _Optional[_Iterable[str]] = ..., sync_clock: _Optional[int] = ..., min_clock: _Optional[int] = ..., rejoined: bool = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "kind", "rows", "elements", "param_bytes", "state_bytes", "version", "offset", "length", "evicted", "dropped", "rejected", "mean_staleness", "max_staleness", "row_dtype", "bytes_per_row", "payload_bytes_per_row", "index_bytes", "metadata_bytes", "resident_rows", "cold_rows", "disk_bytes", "held_bytes", "row_path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ROWS_FIELD_NUMBER: _ClassVar[int]
    COLD_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: TableKind
    rows: int
    elements: int
    param_bytes: int
    state_bytes: int
    version: int
    offset: int
    length: int
    evicted: int
    dropped: int
    rejected: int
    mean_staleness: float
    max_staleness: int
    row_dtype: str
    bytes_per_row: float
    payload_bytes_per_row: int
    index_bytes: int
    metadata_bytes: int
    resident_rows: int
    cold_rows: int
    disk_bytes: int
    held_bytes: int
    row_path: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[TableKind, str]] = ..., rows: _Optional[int] = ..., elements: _Optional[int] = ..., param_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., evicted: _Optional[int] = ..., dropped: _Optional[int] = ..., rejected: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., row_dtype: _Optional[str] = ..., bytes_per_row: _Optional[float] = ..., payload_bytes_per_row: _Optional[int] = ..., index_bytes: _Optional[int] = ..., metadata_bytes: _Optional[int] = ..., resident_rows: _Optional[int] = ..., cold_rows: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ..., row_path: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "tables", "requests", "errors", "bytes_in", "bytes_out", "uptime_s", "workers", "leases_expired", "pushes_aborted_idle", "duplicates", "maintenance_errors", "sync_clock", "checkpoints", "last_checkpoint", "role", "backup", "replicated", "backups_lost", "epoch", "backup_of")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ABORTED_IDLE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    MAINTENANCE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SYNC_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_LOST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_OF_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    requests: _containers.ScalarMap[str, int]
    errors: _containers.ScalarMap[str, int]
    bytes_in: int
    bytes_out: int
    uptime_s: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    leases_expired: int
    pushes_aborted_idle: int
    duplicates: int
    maintenance_errors: int
    sync_clock: int
    checkpoints: int
    last_checkpoint: str
    role: str
    backup: str
    replicated: int
    backups_lost: int
    epoch: int
    backup_of: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., requests: _Optional[_Mapping[str, int]] = ..., errors: _Optional[_Mapping[str, int]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., uptime_s: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., leases_expired: _Optional[int] = ..., pushes_aborted_idle: _Optional[int] = ..., duplicates: _Optional[int] = ..., maintenance_errors: _Optional[int] = ..., sync_clock: _Optional[int] = ..., checkpoints: _Optional[int] = ..., last_checkpoint: _Optional[str] = ..., role: _Optional[str] = ..., backup: _Optional[str] = ..., replicated: _Optional[int] = ..., backups_lost: _Optional[int] = ..., epoch: _Optional[int] = ..., backup_of: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("at_clock", "hold")
    AT_CLOCK_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    at_clock: int
    hold: bool
    def __init__(self, at_clock: _Optional[int] = ..., hold: bool = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("shard_index", "path", "clock")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    path: str
    clock: int
    def __init__(self, shard_index: _Optional[int] = ..., path: _Optional[str] = ..., clock: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("name", "clock", "live", "idle_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    clock: int
    live: bool
    idle_s: float
    def __init__(self, name: _Optional[str] = ..., clock: _Optional[int] = ..., live: bool = ..., idle_s: _Optional[float] = ...) -> None: ...

class RoleRequest(_message.Message):
    __slots__ = ("backup", "attach_id")
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    backup: str
    attach_id: int
    def __init__(self, backup: _Optional[str] = ..., attach_id: _Optional[int] = ...) -> None: ...

class RoleReply(_message.Message):
    __slots__ = ("shard_index", "num_shards", "role", "epoch", "backup", "attached", "bulk_port")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    role: str
    epoch: int
    backup: str
    attached: bool
    bulk_port: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., backup: _Optional[str] = ..., attached: bool = ..., bulk_port: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("backup",)
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    backup: str
    def __init__(self, backup: _Optional[str] = ...) -> None: ...

class AttachChunk(_message.Message):
    __slots__ = ("last", "attach_id", "data")
    LAST_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    last: bool
    attach_id: int
    data: bytes
    def __init__(self, last: bool = ..., attach_id: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("epoch", "attach_id", "entry")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    attach_id: int
    entry: bytes
    def __init__(self, epoch: _Optional[int] = ..., attach_id: _Optional[int] = ..., entry: _Optional[bytes] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepPart(_message.Message):
    __slots__ = ("table", "op", "sync", "seq", "base_version", "count", "dim", "ids_at", "data_at", "base_at")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    IDS_AT_FIELD_NUMBER: _ClassVar[int]
    DATA_AT_FIELD_NUMBER: _ClassVar[int]
    BASE_AT_FIELD_NUMBER: _ClassVar[int]
    table: str
    op: StepOp
    sync: SyncSpec
    seq: int
    base_version: int
    count: int
    dim: int
    ids_at: int
    data_at: int
    base_at: int
    def __init__(self, table: _Optional[str] = ..., op: _Optional[_Union[StepOp, str]] = ..., sync: _Optional[_Union[SyncSpec, _Mapping]] = ..., seq: _Optional[int] = ..., base_version: _Optional[int] = ..., count: _Optional[int] = ..., dim: _Optional[int] = ..., ids_at: _Optional[int] = ..., data_at: _Optional[int] = ..., base_at: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("worker", "client", "dtype", "parts", "data")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    worker: str
    client: str
    dtype: str
    parts: _containers.RepeatedCompositeFieldContainer[StepPart]
    data: bytes
    def __init__(self, worker: _Optional[str] = ..., client: _Optional[str] = ..., dtype: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[StepPart, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepPartReply(_message.Message):
    __slots__ = ("table", "op", "version", "staleness", "clock", "late", "duplicate", "applied", "dropped", "mean_staleness", "max_staleness", "count", "dim", "data_at", "versions_at", "dtype")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_AT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_AT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    table: str
    op: StepOp
    version: int
    staleness: int
    clock: int
    late: bool
    duplicate: bool
    applied: int
    dropped: int
    mean_staleness: float
    max_staleness: int
    count: int
    dim: int
    data_at: int
    versions_at: int
    dtype: str
    def __init__(self, table: _Optional[str] = ..., op: _Optional[_Union[StepOp, str]] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., clock: _Optional[int] = ..., late: bool = ..., duplicate: bool = ..., applied: _Optional[int] = ..., dropped: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., count: _Optional[int] = ..., dim: _Optional[int] = ..., data_at: _Optional[int] = ..., versions_at: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("parts", "data")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[StepPartReply]
    data: bytes
    def __init__(self, parts: _Optional[_Iterable[_Union[StepPartReply, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...
