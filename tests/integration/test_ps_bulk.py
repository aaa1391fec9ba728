"""The PS's data calls over ``tessera.bulk`` (``ShardConfig.bulk_port``, ``tessera ps serve --bulk-port``).

Against real shard servers in this process (two shards, every table cut in two). References:
- the same calls over gRPC to an identical cluster (``transport="grpc"``): every value, version and
  result bitwise equal;
- torch.optim.Adam on the whole dense tensor in one process (fp32, rtol 1e-6).
Errors keep their class, code and message over bulk; the shard's security and roles apply to bulk
calls as to gRPC ones; a client finds a restarted shard's new bulk port by itself.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import (
    InvalidArgumentError,
    NonFiniteError,
    PermissionDeniedError,
    ShapeMismatchError,
    TableNotFoundError,
)
from ps.server import _build, build_server
from ps.stub import ShardStub
from tessera.bulk import BulkChannel
from tessera.service import ClientSecurity, ServerSecurity, issue_cert, make_ca
from tessera.v1 import ps_pb2 as pb

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

pytestmark = pytest.mark.timeout(120)

CHUNK = 64
N = CHUNK * 6 + 5
DIM = 8
ADAM = {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
SVC = "/tessera.v1.ParameterServer/"


def _uses_bulk(c: PSClient) -> list[bool]:
    return [st.replicas[st.cur].bulk is not None for st in c._shards]


def _workload(c: PSClient) -> list[object]:
    """Every kind of data call, with fixed inputs: what came back, in order."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(N).astype(np.float32)
    c.create_dense("w", N, "adam", init=w0, **ADAM)
    c.create_sparse("e", DIM, "adagrad", init="normal", seed=3, lr=0.1)
    got: list[object] = [c.pull_dense("w")]
    for step in range(3):
        g = rng.standard_normal(N).astype(np.float32)
        got.append(c.push_dense("w", g, return_params=step == 1))
        got.append(c.pull_dense("w"))
    ids = rng.integers(0, 10_000, 300)
    rows, versions = c.pull_sparse("e", ids, return_versions=True)
    got += [rows, versions]
    got.append(c.push_sparse("e", ids, rng.standard_normal((len(ids), DIM)).astype(np.float32)))
    uniq = np.unique(ids)
    changed = c.pull_sparse_changed("e", uniq, np.zeros(len(uniq), np.int64), np.zeros(len(uniq), np.int64))
    got += [changed.rows, changed.versions, changed.changed]
    res = c.step(
        push_dense={"w": rng.standard_normal(N).astype(np.float32)},
        push_sparse={"e": (ids[:50], rng.standard_normal((50, DIM)).astype(np.float32))},
        pull_dense=["w"], pull_sparse={"e": ids[:80]},
    )
    got += [res.dense["w"], res.sparse["e"][0], res.sparse["e"][1]]
    got.append([t.version for t in c.describe("w")])
    return got


