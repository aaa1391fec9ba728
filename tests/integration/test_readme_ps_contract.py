"""README promises about the parameter server that had no test (helper Y's README audit,
/work/notes/Y-audit.md), against real shard servers in this process:

* Bad input table: "a checkpoint request without --checkpoint-dir, or a cut at a clock a table has
  passed | FAILED_PRECONDITION | FailedPreconditionError" (and, as for all bad input, nothing
  changes).
"""
from __future__ import annotations

import numpy as np
import pytest

from ps.consistency import SyncPolicy
from ps.errors import FailedPreconditionError
from tessera.v1 import ps_pb2 as pb


def test_checkpoint_without_a_checkpoint_dir_is_failed_precondition(inproc_cluster) -> None:
    cluster = inproc_cluster(2)  # no checkpoint_dir
    c = cluster.client()
    c.create_dense("w", 10, lr=0.1)
    c.push_dense("w", np.ones(10, np.float32))
    before = c.pull_dense("w").copy()
    for at_clock in (None, -1):  # a cluster cut, and each shard now
        with pytest.raises(FailedPreconditionError, match="no checkpoint directory.*--checkpoint-dir"):
            c.checkpoint(at_clock=at_clock)
    np.testing.assert_array_equal(c.pull_dense("w"), before)  # nothing changed
    c.push_dense("w", np.ones(10, np.float32))  # and nothing stays held: the table still takes pushes
    assert all(sh.checkpoints == 0 for sh in cluster.shards)


def test_a_cut_at_a_clock_the_table_has_passed_is_failed_precondition(inproc_cluster, tmp_path) -> None:
    cluster = inproc_cluster(1, checkpoint_dir=str(tmp_path / "ck"))
    c = cluster.client(worker="w0")
    c.create_dense("w", 4, lr=0.1)
    c.join()
    for step in range(3):  # one BSP worker: the table reaches clock 3
        c.pull_dense("w", policy=SyncPolicy(clock=step, sync=True))
        c.push_dense("w", np.ones(4, np.float32), policy=SyncPolicy(clock=step, sync=True))
    c.pull_dense("w", policy=SyncPolicy(clock=3, sync=True))
    before = c.pull_dense("w").copy()
    late = pb.CheckpointRequest(at_clock=1).SerializeToString()  # phase 2 for a clock long passed
    with pytest.raises(FailedPreconditionError, match="'w' is at clock 3, past the requested 1"):
        c._call(0, "Checkpoint", late)
    assert cluster.shards[0].checkpoints == 0
    np.testing.assert_array_equal(c.pull_dense("w"), before)
    # the refused cut held nothing: the next round still applies, and a cut at the current clock works
    c.push_dense("w", np.ones(4, np.float32), policy=SyncPolicy(clock=3, sync=True))
    c.pull_dense("w", policy=SyncPolicy(clock=4, sync=True))
    ((path, clock),) = c.checkpoint()
    assert clock == 4 and path
