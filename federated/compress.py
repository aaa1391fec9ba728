"""Uplink compression of model updates: fp16, int8 (per-tensor scale), top-k with error feedback.

Pure numpy; no wire. A :class:`Compressor` lives on the client (one per client id,
because top-k keeps the client's residual between rounds) and turns a list of
float arrays (the update ``w_local - w_global``) into :class:`EncodedTensor` s;
:func:`decode` turns one back into a float array on the server.

Encodings (``spec`` strings as the CLI takes them):

* ``""``/``"none"``: ``raw``, the array as is.
* ``"fp16"``: values cast to float16 (half the bytes of float32).
* ``"int8"``: ``q = round(x / s)`` with ``s = max|x| / 127`` per tensor; a quarter
  of float32's bytes plus one scale. The rounding error per element is at most ``s/2``.
* ``"topk:R"``: the ``ceil(R * size)`` largest-magnitude entries of each tensor of
  ``x + residual`` as (flat indices, int32 below 2**31 elements else int64; float32 values); what was not sent is
  kept as the new residual and added to the next round's update (error feedback,
  Stich et al. 2018), so nothing is lost, only delayed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from federated.errors import ConfigError, DtypeError, MalformedMessageError, NonFiniteError, ShapeMismatchError

__all__ = ["EncodedTensor", "CompressionSpec", "parse_compression", "Compressor", "decode", "encode_raw", "ENCODINGS"]

ENCODINGS = ("raw", "fp16", "int8", "topk")


@dataclass(frozen=True)
class EncodedTensor:
    """One logical tensor on the wire.

    ``shape``/``dtype``: the decoded tensor's. ``parts``: the arrays the encoding is
    made of (raw/fp16: the values; int8: the int8 codes; topk: int32/int64 indices
    then float32 values). ``scale``: int8's step. ``group``: which list the tensor
    belongs to ("weights", or an extra such as SCAFFOLD's "delta_c").
    """

    encoding: str
    shape: tuple[int, ...]
    dtype: str
    parts: tuple[np.ndarray, ...]
    scale: float = 0.0
    group: str = "weights"

    @property
    def nbytes(self) -> int:
        """Bytes of payload this tensor puts on the wire (headers not counted)."""
        return int(sum(p.nbytes for p in self.parts))


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed compression spec: ``encoding`` in ENCODINGS and, for topk, ``ratio`` in (0, 1]."""

    encoding: str = "raw"
    ratio: float = 1.0

    def __str__(self) -> str:
        if self.encoding == "raw":
            return ""
        return f"topk:{self.ratio:g}" if self.encoding == "topk" else self.encoding


def parse_compression(spec: str | None) -> CompressionSpec:
    """``""``/``"none"``/``"fp16"``/``"int8"``/``"topk:0.1"`` -> CompressionSpec (ConfigError otherwise)."""
    s = (spec or "").strip().lower()
    if s in ("", "none", "raw", "fp32", "float32"):
        return CompressionSpec()
    if s in ("fp16", "float16"):
        return CompressionSpec("fp16")
    if s == "int8":
        return CompressionSpec("int8")
    if s.startswith("topk"):
        _, _, r = s.partition(":")
        try:
            ratio = float(r) if r else 0.1
        except ValueError:
            raise ConfigError(f"compression {spec!r}: top-k ratio {r!r} is not a number") from None
        if not 0.0 < ratio <= 1.0 or not math.isfinite(ratio):
            raise ConfigError(f"compression {spec!r}: top-k ratio must be in (0, 1], got {ratio}")
        return CompressionSpec("topk", ratio)
    raise ConfigError(f"unknown compression {spec!r}; use none, fp16, int8 or topk:RATIO")


def _dtype_name(a: np.ndarray) -> str:
    return np.dtype(a.dtype).name


def encode_raw(arrays: Sequence[np.ndarray], group: str = "weights") -> list[EncodedTensor]:
    """Arrays as they are (no copy for C-contiguous arrays)."""
    out = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        out.append(EncodedTensor("raw", tuple(a.shape), _dtype_name(a), (a,), group=group))
    return out


class Compressor:
    """Encodes one client's updates. Holds the top-k residual (error feedback) between
    calls, so keep one instance per client id. Not thread-safe."""

    def __init__(self, spec: CompressionSpec | str | None = None) -> None:
        self.spec = spec if isinstance(spec, CompressionSpec) else parse_compression(spec)
        self.residual: list[np.ndarray] | None = None

    def encode(self, update: Sequence[np.ndarray], group: str = "weights") -> list[EncodedTensor]:
        """Encode float arrays. Raises NonFiniteError for NaN/Inf (nothing sensible to send)."""
        enc = self.spec.encoding
        if enc == "raw":
            return encode_raw(update, group)
        for i, a in enumerate(update):
            if not np.isfinite(a).all():
                raise NonFiniteError(f"update[{i}] holds NaN or Inf; refusing to compress it")
        if enc == "fp16":
            return [
                EncodedTensor("fp16", tuple(a.shape), _dtype_name(a), (np.ascontiguousarray(a, dtype=np.float16),), group=group)
                for a in update
            ]
        if enc == "int8":
            out = []
            for a in update:
                m = float(np.max(np.abs(a))) if a.size else 0.0
                scale = m / 127.0 if m > 0 else 1.0
                q = np.clip(np.rint(np.asarray(a, dtype=np.float64) / scale), -127, 127).astype(np.int8)
                out.append(EncodedTensor("int8", tuple(a.shape), _dtype_name(a), (q,), scale=scale, group=group))
            return out
        return self._topk(update, group)

    def _topk(self, update: Sequence[np.ndarray], group: str) -> list[EncodedTensor]:
        if self.residual is None or len(self.residual) != len(update) or any(
            r.shape != a.shape for r, a in zip(self.residual, update)
        ):
            self.residual = [np.zeros(a.shape, dtype=np.float64) for a in update]
        out = []
        new_res = []
        for a, r in zip(update, self.residual):
            acc = (np.asarray(a, dtype=np.float64) + r).reshape(-1)
            k = min(acc.size, max(1, math.ceil(self.spec.ratio * acc.size))) if acc.size else 0
            if k == acc.size:
                idx = np.arange(acc.size, dtype=np.int64)
            else:
                idx = np.sort(np.argpartition(np.abs(acc), acc.size - k)[acc.size - k :]).astype(np.int64)
            if acc.size < 2**31:
                idx = idx.astype(np.int32)  # half the index bytes for any realistic tensor
            vals = acc[idx].astype(np.float32)
            rest = acc.copy()
            rest[idx] -= vals.astype(np.float64)  # what float32 rounding lost is kept too
            new_res.append(rest.reshape(a.shape))
            out.append(EncodedTensor("topk", tuple(a.shape), _dtype_name(a), (idx, vals), group=group))
        self.residual = new_res
        return out


def decode(t: EncodedTensor, what: str = "tensor") -> np.ndarray:
    """The float array ``t`` stands for (dtype ``t.dtype``).

    Raises (naming ``what``) MalformedMessageError / DtypeError / ShapeMismatchError /
    NonFiniteError when the parts do not fit the encoding: that is remote input.
    """
    shape = tuple(int(s) for s in t.shape)
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    try:
        out_dtype = np.dtype(t.dtype)
    except TypeError:
        raise DtypeError(f"{what}: unknown dtype {t.dtype!r}") from None
    if out_dtype.kind != "f":
        raise DtypeError(f"{what}: decoded dtype must be a float type, got {t.dtype}")
    enc = t.encoding
    parts = t.parts
    if enc in ("raw", "fp16", "int8"):
        want = {"raw": out_dtype, "fp16": np.dtype(np.float16), "int8": np.dtype(np.int8)}[enc]
        if len(parts) != 1:
            raise MalformedMessageError(f"{what}: {enc} encoding has 1 part, got {len(parts)}")
        p = parts[0]
        if p.dtype != want:
            raise DtypeError(f"{what}: {enc} part has dtype {p.dtype}, expected {want}")
        if tuple(p.shape) != shape:
            raise ShapeMismatchError(f"{what}: {enc} part has shape {tuple(p.shape)}, expected {shape}")
        if enc == "raw":
            return p
        if enc == "fp16":
            return p.astype(out_dtype)
        if not (math.isfinite(t.scale) and t.scale > 0):
            raise NonFiniteError(f"{what}: int8 scale must be finite and > 0, got {t.scale}")
        return (p.astype(np.float64) * t.scale).astype(out_dtype)
    if enc == "topk":
        if len(parts) != 2:
            raise MalformedMessageError(f"{what}: topk encoding has 2 parts (indices, values), got {len(parts)}")
        idx, vals = parts
        if idx.dtype not in (np.int32, np.int64) or idx.ndim != 1:
            raise DtypeError(f"{what}: topk indices must be 1-d int32 or int64, got {idx.dtype} {idx.shape}")
        if vals.dtype.kind != "f" or vals.shape != idx.shape:
            raise DtypeError(f"{what}: topk values must be float with the indices' shape {idx.shape}, got {vals.dtype} {vals.shape}")
        if idx.size > size or (idx.size and (idx.min() < 0 or idx.max() >= size)):
            raise ShapeMismatchError(f"{what}: topk indices out of range for {size} elements")
        if idx.size > 1 and not np.all(np.diff(idx) > 0):
            raise MalformedMessageError(f"{what}: topk indices must be strictly increasing")
        out = np.zeros(size, dtype=out_dtype)
        out[idx] = vals
        return out.reshape(shape)
    raise DtypeError(f"{what}: unknown encoding {enc!r}; expected one of {ENCODINGS}")