def _same(a: object, b: object) -> None:
    if isinstance(a, (np.ndarray, torch.Tensor)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b):  # type: ignore[call-overload]
            _same(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        for k in a.__dataclass_fields__:  # type: ignore[attr-defined]
            _same(getattr(a, k), getattr(b, k))
    else:
        assert a == b


def test_every_data_call_over_bulk_equals_the_same_calls_over_grpc(inproc_cluster) -> None:
    """Reference: an identical cluster driven over gRPC (bitwise equal), and torch.optim.Adam."""
    over_grpc = inproc_cluster(2, chunk_elems=CHUNK, bulk_port=-1)
    over_bulk = inproc_cluster(2, chunk_elems=CHUNK, bulk_port=0)
    cg = over_grpc.client(worker="w0")
    cb = over_bulk.client(worker="w0")
    want = _workload(cg)
    got = _workload(cb)
    assert _uses_bulk(cb) == [True, True] and _uses_bulk(cg) == [False, False]
    _same(got, want)
    # the Adam table against torch.optim on the whole tensor: the first 3 pushes
    rng = np.random.default_rng(0)
    p = torch.from_numpy(rng.standard_normal(N).astype(np.float32)).requires_grad_(True)
    opt = torch.optim.Adam([p], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
    for k in range(3):
        p.grad = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
        opt.step()
        np.testing.assert_allclose(got[2 + 2 * k], p.detach().numpy(), rtol=1e-6, atol=1e-7)  # type: ignore[arg-type]
    # the data went over bulk: each shard's gRPC server saw the Role lookups only
    for sh in over_bulk.shards:
        assert sh.requests["Step"] == 1 and sh.requests["PushDense"] >= 4


def test_grpc_transport_and_a_shard_without_bulk_stay_on_grpc(inproc_cluster) -> None:
    bulk = inproc_cluster(1, bulk_port=0)
    plain = inproc_cluster(1, bulk_port=-1)
    c1 = bulk.client(transport="grpc")
    c2 = plain.client()
    for c in (c1, c2):
        c.create_dense("w", 10)
        c.push_dense("w", np.ones(10, np.float32))
    assert _uses_bulk(c1) == [False] and _uses_bulk(c2) == [False]
    with pytest.raises(ValueError, match="transport"):
        PSClient(bulk.addresses, transport="tcp")


def test_bad_input_over_bulk_gets_the_same_typed_errors_and_changes_nothing(inproc_cluster) -> None:
    cl = inproc_cluster(2, chunk_elems=CHUNK, bulk_port=0)
    c = cl.client(worker="w0")
    c.create_dense("w", N, "adam", **ADAM)
    c.create_sparse("e", DIM, "sgd", lr=0.1)
    c.push_dense("w", np.ones(N, np.float32))
    assert _uses_bulk(c) == [True, True]
    before = c.pull_dense("w")
    with pytest.raises(TableNotFoundError, match="'nope'") as e:
        c.pull_dense("nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    with pytest.raises(NonFiniteError, match="'w'"):
        c.push_dense("w", np.full(N, np.nan, np.float32))
    # the shard's own check (the client's is bypassed: a hand-made push of the wrong length)
    stub = c._shards[0]
    head = pb.DenseChunk(table="w", offset=0, last=True, dtype="float32", shape=[3])
    with pytest.raises(grpc.RpcError) as raw:
        list(stub.push_dense(iter([head.SerializeToString()])))
    assert raw.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)  # type: ignore[attr-defined]
    assert "'w'" in raw.value.details()  # type: ignore[attr-defined]
    with pytest.raises((ShapeMismatchError, InvalidArgumentError), match="'e'"):
        c.push_sparse("e", [1, 2], np.ones((2, DIM + 1), np.float32))
    np.testing.assert_array_equal(c.pull_dense("w"), before)
    c.push_dense("w", np.ones(N, np.float32))  # still serving
    assert not np.array_equal(c.pull_dense("w"), before)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca, ca_key = make_ca()
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for name in ("server", "admin", "worker"):
        cert, key = issue_cert(ca, ca_key, name, hosts=["127.0.0.1", "localhost"])
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        out[name] = (str(d / f"{name}.crt"), str(d / f"{name}.key"))
    (d / "ca.crt").write_bytes(ca)
    out["ca"] = str(d / "ca.crt")
    return out


TOKENS = {"admin": "admin-token-0123456789", "w": "worker-token-0123456789"}
ROLES = {"admin": ["admin", "worker"], "w": ["worker"]}


def test_tls_tokens_and_roles_hold_over_bulk(pki) -> None:
    """A TLS shard with tokens: data calls go over bulk (TLS too); a worker may push but not drop a
    table; a wrong token never gets a call through the bulk port."""
    sec = ServerSecurity(tls_cert=pki["server"][0], tls_key=pki["server"][1], tokens=TOKENS, roles=ROLES)
    server, port, shard = build_server(ShardConfig(bulk_port=0), security=sec)
    addr = f"127.0.0.1:{port}"
    try:
        admin = PSClient(addr, timeout=10, security=ClientSecurity(tls_ca=pki["ca"], token=TOKENS["admin"]))
        worker = PSClient(addr, timeout=10, retries=0, security=ClientSecurity(tls_ca=pki["ca"], token=TOKENS["w"]))
        admin.create_dense("w", 16, "sgd", lr=1.0)
        worker.push_dense("w", np.ones(16, np.float32))
        np.testing.assert_array_equal(worker.pull_dense("w"), -np.ones(16, np.float32))
        assert _uses_bulk(admin) == [True] and _uses_bulk(worker) == [True]
        # over TLS the push stream stays on gRPC (one OpenSSL connection is never read and written at once)
        assert not worker._shards[0].replicas[0].bulk.full_duplex  # type: ignore[union-attr]
        with pytest.raises(PermissionDeniedError, match="DropTable"):
            worker.drop_table("w")
        # straight at the bulk port with a wrong token: refused, nothing reaches the table
        bulk_port = admin._shards[0].replicas[0].bulk.address.rsplit(":", 1)[1]  # type: ignore[union-attr]
        intruder = BulkChannel(f"127.0.0.1:{bulk_port}", ClientSecurity(tls_ca=pki["ca"], token="guess"))
        try:
            with pytest.raises(grpc.RpcError) as e:
                intruder.unary_unary(SVC + "Stats")(pb.StatsRequest().SerializeToString(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        finally:
            intruder.close()
        np.testing.assert_array_equal(admin.pull_dense("w"), -np.ones(16, np.float32))
        admin.close()
        worker.close()
    finally:
        server.stop(None)
        shard.close()


def test_a_restarted_shard_on_a_new_bulk_port_is_found_again(tmp_path) -> None:
    """The shard comes back on the same gRPC port (restored from its checkpoint) with another bulk
    port: the client's next call fails over the old one, asks again and goes on over the new one."""
    cfg = ShardConfig(bulk_port=0, checkpoint_dir=str(tmp_path))
    server, port, shard = build_server(cfg)
    c = PSClient(f"127.0.0.1:{port}", timeout=10, retry_timeout=20)
    try:
        c.create_dense("w", 16, "sgd", lr=1.0)
        c.push_dense("w", np.ones(16, np.float32))
        old = c._shards[0].replicas[0].bulk.address  # type: ignore[union-attr]
        shard.save_checkpoint()
        server.stop(None)
        shard.close()
        server, _, shard = build_server(ShardConfig(port=port, bulk_port=0, checkpoint_dir=str(tmp_path)), restore=True)
        c.push_dense("w", np.ones(16, np.float32))
        np.testing.assert_array_equal(c.pull_dense("w"), -2 * np.ones(16, np.float32))
        new = c._shards[0].replicas[0].bulk.address  # type: ignore[union-attr]
        assert new != old
    finally:
        c.close()
        server.stop(None)
        shard.close()


def test_ps_serve_bulk_port_flag(tmp_path) -> None:
    """``tessera ps serve`` with no transport flag serves a bulk port (a free one, said on its first line)
    and a client uses it for data calls (the README: the bulk plane is the default); ``--bulk-port -1``
    serves none; a bad port is refused."""
    p = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "ps", "serve"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line and " bulk " in line, line
        address = line.split("listening on ")[1].split()[0]
        bulk_port = int(line.split(" bulk ")[1].split()[0])
        with PSClient(address, timeout=10) as c:
            c.create_dense("w", 4)
            c.push_dense("w", np.ones(4, np.float32))
            assert c._shards[0].replicas[0].bulk.address == f"127.0.0.1:{bulk_port}"  # type: ignore[union-attr]
    finally:
        p.terminate()
        p.wait(20)
    off = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "ps", "serve", "--bulk-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = off.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line and " bulk " not in line, line
        with PSClient(line.split("listening on ")[1].split()[0], timeout=10) as c:
            c.create_dense("w", 4)
            assert c._shards[0].replicas[0].bulk is None  # type: ignore[union-attr]
    finally:
        off.terminate()
        off.wait(20)
    bad = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "ps", "serve", "--bulk-port", "70000"], check=False, capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and "bulk_port" in bad.stderr, bad.stderr


def test_ps_serve_bulk_port_flag_serves_the_port_it_names() -> None:
    """README: ``--bulk-port PORT`` serves the bulk plane on that fixed port (a container or firewall
    setup names one, as docker-compose.yml does with 7001), and the shard says it in its Role reply.
    Reference: a free port chosen here before the shard starts (bind port 0, close); the shard's
    first line, its Role reply and the client's bulk channel must all name that port, and a push and
    a pull over it give SGD's lr-1 result on ones by hand."""
    named = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "ps", "serve", "--bulk-port", str(named)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line and f" bulk {named}" in line, line
        address = line.split("listening on ")[1].split()[0]
        ch = grpc.insecure_channel(address)
        try:
            role = pb.RoleReply.FromString(ch.unary_unary("/tessera.v1.ParameterServer/Role")(pb.RoleRequest().SerializeToString(), timeout=10))
        finally:
            ch.close()
        assert role.bulk_port == named, role
        with PSClient(address, timeout=10) as c:
            c.create_dense("w", 4, "sgd", lr=1.0)
            c.push_dense("w", np.ones(4, np.float32))
            np.testing.assert_array_equal(c.pull_dense("w"), -np.ones(4, np.float32))
            assert c._shards[0].replicas[0].bulk.address == f"127.0.0.1:{named}"  # type: ignore[union-attr]
            assert _uses_bulk(c) == [True]
    finally:
        p.terminate()
        p.wait(20)


def test_a_shard_closes_idle_bulk_connections_after_5_minutes() -> None:
    """README: the bulk plane closes idle connections after 5 minutes. The closing itself is
    tested with 0.5 s (tests/integration/test_bulk.py::test_idle_and_silent_connections_are_closed);
    this checks the figure: ``serve_bulk``'s default ``idle_timeout_s`` and what the bulk server of a
    shard built by ps.server (as ``tessera ps serve`` builds it) runs with are 300 s."""
    import inspect

    from tessera.bulk import serve_bulk

    assert inspect.signature(serve_bulk).parameters["idle_timeout_s"].default == 300.0
    server, _, shard, bulk, _ = _build(ShardConfig(bulk_port=0), False, None, None)
    try:
        assert bulk is not None and bulk._idle == 300.0
    finally:
        server.stop(None)
        shard.close()


@pytest.mark.timeout(400)
def test_the_bad_input_step_and_fused_push_suites_pass_over_bulk() -> None:
    """The house's bad-input contract (every refusal typed, named, state unchanged, still serving),
    the Step RPC's references and the fused push's, run again with every in-process shard serving
    its bulk port (``TESSERA_TEST_BULK=1``: tests/conftest.py), so PSClient sends their data calls
    over tessera.bulk. (The whole of tests/integration passes that way too; this is the subset CI
    can afford.)"""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, f) for f in ("test_bad_input.py", "test_ps_step.py", "test_dense_fused_push.py")]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "--timeout", "120", "-p", "no:cacheprovider", *files],
        check=False, capture_output=True, text=True, timeout=380, env={**os.environ, "TESSERA_TEST_BULK": "1"},
        cwd=os.path.dirname(os.path.dirname(here)),
    )
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail


