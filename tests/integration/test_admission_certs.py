"""Certificate identities get roles: with mutual TLS and no tokens, the token file maps a client
certificate's common name to roles (token ``-``), through ``tessera ps serve --token-file`` on a
real shard process. CreateTable is allowed for the certificate mapped to admin and refused
(PERMISSION_DENIED, nothing created) for another certificate of the same CA."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ps.cli import start_local_shards, stop_processes
from ps.client import PSClient
from ps.errors import PermissionDeniedError, TableNotFoundError
from tessera.service import ClientSecurity, ConfigError, ServerSecurity, issue_cert, make_ca, read_token_file, write_token_file

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("certroles")
    ca, ca_key = make_ca()
    files = {"ca": str(d / "ca.crt")}
    (d / "ca.crt").write_bytes(ca)
    for name, hosts in (("server", ["127.0.0.1"]), ("ops", []), ("trainer", [])):
        cert, key = issue_cert(ca, ca_key, name, hosts)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        files[name] = str(d / f"{name}.crt")
        files[name + ".key"] = str(d / f"{name}.key")
    # certificate identities only: no bearer token anywhere; ops is admin, everyone else the default role
    write_token_file(str(d / "roles"), {"ops": None, "trainer": None}, {"ops": ["admin"], "trainer": ["worker"]})
    files["roles"] = str(d / "roles")
    return files


@pytest.fixture(scope="module")
def shard(pki) -> Iterator[str]:
    procs, (address,) = start_local_shards(1, (
        "--tls-cert", pki["server"], "--tls-key", pki["server.key"], "--tls-ca", pki["ca"], "--token-file", pki["roles"],
    ))
    try:
        yield address
    finally:
        stop_processes(procs)


def _as(pki: dict[str, str], address: str, who: str) -> PSClient:
    return PSClient([address], timeout=10, retry_timeout=0.5, security=ClientSecurity(pki["ca"], pki[who], pki[who + ".key"]))


def test_the_token_file_maps_certificates_to_roles(pki) -> None:
    tf = read_token_file(pki["roles"])
    assert tf.tokens == {} and tf.certificates == {"ops", "trainer"} and tf.roles["ops"] == ["admin"]
    sec = ServerSecurity.from_files(pki["server"], pki["server.key"], pki["ca"], pki["roles"])
    assert sec.tokens is None and sec.mutual  # no tokens: callers are named by their certificates
    with pytest.raises(ConfigError, match="need mutual TLS"):  # certificate identities without --tls-ca
        ServerSecurity.from_files(pki["server"], pki["server.key"], None, pki["roles"]).check("127.0.0.1")


def test_create_table_allowed_for_the_admin_certificate_refused_for_another(pki, shard) -> None:
    with _as(pki, shard, "trainer") as trainer:
        with pytest.raises(PermissionDeniedError, match="identity 'trainer'.*needs one of \\['admin'\\]"):
            trainer.create_dense("refused", 4)
        with pytest.raises(TableNotFoundError):  # nothing was created
            trainer.describe("refused")
    with _as(pki, shard, "ops") as ops:
        ops.create_dense("w", 4, lr=1.0)  # the certificate mapped to admin
        assert ops.describe("w")[0].spec.shape == (4,)
    with _as(pki, shard, "trainer") as trainer:  # the worker role by certificate: trains
        trainer.push_dense("w", np.ones(4, np.float32))
        np.testing.assert_array_equal(trainer.pull_dense("w"), -np.ones(4, np.float32))  # SGD lr 1 from zeros
