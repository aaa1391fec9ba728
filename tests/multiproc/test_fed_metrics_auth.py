"""The federated server's /metrics behind its own security (issue 30), on real `tessera fed server`
processes over real HTTPS: TLS when the server has TLS (client certificates too under mutual TLS),
and with identities only a ``reader`` (or ``admin``) one may scrape: no token 401, a client's token
403, the reader's 200 with the federated families; plain HTTP to the TLS endpoint is refused. A
reader's token cannot join as a client. An open loopback server still serves plain HTTP. A real
Prometheus scrapes it with deploy/prometheus.yml's ``tessera-fed`` job (the compose cluster's)."""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from ps.cli import read_first_line
from tessera.cli import main
from tessera.metrics import FED_METRICS
from tessera.service import issue_cert, make_ca

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}



class FedProcess:
    """A `tessera fed server` (1 round, waiting for its client) with --metrics-port; ``line`` is
    its 'metrics on' line, ``address`` its gRPC address."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.err = open(tmp / f"server-{time.monotonic_ns()}.err", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "fed", "server", "--task", "digits_logreg", "--rounds", "1",
             "--min-clients", "1", "--eval-every", "0", "--metrics-port", str(free_port()), *extra],
            cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=self.err)
        deadline = time.monotonic() + 90
        self.line = read_first_line(self.proc, deadline).strip()
        listening = read_first_line(self.proc, deadline).strip()
        assert " metrics on " in self.line and "listening on" in listening, (self.line, listening, self.stderr())
        self.port = int(self.line.split(" metrics on 127.0.0.1:")[1].split()[0])
        self.address = listening.split("listening on ")[1]

    def stderr(self) -> str:
        self.err.flush()
        return Path(self.err.name).read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, the server's certificate (127.0.0.1), client certificates ``prom`` and ``c0``, and a token
    file as `tessera fed tokens c0 metrics:reader` writes it."""
    d = tmp_path_factory.mktemp("fed-metrics")
    ca, ca_key = make_ca()
    (d / "ca.crt").write_bytes(ca)
    for name, hosts in (("server", ["127.0.0.1", "localhost"]), ("prom", []), ("c0", [])):
        cert, key = issue_cert(ca, ca_key, name, hosts)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
    assert main(["fed", "tokens", "c0", "metrics:reader", "--out", str(d / "fed.tokens")]) == 0
    tokens = {line.split()[0]: line.split()[1] for line in (d / "fed.tokens").read_text().splitlines()}
    (d / "metrics.bearer").write_text(tokens["metrics"] + "\n")  # as make-secrets.sh writes it
    return {"d": d, "ca": d / "ca.crt", "tokens": d / "fed.tokens", "c0_token": tokens["c0"],  # type: ignore[dict-item]
            "metrics_token": tokens["metrics"]}


@pytest.fixture(scope="module")
def tls_server(pki) -> Iterator[FedProcess]:
    """TLS + tokens, as the compose file's fed-server runs."""
    server = FedProcess(pki["d"], "--tls-cert", str(pki["d"] / "server.crt"), "--tls-key", str(pki["d"] / "server.key"),
                        "--token-file", str(pki["tokens"]))
    yield server
    server.close()


def _get(url: str, ca: Path | None = None, token: str | None = None, cert: tuple[Path, Path] | None = None) -> tuple[int, str]:
    ctx = None
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
        if cert:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _sample(page: str, name: str, **labels: str) -> float | None:
    for line in page.splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def test_fed_metrics_need_https_and_a_reader_token(tls_server, pki) -> None:
    assert tls_server.line == f"tessera-fed metrics on 127.0.0.1:{tls_server.port} (https, reader token or certificate)"
    url = f"https://127.0.0.1:{tls_server.port}/metrics"
    status, body = _get(url, pki["ca"])
    assert status == 401 and "no token" in body and "tessera_fed" not in body, (status, body)
    status, body = _get(url, pki["ca"], "x" * 64)
    assert status == 401 and "unknown token" in body, (status, body)
    status, body = _get(url, pki["ca"], pki["c0_token"])  # a client's token: not a reader
    assert status == 403 and "identity 'c0' (roles ['client'])" in body and "reader" in body, (status, body)
    with pytest.raises((OSError, ssl.SSLError)):  # plain HTTP to the TLS endpoint: no page
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.port}/metrics", timeout=10).read()
    status, page = _get(url, pki["ca"], pki["metrics_token"])
    assert status == 200, (status, page)
    for name in FED_METRICS:
        assert f"# TYPE {name} " in page, name
    assert _sample(page, "tessera_fed_clients_connected") == 0.0 and _sample(page, "tessera_fed_rounds_total") == 0.0


