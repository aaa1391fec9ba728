"""The committed stubs are what proto/ generates, and the layering rules hold."""
from __future__ import annotations

import filecmp
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_generated_code_is_fresh(tmp_path) -> None:
    pytest.importorskip("grpc_tools")
    from tessera.protogen import generate

    generate(str(tmp_path))
    gen_dir = tmp_path / "tessera" / "v1"
    committed = os.path.join(ROOT, "tessera", "v1")
    names = sorted(p.name for p in gen_dir.iterdir())
    assert names, "protoc produced nothing"
    stale = [n for n in names if not filecmp.cmp(gen_dir / n, os.path.join(committed, n), shallow=False)]
    assert not stale, f"stale generated files {stale}: run `python -m tessera.protogen`"


WIRE_MODULES = {"codec.py", "wire.py", "servicer.py", "client.py", "protogen.py", "replication.py"}
GRPC_MODULES = WIRE_MODULES | {"server.py", "rpc.py", "security.py"}


def _py_files(pkg: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
        if os.sep + "v1" in dirpath:
            continue
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


@pytest.mark.parametrize("pkg", ["tessera", "ps", "worker", "federated"])
def test_domain_modules_do_not_touch_the_wire(pkg: str) -> None:
    bad = []
    for path in _py_files(pkg):
        src = open(path).read()
        name = os.path.basename(path)
        if re.search(r"^\s*(from|import)\s+\S*_pb2", src, re.M) and name not in WIRE_MODULES:
            bad.append(f"{path}: imports generated protobuf code")
        if re.search(r"^\s*(import grpc|from grpc)", src, re.M) and name not in GRPC_MODULES:
            bad.append(f"{path}: imports grpc")
        if re.search(r"^\s*(import pickle|from pickle)|pickle\.loads|torch\.load\((?!.*weights_only)", src, re.M):
            bad.append(f"{path}: pickle")
    assert not bad, "\n".join(bad)


def test_ps_does_not_import_worker_or_federated() -> None:
    bad = [p for p in _py_files("ps") if re.search(r"^\s*(from|import)\s+(worker|federated)\b", open(p).read(), re.M)]
    assert not bad
