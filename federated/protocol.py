"""The federated protocol as plain values (no protobuf): what the server asks a client
to do (:class:`Task`) and what the client answers (:class:`Answer`).

``wire.py`` converts these to and from ``tessera.v1.fed_pb2`` messages; the server's
round logic and the client runtime only ever see these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from federated.compress import EncodedTensor

__all__ = ["FIT", "EVALUATE", "SECAGG", "KINDS", "Scalar", "Task", "Answer", "Blob", "WEIGHTS", "SECAGG_GROUP"]

FIT = "fit"
EVALUATE = "evaluate"
SECAGG = "secagg"
KINDS = (FIT, EVALUATE, SECAGG)

WEIGHTS = "weights"
"""Group name of the model's weights in blobs and answers."""
SECAGG_GROUP = "secagg"
"""Group name of a secure-aggregation message (one uint8 tensor of opaque bytes)."""

Scalar = Union[float, int, str, bool]


@dataclass(frozen=True)
class Task:
    """Server -> client: do ``kind`` for round ``round`` on the tensors of ``blob``.

    ``compress``: the uplink encoding the server asks for (a compression spec string).
    ``secagg``: a FIT under secure aggregation (the client keeps its update and
    answers with its first secure-aggregation message). ``secagg_stage``: for
    SECAGG tasks, the step of the protocol. ``inline``: the task's tensors when
    they are small enough to ride in the task message (no Fetch round trip).
    """

    task_id: str
    client_id: str
    round: int
    kind: str
    config: dict[str, Scalar] = field(default_factory=dict)
    blob: str = ""
    blob_bytes: int = 0
    timeout_s: float = 0.0
    compress: str = ""
    secagg_stage: int = 0
    secagg: bool = False
    inline: "Blob | None" = None  # a small blob sent with the task instead of fetched


@dataclass(frozen=True)
class Blob:
    """Tensors the server offers for Fetch: encoded tensors tagged by group, and their
    bytes laid end to end (``data``, built once and shared by every fetcher)."""

    tensors: tuple[EncodedTensor, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        """Size of the blob's encoded bytes."""
        return len(self.data)


@dataclass(frozen=True)
class Answer:
    """Client -> server: the outcome of one task.

    FIT: ``tensors`` holds group "weights" (full weights, or ``w - w_global`` when
    ``is_delta``) and any extras; EVALUATE: ``loss``, ``num_examples``,
    ``metrics``; SECAGG: one uint8 tensor in group "secagg". ``error`` set means the
    client failed the task and nothing else is meaningful. ``bytes_received``: what
    the client fetched for this task; ``bytes_sent`` is filled in by the server.
    """

    task_id: str
    client_id: str
    round: int
    kind: str
    num_examples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    loss: float = 0.0
    tensors: tuple[EncodedTensor, ...] = ()
    is_delta: bool = False
    error: str = ""
    secagg_stage: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0

    def group(self, name: str) -> list[EncodedTensor]:
        """The answer's tensors of group ``name`` (``"weights"``, or an extra such as ``"delta_c"``), in order."""
        return [t for t in self.tensors if t.group == name]