def test_after_the_cool_down_the_client_tries_the_bulk_port_again(monkeypatch, caplog) -> None:
    """README: while the advertised bulk port cannot be reached the calls stay on gRPC for the
    cool-down (``_Replica.BULK_COOLDOWN_S``, 30 s; 0.5 s here), then the bulk port is tried again.
    The shard's bulk server is stopped (its port still advertised), then served again on the same
    port, as a firewall that opens later: the first call after the cool-down goes over bulk, with a
    warning that says so. Reference: SGD with lr 1 on ones by hand."""
    from ps.servicer import PSServicer
    from ps.stub import _Replica
    from tessera.bulk import serve_bulk

    monkeypatch.setattr(_Replica, "BULK_COOLDOWN_S", 0.5)
    server, port, shard, bulk, access = _build(ShardConfig(bulk_port=0), False, None, None)
    assert bulk is not None
    bulk.stop()
    again = None
    ones = np.ones(16, np.float32)
    try:
        with caplog.at_level(logging.WARNING, logger="ps.stub"), PSClient(f"127.0.0.1:{port}", timeout=5, retry_timeout=5) as c:
            c.create_dense("w", 16, "sgd", lr=1.0)
            c.push_dense("w", ones)
            assert _uses_bulk(c) == [False]
            again = serve_bulk(
                (PSServicer(shard, access).handlers(),), "127.0.0.1", bulk.port, ServerSecurity(), access.caller,
                interceptors=[access.interceptor()],
            )
            time.sleep(0.6)
            c.push_dense("w", ones)
            assert _uses_bulk(c) == [True]
            assert again.connections >= 1
            np.testing.assert_array_equal(c.pull_dense("w"), -2 * ones)
        said = [r.getMessage() for r in caplog.records if r.name == "ps.stub"]
        assert len([m for m in said if "cannot be reached" in m]) == 1, said
        assert [m for m in said if f"bulk port {bulk.port} reachable again" in m], said
    finally:
        if again is not None:
            again.stop()
        server.stop(None)
        shard.close()


