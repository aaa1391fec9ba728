"""The digits data both the worker's and the federated ``digits`` tasks use is read from scikit-learn's
bundled file with numpy (no scikit-learn import in a worker): the same values as
``sklearn.datasets.load_digits`` (the reference), scaled to [0, 1]."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from worker.tasks import digits


def test_digits_equal_scikit_learns_load_digits() -> None:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    ref = sklearn_datasets.load_digits()
    x_tr, y_tr, x_te, y_te = digits.load_split(0)
    x, y = np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])
    perm = np.random.default_rng(0).permutation(len(ref.data))
    order = np.concatenate([perm[360:], perm[:360]])  # load_split's train then test rows
    assert x.dtype == np.float32 and np.array_equal(x, (ref.data[order] / 16.0).astype(np.float32))
    assert y.dtype == np.int64 and np.array_equal(y, ref.target[order])
    assert x_tr.shape == (1437, 64) and x_te.shape == (360, 64)


def test_a_digits_worker_does_not_import_scikit_learn() -> None:
    code = "import sys; from worker.tasks import digits; digits.load_split(0); print('sklearn' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "False", r.stdout + r.stderr
