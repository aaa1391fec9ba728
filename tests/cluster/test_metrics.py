"""The runtime's metrics and health on a real shard server (in this process, 127.0.0.1:0) and a
real PSClient: every call is counted by method and status code with its wire bytes and latency;
a refused call is counted under its code; the shard's own figures come from Shard.stats(); the
endpoint serves them over HTTP; ``tessera health`` answers SERVING, then UNREACHABLE once stopped."""
from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import TableNotFoundError
from ps.server import build_server
from tessera.cli import main as cli_main
from tessera.health import check
from tessera.metrics import SHARD_METRICS, ShardCollector, serve_metrics


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(60)
def test_shard_rpc_metrics_shard_figures_and_health() -> None:
    cfg = ShardConfig(shard_index=0, num_shards=1, host="127.0.0.1", port=0)
    server, port, shard = build_server(cfg)
    address = f"127.0.0.1:{port}"
    name = f"ps{cfg.shard_index}"
    try:
        before = generate_latest(REGISTRY).decode()
        ok0 = _sample(before, "tessera_rpc_requests_total", server=name, method="PullDense", code="OK")
        nf0 = _sample(before, "tessera_rpc_requests_total", server=name, method="DescribeTable", code="NOT_FOUND")
        with PSClient([address]) as client:
            client.create_dense("w", (1000,), "sgd", lr=0.1)
            for _ in range(3):
                w = client.pull_dense("w")
                client.push_dense("w", np.ones_like(w))
            with pytest.raises(TableNotFoundError):  # the client describes the table first: NOT_FOUND there
                client.pull_dense("no-such-table")
        assert check(address) == "SERVING"
        assert cli_main(["health", address]) == 0  # `tessera health HOST:PORT`, as the README says
        assert cli_main(["health", address, "--service", "no.such.Service"]) == 1
        text = generate_latest(REGISTRY).decode()
        assert _sample(text, "tessera_rpc_requests_total", server=name, method="PullDense", code="OK") - ok0 == 3
        assert _sample(text, "tessera_rpc_requests_total", server=name, method="DescribeTable", code="NOT_FOUND") - nf0 == 1
        # 3 pulls of 1000 float32 went out: at least 12000 bytes sent for PullDense
        assert _sample(text, "tessera_rpc_sent_bytes_total", server=name, method="PullDense") >= 12000
        assert _sample(text, "tessera_rpc_received_bytes_total", server=name, method="PushDense") >= 12000
        assert _sample(text, "tessera_rpc_latency_seconds_count", server=name, method="PushDense") >= 3

        own = CollectorRegistry()
        own.register(ShardCollector(shard))
        figures = generate_latest(own).decode()
        helps = [line.split()[2] for line in figures.splitlines() if line.startswith("# HELP ")]
        assert len(helps) == len(set(helps))
        for n in SHARD_METRICS:
            assert f"# HELP {n.removesuffix('_total')}" in figures, n
        assert _sample(figures, "tessera_ps_table_version", table="w") == 3
        assert _sample(figures, "tessera_ps_requests_total", method="PushDense") == 3
        # the shard's own error count leaves out DescribeTable's NOT_FOUND (workers poll for tables
        # that way); the RPC metrics above still show the call and its code
        assert _sample(figures, "tessera_ps_errors_total", code="NOT_FOUND") == 0

        mport = serve_metrics(0)
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
            page = r.read().decode()
        assert _sample(page, "tessera_rpc_requests_total", server=name, method="PushDense", code="OK") >= 3
    finally:
        server.stop(0).wait()
        shard.close()
    assert check(address, timeout=1.0).startswith("UNREACHABLE")


@pytest.mark.timeout(30)
def test_serving_when_gates_the_health_answer() -> None:
    import threading
    import time

    from tessera.health import serving_when
    from tessera.service import ServerSecurity
    from tessera.service import build_server as kernel_build_server

    server, port, health = kernel_build_server((), "127.0.0.1", 0, ServerSecurity(), service_names=("x.Y",))
    try:
        ready = threading.Event()
        serving_when(health, ready.is_set, ("x.Y",), period=0.05)
        address = f"127.0.0.1:{port}"
        assert check(address) == "NOT_SERVING" and check(address, "x.Y") == "NOT_SERVING"
        ready.set()
        deadline = time.monotonic() + 5
        while check(address) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert check(address) == "SERVING" and check(address, "x.Y") == "SERVING"
    finally:
        server.stop(0).wait()
