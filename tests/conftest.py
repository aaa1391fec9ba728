"""Shared fixtures: real shard servers, in this process or as child processes; and how the suite is
spread over pytest-xdist's workers (README "Test it": ``-n 4 --dist loadgroup``)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist

from tests import zygote

from ps.cli import start_local_shards, stop_processes
from ps.client import PSClient
from ps.config import ShardConfig
from ps.server import build_server
from ps.shard import Shard


TESTS = Path(__file__).resolve().parent

# Long multi-process runs (30 s or more each on a quiet 2-core machine): marked `slow` and started
# first, so under xdist they overlap one another and the many short tests fill in behind them (the
# longest-first rule for a short makespan). CI runs all of them. Paths relative to tests/; a module
# path marks every test in it.
SLOW = (
    "cluster/test_compose_netns.py",
    "bench/",
    "multiproc/test_ps_faults.py",
    "multiproc/test_peer_faults.py",
    "multiproc/test_peer_hybrid_wait.py",
    "multiproc/test_peer_equivalence.py",
    "multiproc/test_peer_flags.py",
    "multiproc/test_pipeline_",
    "multiproc/test_tensor_parallel",
    "multiproc/test_moe.py",
    "multiproc/test_worker_faults.py",
    "multiproc/test_worker_restart.py",
    "multiproc/test_shard_restart.py",
    "multiproc/test_demo.py",
    "multiproc/test_experiment.py",
    "multiproc/test_readme_blocks.py",
    "multiproc/test_ps_memory.py",
    "integration/test_ps_bulk.py::test_the_bad_input_step_and_fused_push_suites_pass_over_bulk",
)

# Modules whose tests must not run at the same time as each other on different workers: the tc
# netem link's subnet is chosen from the process id, one link at a time per process.
SERIAL_MODULES = ("multiproc/test_netem.py",)

_SHARED_SCOPES = ("module", "class", "package")


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture wider than a test (module, class, package): one xdist worker
    then runs the whole module, so that fixture (a 4-rank process group, a PKI, shard processes) is
    made once, not once per worker."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in _SHARED_SCOPES for defs in info.name2fixturedefs.values() if defs)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the long runs `slow` and put them first (a stable sort: otherwise the collection order),
    and give each module that shares a fixture, or must run serially, an ``xdist_group`` (honoured
    by ``--dist loadgroup``; without xdist the marks change nothing)."""
    for item in items:
        try:
            rel = item.path.resolve().relative_to(TESTS).as_posix()
        except ValueError:  # a test file outside tests/ (named on the command line)
            continue
        node = rel + item.nodeid.partition("::")[1] + item.nodeid.partition("::")[2]
        if any(node.startswith(p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
        if rel in SERIAL_MODULES or _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(rel))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Modules about a fresh interpreter itself (what it imports, how it exits) or about a process's parent:
# their Python children are exec'd, not forked from the zygote (tests/zygote.py). Paths relative to tests/.
REAL_PROCESSES = (
    "multiproc/test_fed_numpy_client.py",
    "multiproc/test_peer_faults.py",  # finds a rank among its agent's children (a forked one's parent is a zygote)
    "unit/test_digits_data.py",
)


@pytest.fixture(scope="session", autouse=True)
def _zygote() -> Iterator[None]:
    """One fork server per test process (xdist worker): the suite's Python children are forked from
    it with torch already loaded instead of each importing it (tests/zygote.py says why and how).
    ``TESSERA_TEST_FORK=0`` execs every child instead."""
    if os.environ.get("TESSERA_TEST_FORK") == "0":
        yield
        return
    where = tempfile.mkdtemp(prefix="tz")  # a short path: a unix socket's name is at most 107 bytes
    proc = zygote.start(os.path.join(where, "sock"))
    real = subprocess.Popen
    os.environ[zygote.ENV] = os.path.join(where, "sock")
    zygote.install()
    yield
    subprocess.Popen = real  # type: ignore[misc]
    os.environ.pop(zygote.ENV, None)
    proc.kill()
    proc.wait()
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _real_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """The modules in REAL_PROCESSES exec their children (before any of their fixtures start one)."""
    try:
        rel = Path(str(request.fspath)).resolve().relative_to(TESTS).as_posix()
    except ValueError:
        rel = ""
    if rel not in REAL_PROCESSES:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(zygote.ENV, raising=False)
        yield


# TESSERA_TEST_BULK=1: every in-process shard also serves its bulk port, so the same tests run the
# PS's data calls over tessera.bulk (tests/integration/test_ps_bulk.py runs a selection that way)
BULK = os.environ.get("TESSERA_TEST_BULK") == "1"


class InprocCluster:
    """S shard servers in this process on 127.0.0.1 ports chosen at run time."""

    def __init__(self, num_shards: int, **config: object) -> None:
        if BULK:
            config.setdefault("bulk_port", 0)
        self.servers = []
        self.shards: list[Shard] = []
        self.addresses: list[str] = []
        for i in range(num_shards):
            server, port, shard = build_server(ShardConfig(shard_index=i, num_shards=num_shards, **config))  # type: ignore[arg-type]
            self.servers.append(server)
            self.shards.append(shard)
            self.addresses.append(f"127.0.0.1:{port}")
        self.clients: list[PSClient] = []

    def client(self, **kw: object) -> PSClient:
        c = PSClient(self.addresses, timeout=kw.pop("timeout", 20.0), **kw)  # type: ignore[arg-type]
        self.clients.append(c)
        return c

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.stop(0)
        for sh in self.shards:
            sh.close()


@pytest.fixture
def inproc_cluster() -> Iterator[Callable[..., InprocCluster]]:
    """Factory: inproc_cluster(num_shards, **ShardConfig fields) -> InprocCluster (stopped at teardown)."""
    made: list[InprocCluster] = []

    def make(num_shards: int = 1, **config: object) -> InprocCluster:
        c = InprocCluster(num_shards, **config)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def proc_cluster() -> Iterator[Callable[..., list[str]]]:
    """Factory: proc_cluster(num_shards, *serve_args) -> addresses of shard *processes* (killed at teardown)."""
    procs: list[subprocess.Popen] = []

    def make(num_shards: int, *extra: str) -> list[str]:
        p, addresses = start_local_shards(num_shards, tuple(extra))
        procs.extend(p)
        return addresses

    yield make
    stop_processes(procs, grace=3.0)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """A list to append started processes to; those still running at the end are killed."""
    made: list[subprocess.Popen] = []
    yield made
    for p in made:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture
def train_workers() -> Callable[..., dict[int, Any]]:
    """train_workers(n, make_trainer) -> {i: Summary}: ``make_trainer(i).run()`` for i < n, each in its
    own thread (workers with their own PSClient); re-raises the first worker error."""

    def run(n: int, make_trainer: Callable[[int], Any], timeout: float = 300.0) -> dict[int, Any]:
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                results[i] = make_trainer(i).run()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,), name=f"test-worker-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            raise errors[0]
        assert len(results) == n, "a worker thread did not finish in time"
        return results

    return run


@pytest.fixture(scope="module")
def gloo_group() -> Iterator[None]:
    """A real Gloo process group of one rank in this process."""
    if dist.is_initialized():
        yield
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
