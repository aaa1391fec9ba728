"""Tensor and sequence parallelism (worker/peer/tensor_parallel.py) in a ParallelMesh, on CPU with Gloo.

Each launch starts D*T*P rank processes running tests/multiproc/tp_child.py, which builds one mesh
and runs several checks in it. Reference for the training checks: one process training a deep copy
of the same plain ``gpt`` model with ``torch.optim.SGD`` on the global batch: the global loss at
every step and every parameter (gathered from the TP shards) after every step match it (fp32:
rtol 1e-5; fp64 with SGD lr=1: rtol 1e-12). Sequence parallel is checked against that same
reference, so SP == plain TP == one process. Two launches in all: (1,2,1) and (2,2,1).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

from worker.peer.mesh import ParallelMesh, PeerConfigError, check_divisibility

CHILD = os.path.join(ROOT, "tests", "multiproc", "tp_child.py")


def run_mesh(
    dp: int, tp: int, pp: int, checks: list[str], timeout: float = 240.0, child: str = CHILD,
) -> list[tuple[int, str, str]]:
    """Start the D*T*P ranks of ``child`` (tp_child.py); [(returncode, stdout, stderr)] per rank. Output goes to
    files, not pipes: a rank printing more than a pipe holds (the parameters) while another rank's
    pipe is being read would block in print and hang its peers in their next collective."""
    world, port = dp * tp * pp, free_port()
    procs: list[subprocess.Popen[str]] = []
    files = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        try:
            for r in range(world):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                           PYTHONWARNINGS="ignore::FutureWarning")
                out = stack.enter_context(open(os.path.join(tmp, f"{r}.out"), "w+"))
                err = stack.enter_context(open(os.path.join(tmp, f"{r}.err"), "w+"))
                files.append((out, err))
                procs.append(subprocess.Popen([sys.executable, child, str(dp), str(tp), str(pp), *checks], env=env,
                                              cwd=ROOT, stdout=out, stderr=err, text=True))
            deadline = time.monotonic() + timeout
            results = []
            for p, (out, err) in zip(procs, files):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                out.seek(0)
                err.seek(0)
                results.append((p.returncode, out.read(), err.read()))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _check(results: list[tuple[int, str, str]], checks: list[str]) -> None:
    failed = [(r, rc, so, se) for r, (rc, so, se) in enumerate(results) if rc != 0]
    assert not failed, "\n".join(f"rank {r} failed (rc {rc}):\n{so[-1500:]}\n{se[-3000:]}" for r, rc, so, se in failed)
    for r, (rc, so, se) in enumerate(results):
        for c in checks:
            assert f"OK {c}" in so, f"rank {r}: check {c} did not report OK:\n{so}\n{se[-2000:]}"


def _ckpt(out: str, kind: str, mode: str) -> tuple[float, list[float]]:
    line = next(line for line in out.splitlines() if line.startswith(f"CKPT {kind} {mode} "))
    rec = json.loads(line.split(" ", 3)[3])
    return rec["loss"], rec["params"]


@pytest.fixture(scope="module")
def d2t2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, str, str]]]:
    """One (D,T,P) = (2,2,1) launch: its checks, then 4 TP steps with a checkpoint after step 3."""
    d = str(tmp_path_factory.mktemp("tp") / "ckpt")
    return d, run_mesh(2, 2, 1, [*D2T2_CHECKS, f"ckpt-save:{d}:tp", f"ckpt-save:{d}-zero2:tpzero2"])


D2T2_CHECKS = ["mesh", "tp", "tp-sp", "tp-zero1", "tp-zero2", "tp-zero3"]


@pytest.mark.timeout(300)
def test_d2_t2_tp_sp_and_zero1_2_3_match_one_process(d2t2) -> None:
    """(D,T,P) = (2,2,1): 4 ranks, the DP all-reduce over dp_group composed with TP (and SP, whose
    replicated gradients are also summed over tp_group) == one process with the global batch; so
    do ZeRO-1, -2 and -3 on the DP dimension with SP and 2 micro-batches (momentum SGD, each rank
    holding half the momentum)."""
    d, results = d2t2
    _check(results, [*D2T2_CHECKS, f"ckpt-save:{d}:tp", f"ckpt-save:{d}-zero2:tpzero2"])
    assert sorted(os.listdir(d)) == ["step-3"]
    # the ZeRO-2 run (optimizer state and gradients split over the DP group) saved the same step as plain TP
    torch.testing.assert_close(torch.tensor(_ckpt(results[0][1], "ckpt-save", "tpzero2")[1]),
                               torch.tensor(_ckpt(results[0][1], "ckpt-save", "tp")[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_t2_tp_sp_fp64_accumulation_vocab_ce_activations_dropout_and_resharded_checkpoints(d2t2, tmp_path) -> None:
    """(D,T,P) = (1,2,1): the mesh's groups and RNG streams; vocab-parallel cross-entropy and its
    gradient == F.cross_entropy on the full logits (fp64, 1e-12); TP, SP, TP fp64 SGD lr=1 and TP with
    2 accumulation micro-batches == one process; SP keeps no full-sequence activation outside the TP
    regions and fewer bytes per rank; replicated dropout masks agree across TP ranks.
    Checkpoints (momentum SGD, so the optimizer state matters): the (2,2,1) TP checkpoint resumed at
    (1,2,1) and in plain DP over 2 ranks, a DP checkpoint of 2 ranks resumed at (1,2,1), a TP + ZeRO-2
    checkpoint of (2,2,1) (momentum gathered over the DP group) resumed at (1,2,1) with ZeRO-1 and in
    DP over 2 ranks with ZeRO-3; reference
    for each resumed step: the run that saved it, which went on past its checkpoint (step 3's global
    loss and the parameters after it, rtol 1e-5)."""
    d, saved = d2t2
    d_dp = str(tmp_path / "dp")
    checks = ["mesh", "vocab-ce", "tp", "tp-sp", "tp64", "tp-accum", "sp-activations", "dropout",
              f"ckpt-load:{d}:tp", f"ckpt-load:{d}:dp", f"ckpt-save:{d_dp}:dp", f"ckpt-load:{d_dp}:tp",
              f"ckpt-load:{d}-zero2:tpzero1", f"ckpt-load:{d}-zero2:zero3"]
    results = run_mesh(1, 2, 1, checks)
    _check(results, checks)
    want = _ckpt(saved[0][1], "ckpt-save", "tp")
    want_dp = _ckpt(results[0][1], "ckpt-save", "dp")
    want_zero2 = _ckpt(saved[0][1], "ckpt-save", "tpzero2")
    for r in range(2):
        for (loss, params), (wl, wp), what in [
            (_ckpt(results[r][1], "ckpt-load", "tp"), want, "TP (2,2,1) -> TP (1,2,1)"),
            (_ckpt(results[r][1], "ckpt-load", "dp"), want, "TP (2,2,1) -> DP 2 ranks"),
            (_last_load(results[r][1]), want_dp, "DP 2 ranks -> TP (1,2,1)"),
            (_ckpt(results[r][1], "ckpt-load", "tpzero1"), want_zero2, "TP+ZeRO-2 (2,2,1) -> TP+ZeRO-1 (1,2,1)"),
            (_ckpt(results[r][1], "ckpt-load", "zero3"), want_zero2, "TP+ZeRO-2 (2,2,1) -> DP+ZeRO-3 2 ranks"),
        ]:
            assert loss == pytest.approx(wl, rel=1e-5), what
            torch.testing.assert_close(torch.tensor(params), torch.tensor(wp), rtol=1e-5, atol=1e-6, msg=what)


def _last_load(out: str) -> tuple[float, list[float]]:
    """The last ``CKPT ckpt-load tp`` line (the second TP resume of the launch)."""
    line = [line for line in out.splitlines() if line.startswith("CKPT ckpt-load tp ")][-1]
    rec = json.loads(line.split(" ", 3)[3])
    return rec["loss"], rec["params"]


def test_rank_layout_is_tp_innermost_pp_outermost() -> None:
    """rank = pp*(D*T) + dp*T + tp, the layout helper E's pipeline relies on."""
    seen = set()
    for rank in range(2 * 3 * 2):
        d, t, p = ParallelMesh.coords(rank, 2, 3, 2)
        assert ParallelMesh.rank_of(d, t, p, 2, 3) == rank
        seen.add((d, t, p))
    assert len(seen) == 12
    assert ParallelMesh.coords(1, 2, 3, 2) == (0, 1, 0) and ParallelMesh.coords(3, 2, 3, 2) == (1, 0, 0)
    assert ParallelMesh.coords(6, 2, 3, 2) == (0, 0, 1)


