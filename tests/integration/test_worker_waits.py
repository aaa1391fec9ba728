"""Issue 17 item 9, README "Membership": a worker waiting at the start of a run never waits in silence.
Real shard over gRPC; worker 0 of 2 joins alone and must say, every WAIT_NOTE_S seconds, how many of the
workers joined and who; worker 1 waiting for worker 0's tables says that too."""
from __future__ import annotations

import logging

import pytest
import torch

import worker.paramsync as paramsync
from ps.client import PSClient
from ps.config import ShardConfig
from ps.server import build_server
from worker.paramsync import PSSync


@pytest.fixture
def shard_addr():
    server, port, shard = build_server(ShardConfig())
    yield f"127.0.0.1:{port}"
    server.stop(0)
    shard.close()


def test_start_waits_are_reported(shard_addr, caplog, monkeypatch) -> None:
    monkeypatch.setattr(paramsync, "WAIT_NOTE_S", 0.3)
    caplog.set_level(logging.WARNING, logger="worker.paramsync")

    # worker 1 first: worker 0 has not created the tables yet
    c1 = PSClient([shard_addr])
    s1 = PSSync(torch.nn.Linear(3, 2), c1, "waits", worker_index=1, num_workers=2, start_timeout_s=30)
    with pytest.raises(TimeoutError, match="is worker 0 running"):
        s1.create_tables(creator=False, timeout=1.0)
    assert any("waiting" in r.getMessage() and "worker 0 to create the tables" in r.getMessage() for r in caplog.records)

    # worker 0 joins alone: it reports 1 of 2 joined, naming itself, until the start timeout
    c0 = PSClient([shard_addr])
    s0 = PSSync(torch.nn.Linear(3, 2), c0, "waits", worker_index=0, num_workers=2, start_timeout_s=1.2, dense_optimizer="sgd")
    caplog.clear()
    try:
        with pytest.raises(TimeoutError, match="only 1 of 2 workers"):
            s0.join()
    finally:
        s0.leave()
        c0.close()
        c1.close()
    notes = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(notes) >= 2, notes
    assert "1 of 2 joined (w0)" in notes[0], notes
