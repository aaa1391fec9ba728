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


def test_zero_selects_the_stage_and_mode_zero_k_is_its_alias() -> None:
    """`--zero N` with `--mode dp` (the default) is the registry's zeroN; `--mode zeroN` alone or with an
    equal `--zero` too; `--mode hybrid --zero N` keeps the mode, N its dense part's stage; a pair that
    contradicts or a stage past 3 is refused (ValueError: one line, which `tessera peer` prints before
    starting a rank, exit 2)."""
    from worker.peer.cli import resolve_mode

    for argv, want in [((), ("dp", 0)), (("--zero", "2"), ("zero2", 2)), (("--mode", "dp", "--zero", "3"), ("zero3", 3)),
                       (("--mode", "zero1",), ("zero1", 1)), (("--mode", "zero2", "--zero", "2"), ("zero2", 2)),
                       (("--mode", "hybrid", "--zero", "0"), ("hybrid", 0)), (("--mode", "hybrid", "--zero", "3"), ("hybrid", 3)),
                       (("--mode", "hybrid",), ("hybrid", 0))]:
        args = _parse(*argv)
        resolve_mode(args)
        assert (args.mode, args.zero) == want, argv
    args = _parse("--zero", "2")
    resolve_mode(args)
    assert launcher_argv(args)[-4:] == ["--mode", "zero2", "--zero", "2"]  # the ranks resolve it alike
    for argv, msg in [(("--mode", "zero1", "--zero", "3"), r"--mode zero1 \(ZeRO stage 1\) and --zero 3 contradict"),
                      (("--mode", "zero3", "--zero", "0"), r"--mode zero3 \(ZeRO stage 3\) and --zero 0 contradict")]:
        with pytest.raises(ValueError, match=msg):
            resolve_mode(_parse(*argv))
    with pytest.raises(SystemExit):  # argparse: choices 0-3
        _parse("--zero", "4")


def test_the_registry_gives_hybrid_any_zero_stage() -> None:
    """`worker.modes.check_mode` is the one place a mode is validated and what the CLI resolves with:
    `hybrid` takes any ZeRO stage 0-3 for its dense part (no refusal), as a `SyncPlan` does; a stage
    past 3 and `--zero` with a PS mode are still refused with one line."""
    from worker.modes import check_mode
    from worker.peer.mesh import PeerConfigError
    from worker.peer.sync_plan import SyncPlan

    for k in (0, 1, 2, 3):
        mode = check_mode("hybrid", "peer", zero=k)
        assert (mode.name, mode.stage, mode.factory) == ("hybrid", k, "worker.peer.hybrid:HybridSync")
        assert SyncPlan("hybrid", zero=k).stage == k
        assert SyncPlan("dp", zero=k).stage == k and SyncPlan(f"zero{k}" if k else "dp").stage == k
    assert check_mode("hybrid", "peer").stage == 0 and SyncPlan("hybrid").stage == 0
    with pytest.raises(ValueError, match="--zero must be 0, 1, 2 or 3, got 4"):
        check_mode("hybrid", "peer", zero=4)
    with pytest.raises(PeerConfigError, match="--zero must be 0, 1, 2 or 3, got 4"):
        SyncPlan("hybrid", zero=4)
    with pytest.raises(PeerConfigError, match=r"--mode zero1 \(ZeRO stage 1\) and --zero 2 contradict"):
        SyncPlan("zero1", zero=2)
    with pytest.raises(ValueError, match="--zero 1 with --mode sync: ZeRO is peer mode's"):
        check_mode("sync", zero=1)


def test_documented_defaults_of_the_rank_flags() -> None:
    """README (Peer mode): "`--sparse-mode async` (default)", "`--timeout` (seconds, default 120)
    bounds every collective", "`--bucket-mb` MiB (default 25", "`--moe-aux`, default 0.01", "the
    router z-loss (`--moe-z`, 0.001)", and the hybrid's "`--retry-timeout` (60 s)". `tessera peer`
    given none of them, and the rank program's own parser (`python -m worker.peer` under a torchrun
    you start yourself), both parse to those values. Reference: the README's figures (the mode and
    stage defaults: test_zero_selects_the_stage_and_mode_zero_k_is_its_alias)."""
    from worker.peer.cli import add_train_args

    rank = argparse.ArgumentParser()
    add_train_args(rank)
    for args in (_parse(), rank.parse_args([])):
        got = (args.sparse_mode, args.timeout, args.bucket_mb, args.moe_aux, args.moe_z, args.retry_timeout)
        assert got == ("async", 120.0, 25.0, 0.01, 0.001, 60.0), got