def test_divisibility_one_message_naming_every_misfit() -> None:
    with pytest.raises(PeerConfigError) as e:
        check_divisibility(2, 4, 3, heads=6, dim=64, layers=4, global_batch=6, vocab=102, seq=30,
                           sequence_parallel=True, micro_batches=2)
    msg = str(e.value)
    for part in ("heads 6 not divisible by tp 4", "vocab 102 not divisible by tp 4", "sequence length 30",
                 "layers 4 not divisible by pp 3", "global batch 6 not divisible by dp 2 x micro-batches 2"):
        assert part in msg, msg
    assert "hidden size" not in msg
    check_divisibility(2, 2, 2, heads=4, dim=64, layers=4, global_batch=8, vocab=64, seq=32, sequence_parallel=True)
    with pytest.raises(PeerConfigError, match="tp must be >= 1"):
        check_divisibility(1, 0, 1)


GPT_CLI = ["--task", "gpt", "--task-opt", "dim=32", "--task-opt", "seq=16", "--task-opt", "layers=1", "--no-progress",
           "--torch-threads", "1", "--backend", "gloo", "--device", "cpu"]


@pytest.mark.timeout(200)
def test_peer_rank_program_trains_gpt_with_tp2_and_sequence_parallel_and_refuses_misfits() -> None:
    """`python -m worker.peer --tp 2 --sequence-parallel --mode zero1` (2 ranks: D=1, T=2) learns the chain and
    reports its layout; a model whose heads T does not divide stops every rank at start (exit 2)
    with one message; a world size T x P does not divide is refused too."""
    import math

    from test_peer_equivalence import run_ranks  # type: ignore[import-not-found]

    ok = run_ranks(2, [*GPT_CLI, "--tp", "2", "--sequence-parallel", "--mode", "zero1", "--steps", "30", "--global-batch", "16"],
                   module=True, timeout=150)
    for r, (rc, _, err) in enumerate(ok):
        assert rc == 0, (r, err[-3000:])
    report = json.loads([line for line in ok[0][1].splitlines() if line.startswith("{")][-1])
    assert (report["dp"], report["tp"], report["pp"], report["sequence_parallel"], report["mode"]) == (1, 2, 1, True, "zero1"), report
    assert report["steps"] == 30 and report["loss"] < math.log(256) - 1.0, report
    bad = run_ranks(2, [*GPT_CLI, "--tp", "2", "--task-opt", "dim=48", "--task-opt", "heads=3", "--steps", "2",
                        "--global-batch", "8"], module=True, timeout=100)
    for r, (rc, _, err) in enumerate(bad):
        assert rc == 2 and "heads 3 not divisible by tp 2" in err, (r, rc, err[-3000:])
    [(rc, _, err)] = run_ranks(1, [*GPT_CLI, "--tp", "2", "--steps", "2", "--global-batch", "8"], module=True, timeout=100)
    assert rc == 2 and "world size 1 is not divisible by tp 2 x pp 1" in err, (rc, err[-3000:])
