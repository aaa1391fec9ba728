"""Method names live in the .proto: every RPC of both services is served by its servicer, and
every method a client calls exists there (a typo in a hand-written method string fails here,
not at run time)."""
from __future__ import annotations

import os
import re

import grpc
import pytest

from tessera.v1 import fed_pb2, ps_pb2

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _served(handler: grpc.GenericRpcHandler, service: str, methods: set[str]) -> set[str]:
    return {m for m in methods if handler.service(_Details(f"/{service}/{m}")) is not None}


def _called(path: str) -> set[str]:
    src = open(os.path.join(ROOT, path)).read()
    found = set(re.findall(r'_?SERVICE \+ "(\w+)"', src)) | set(re.findall(r'u\("(\w+)"\)', src))
    found |= set(re.findall(r'_call\(\w+, "(\w+)"', src))  # PSClient -> ShardStub.call by method name
    found |= set(re.findall(r'\.start\("(\w+)"', src))  # PSClient -> ShardStub.start (sent now, the reply read later)
    found |= set(re.findall(r'_all\("(\w+)"', src))  # PSClient._all: one unary call on every shard
    unary = re.search(r"_UNARY = \(([^)]*)\)", src)  # ps/stub.py: the unary stubs it makes
    if unary:
        found |= set(re.findall(r'"(\w+)"', unary.group(1)))
    return found


@pytest.mark.parametrize("which", ["ps", "federated"])
def test_servicers_serve_exactly_the_proto_and_clients_call_only_it(which: str) -> None:
    if which == "ps":
        from ps.config import ShardConfig
        from ps.servicer import METHOD_ROLES, SERVICE_NAME, PSServicer
        from ps.shard import Shard

        proto = set(ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name)
        shard = Shard(ShardConfig())
        try:
            assert _served(PSServicer(shard).handlers(), SERVICE_NAME, proto) == proto
        finally:
            shard.close()
        assert set(METHOD_ROLES) == proto
        assert _called("ps/client.py") <= proto and _called("ps/stub.py") <= proto and _called("ps/replication.py") <= proto
        assert {"Step", "PullSparse", "PushSparse", "CreateTable"} <= _called("ps/client.py")
        assert {"PushDense", "PullDense", "Role", "Step"} <= _called("ps/stub.py")
    else:
        from federated.registry import Registry
        from federated.servicer import METHOD_ROLES as FED_ROLES, SERVICE_NAME as FED, FedServicer

        proto = set(fed_pb2.DESCRIPTOR.services_by_name["Federated"].methods_by_name)
        assert _served(FedServicer(Registry()).handlers(), FED, proto) == proto
        assert set(FED_ROLES) == proto
        assert _called("federated/client.py") <= proto and _called("federated/client.py")
