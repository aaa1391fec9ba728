"""The compiled row kernel behind ``SparseTable`` (``ps/_rowkernel.c``), loaded with ctypes.

One C pass over a request's rows: a push applies the optimizer to each row and its state in place
(or into buffers, for a push whose new rows a backup must see before they are stored) and bumps its
version; a pull copies each row into the reply. ctypes releases the GIL for the call, so a shard's
handler threads run requests of different tables in parallel.

``pip install`` builds the library (setup.py: an optional extension, plain C, no Python headers);
where it could not be built (no C compiler), or ``TESSERA_ROW_KERNEL=0`` is set, or the self-check
at load finds it would not give the torch path's floats bit for bit on this machine, tables use the
numpy/torch path (``ps.optim``), which stays the reference: ``path_of(spec)`` says which a table
uses and why, and ``SparseTable.memory_stats().row_path`` reports it.

Covered: every optimizer of ``ps.optim`` (sgd, momentum, nesterov, adagrad, rowwise_adagrad, adam,
adamw, ftrl; Adam's bias correction and Adagrad's lr_decay per row, from the row's own step: its
version after the update) on float32, bfloat16 (stochastic rounding, as ``ps.rowdtype``) and
float16 rows (where the compiler has ``_Float16``).
Pure ctypes/numpy/torch: no grpc.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import platform
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

__all__ = ["KERNEL", "RowKernel", "UNAVAILABLE", "kept_ptr", "kernel_for", "path_of", "ptr", "say_once"]

_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
_OPT_CODES = {"sgd": 0, "momentum": 1, "nesterov": 2, "adagrad": 3, "rowwise_adagrad": 4, "adam": 5, "adamw": 6, "ftrl": 7}
_STATE = {  # (elementwise, row-wise, second elementwise) state names the kernel updates (s0, s1, s2), in ps.optim's names
    "sgd": (None, None, None), "momentum": ("momentum_buffer", None, None), "nesterov": ("momentum_buffer", None, None),
    "adagrad": ("sum", None, None), "rowwise_adagrad": (None, "sum", None),
    "adam": ("exp_avg", None, "exp_avg_sq"), "adamw": ("exp_avg", None, "exp_avg_sq"), "ftrl": ("z", None, "n"),
}


class _Hparams(ctypes.Structure):
    """tk_hparams: every optimizer's hyperparameters as Python has them (0 where one has none)."""

    _fields_ = [(k, ctypes.c_double) for k in ("lr", "weight_decay", "eps", "momentum", "lr_decay", "beta1", "beta2", "beta", "l1", "l2")]


_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def ptr(a: np.ndarray | torch.Tensor | None) -> int | None:
    """The address of ``a``'s data (None: None)."""
    return None if a is None else a.data_ptr() if isinstance(a, torch.Tensor) else _address(a)


def _address(a: np.ndarray) -> int:
    if a.flags.writeable:  # a writable buffer's address, ~0.4 us: ``a.ctypes`` builds an object (~1 us, ~30 per Step)
        try:  # (try, not contextlib.suppress: that object alone costs ~0.4 us here)
            return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]
        except (TypeError, ValueError, BufferError):  # empty, or not one contiguous buffer
            pass
    return int(a.ctypes.data)


# id(array) -> (weakref to it, its address): a dict lookup (~0.15 us) beats even ``_address``. Only for
# arrays that outlive a call (the store's pointer tables, the index's runs): they are replaced, never
# resized, when the store or index grows, and a dead array's entry goes with it
_ADDRESSES: dict[int, tuple[weakref.ref, int]] = {}


def kept_ptr(a: np.ndarray | None) -> int | None:
    """``ptr`` of an array that is replaced, never resized in place (its address is fixed for its life)."""
    if a is None:
        return None
    key = id(a)
    e = _ADDRESSES.get(key)
    if e is not None and e[0]() is a:
        return e[1]
    addr = _address(a)
    _ADDRESSES[key] = (weakref.ref(a, functools.partial(_forget_address, key)), addr)
    return addr


def _forget_address(key: int, ref: weakref.ref) -> None:
    e = _ADDRESSES.get(key)
    if e is not None and e[0] is ref:
        del _ADDRESSES[key]


_HPARAMS: dict[tuple, _Hparams] = {}  # (name, value) items -> the struct (a table's hparams rarely change)


