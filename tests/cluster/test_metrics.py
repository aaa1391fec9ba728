"""The runtime's metrics and health on a real shard server (in this process, 127.0.0.1:0) and a
real PSClient: every call is counted by method and status code with its wire bytes and latency;
a refused call is counted under its code; the shard's own figures come from Shard.stats(); the
endpoint serves them over HTTP; ``tessera health`` answers SERVING, then UNREACHABLE once stopped."""
from __future__ import annotations

import urllib.parse
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

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)


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
        assert _sample(figures, "tessera_ps_table_version", server=name, table="w") == 3  # one label name: server="ps0"
        # RPCs are counted once, by the runtime (tessera_rpc_requests_total), not again by the shard
        assert "tessera_ps_requests_total" not in figures and "tessera_ps_errors_total" not in figures
        # an open server: the calls' identity label is "anonymous"
        assert _sample(text, "tessera_rpc_requests_total", server=name, method="PushDense", code="OK", identity="anonymous") >= 3

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


# ---------------------------------------------------------------------- metrics behind the server's security
TOKENS = {"w0": "w" * 32, "metrics": "m" * 32, "admin": "a" * 32}
ROLES = {"w0": ["worker"], "metrics": ["reader"], "admin": ["admin"]}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A shard with mutual TLS + tokens (as the compose file runs them), some calls made, and its
    metrics endpoint started as ``ps serve --metrics-port`` starts it (its security)."""
    from tessera.service import ClientSecurity, ServerSecurity, issue_cert, make_ca

    d = tmp_path_factory.mktemp("metrics-tls")
    ca, ca_key = make_ca()
    files = {"ca": d / "ca.crt"}
    files["ca"].write_bytes(ca)
    for name, hosts in (("server", ["127.0.0.1", "localhost"]), ("client", [])):
        cert, key = issue_cert(ca, ca_key, name, hosts)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        files[name], files[name + ".key"] = d / f"{name}.crt", d / f"{name}.key"
    (d / "metrics.bearer").write_text(TOKENS["metrics"] + "\n")
    files["bearer"] = d / "metrics.bearer"
    sec = ServerSecurity(tls_cert=str(files["server"]), tls_key=str(files["server.key"]), tls_ca=str(files["ca"]),
                         tokens=TOKENS, roles=ROLES)
    server, port, shard = build_server(ShardConfig(shard_index=0, num_shards=1), security=sec)
    try:
        creds = ClientSecurity(str(files["ca"]), str(files["client"]), str(files["client.key"]), TOKENS["admin"])
        with PSClient([f"127.0.0.1:{port}"], timeout=10, security=creds) as admin:
            admin.create_dense("w", 8, lr=1.0)
        creds = ClientSecurity(str(files["ca"]), str(files["client"]), str(files["client.key"]), TOKENS["w0"])
        with PSClient([f"127.0.0.1:{port}"], timeout=10, security=creds) as w0:
            w0.push_dense("w", np.ones(8, np.float32))
        collector = ShardCollector(shard)
        mport = serve_metrics(0, "127.0.0.1", [collector], security=sec)
        yield {"files": files, "port": mport, "d": d}
    finally:
        REGISTRY.unregister(collector)
        server.stop(0).wait()
        shard.close()


def _get(url: str, files: dict, token: str | None = None, cert: bool = True) -> tuple[int, str]:
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(files["ca"]))
    if cert:
        ctx.load_cert_chain(str(files["client"]), str(files["client.key"]))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.timeout(60)
def test_metrics_need_https_and_a_reader_token_on_a_secured_shard(secured) -> None:
    import urllib.request

    files, port = secured["files"], secured["port"]
    url = f"https://127.0.0.1:{port}/metrics"
    status, body = _get(url, files)  # no token: refused, and the page is not served
    assert status == 401 and "no token" in body and "tessera_" not in body, (status, body)
    status, body = _get(url, files, "x" * 32)
    assert status == 401 and "unknown token" in body, (status, body)
    status, body = _get(url, files, TOKENS["w0"])  # a worker's token: not a reader
    assert status == 403 and "identity 'w0'" in body and "reader" in body, (status, body)
    with pytest.raises(Exception):  # mutual TLS: no client certificate, no handshake
        _get(url, files, TOKENS["metrics"], cert=False)
    with pytest.raises(Exception):  # plain HTTP to the TLS endpoint
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    status, page = _get(url, files, TOKENS["metrics"])
    assert status == 200, (status, page)
    # one count per RPC, with the bounded identity label; the shard's figures under server="ps0"
    assert _sample(page, "tessera_rpc_requests_total", server="ps0", method="PushDense", code="OK", identity="w0") == 1
    assert _sample(page, "tessera_rpc_requests_total", server="ps0", method="CreateTable", code="OK", identity="admin") >= 1
    assert _sample(page, "tessera_ps_table_version", server="ps0", table="w") == 1


@pytest.mark.timeout(120)
def test_prometheus_scrapes_a_tls_token_shard_with_the_documented_config(secured) -> None:
    """A real Prometheus (Debian's ``prometheus`` package) with deploy/prometheus.yml's tessera-ps job
    (its scheme, tls_config and authorization as documented; only the file paths and the target
    changed) scrapes the shard; the same job without ``authorization`` is refused (401)."""
    import json
    import shutil
    import socket
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no Prometheus server here (Debian: apt-get install prometheus); the unauthenticated-scrape test above still runs")
    files, port, d = secured["files"], secured["port"], secured["d"]
    doc = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in doc["scrape_configs"] if j["job_name"] == "tessera-ps")
    assert job["scheme"] == "https" and job["authorization"]["type"] == "Bearer"
    paths = {"ca.crt": files["ca"], "client.crt": files["client"], "client.key": files["client.key"], "metrics.bearer": files["bearer"]}
    for section, key in (("tls_config", "ca_file"), ("tls_config", "cert_file"), ("tls_config", "key_file"),
                         ("authorization", "credentials_file")):
        job[section][key] = str(paths[Path(job[section][key]).name])
    job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    anonymous = {k: v for k, v in job.items() if k != "authorization"}
    anonymous["job_name"] = "no-token"
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [job, anonymous]}
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        web = s.getsockname()[1]
    prom = subprocess.Popen(
        [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        targets: dict = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/targets", timeout=2) as r:
                    active = json.loads(r.read())["data"]["activeTargets"]
                targets = {t["labels"]["job"]: t for t in active}
                if all(t.get("lastScrape", "").startswith("2") and t["health"] != "unknown" for t in targets.values()) and len(targets) == 2:
                    break
            except OSError:
                pass
            assert prom.poll() is None, prom.stderr.read() if prom.stderr else ""
            time.sleep(0.5)
        print({k: (t["health"], t["lastError"]) for k, t in targets.items()})
        assert targets["tessera-ps"]["health"] == "up", targets["tessera-ps"]
        assert targets["no-token"]["health"] == "down" and "401" in targets["no-token"]["lastError"], targets["no-token"]
        q = urllib.parse.quote('tessera_rpc_requests_total{server="ps0",method="PushDense",identity="w0"}')
        deadline = time.monotonic() + 30
        result: list = []
        while not result and time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/query?query={q}", timeout=5) as r:
                result = json.loads(r.read())["data"]["result"]
            time.sleep(0.5)
        assert result and float(result[0]["value"][1]) == 1.0, result
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()


def test_the_readme_scrape_config_is_deploys() -> None:
    """README (Watch metrics) shows the shards' job of deploy/prometheus.yml, as it is there."""
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).parents[2]
    block = re.search(r"```yaml\n( *- job_name: tessera-ps\n.*?)```", (root / "README.md").read_text(), re.S)
    assert block, "README: no tessera-ps scrape config block"
    import textwrap
    doc = yaml.safe_load((root / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in doc["scrape_configs"] if j["job_name"] == "tessera-ps")
    assert yaml.safe_load(textwrap.dedent(block.group(1))) == [job]


@pytest.mark.timeout(30)
def test_the_endpoint_binds_loopback_unless_metrics_host_is_given(capsys) -> None:
    """README: the endpoint binds 127.0.0.1 unless --metrics-host is given (even with --host 0.0.0.0)."""
    import argparse
    import socket

    from tessera.metrics import start_from_args

    port = start_from_args(argparse.Namespace(metrics_port=free_port(), metrics_host=None, host="0.0.0.0"), what="t")
    assert f"t metrics on 127.0.0.1:{port}" in capsys.readouterr().out
    with socket.socket() as s:  # nothing on another address of this machine
        s.settimeout(2)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:  # the address routes would leave by
            try:
                u.connect(("10.255.255.255", 1))
                other = u.getsockname()[0]
            except OSError:
                other = "127.0.0.1"
        if other.startswith("127.") or other == "0.0.0.0":
            pytest.skip("this machine has no non-loopback address to try")
        assert s.connect_ex((other, port)) != 0
