"""Low-precision row storage: which dtypes a sparse table may store its rows in, and the rounding
rule of the write back.

Rows are stored in ``float32``, ``float16`` or ``bfloat16``; optimizer maths is always fp32 (the
stored row is widened, updated with fp32 state, and rounded back). The rounding rule:

- ``float32``: none.
- ``float16``: round to nearest even (10 mantissa bits keep updates of ~1e-3 relative size).
- ``bfloat16``: **stochastic rounding**. With ``b`` the fp32 bit pattern of the new value and
  ``u`` a 16-bit random integer, the stored value is ``(b + u) & 0xFFFF0000`` read as fp32 (then
  exactly bf16): the magnitude is rounded up with probability (dropped low 16 bits) / 2^16, down
  otherwise, so the stored value's expectation is the fp32 value and an update smaller than half
  a bf16 ulp still moves the row on average (round to nearest would drop it every time).
  NaN stays NaN; a value that rounds past the largest finite bf16 becomes inf (as with RNE).
  ``u`` is a counter-based hash of (table key, row id, row version after the update, column): the
  same push gives the same bits on every run, on a primary and its backup, whatever the shard
  count.

Initial values and values loaded from fp32 (assign, checkpoints of fp32 tables) are rounded to
nearest.
"""
from __future__ import annotations

import numpy as np
import torch

from ps.partition import GOLDEN, mix64

__all__ = ["ROW_DTYPES", "round_rows", "stochastic_round_bf16", "to_storage_array", "from_storage_array"]

ROW_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_M32 = 0xFFFFFFFF


def _noise16(row_keys: np.ndarray, dim: int) -> torch.Tensor:
    """(n, dim) int32 in [0, 2^16): a hash of each row's 64-bit key and the column (lowbias32)."""
    k = torch.from_numpy((row_keys & np.uint64(_M32)).astype(np.int64))[:, None]
    cols = torch.arange(dim, dtype=torch.int64)[None, :]
    x = (k + cols * 0x9E3779B9) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # wraps mod 2^64 in int64: the low 32 bits are still right
    x = x ^ (x >> 16)
    return (x & 0xFFFF).to(torch.int32)


_ROUND_BLOCK = 4096  # rows per block: the int64 hash temporaries stay ~2 MiB whatever the push size


def stochastic_round_bf16(x: torch.Tensor, row_keys: np.ndarray) -> torch.Tensor:
    """``x`` (n, dim) float32 rounded stochastically to bfloat16 (see the module doc); ``row_keys``:
    n uint64 keys, one per row (the randomness). Works block by block of rows, so its temporaries
    do not grow with ``n``."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    for a in range(0, x.shape[0], _ROUND_BLOCK):
        xs = x[a : a + _ROUND_BLOCK]
        noisy = _noise16(row_keys[a : a + _ROUND_BLOCK], x.shape[1]).add_(xs.view(torch.int32)).bitwise_and_(~0xFFFF)
        rounded = noisy.view(torch.float32)
        nan = torch.isnan(xs)
        if bool(nan.any()):
            rounded = torch.where(nan, xs, rounded)
        out[a : a + _ROUND_BLOCK] = rounded  # exactly representable: the cast only drops zero bits
    return out


def row_keys(table_key: np.uint64, ids: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """uint64 key per (row id, version): the randomness of one row's write back."""
    with np.errstate(over="ignore"):
        return mix64(np.asarray(ids, np.int64).view(np.uint64) ^ table_key ^ (np.asarray(versions, np.int64).view(np.uint64) * GOLDEN))


def round_rows(x: torch.Tensor, dtype: torch.dtype, keys: np.ndarray | None = None) -> torch.Tensor:
    """fp32 rows ``x`` in the storage ``dtype`` (stochastic for bf16 when ``keys`` are given, else
    round to nearest)."""
    if dtype == torch.float32:
        return x
    if dtype == torch.bfloat16 and keys is not None:
        return stochastic_round_bf16(x, keys)
    return x.to(dtype)


def to_storage_array(t: torch.Tensor) -> np.ndarray:
    """Rows in their storage dtype as a numpy array (bfloat16 as its uint16 bit pattern)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage_array(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of to_storage_array; float32 input is rounded to nearest into ``dtype``."""
    if a.dtype == np.uint16:
        if dtype != torch.bfloat16:
            raise ValueError("uint16 rows are bfloat16 bit patterns; this table does not store bfloat16")
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
