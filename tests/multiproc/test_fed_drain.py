"""Draining the federated server (issue 30): a `tessera fed server` process training with two
client processes (fed_child.py) gets SIGTERM. Its health says NOT_SERVING within 1 s, a new
call and the nodes' streams end UNAVAILABLE "... the server is stopping" (the clients keep
retrying: a restarted server would have them back), it exits within 10 s, and its final
checkpoint holds every round it completed, resuming where it stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from federated.checkpoint import load_checkpoint
from ps.cli import read_first_line
from tessera.v1 import fed_pb2 as pb

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "multiproc", "fed_child.py")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _health(channel: grpc.Channel) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tessera.v1.Federated"), timeout=0.5)
    except grpc.RpcError as e:
        return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _wait(pred, timeout: float, every: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return pred()


def test_sigterm_drains_not_serving_at_once_stopping_calls_and_final_checkpoint(procs, tmp_path) -> None:
    ck = str(tmp_path / "ckpt")
    server = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "fed", "server", "--task", "digits_logreg", "--rounds", "100000",
         "--min-clients", "2", "--eval-every", "0", "--checkpoint", ck], cwd=ROOT, env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(server)
    line = read_first_line(server, time.monotonic() + 60)
    assert "listening on" in line, line
    address = line.split("listening on ")[1].split()[0]
    clients = [subprocess.Popen([sys.executable, CHILD, address, f"c{i}", "10"], cwd=ROOT, env=ENV, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 2)]
    procs.extend(clients)
    channel = grpc.insecure_channel(address)
    try:
        assert _wait(lambda: _health(channel) == "SERVING", 30)
        # training: a checkpoint past round 2 (written after every round)
        assert _wait(lambda: os.path.exists(ck) and load_checkpoint(ck).round >= 2, 60, every=0.1)

        server.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert _wait(lambda: _health(channel) == "NOT_SERVING", 1.0), _health(channel)
        # a new call while it drains: refused, saying why
        hello = pb.NodeMessage()
        hello.hello.client_ids.append("late")
        with pytest.raises(grpc.RpcError) as e:
            next(channel.stream_stream("/tessera.v1.Federated/Connect")(iter([hello.SerializeToString()]), timeout=5))
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE,), e.value
        assert "the server is stopping" in (e.value.details() or ""), e.value.details()
        assert server.wait(10 - (time.monotonic() - t0)) == 0
    finally:
        channel.close()
    out, err = server.communicate(timeout=10)
    assert "tessera-fed stopped" in err, err[-2000:]
    # the clients were not told to exit: their streams ended UNAVAILABLE and they retry (a restarted
    # server gets them back), saying why
    for c in clients:
        assert c.poll() is None
        c.send_signal(signal.SIGTERM)
        _, cerr = c.communicate(timeout=20)
        assert "the server is stopping" in cerr, cerr[-2000:]
    final = load_checkpoint(ck)
    assert final.round >= 2 and [r["round"] for r in final.history] == list(range(1, final.round + 1))
