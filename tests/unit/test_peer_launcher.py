"""`tessera peer`'s torchrun command line (pure: no process is started)."""
from __future__ import annotations

import argparse

import pytest

from worker.peer.cli import add_peer_commands, launcher_argv


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_peer_commands(p.add_subparsers(dest="command"))
    return p.parse_args(["peer", *argv])


def test_one_node_is_standalone_and_rank_flags_pass_through() -> None:
    argv = launcher_argv(_parse("--nproc-per-node", "4", "--task", "gpt", "--task-opt", "dim=32", "--mode", "zero2",
                                "--global-batch", "32", "--no-progress"))
    assert argv[: argv.index("-m")] == ["--nproc-per-node", "4", "--max-restarts", "0", "--standalone"]
    rank = argv[argv.index("-m") :]
    assert rank[:2] == ["-m", "worker.peer"]
    assert rank[2:] == ["--task-opt", "dim=32", "--mode", "zero2", "--global-batch", "32", "--no-progress"]  # defaults left out


def test_several_nodes_use_a_c10d_rendezvous() -> None:
    argv = launcher_argv(_parse("--nproc-per-node", "8", "--nnodes", "1:2", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "r1",
                                "--rdzv-conf", "last_call_timeout=5", "--max-restarts", "3"))
    assert argv[: argv.index("-m")] == [
        "--nproc-per-node", "8", "--max-restarts", "3", "--nnodes", "1:2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29400", "--rdzv-id", "r1", "--rdzv-conf", "last_call_timeout=5",
    ]


def test_several_nodes_without_an_endpoint_are_refused() -> None:
    with pytest.raises(SystemExit, match="--nnodes > 1 needs --rdzv-endpoint"):
        launcher_argv(_parse("--nnodes", "2"))