def test_a_reader_token_cannot_join_as_a_client(tls_server, pki) -> None:
    """`tessera fed client` with the reader's token: one line naming PERMISSION_DENIED, exit 2; the
    server counts the refused Connect under the reader's identity and connects nobody."""
    p = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "fed", "client", "--server", tls_server.address, "--task", "digits_logreg",
         "--partition", "0/1", "--tls-ca", str(pki["ca"]), "--token-file", str(pki["tokens"]), "--identity", "metrics",
         "--reconnect-timeout", "20"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert last.startswith("tessera fed client: error: ") and "identity 'metrics' (roles ['reader'])" in last, last
    assert "PERMISSION_DENIED" in last, last
    status, page = _get(f"https://127.0.0.1:{tls_server.port}/metrics", pki["ca"], pki["metrics_token"])
    assert status == 200
    assert (_sample(page, "tessera_rpc_requests_total", server="fed", method="Connect", code="PERMISSION_DENIED",
                    identity="metrics") or 0) >= 1, page
    assert _sample(page, "tessera_fed_clients_connected") == 0.0


def test_mutual_tls_certificate_identities_get_their_roles(pki, tmp_path) -> None:
    """--tls-ca with a token file of certificate identities (token '-'): the ``prom`` certificate
    (reader) scrapes without a token, ``c0``'s (a client) is refused 403, no certificate: no handshake."""
    (tmp_path / "certs.tokens").write_text("c0 -\nprom - reader\n")
    d = pki["d"]
    server = FedProcess(tmp_path, "--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key"),
                        "--tls-ca", str(pki["ca"]), "--token-file", str(tmp_path / "certs.tokens"))
    try:
        url = f"https://127.0.0.1:{server.port}/metrics"
        assert server.line.endswith("(https, reader token or certificate)"), server.line
        status, page = _get(url, pki["ca"], cert=(d / "prom.crt", d / "prom.key"))
        assert status == 200 and "tessera_fed_rounds_total" in page, (status, page[:300])
        status, body = _get(url, pki["ca"], cert=(d / "c0.crt", d / "c0.key"))
        assert status == 403 and "identity 'c0'" in body, (status, body)
        with pytest.raises((OSError, ssl.SSLError)):  # mutual TLS: no client certificate, no handshake
            _get(url, pki["ca"], pki["metrics_token"])
    finally:
        server.close()


def test_an_open_loopback_server_still_serves_plain_http(tmp_path) -> None:
    server = FedProcess(tmp_path)
    try:
        assert server.line == f"tessera-fed metrics on 127.0.0.1:{server.port}", server.line
        status, page = _get(f"http://127.0.0.1:{server.port}/metrics")
        assert status == 200 and _sample(page, "tessera_fed_rounds_total") == 0.0, (status, page[:300])
    finally:
        server.close()


def test_prometheus_scrapes_the_fed_server_with_the_documented_job(tls_server, pki) -> None:
    """A real Prometheus (Debian's ``prometheus`` package) runs deploy/prometheus.yml's tessera-fed
    job (its scheme, tls_config and authorization; only the file paths and the target changed):
    the target is up and the federated families are queryable; the same job without
    ``authorization`` is down with 401."""
    import yaml

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no Prometheus server here (Debian: apt-get install prometheus); the scrape tests above still run")
    d: Path = pki["d"]
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = next(j for j in doc["scrape_configs"] if j["job_name"] == "tessera-fed")
    assert job["scheme"] == "https" and job["authorization"]["type"] == "Bearer", job
    for section in ("tls_config", "authorization"):
        for key, path in job[section].items():
            if key.endswith("_file"):
                job[section][key] = str(d / Path(path).name)  # ca.crt, metrics.bearer
    job["static_configs"] = [{"targets": [f"127.0.0.1:{tls_server.port}"]}]
    anonymous = {**{k: v for k, v in job.items() if k != "authorization"}, "job_name": "no-token"}
    run = d / "prometheus"
    run.mkdir(exist_ok=True)
    (run / "prometheus.yml").write_text(yaml.safe_dump(
        {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [job, anonymous]}))
    web = free_port()
    prom = subprocess.Popen([binary, f"--config.file={run / 'prometheus.yml'}", f"--storage.tsdb.path={run / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)

    def api(path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/{path}", timeout=5) as r:
            return json.loads(r.read())["data"]

    try:
        targets: dict[str, Any] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                targets = {t["labels"]["job"]: t for t in api("targets")["activeTargets"]}
            except OSError:
                pass
            if len(targets) == 2 and all(t["health"] != "unknown" for t in targets.values()):
                break
            assert prom.poll() is None, prom.stderr.read() if prom.stderr else ""
            time.sleep(0.5)
        assert targets["tessera-fed"]["health"] == "up", targets["tessera-fed"]
        assert targets["no-token"]["health"] == "down" and "401" in targets["no-token"]["lastError"], targets["no-token"]
        result: list[Any] = []
        deadline = time.monotonic() + 30
        while not result and time.monotonic() < deadline:
            result = api("query?query=" + urllib.parse.quote('tessera_fed_rounds_total{job="tessera-fed"}'))["result"]
            time.sleep(0.5)
        assert result and float(result[0]["value"][1]) == 0.0, result
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
