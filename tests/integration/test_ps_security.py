"""Security of the PS through the kernel's service runtime: TLS, mutual TLS, tokens with roles,
worker names bound to identities, unsafe setups refused, the health service, and the method
table checked against the .proto.

The auth matrix calls every RPC of the PS service with no credentials, a wrong token, a token
of an identity whose role does not allow it, and the right role, and checks the status and that
a refused call changed nothing (the shard's snapshot before == after)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import grpc
import numpy as np
import pytest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import PermissionDeniedError, UnauthenticatedError
from ps.server import build_server
from ps.servicer import METHOD_ROLES
from tessera.codec import pack
from tessera.service import ClientSecurity, ConfigError, ServerSecurity, client_channel, issue_cert, make_ca
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(60)

TOKENS = {
    "admin": "a" * 32, "w0": "b" * 32, "w1": "c" * 32, "reader": "d" * 32, "peer": "e" * 32,
}
ROLES = {"admin": ["admin"], "w0": ["worker"], "w1": ["worker"], "reader": ["reader"], "peer": ["replica"]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = make_ca()
    files = {"ca": d / "ca.crt"}
    files["ca"].write_bytes(ca_cert)
    for name, hosts in (("server", ["127.0.0.1", "localhost"]), ("w0", []), ("intruder", [])):
        cert, key = issue_cert(ca_cert, ca_key, name, hosts)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        files[name] = (str(d / f"{name}.crt"), str(d / f"{name}.key"))
    other_ca, other_key = make_ca("someone else's CA")
    cert, key = issue_cert(other_ca, other_key, "w0")
    (d / "rogue.crt").write_bytes(cert)
    (d / "rogue.key").write_bytes(key)
    files["rogue"] = (str(d / "rogue.crt"), str(d / "rogue.key"))
    return files


@pytest.fixture
def shard(pki):
    sec = ServerSecurity(tls_cert=pki["server"][0], tls_key=pki["server"][1], tokens=TOKENS, roles=ROLES)
    server, port, sh = build_server(ShardConfig(), security=sec)
    yield f"127.0.0.1:{port}", sh
    server.stop(0)
    sh.close()


def _client(address: str, pki, token: str | None, **kw) -> PSClient:
    kw.setdefault("timeout", 5)
    return PSClient([address], retry_timeout=0.2, security=ClientSecurity(tls_ca=str(pki["ca"]), token=token), **kw)


def _seed(address: str, pki) -> None:
    with _client(address, pki, TOKENS["admin"]) as c:
        c.create_dense("w", 8, lr=1.0)
        c.create_sparse("emb", 4, lr=1.0)
        c.pull_sparse("emb", np.arange(4))


def _fingerprint(sh) -> bytes:
    snap = sh.snapshot()
    parts = []
    for t in snap.tables:
        parts += [t["values"].tobytes(), t.get("versions", np.zeros(0)).tobytes(), str(t.get("version", t.get("step"))).encode()]
    return b"".join(parts) + repr(snap.clocks).encode() + repr(sorted(sh.membership.live())).encode()


def _requests(worker: str) -> dict[str, tuple[str, object]]:
    """One request per RPC that passes authentication's part of the checks: (kind, request bytes or
    iterator factory). ``worker``: the name to join as (a name belongs to the identity that used it first)."""
    chunk = pack(pb.DenseChunk(table="w", offset=0, dtype="float32", last=True, client="x", seq=1), {15: np.ones(8, np.float32)})
    assign = pack(pb.DenseChunk(table="w", offset=0, dtype="float32", last=True, op=pb.DENSE_OP_ASSIGN), {15: np.ones(8, np.float32)})
    spec = pb.TableSpec(name="new", kind=pb.TABLE_KIND_DENSE, shape=[4], dtype="float32", optimizer=pb.OptimizerSpec(name="sgd"))
    return {
        "CreateTable": ("uu", pb.CreateTableRequest(spec=spec, num_shards=1).SerializeToString()),
        "DropTable": ("uu", pb.DropTableRequest(tables=["new"]).SerializeToString()),  # admin: drops what it just created
        "DescribeTable": ("uu", pb.DescribeTableRequest(table="w").SerializeToString()),
        "PushDense": ("ss", lambda: iter([chunk])),
        "PushDenseAssign": ("ss", lambda: iter([assign])),
        "PullDense": ("us", pb.PullDenseRequest(table="w").SerializeToString()),
        "PullSparse": ("uu", pack(pb.PullSparseRequest(table="emb"), {15: np.arange(2, dtype=np.int64)})),
        "PushSparse": ("uu", pack(pb.PushSparseRequest(table="emb", dim=4, dtype="float32", client="x", seq=2),
                                  {14: np.arange(2, dtype=np.int64), 15: np.ones((2, 4), np.float32)})),
        "Stats": ("uu", pb.StatsRequest().SerializeToString()),
        "Join": ("uu", pb.JoinRequest(worker=worker).SerializeToString()),
        "Heartbeat": ("uu", pb.HeartbeatRequest(worker=worker).SerializeToString()),
        "Checkpoint": ("uu", pb.CheckpointRequest(at_clock=-1).SerializeToString()),
        "Role": ("uu", pb.RoleRequest().SerializeToString()),
        "Attach": ("us", pb.AttachRequest(backup="").SerializeToString()),  # authorized: INVALID_ARGUMENT
        "Replicate": ("uu", pb.ReplicateRequest(attach_id=1).SerializeToString()),
    }


def _call(channel: grpc.Channel, name: str, kind: str, req: object) -> grpc.StatusCode:
    method = "/tessera.v1.ParameterServer/" + ("PushDense" if name == "PushDenseAssign" else name)
    try:
        if kind == "uu":
            channel.unary_unary(method)(req, timeout=5)
        elif kind == "us":
            list(channel.unary_stream(method)(req, timeout=5))
        else:
            list(channel.stream_stream(method)(req(), timeout=5))  # type: ignore[operator]
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _allowed(name: str, role: str) -> bool:
    if name == "PushDenseAssign":
        return role == "admin"
    return role in METHOD_ROLES[name]


def test_auth_matrix_every_rpc_every_credential(shard, pki) -> None:
    address, sh = shard
    _seed(address, pki)
    U, P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    creds = {"none": None, "wrong": "z" * 32, **{ident: TOKENS[ident] for ident in ("reader", "w0", "peer", "admin")}}
    role_of = {"reader": "reader", "w0": "worker", "peer": "replica", "admin": "admin"}
    seen = {}
    for cred, token in creds.items():
        channel = client_channel(address, ClientSecurity(tls_ca=str(pki["ca"]), token=token))
        try:
            for name, (kind, req) in _requests(cred).items():
                before = _fingerprint(sh)
                code = _call(channel, name, kind, req)
                seen[(name, cred)] = code
                if cred in ("none", "wrong"):
                    assert code == U, (name, cred, code)
                elif not _allowed(name, role_of[cred]):
                    assert code == P, (name, cred, code)
                else:
                    assert code not in (U, P), (name, cred, code)
                if code in (U, P):
                    assert _fingerprint(sh) == before, (name, cred)
        finally:
            channel.close()
    # the right role gets real answers (not just "not refused")
    assert seen[("PushDense", "w0")] == grpc.StatusCode.OK and seen[("CreateTable", "admin")] == grpc.StatusCode.OK
    assert seen[("PushDenseAssign", "admin")] == grpc.StatusCode.OK and seen[("PushDenseAssign", "w0")] == P
    assert seen[("DropTable", "admin")] == grpc.StatusCode.OK and seen[("DropTable", "w0")] == P
    assert "new" not in sh.tables and {"w", "emb"} <= set(sh.tables)


def test_a_worker_name_belongs_to_the_identity_that_used_it_first(shard, pki) -> None:
    address, sh = shard
    _seed(address, pki)
    with _client(address, pki, TOKENS["w0"], worker="w0") as mine, _client(address, pki, TOKENS["w1"], worker="w0") as thief:
        mine.join()
        before = _fingerprint(sh)
        with pytest.raises(PermissionDeniedError, match="belongs to identity 'w0'"):
            thief.leave()  # Heartbeat(leave) as w0 with w1's token
        with pytest.raises(PermissionDeniedError):
            thief.push_sparse("emb", np.arange(2), np.ones((2, 4), np.float32))
        assert _fingerprint(sh) == before and "w0" in sh.membership.live()
        mine.leave()
        assert "w0" not in sh.membership.live()


def test_pushes_of_one_identity_cannot_be_made_to_look_retried_by_another(shard, pki) -> None:
    """Dedup records are kept per identity: w1 replaying w0's (client, seq) does not suppress w0's push."""
    address, sh = shard
    _seed(address, pki)
    req = pack(pb.PushSparseRequest(table="emb", dim=4, dtype="float32", client="shared", seq=7),
               {14: np.arange(1, dtype=np.int64), 15: np.ones((1, 4), np.float32)})
    for ident in ("w1", "w0"):
        channel = client_channel(address, ClientSecurity(tls_ca=str(pki["ca"]), token=TOKENS[ident]))
        reply = pb.PushSparseReply.FromString(channel.unary_unary("/tessera.v1.ParameterServer/PushSparse")(req, timeout=5))
        channel.close()
        assert not reply.duplicate and reply.applied == 1


def test_psclient_with_tls_and_token_trains_and_without_is_refused(shard, pki) -> None:
    address, _ = shard
    _seed(address, pki)
    with _client(address, pki, TOKENS["w0"]) as c:
        c.push_dense("w", np.ones(8, np.float32))
        assert c.pull_dense("w")[0] == -1.0
    with _client(address, pki, None) as c, pytest.raises(UnauthenticatedError, match="no token"):
        c.pull_dense("w")
    with PSClient([address], timeout=3, retry_timeout=0.5) as plain, pytest.raises(Exception):
        plain.pull_dense("w")  # plaintext to a TLS port: no connection


def test_unsafe_setups_are_refused(pki) -> None:
    with pytest.raises(ConfigError, match="tokens over plaintext"):
        build_server(ShardConfig(), security=ServerSecurity(tokens=TOKENS))
    with pytest.raises(ConfigError, match="open server"):
        build_server(ShardConfig(host="0.0.0.0"), security=ServerSecurity())
    with pytest.raises(ConfigError, match="needs both"):
        build_server(ShardConfig(), security=ServerSecurity(tls_cert=pki["server"][0]))
    # allowed when asked for explicitly (loopback experiments)
    server, port, sh = build_server(ShardConfig(), security=ServerSecurity(tokens=TOKENS, roles=ROLES, insecure=True))
    try:
        with PSClient([f"127.0.0.1:{port}"], timeout=5, security=ClientSecurity(token=TOKENS["reader"])) as c:
            assert c.stats()[0].shard_index == 0
    finally:
        server.stop(0)
        sh.close()


def test_mutual_tls_identifies_callers_by_certificate(pki) -> None:
    sec = ServerSecurity(
        tls_cert=pki["server"][0], tls_key=pki["server"][1], tls_ca=str(pki["ca"]), roles={"w0": ["admin"]}, default_roles=("reader",)
    )
    server, port, sh = build_server(ShardConfig(), security=sec)
    address = f"127.0.0.1:{port}"
    try:
        ca = str(pki["ca"])
        with PSClient([address], timeout=5, security=ClientSecurity(ca, *pki["w0"])) as c:
            c.create_dense("w", 4)  # w0's certificate: admin
        with PSClient([address], timeout=5, retry_timeout=0.2, security=ClientSecurity(ca, *pki["intruder"])) as c:
            assert c.pull_dense("w").shape == (4,)  # a known CA, default role reader: may read ...
            with pytest.raises(PermissionDeniedError):
                c.push_dense("w", np.ones(4, np.float32))  # ... not write
        for creds in (ClientSecurity(ca), ClientSecurity(ca, *pki["rogue"])):  # no certificate / another CA's
            with PSClient([address], timeout=3, retry_timeout=0.5, security=creds) as c, pytest.raises(Exception):
                c.pull_dense("w")
        assert sh.dense("w").version == 0
    finally:
        server.stop(0)
        sh.close()


def test_health_service_answers_serving_without_credentials(shard, pki) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, _ = shard
    channel = client_channel(address, ClientSecurity(tls_ca=str(pki["ca"])))
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for svc in ("", "tessera.v1.ParameterServer"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_tessera_tokens_and_cert_commands(tmp_path) -> None:
    out = tmp_path / "tokens.txt"
    r = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "tokens", "--out", str(out), "admin:admin,worker", "w1:worker", "peer:replica"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    lines = [line.split() for line in out.read_text().splitlines()]
    assert [(x[0], x[2]) for x in lines] == [("admin", "admin,worker"), ("w1", "worker"), ("peer", "replica")]
    assert all(len(x[1]) == 64 for x in lines)
    r = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "cert", "--out-dir", str(tmp_path / "pki"), "--hosts", "ps0,10.0.0.1", "--clients", "w0"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    for f in ("ca.crt", "ca.key", "server.crt", "server.key", "w0.crt", "w0.key"):
        assert (tmp_path / "pki" / f).exists()
    assert stat.S_IMODE(os.stat(tmp_path / "pki" / "server.key").st_mode) == 0o600
    # a shard refuses tokens over plaintext at start, with a message
    r = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "ps", "serve", "--token-file", str(out)], capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "tokens over plaintext" in r.stderr


def test_calls_in_flight_are_limited_per_identity(pki) -> None:
    import threading

    from ps.consistency import SyncPolicy
    from ps.errors import ResourceExhaustedError

    sec = ServerSecurity(
        tls_cert=pki["server"][0], tls_key=pki["server"][1], tokens=TOKENS, roles=ROLES, max_concurrent=2,
    )
    server, port, sh = build_server(ShardConfig(), security=sec)
    address = f"127.0.0.1:{port}"
    try:
        _seed(address, pki)
        blocked = []
        with _client(address, pki, TOKENS["w0"], timeout=3) as w0:
            # two BSP pulls for a clock nobody pushes: each holds one of w0's two slots until its deadline
            threads = [threading.Thread(target=lambda: blocked.append(_try(lambda: w0.pull_dense("w", policy=SyncPolicy(clock=1, sync=True)))))
                       for _ in range(2)]
            for t in threads:
                t.start()
            import time

            deadline = time.monotonic() + 5
            while sh.requests.get("PullDense", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
            with pytest.raises(ResourceExhaustedError, match="identity 'w0' has 2 calls in flight"):
                w0.stats()
            with _client(address, pki, TOKENS["w1"]) as w1:
                assert w1.stats()[0].shard_index == 0  # another identity is served
            for t in threads:
                t.join(10)
    finally:
        server.stop(0)
        sh.close()


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e