def test_bulk_calls_are_counted_in_the_servers_metrics(inproc_cluster) -> None:
    """Prometheus counts the bulk port's calls as it counts gRPC's: by method and code, server "psN-bulk";
    and the bytes of replies sent as pieces (codec.Packed): a pull of 1,000 float32 counts at least
    its 4,000 bytes (reference: the values' size; counting the pieces would give a handful)."""
    from prometheus_client import REGISTRY

    def sent(method: str) -> float:
        return REGISTRY.get_sample_value("tessera_rpc_sent_bytes_total", {"server": "ps0-bulk", "method": method}) or 0.0

    def count(method: str, code: str) -> float:
        labels = {"server": "ps0-bulk", "method": method, "code": code, "identity": "anonymous"}  # (an open shard)
        return REGISTRY.get_sample_value("tessera_rpc_requests_total", labels) or 0.0

    cl = inproc_cluster(1, bulk_port=0)
    c = cl.client()
    ok0, missing0 = count("PushDense", "OK"), count("DescribeTable", "NOT_FOUND")
    c.create_dense("w", 8)
    c.push_dense("w", np.ones(8, np.float32))
    c.push_dense("w", np.ones(8, np.float32))
    with pytest.raises(TableNotFoundError):
        c.pull_dense("nope")
    assert count("PushDense", "OK") - ok0 == 2
    assert count("DescribeTable", "NOT_FOUND") - missing0 == 1  # (the client looks the table up first)
    c.create_dense("big", 1000)
    before = sent("PullDense")
    c.pull_dense("big")
    assert 4000 <= sent("PullDense") - before < 4400