def _hparams(hparams: Mapping[str, float]) -> _Hparams:
    key = tuple(hparams.items())
    h = _HPARAMS.get(key)
    if h is None:
        if len(_HPARAMS) >= 256:  # staleness-scaled lrs make new ones: keep it bounded
            _HPARAMS.clear()
        h = _HPARAMS[key] = _Hparams(*(float(hparams.get(field[0], 0.0)) for field in _Hparams._fields_))
    return h


class RowKernel:
    """The loaded library. Methods take the store's per-chunk column pointer tables
    (``RowStore.pointers``) and contiguous numpy/torch buffers; callers hold the table's lock."""

    def __init__(self, lib: ctypes.CDLL, lanes: int) -> None:
        self.lanes = lanes
        self._push = lib.tk_push
        self._push.restype = ctypes.c_int
        self._push.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, _I64, _I64, ctypes.c_int, _I64, ctypes.POINTER(_Hparams),
            _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P,
        ]
        self._scatter = lib.tk_scatter
        self._scatter.restype = None
        self._scatter.argtypes = [
            ctypes.c_int, _I64, _I64, ctypes.c_int, _I64, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64,
        ]
        lib.tk_features.restype = ctypes.c_int
        self.row_dtypes = ("float32", "bfloat16", "float16") if lib.tk_features() & 1 else ("float32", "bfloat16")
        self._gather = lib.tk_gather
        self._gather.restype = None
        self._gather.argtypes = [_I64, _I64, ctypes.c_int, _I64, _P, _P, _P, _P, _P]
        # the id index's hash table (ps.index.HashIndex calls these with its own pointers)
        self.hash_lookup, self.hash_insert, self.hash_set, self.hash_move = lib.tk_hash_lookup, lib.tk_hash_insert, lib.tk_hash_set, lib.tk_hash_move
        self.hash_lookup.restype, self.hash_move.restype = None, None
        self.hash_insert.restype = self.hash_set.restype = _I64
        self.hash_lookup.argtypes = [_P, _I64, _P, _P, _I64, _P]
        self.hash_insert.argtypes = self.hash_set.argtypes = [_P, _I64, _P, _P, _P, _I64, _P]
        self.hash_move.argtypes = [_P, _I64, _P, _I64, _P]
        self.hash_gather = lib.tk_hash_gather  # (ps.index.HashIndex.lookup_rows)
        self.hash_gather.restype = _I64
        self.hash_gather.argtypes = [_P, _I64, _P, _P, _I64, _P, _I64, ctypes.c_int, _I64, _P, _P, _P, _P, _P]
        self._staleness = lib.tk_staleness
        self._staleness.restype = None
        self._staleness.argtypes = [_I64, ctypes.c_int, _I64, _P, _P, _P, _P]
        self._shard_of = lib.tk_shard_of
        self._shard_of.restype = None
        self._shard_of.argtypes = [_P, _I64, ctypes.c_uint64, _P, _I64, _P]

    def staleness(self, shift: int, rows: np.ndarray, versions: np.ndarray, base: np.ndarray) -> tuple[int, int, int]:
        """Of store rows ``rows`` whose gradients were computed from versions ``base`` (int64, contiguous;
        < 0: not measured), the staleness (version now - base) where it is >= 0: (count, sum, max; -1 if none)."""
        stats = np.array([0, 0, -1], np.int64)
        self._staleness(len(rows), shift, (1 << shift) - 1, ptr(rows), kept_ptr(versions), ptr(base), ptr(stats))
        return int(stats[0]), int(stats[1]), int(stats[2])

    def shard_of(self, ids: np.ndarray, num_slots: int, slot_shards: np.ndarray | None, num_shards: int) -> np.ndarray:
        """``ps.partition.SlotMap.shard_of`` of int64 ``ids`` (contiguous) in one pass: the same shards."""
        out = np.empty(len(ids), np.int64)
        self._shard_of(ptr(ids), len(ids), num_slots, kept_ptr(slot_shards), num_shards, ptr(out))
        return out

    def push(
        self, opt: str, hparams: Mapping[str, float], dim: int, shift: int, rows: np.ndarray, grad: torch.Tensor,
        grad_idx: np.ndarray | None, cols: Mapping[str, np.ndarray | None], touch: int,
        out: Mapping[str, np.ndarray | None] | None = None, row_dtype: str = "float32", ids: np.ndarray | None = None,
        table_key: int = 0,
    ) -> None:
        """Apply ``opt`` to store rows ``rows`` (int64, unique; their ids ``ids``, needed for bfloat16)
        with gradient rows ``grad[grad_idx]`` (fp32 (m, dim) contiguous; ``grad_idx`` None: row i).
        ``cols``: pointer tables of "values", "s0", "s1", "s2", "version", "touch" (None where absent;
        s0 and s2 elementwise state, s1 row-wise: ``_STATE``). A row's step (Adam's bias correction,
        Adagrad's lr_decay) is its version after this update.
        ``out`` (keys "values", "s0", "s1", "s2", "version": buffers of len(rows) rows, values fp32):
        compute into them, leaving the store as it is. Values are stored as ``row_dtype`` (bfloat16
        rounded stochastically with ``table_key``, as ``ps.rowdtype``)."""
        h = _hparams(hparams)
        o = out or {}
        rc = self._push(
            _OPT_CODES[opt], self.lanes, _DTYPE_CODES[row_dtype], int(table_key), len(rows), dim, shift, (1 << shift) - 1,
            ctypes.byref(h), ptr(rows), ptr(ids), ptr(grad), ptr(grad_idx), kept_ptr(cols["values"]), kept_ptr(cols.get("s0")),
            kept_ptr(cols.get("s1")), kept_ptr(cols.get("s2")), kept_ptr(cols["version"]), kept_ptr(cols.get("touch")), touch,
            ptr(o.get("values")), ptr(o.get("s0")), ptr(o.get("s1")), ptr(o.get("s2")), ptr(o.get("version")),
        )
        assert rc == 0, f"row kernel refused optimizer {opt!r} on {row_dtype} rows"

    def scatter(
        self, dim: int, shift: int, rows: np.ndarray, new: Mapping[str, np.ndarray | None], cols: Mapping[str, np.ndarray | None], touch: int,
        row_dtype: str = "float32",
    ) -> None:
        """Store rows computed by ``push(..., out=new)``."""
        self._scatter(
            _DTYPE_CODES[row_dtype], len(rows), dim, shift, (1 << shift) - 1, ptr(rows),
            new.get("s0") is not None, new.get("s1") is not None, new.get("s2") is not None,
            ptr(new["values"]), ptr(new.get("s0")), ptr(new.get("s1")), ptr(new.get("s2")), ptr(new["version"]),
            kept_ptr(cols["values"]), kept_ptr(cols.get("s0")), kept_ptr(cols.get("s1")), kept_ptr(cols.get("s2")),
            kept_ptr(cols["version"]), kept_ptr(cols.get("touch")), touch,
        )

    def gather(
        self, row_bytes: int, shift: int, rows: np.ndarray, values: np.ndarray, versions: np.ndarray | None,
        out: torch.Tensor, out_versions: np.ndarray | None,
    ) -> None:
        """Copy the ``row_bytes``-byte values of store rows ``rows`` into ``out`` (contiguous, one row
        per entry) and their versions into ``out_versions``."""
        self._gather(
            len(rows), row_bytes, shift, (1 << shift) - 1, ptr(rows), kept_ptr(values), kept_ptr(versions), ptr(out), ptr(out_versions)
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (NaNs compare equal when their bits do)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _self_check(k: RowKernel) -> str:
    """'' if the kernel gives the torch path's floats bit for bit on random rows, else what differs."""
    from ps.optim import make_optimizer
    from ps.rowdtype import ROW_DTYPES, round_rows, row_keys

    gen = torch.Generator().manual_seed(12345)
    n, dim = 37, 67  # a tail past every vector width
    adam = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    for opt, h in (
        ("sgd", {"lr": 0.05, "weight_decay": 0.01}), ("momentum", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
        ("nesterov", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}),
        ("adagrad", {"lr": 0.1, "lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.01, "initial_accumulator": 0.1}),
        ("adagrad", {"lr": 0.1, "lr_decay": 0.01, "eps": 1e-10, "weight_decay": 0.01, "initial_accumulator": 0.1}),
        ("rowwise_adagrad", {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.0}),
        ("rowwise_adagrad", {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01}),
        ("adam", {**adam, "weight_decay": 0.0}), ("adam", {**adam, "weight_decay": 0.01}),
        ("adam", {**adam, "beta1": 0.3, "beta2": 0.6, "weight_decay": 0.0}),  # lerp's other form (weight >= 0.5)
        ("adamw", {**adam, "weight_decay": 0.01}),
        ("ftrl", {"lr": 0.05, "beta": 1.0, "l1": 0.3, "l2": 0.01, "initial_accumulator": 0.1}),
    ):
      for dtype in k.row_dtypes:
        o = make_optimizer(opt, h)
        rd = ROW_DTYPES[dtype]
        p = (torch.randn(n, dim, generator=gen) * 1e3).to(rd)  # row dtype overflow and NaN rows included
        if dtype != "float32":
            p[0, :3] = torch.tensor([float("nan"), float("inf"), 6e4]).to(rd)
        g = torch.randn(n, dim, generator=gen)
        names = _STATE[opt]
        state = o.init_state(p.float())
        for v in state.values():
            v.add_(torch.rand(v.shape, generator=gen))
        ids = torch.randint(0, 1 << 40, (n,), generator=gen).numpy()
        ver = torch.randint(0, 3000, (n,), generator=gen).numpy()  # each row at its own step
        new_ver = ver + 1
        ref_p, ref_s = p.float().clone(), {key: v.clone() for key, v in state.items()}
        o.update(ref_p, g, ref_s, torch.from_numpy(new_ver).to(torch.float64)[:, None])
        ref = round_rows(ref_p, rd, row_keys(np.uint64(77), ids, new_ver) if dtype == "bfloat16" else None)
        kp, ks = p.clone(), {key: v.clone() for key, v in state.items()}
        cols: dict[str, np.ndarray | None] = {"values": np.array([kp.data_ptr()], np.int64), "version": np.array([ver.ctypes.data], np.int64)}
        for col, name in zip(("s0", "s1", "s2"), names, strict=True):
            cols[col] = np.array([ks[name].data_ptr()], np.int64) if name else None
        k.push(opt, h, dim, 20, np.arange(n, dtype=np.int64), g, None, cols, 0, row_dtype=dtype, ids=ids, table_key=77)
        same = torch.equal(_bits(kp), _bits(ref)) and all(torch.equal(_bits(ks[key]), _bits(ref_s[key])) for key in ref_s)
        if not same or not (ver == new_ver).all():
            return f"{opt} on {dtype} rows differs from ps.optim's torch path on this machine"
    return ""


def _load() -> tuple[RowKernel | None, str]:
    if os.environ.get("TESSERA_ROW_KERNEL", "1") == "0":
        return None, "TESSERA_ROW_KERNEL=0"
    # the built library next to this file (ps/_rowkernel<extension suffix>)
    candidates = (Path(__file__).parent / f"_rowkernel{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return None, "not built (no C compiler at install: pip install -e . with one builds it)"
    # floats per vector in torch's CPU kernels (the order of the row-wise norm's sum), None where it is not
    # known here (the kernel is not used): vector_norm over the last dim sums in 8 lanes under both AVX512
    # and AVX2 (its reduction kernels stop at AVX2)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    lanes = {"AVX512": 8, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability()) if x86 else None
    if lanes is None:
        return None, f"torch's vector width on {platform.machine()} / {torch.backends.cpu.get_cpu_capability()} is not known to it"
    try:
        k = RowKernel(ctypes.CDLL(str(path)), lanes)
    except (OSError, AttributeError) as e:
        return None, f"could not load {path.name}: {e}"
    bad = _self_check(k)
    return (None, bad) if bad else (k, "")


KERNEL, UNAVAILABLE = _load()
_said = False


def say_once() -> None:
    """Print, once per process, the line a shard starts with when its tables cannot use the kernel."""
    global _said
    if KERNEL is None and not _said:
        _said = True
        print(f"tessera ps: row kernel not in use ({UNAVAILABLE}); sparse tables run the numpy path", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Binding:
    kernel: RowKernel
    opt: str
    s0: str | None  # the state columns the kernel updates (``_STATE``)
    s1: str | None
    s2: str | None


def path_of(opt: str, hparams: Mapping[str, float], row_dtype: str) -> str:
    """``"kernel"`` if a table of this optimizer and row dtype runs on the row kernel, else
    ``"numpy (<why>)"``."""
    if KERNEL is None:
        return f"numpy ({UNAVAILABLE})"
    if row_dtype not in KERNEL.row_dtypes:
        return f"numpy ({row_dtype} rows: this build of the kernel has no {row_dtype})"
    if opt not in _OPT_CODES:
        return f"numpy ({opt}: not in the kernel)"
    return "kernel"


def kernel_for(opt: str, hparams: Mapping[str, float], row_dtype: str) -> _Binding | None:
    """The kernel bound to a table's optimizer, or None where ``path_of`` says numpy."""
    if path_of(opt, hparams, row_dtype) != "kernel":
        return None
    assert KERNEL is not None
    return _Binding(KERNEL, opt, *_STATE[opt])
