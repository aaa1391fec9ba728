"""ps.rowkernel's cache of long-lived arrays' addresses: always the array's own, never a dead one's."""
import gc

import numpy as np

from ps import rowkernel


def test_kept_address_is_the_arrays_own_and_dies_with_it() -> None:
    a = np.arange(4, dtype=np.int64)
    assert rowkernel.kept_ptr(a) == a.ctypes.data == rowkernel.kept_ptr(a)
    key = id(a)
    del a
    gc.collect()
    assert key not in rowkernel._ADDRESSES  # a dead array's entry goes with it
    # a new array (a store's pointer table after growth, perhaps at a recycled id) gets its own address
    for _ in range(50):
        b = np.arange(8, dtype=np.int64)
        assert rowkernel.kept_ptr(b) == b.ctypes.data
        del b
    assert rowkernel.kept_ptr(None) is None


def test_hparams_struct_follows_the_values() -> None:
    h1 = rowkernel._hparams({"lr": 0.1, "eps": 1e-8})
    h2 = rowkernel._hparams({"lr": 0.05, "eps": 1e-8})  # a staleness-scaled lr: its own struct
    assert (h1.lr, h1.eps, h1.momentum) == (0.1, 1e-8, 0.0) and h2.lr == 0.05
    assert rowkernel._hparams({"lr": 0.1, "eps": 1e-8}) is h1


def test_ptr_is_numpys_address_for_every_kind_of_array() -> None:
    """``ptr`` reads a writable array's address through its buffer (faster than ``a.ctypes``) and
    falls back to ``a.ctypes.data`` where that cannot work: reference, numpy's own address."""
    base = np.arange(64, dtype=np.float32)
    readonly = np.frombuffer(bytes(64), np.int64)
    arrays = [base, base[5:], base.reshape(8, 8)[:, 1], np.zeros(0, np.int64), readonly, readonly[3:], np.zeros((3, 0))]
    for a in arrays:
        assert rowkernel.ptr(a) == a.ctypes.data
    assert rowkernel.ptr(None) is None