def test_a_shard_takes_at_most_4_connections_per_thread_on_its_bulk_port(inproc_cluster) -> None:
    """``--threads 1``: a fifth connection is refused (RESOURCE_EXHAUSTED); gRPC and the others still serve."""
    cl = inproc_cluster(1, bulk_port=0, workers=1)
    c = cl.client()
    c.create_dense("w", 4)
    c.push_dense("w", np.ones(4, np.float32))
    bulk_addr = c._shards[0].replicas[0].bulk.address  # type: ignore[union-attr]  # holds one connection
    extra = [BulkChannel(bulk_addr) for _ in range(4)]
    try:
        stats = pb.StatsRequest().SerializeToString()
        for ch in extra[:3]:
            ch.unary_unary(SVC + "Stats")(stats, timeout=5)  # 4 connections now, each kept in its pool
        with pytest.raises(grpc.RpcError) as e:
            extra[3].unary_unary(SVC + "Stats")(stats, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        c.push_dense("w", np.ones(4, np.float32))
        np.testing.assert_array_equal(PSClient(cl.addresses, transport="grpc").pull_dense("w"), -0.02 * np.ones(4, np.float32))
    finally:
        for ch in extra:
            ch.close()


def test_worker_ps_transport_flag() -> None:
    from tessera.cli import build_parser

    base = ["worker", "--ps", "127.0.0.1:1", "--task", "ctr"]
    assert build_parser().parse_args(base).ps_transport == "auto"
    assert build_parser().parse_args([*base, "--ps-transport", "grpc"]).ps_transport == "grpc"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--ps-transport", "tcp"])


def test_an_unreachable_bulk_port_falls_back_to_grpc(caplog) -> None:
    """The shard advertises a bulk port that cannot be reached (its bulk server stopped, gRPC still
    serving): the client's calls succeed over gRPC (reference: SGD with lr 1 on ones by hand),
    with one warning naming the port, and stay on gRPC during the cool-down."""
    server, port, shard, bulk, _ = _build(ShardConfig(bulk_port=0), False, None, None)
    assert bulk is not None
    bulk.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="ps.stub"), PSClient(f"127.0.0.1:{port}", timeout=5, retry_timeout=5) as c:
            c.create_dense("w", 16, "sgd", lr=1.0)
            for _ in range(3):
                c.push_dense("w", np.ones(16, np.float32))
            np.testing.assert_array_equal(c.pull_dense("w"), -3 * np.ones(16, np.float32))
            assert _uses_bulk(c) == [False]
        warnings = [r for r in caplog.records if r.name == "ps.stub" and str(bulk.port) in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    finally:
        server.stop(None)
        shard.close()


def test_unresolve_once_per_generation_and_retired_channels_stay_open(inproc_cluster) -> None:
    """Calls that failed on the same channel generation move the stub once (not once each), and a
    call already holding the old bulk channel still completes on it (before: CANCELLED "channel is
    closed"); the next resolve finds the bulk port again. Reference: Stats over gRPC."""
    cl = inproc_cluster(1, bulk_port=0)
    stub = ShardStub(0, cl.addresses[0], [])
    try:
        r = stub.replicas[0]
        r.resolve(5)
        assert r.bulk is not None
        old_stats, gen = r.unary["Stats"], r.gen
        req = pb.StatsRequest().SerializeToString()
        want = pb.StatsReply.FromString(r._grpc[0]["Stats"](req, timeout=5))
        r.unresolve(gen)
        after = r.gen
        r.unresolve(gen)  # a second call that failed on the same generation: nothing
        assert r.gen == after and r.bulk is None
        assert pb.StatsReply.FromString(old_stats(req, timeout=5)).tables == want.tables  # the retired channel still serves
        r.resolve(5)
        assert r.bulk is not None and r.gen > after
    finally:
        stub.close()
