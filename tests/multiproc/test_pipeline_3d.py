"""Pipeline x tensor x data parallelism (worker/peer/pipeline.py with tensor-parallel stages), on CPU with Gloo.

Each launch starts D*T*P rank processes of tests/multiproc/pp3d_child.py in one ParallelMesh; its
checks train the gpt task (4 blocks, dim 16) 3 steps with 4 micro-batches and compare, at every
step (loss) and after the last (every parameter, gathered whole from the TP shards), with one
process training a deep copy of the same model with torch SGD (momentum 0.9) on the global batch:
fp32 rtol 1e-5. Schedules end bit-identical; recompute equals no recompute; sequence-parallel stages
equal the same reference; ZeRO-1 on the DP
dimension equals it with 1/D of the momentum state per rank; bf16 compute stays within 2e-3 (loss) and 1e-2
(parameters) of the fp32 reference with fp32 master weights and gradients (see the child's docstring for why 2e-2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]
from test_tensor_parallel import _check  # type: ignore[import-not-found]
from test_tensor_parallel import run_mesh as _run_mesh  # type: ignore[import-not-found]

CHILD = os.path.join(ROOT, "tests", "multiproc", "pp3d_child.py")


def run_mesh(dp: int, tp: int, pp: int, checks: list[str], timeout: float = 240.0) -> list[tuple[int, str, str]]:
    """The D*T*P ranks of pp3d_child.py (test_tensor_parallel's launcher: output to files, not pipes)."""
    return _run_mesh(dp, tp, pp, checks, timeout, child=CHILD)


CHECKS_TP2_PP2 = ["1f1b", "gpipe", "interleaved-v2", "1f1b-recompute", "same", "1f1b-bf16", "1f1b-sp", "interleaved-v2-recompute-sp"]
CHECKS_DP2_PP2 = ["1f1b-zero1", "gpipe-recompute-zero1", "1f1b-zero2", "gpipe-zero3", "1f1b", "same"]


@pytest.mark.timeout(300)
def test_tp2_pp2_equals_one_process() -> None:
    """(D, T, P) = (1, 2, 2): tensor-parallel stages; schedules, recompute, bf16 compute, sequence parallelism."""
    _check(run_mesh(1, 2, 2, CHECKS_TP2_PP2), CHECKS_TP2_PP2)


@pytest.mark.timeout(300)
def test_dp2_pp2_zero1_equals_one_process() -> None:
    """(D, T, P) = (2, 1, 2): ZeRO-1, -2 and -3 over the DP pairs of each stage (gradients reduce-scattered
    once per step after the last micro-batch; ZeRO-3 gathers a stage's parameters per step), with and
    without recompute."""
    _check(run_mesh(2, 1, 2, CHECKS_DP2_PP2), CHECKS_DP2_PP2)


CHECKS_DP2_TP2_PP2 = ["1f1b", "interleaved-v2", "1f1b-recompute-zero1", "same", "1f1b-bf16", "gpipe-zero3-fp64", "1f1b-zero2-sp"]


@pytest.mark.timeout(400)
def test_dp2_tp2_pp2_equals_one_process() -> None:
    """(D, T, P) = (2, 2, 2): 8 processes (about 25 s on 2 busy cores); ZeRO-1 over DP with TP stages,
    ZeRO-2 with sequence parallelism; ZeRO-3 in float64 with SGD lr=1 equal to one process to rtol 1e-12."""
    _check(run_mesh(2, 2, 2, CHECKS_DP2_TP2_PP2, timeout=360), CHECKS_DP2_TP2_PP2)


# ------------------------------------------------------------------ tessera peer --tp T --pp P [--recompute] [--precision bf16]
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 3, "heads": 2}
GPT = ["--task", "gpt", *[a for k, v in OPTS.items() for a in ("--task-opt", f"{k}={v}")], "--no-progress", "--torch-threads", "1",
       "--steps", "4", "--global-batch", "8"]


def _peer(nproc: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", str(nproc), *GPT, *args]
    return subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=170)


def _report(p: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])  # type: ignore[no-any-return]


def _reference_losses(steps: int = 4) -> list[float]:
    """One process, torch Adam on the global batch: the loss of every step."""
    import torch

    from worker.tasks import load_task

    task = load_task("gpt", seed=0, **OPTS)
    opt = torch.optim.Adam(task.model.parameters(), lr=task.dense_optimizer.hparams["lr"])
    data, out = task.batches(0, 1, 8, 0), []
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(task.model, next(data))
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.timeout(300)
def test_tessera_peer_tp_pp_recompute_and_bf16() -> None:
    """`tessera peer --tp 2 --pp 2 --sequence-parallel` and `--tp 2 --recompute` equal one process (Adam,
    every step's loss, rtol 1e-5); `--tp 2 --precision bf16` is within 2e-3 of it and reports bf16;
    `--sequence-parallel` on a sequence T does not divide stops every rank with one message (exit 2)."""
    ref = _reference_losses()
    r = _report(_peer(4, ["--tp", "2", "--pp", "2", "--micro-batches", "4", "--sequence-parallel"]))
    assert (r["dp"], r["tp"], r["pp"], r["precision"], r["sequence_parallel"]) == (1, 2, 2, "fp32", True), r
    assert r["losses"] == pytest.approx(ref, rel=1e-5), (r["losses"], ref)
    r = _report(_peer(2, ["--tp", "2", "--recompute", "--micro-batches", "2"]))
    assert (r["tp"], r["pp"], r["recompute"]) == (2, 1, True), r
    assert r["losses"] == pytest.approx(ref, rel=1e-5), (r["losses"], ref)
    r = _report(_peer(2, ["--tp", "2", "--precision", "bf16", "--micro-batches", "2"]))
    assert r["precision"] == "bf16", r
    assert r["losses"] == pytest.approx(ref, rel=2e-3) and r["losses"] != pytest.approx(ref, rel=1e-7), (r["losses"], ref)
    p = _peer(4, ["--tp", "2", "--pp", "2", "--sequence-parallel", "--task-opt", "seq=7"])
    assert p.returncode != 0
    assert p.stderr.count("sequence length 7 not divisible by tp 2") >= 4, p.stderr[-2000:]
