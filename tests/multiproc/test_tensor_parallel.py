"""Tensor and sequence parallelism (worker/peer/tensor_parallel.py) in a ParallelMesh, on CPU with Gloo.

Each launch starts D*T*P rank processes running tests/multiproc/tp_child.py, which builds one mesh
and runs several checks in it. Reference for the training checks: one process training a deep copy
of the same plain ``gpt`` model with ``torch.optim.SGD`` on the global batch: the global loss at
every step and every parameter (gathered from the TP shards) after every step match it (fp32:
rtol 1e-5; fp64 with SGD lr=1: rtol 1e-12). Sequence parallel is checked against that same
reference, so SP == plain TP == one process. Two launches in all: (1,2,1) and (2,2,1).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from test_peer_equivalence import ROOT, _free_port  # type: ignore[import-not-found]

from worker.peer.mesh import ParallelMesh, PeerConfigError, check_divisibility

CHILD = os.path.join(ROOT, "tests", "multiproc", "tp_child.py")


def run_mesh(dp: int, tp: int, pp: int, checks: list[str], timeout: float = 240.0) -> list[tuple[int, str, str]]:
    """Start the D*T*P ranks of tp_child.py; [(returncode, stdout, stderr)] per rank."""
    world, port = dp * tp * pp, _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   PYTHONWARNINGS="ignore::FutureWarning")
        procs.append(subprocess.Popen([sys.executable, CHILD, str(dp), str(tp), str(pp), *checks], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _check(results: list[tuple[int, str, str]], checks: list[str]) -> None:
    for r, (rc, so, se) in enumerate(results):
        assert rc == 0, f"rank {r} failed (rc {rc}):\n{se[-4000:]}"
        for c in checks:
            assert f"OK {c}" in so, f"rank {r}: check {c} did not report OK:\n{so}\n{se[-2000:]}"


@pytest.mark.timeout(300)
def test_t2_tp_sp_fp64_accumulation_vocab_ce_activations_dropout() -> None:
    """(D,T,P) = (1,2,1): the mesh's groups and RNG streams; vocab-parallel cross-entropy and its
    gradient == F.cross_entropy on the full logits (fp64, 1e-12); TP, SP, TP fp64 SGD lr=1 and TP with
    2 accumulation micro-batches == one process; SP keeps no full-sequence activation outside the TP
    regions and fewer bytes per rank; replicated dropout masks agree across TP ranks."""
    checks = ["mesh", "vocab-ce", "tp", "tp-sp", "tp64", "tp-accum", "sp-activations", "dropout"]
    _check(run_mesh(1, 2, 1, checks), checks)


@pytest.mark.timeout(300)
def test_d2_t2_tp_and_sp_match_one_process() -> None:
    """(D,T,P) = (2,2,1): 4 ranks, the DP all-reduce over dp_group composed with TP (and SP, whose
    replicated gradients are also summed over tp_group) == one process with the global batch."""
    checks = ["mesh", "tp", "tp-sp"]
    _check(run_mesh(2, 2, 1, checks), checks)


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
    """`python -m worker.peer --tp 2 --sequence-parallel` (2 ranks: D=1, T=2) learns the chain and
    reports its layout; a model whose heads T does not divide stops every rank at start (exit 2)
    with one message; a world size T x P does not divide is refused too."""
    import json
    import math

    from test_peer_equivalence import run_ranks  # type: ignore[import-not-found]

    ok = run_ranks(2, [*GPT_CLI, "--tp", "2", "--sequence-parallel", "--steps", "30", "--global-batch", "16"],
                   module=True, timeout=150)
    for r, (rc, _, err) in enumerate(ok):
        assert rc == 0, (r, err[-3000:])
    report = json.loads([line for line in ok[0][1].splitlines() if line.startswith("{")][-1])
    assert (report["dp"], report["tp"], report["pp"], report["sequence_parallel"]) == (1, 2, 1, True), report
    assert report["steps"] == 30 and report["loss"] < math.log(256) - 1.0, report
    bad = run_ranks(2, [*GPT_CLI, "--tp", "2", "--task-opt", "dim=48", "--task-opt", "heads=3", "--steps", "2",
                        "--global-batch", "8"], module=True, timeout=100)
    for r, (rc, _, err) in enumerate(bad):
        assert rc == 2 and "heads 3 not divisible by tp 2" in err, (r, rc, err[-3000:])
    [(rc, _, err)] = run_ranks(1, [*GPT_CLI, "--tp", "2", "--steps", "2", "--global-batch", "8"], module=True, timeout=100)
    assert rc == 2 and "world size 1 is not divisible by tp 2 x pp 1" in err, (rc, err[-3000:])
