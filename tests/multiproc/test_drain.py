"""SIGTERM during a BSP wait, against a real shard process (the README's draining contract).

A shard with a checkpoint directory serves two BSP workers (5 rounds) and async pushes to a second
table; then worker w0 pushes its step 5 and waits for round 5, which w1 never completes. On
SIGTERM: health says NOT_SERVING within 1 s, the waiting pull ends UNAVAILABLE with a message
saying the shard is stopping, new calls are refused (UNAVAILABLE), the process exits within 10 s,
and a shard restored from its final checkpoint holds every acknowledged update: the reference is
the same SGD (lr 1) computed here in numpy from the gradients pushed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from ps.cli import read_first_line, start_local_shards, stop_processes
from ps.client import PSClient
from ps.consistency import SyncPolicy
from tessera.health import check
from tessera.service import client_channel
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(180)

N = 8


def test_sigterm_during_a_bsp_wait_drains_checkpoints_and_exits(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    procs, (address,) = start_local_shards(1, ("--checkpoint-dir", ckpt, "--lease", "60"))
    proc = procs[0]
    try:
        w0 = PSClient([address], worker="w0", timeout=30, transport="grpc")
        w1 = PSClient([address], worker="w1", timeout=30, transport="grpc")
        w0.create_dense("w", N, lr=1.0)
        w0.create_dense("a", N, lr=1.0)
        w0.join(lease_s=60)
        w1.join(lease_s=60)
        expect_w = np.zeros(N, np.float32)
        for t in range(5):  # 5 BSP rounds: the mean of both workers' gradients, applied once per round
            g0 = np.full(N, t + 1.0, np.float32)
            g1 = np.arange(N, dtype=np.float32) * (t + 1)
            w0.push_dense("w", g0, policy=SyncPolicy(clock=t, sync=True))
            w1.push_dense("w", g1, policy=SyncPolicy(clock=t, sync=True))
            w0.pull_dense("w", policy=SyncPolicy(clock=t + 1, sync=True))
            w1.pull_dense("w", policy=SyncPolicy(clock=t + 1, sync=True))
            expect_w -= (g0 + g1) / np.float32(2)
        expect_a = np.zeros(N, np.float32)
        for k in range(10):  # async pushes, each acknowledged
            g = np.full(N, 0.5 * (k + 1), np.float32)
            w0.push_dense("a", g)
            expect_a -= g
        w0.push_dense("w", np.ones(N, np.float32), policy=SyncPolicy(clock=5, sync=True))  # round 5 never completes

        # w0's pull for round 5's result waits (w1 never pushes step 5)
        channel = client_channel(address)
        pull = channel.unary_stream("/tessera.v1.ParameterServer/PullDense")
        req = pb.PullDenseRequest(table="w", dtype="float32", worker="w0", sync=pb.SyncSpec(clock=6, sync=True))
        waiting = pull(req.SerializeToString(), timeout=120)
        ended: dict[str, Any] = {}

        def read() -> None:
            try:
                for _ in waiting:
                    pass
                ended["code"] = "OK"
            except grpc.RpcError as e:
                ended["code"], ended["details"] = e.code(), e.details()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while "PullDense" not in str(w1.stats()[0].requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the pull is in its wait
        assert reader.is_alive(), ended
        assert check(address, timeout=2.0) == "SERVING"

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status, seen = "", []
        while time.monotonic() - t0 < 5.0:
            status = check(address, timeout=0.5)
            seen.append((round(time.monotonic() - t0, 3), status))
            if status != "SERVING":
                break
            time.sleep(0.02)
        not_serving_after = time.monotonic() - t0
        print(f"health after SIGTERM: {seen[-3:]}")
        assert status == "NOT_SERVING", seen  # the contract: NOT_SERVING, not straight to unreachable
        assert not_serving_after <= 1.0, seen

        with pytest.raises(grpc.RpcError) as refused:  # new work is refused
            w_new = channel.unary_unary("/tessera.v1.ParameterServer/Stats")
            w_new(pb.StatsRequest().SerializeToString(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "the server is stopping" in refused.value.details(), refused.value.details()

        reader.join(15)
        print(f"the waiting pull ended: {ended}")
        assert ended.get("code") == grpc.StatusCode.UNAVAILABLE, ended
        assert "stopping" in ended.get("details", ""), ended

        rc = proc.wait(timeout=30)
        exited_after = time.monotonic() - t0
        print(f"exited {rc} after {exited_after:.2f} s")
        assert rc == 0
        assert exited_after <= 10.0, exited_after
        channel.close()
        w0.close()
        w1.close()

        # a shard restored from the final checkpoint holds every acknowledged update
        procs2, (address2,) = start_local_shards(1, ("--checkpoint-dir", ckpt, "--restore"))
        procs += procs2
        with PSClient([address2], timeout=30, transport="grpc") as admin:
            np.testing.assert_allclose(admin.pull_dense("w"), expect_w, rtol=0, atol=1e-5)
            np.testing.assert_allclose(admin.pull_dense("a"), expect_a, rtol=0, atol=1e-5)
    finally:
        stop_processes(procs)
