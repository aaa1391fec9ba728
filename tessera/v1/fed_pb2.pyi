from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    TASK_KIND_FIT: _ClassVar[TaskKind]
    TASK_KIND_EVALUATE: _ClassVar[TaskKind]
    TASK_KIND_SECAGG: _ClassVar[TaskKind]
TASK_KIND_UNSPECIFIED: TaskKind
TASK_KIND_FIT: TaskKind
TASK_KIND_EVALUATE: TaskKind
TASK_KIND_SECAGG: TaskKind

class Scalar(_message.Message):
    __slots__ = ("f", "i", "s", "b")
    F_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    f: float
    i: int
    s: str
    b: bool
    def __init__(self, f: _Optional[float] = ..., i: _Optional[int] = ..., s: _Optional[str] = ..., b: bool = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("group", "encoding", "shape", "dtype", "scale", "parts")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    group: str
    encoding: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    scale: float
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, group: _Optional[str] = ..., encoding: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., scale: _Optional[float] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node", "client_ids", "version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    client_ids: _containers.RepeatedScalarFieldContainer[str]
    version: str
    def __init__(self, node: _Optional[str] = ..., client_ids: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("client_ids", "server")
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    client_ids: _containers.RepeatedScalarFieldContainer[str]
    server: str
    def __init__(self, client_ids: _Optional[_Iterable[str]] = ..., server: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "client_id", "round", "kind", "config", "blob", "blob_bytes", "timeout_s", "compress", "secagg_stage", "secagg", "specs", "data")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Scalar
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_STAGE_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    client_id: str
    round: int
    kind: TaskKind
    config: _containers.MessageMap[str, Scalar]
    blob: str
    blob_bytes: int
    timeout_s: float
    compress: str
    secagg_stage: int
    secagg: bool
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    data: bytes
    def __init__(self, task_id: _Optional[str] = ..., client_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., config: _Optional[_Mapping[str, Scalar]] = ..., blob: _Optional[str] = ..., blob_bytes: _Optional[int] = ..., timeout_s: _Optional[float] = ..., compress: _Optional[str] = ..., secagg_stage: _Optional[int] = ..., secagg: bool = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("welcome", "task", "cancel", "shutdown")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    task: Task
    cancel: Cancel
    shutdown: Shutdown
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("hello", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("blob", "client_id", "task_id")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    blob: str
    client_id: str
    task_id: str
    def __init__(self, blob: _Optional[str] = ..., client_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("offset", "last", "total", "specs", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    last: bool
    total: int
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., last: bool = ..., total: _Optional[int] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("task_id", "client_id", "round", "kind", "num_examples", "metrics", "loss", "specs", "is_delta", "total", "error", "secagg_stage", "bytes_received")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    IS_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECAGG_STAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    client_id: str
    round: int
    kind: TaskKind
    num_examples: int
    metrics: _containers.ScalarMap[str, float]
    loss: float
    specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    is_delta: bool
    total: int
    error: str
    secagg_stage: int
    bytes_received: int
    def __init__(self, task_id: _Optional[str] = ..., client_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., num_examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., loss: _Optional[float] = ..., specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., is_delta: bool = ..., total: _Optional[int] = ..., error: _Optional[str] = ..., secagg_stage: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class SubmitChunk(_message.Message):
    __slots__ = ("header", "offset", "last", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    offset: int
    last: bool
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., offset: _Optional[int] = ..., last: bool = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    def __init__(self, accepted: bool = ..., detail: _Optional[str] = ...) -> None: ...
