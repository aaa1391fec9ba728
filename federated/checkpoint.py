"""Server checkpoints: the round reached, the global weights, the strategy's state and
the history, in one msgpack file (numpy arrays as dtype + shape + raw bytes; no
pickle). Written atomically (temp file + rename), so a crash mid-write leaves the
previous checkpoint intact."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from federated.errors import ConfigError

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint"]

_ND = 1  # msgpack ext type of a numpy array
_FORMAT = "tessera-fed-checkpoint/1"


@dataclass
class Checkpoint:
    """``round``: the last completed round (its weights are ``weights``)."""

    round: int
    weights: list[np.ndarray]
    strategy_state: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "fiub":
            raise TypeError(f"cannot checkpoint an array of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_ND, msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _ND:
        return msgpack.ExtType(code, data)
    dtype, shape, raw = msgpack.unpackb(data)
    dt = np.dtype(dtype)
    if dt.kind not in "fiub":
        raise ValueError(f"checkpoint holds an array of dtype {dt}")
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


def save_checkpoint(path: str, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` to ``path`` atomically (msgpack; numpy arrays as dtype + shape + raw bytes, never
    pickle): a crash mid-write leaves the previous checkpoint in place. Blocking."""
    doc = {
        "format": _FORMAT,
        "round": ckpt.round,
        "weights": list(ckpt.weights),
        "strategy_state": ckpt.strategy_state,
        "history": ckpt.history,
        "meta": ckpt.meta,
    }
    data = msgpack.packb(doc, default=_default, use_bin_type=True)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> Checkpoint:
    """Raises ConfigError for a file that is not a Tessera federated checkpoint."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        doc = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any decode failure means "not a checkpoint"
        raise ConfigError(f"{path}: not a readable checkpoint ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ConfigError(f"{path}: not a Tessera federated checkpoint")
    return Checkpoint(
        round=int(doc["round"]), weights=list(doc["weights"]), strategy_state=dict(doc.get("strategy_state") or {}),
        history=list(doc.get("history") or []), meta=dict(doc.get("meta") or {}),
    )
