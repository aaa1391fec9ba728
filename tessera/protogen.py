"""Regenerate tessera/v1 from proto/: ``python -m tessera.protogen [OUT_DIR]``.

Uses grpcio-tools (pinned in the ``test`` extra to the version the committed
stubs came from; stubs from a newer generator refuse to import under an older
grpcio). tests/unit/test_wire_contract.py regenerates into a temp dir and fails
on any difference.
"""
from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(out_dir: str = ROOT) -> None:
    from grpc_tools import protoc

    protos = sorted(glob.glob(os.path.join(ROOT, "proto", "tessera", "v1", "*.proto")))
    args = ["protoc", f"-I{os.path.join(ROOT, 'proto')}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else ROOT)
