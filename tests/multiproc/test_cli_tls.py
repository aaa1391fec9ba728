"""Issue 17 item 10: a client whose transport security does not match the server's fails within
seconds with a message naming the likely cause, instead of retrying UNAVAILABLE until its
retry timeout (the server only logs WRONG_VERSION_NUMBER). Real TLS shard servers on loopback
ports chosen at run time; the CLI cases run the real `tessera` command."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import UnauthenticatedError
from ps.server import build_server
from tessera.service import (
    ClientSecurity,
    ServerSecurity,
    ServerUnreachableError,
    TransportSecurityError,
    diagnose,
    issue_cert,
    make_ca,
    wait_for_server,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = make_ca()
    other_ca, other_key = make_ca("another CA")
    server = issue_cert(ca, ca_key, "localhost", ["127.0.0.1"])
    client = issue_cert(ca, ca_key, "w0")
    files = {}
    for name, pem in [("ca.crt", ca), ("other.crt", other_ca), ("server.crt", server[0]), ("server.key", server[1]),
                      ("w0.crt", client[0]), ("w0.key", client[1])]:
        (d / name).write_bytes(pem)
        files[name] = str(d / name)
    return files


def _serve(security: ServerSecurity):
    server, port, shard = build_server(ShardConfig(), security=security)
    return server, shard, f"127.0.0.1:{port}"


@pytest.fixture
def tls_shard(pki):
    server, shard, address = _serve(ServerSecurity(tls_cert=pki["server.crt"], tls_key=pki["server.key"]))
    yield address, shard
    server.stop(0)
    shard.close()


@pytest.fixture
def plain_shard():
    server, shard, address = _serve(ServerSecurity())
    yield address, shard
    server.stop(0)
    shard.close()


def _fails_fast(address: str, security: ClientSecurity | None, match: str) -> None:
    """A PSClient that would retry UNAVAILABLE for 10 minutes fails at once, with the cause named (the
    120 s bound is a deadline far from the wrong behaviour, not a speed check)."""
    t0 = time.monotonic()
    with PSClient([address], timeout=10, retry_timeout=600, security=security) as c:
        with pytest.raises(UnauthenticatedError, match=match):
            c.create_dense("w", 4)
    assert time.monotonic() - t0 < 120


def test_plaintext_client_to_tls_server_fails_fast_naming_tls(tls_shard) -> None:
    address, shard = tls_shard
    _fails_fast(address, None, r"speaks TLS but this client connects in plaintext.*--tls-ca")
    assert shard.stats().tables == []  # nothing reached the shard


def test_tls_client_to_plaintext_server_fails_fast(plain_shard, pki) -> None:
    address, shard = plain_shard
    _fails_fast(address, ClientSecurity(tls_ca=pki["ca.crt"]), r"does not speak TLS.*drop --tls-ca")
    assert shard.stats().tables == []


def test_certificate_of_another_ca_is_named(tls_shard, pki) -> None:
    address, _ = tls_shard
    _fails_fast(address, ClientSecurity(tls_ca=pki["other.crt"]), r"not accepted by the CA given \(--tls-ca\)")


def test_mutual_tls_without_client_certificate_is_named(pki) -> None:
    server, shard, address = _serve(
        ServerSecurity(tls_cert=pki["server.crt"], tls_key=pki["server.key"], tls_ca=pki["ca.crt"], default_roles=("admin",))
    )
    try:
        _fails_fast(address, ClientSecurity(tls_ca=pki["ca.crt"]), r"requires a client certificate")
        # with its certificate the same client works (the probe does not get in the way)
        with PSClient([address], timeout=10, security=ClientSecurity(pki["ca.crt"], pki["w0.crt"], pki["w0.key"])) as c:
            c.create_dense("w", 4)
            assert np.array_equal(c.pull_dense("w"), np.zeros(4, np.float32))
    finally:
        server.stop(0)
        shard.close()


def test_matching_security_is_diagnosed_ok_and_streams_work(tls_shard, pki) -> None:
    address, _ = tls_shard
    sec = ClientSecurity(tls_ca=pki["ca.crt"])
    assert diagnose(address, sec).kind == "ok"
    with PSClient([address], timeout=10, security=sec) as c:
        c.create_dense("w", 1 << 19)  # pulls and pushes stream in chunks through the checking wrapper
        c.push_dense("w", np.ones(1 << 19, np.float32))
        assert c.pull_dense("w").shape == (1 << 19,)


def test_wait_for_server_says_why_and_is_bounded(tls_shard) -> None:
    address, _ = tls_shard
    t0 = time.monotonic()
    with pytest.raises(TransportSecurityError, match="speaks TLS"):
        wait_for_server(address, None, timeout=600)
    assert time.monotonic() - t0 < 120  # at once, not after waiting 10 minutes
    heard = []
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachableError, match="nothing is listening"):
        wait_for_server(free, None, timeout=2.5, on_wait=lambda t, d: heard.append(d.kind), every=1.0)
    assert 2.0 < time.monotonic() - t0 < 60  # it waited its 2.5 s, then gave up (60: a deadline, not a speed check)
    assert heard and set(heard) == {"refused"}


def _tessera(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_stats_and_worker_without_certificate_are_one_line(tls_shard) -> None:
    address, _ = tls_shard
    for args in (["ps", "stats", "--ps", address, "--wait", "600"], ["worker", "--ps", address, "--steps", "2", "--retry-timeout", "600"]):
        t0 = time.monotonic()
        r = _tessera(*args, timeout=300)
        assert time.monotonic() - t0 < 120  # both would wait 10 minutes for a shard: they did not wait it out
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "speaks TLS" in lines[0] and "--tls-ca" in lines[0]
