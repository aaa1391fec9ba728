"""The committed stubs are what proto/ generates, and the layering rules hold."""
from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys

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


def test_import_contracts() -> None:
    """The [tool.importlinter] contracts of pyproject.toml (layering of ARCHITECTURE.md): domain
    modules reach no grpc/protobuf, directly or through another module; ps and federated are
    independent; ps imports no worker; the kernel imports no part (tessera.cli's dispatch excepted)."""
    pytest.importorskip("importlinter")
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        f"sys.exit(lint_imports(config_filename={os.path.join(ROOT, 'pyproject.toml')!r}, no_cache=True, no_logo=True))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, f"import contracts broken (lint-imports exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


# Domain modules of each part, as the import contract lists them; here they are imported in a
# fresh interpreter, which also runs the package __init__ the static graph does not see.
_DOMAIN = {
    "ps": ["ps.config", "ps.table", "ps.index", "ps.optim", "ps.partition", "ps.consistency", "ps.shard",
           "ps.checkpoint", "ps.dedup", "ps.gate", "ps.errors", "ps.initializers"],
    "federated": ["federated.strategy", "federated.secagg", "federated.privacy", "federated.partition",
                  "federated.compress", "federated.updates", "federated.protocol", "federated.registry",
                  "federated.checkpoint", "federated.config", "federated.errors"],
    "worker": ["worker.netem", "worker.netns"],
}


@pytest.mark.parametrize(
    "part",
    [
        "ps",  # ps/__init__.py re-exports lazily, as federated/__init__.py does
        "federated",
        "worker",  # worker/__init__.py re-exports lazily too
    ],
)
def test_domain_modules_load_without_grpc(part: str) -> None:
    code = (
        "import sys\n"
        f"for m in {_DOMAIN[part]!r}:\n"
        "    __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'google.protobuf', 'tessera.v1')))\n"
        "print(' '.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.strip(), f"importing the domain modules of {part} loaded: {r.stdout.strip()[:500]}"


def _py_files(pkg: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
        if os.sep + "v1" in dirpath:
            continue
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


@pytest.mark.parametrize("pkg", ["tessera", "ps", "worker", "federated"])
def test_nothing_unpickles(pkg: str) -> None:
    """No pickle, and no torch.load without weights_only, anywhere (data may have crossed a network)."""
    bad = []
    for path in _py_files(pkg):
        src = open(path).read()
        if re.search(r"^\s*(import pickle|from pickle)|pickle\.loads|torch\.load\((?!.*weights_only)", src, re.M):
            bad.append(f"{path}: pickle")
    assert not bad, "\n".join(bad)


# What a peer rank imports (worker/peer/cli.py's run_rank and the modules it reaches); HybridSync,
# the one peer ParamSync with PS embeddings, is left out: it needs the PS client.
_PEER_RANK = ["worker.peer", "worker.peer.cli", "worker.peer.mesh", "worker.peer.moe", "worker.peer.pipeline",
              "worker.peer.tensor_parallel", "worker.peer.core", "worker.peer.sync_plan", "worker.modes", "worker.peer.data_parallel", "worker.peer.trace",
              "worker.peer.debug", "worker.peer.checkpoint", "worker.sync_api", "worker.tasks", "worker.trainer"]


@pytest.mark.timeout(120)
def test_peer_rank_loads_no_grpc() -> None:
    """A peer rank talks torch.distributed only: a real one-rank ``dp`` run (Gloo, the digits task,
    3 steps, through worker.peer.cli's main as torchrun would start it) and the import of every
    module a rank reaches leave no grpc, protobuf, generated stub or ``ps.client`` in sys.modules;
    ``worker.paramsync`` still re-exports the seam and ``worker.peer.HybridSync`` still resolves
    (after the check: both load the PS client)."""
    code = (
        "import os, socket, sys\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',\n"
        "                  MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\n"
        "from worker.peer.cli import main\n"
        "rc = main(['--task', 'digits', '--mode', 'dp', '--steps', '3', '--global-batch', '16'])\n"
        "assert rc == 0, rc\n"
        f"for m in {_PEER_RANK!r}:\n"
        "    __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'google.protobuf', 'tessera.v1', 'ps.client')))\n"
        "print('LOADED', ' '.join(bad))\n"
        "import worker.paramsync, worker.sync_api, worker.peer\n"
        "assert all(getattr(worker.paramsync, n) is getattr(worker.sync_api, n) for n in worker.sync_api.__all__)\n"
        "assert worker.peer.HybridSync.__module__ == 'worker.peer.hybrid'\n"
        "print('REEXPORTS OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = [ln for ln in r.stdout.splitlines() if ln.startswith("LOADED")]
    assert loaded == ["LOADED "], f"a peer rank loaded: {loaded}"
    assert "REEXPORTS OK" in r.stdout


@pytest.mark.timeout(60)
def test_tessera_parser_loads_no_torch() -> None:
    """``tessera --help`` and a mistyped flag cost what argparse costs: building the whole parser
    (every subcommand: ps, worker, peer with its pipeline flags, plan, fed, cert, tokens, health)
    loads no torch, in a fresh interpreter. Reference: ``sys.modules`` after ``build_parser()``."""
    code = (
        "import sys\n"
        "from tessera.cli import build_parser\n"
        "p = build_parser()\n"
        "p.parse_args(['peer', '--pp', '2', '--recompute', 'selective'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-500:]
