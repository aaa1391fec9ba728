"""A PS shard whose sparse tables do no work: the ceiling ``bench/ps_throughput.py --only sparse``
measures against (bench only, never a product path).

``SparseTable.pull_rows`` returns uninitialized rows and ``apply_push`` applies nothing. Everything
else is the real shard: the servicer, auth, validation (ids, shapes, finiteness), framing and both
transports. A sparse pull + push against these shards costs what it would cost if the table's code
(id index, gather, optimizer, scatter) took no time at all.

Run as ``python bench/no_table_shard.py ps serve ...`` (the arguments of ``tessera``).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ps.table import PushResult, SparsePush, SparseTable
from tessera.cli import main


def _pull_rows(self: SparseTable, ids: np.ndarray, checked: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    return torch.empty((len(ids), self.dim), dtype=self.row_dtype), np.zeros(len(ids), np.int64)


def _apply_push(self: SparseTable, p: SparsePush, *args: object, **kwargs: object) -> PushResult:
    return PushResult(len(p.ids), 0, -1.0, -1, self.step + 1)


SparseTable.pull_rows = _pull_rows  # type: ignore[method-assign]
SparseTable.apply_push = _apply_push  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
