"""`tessera peer --pp P --schedule ... --micro-batches m [--recompute]`.

The peer run's reported loss of the last step equals one process training the same gpt model with
torch Adam on the global batch (rtol 1e-5); a schedule that does not fit stops every rank with
one message and exit 2; `tessera plan --measure` runs its best candidates here and picks the
fastest measured.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_peer_equivalence import ROOT, run_ranks  # type: ignore[import-not-found]

ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 3, "heads": 2}
GPT = ["--task", "gpt", *[a for k, v in OPTS.items() for a in ("--task-opt", f"{k}={v}")], "--no-progress", "--torch-threads", "1"]


def _reference_loss(steps: int, batch: int) -> float:
    from worker.tasks import load_task

    task = load_task("gpt", seed=0, **OPTS)
    opt = torch.optim.Adam(task.model.parameters(), lr=task.dense_optimizer.hparams["lr"])
    data = task.batches(0, 1, batch, 0)
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(task.model, next(data))
        loss.backward()
        opt.step()
    return float(loss.detach())


@pytest.mark.timeout(150)
def test_tessera_peer_pp2_1f1b_recompute_equals_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", *GPT, "--pp", "2", "--schedule", "1f1b",
           "--micro-batches", "4", "--recompute", "--steps", "4", "--global-batch", "8", "--trace", str(tmp_path)]
    p = subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert report["pp"] == 2 and report["dp"] == 1 and report["schedule"] == "1f1b" and report["recompute"] is True, report
    assert report["stages"] == [[0, 2], [2, 5]]  # by parameters: embeddings + block 0 | blocks 1-2 + head
    assert report["bubble_theory"] == pytest.approx(1 / 5), report
    want = _reference_loss(4, 8)  # the last step's global loss (report["loss"] is the mean of the last log window)
    assert abs(report["last_loss"] - want) <= 1e-5 * want, (report["last_loss"], want)
    # --trace: every forward and backward of every micro-batch, and the sends between the stages
    for r in range(2):
        names = [e["name"] for e in json.loads((tmp_path / f"trace-rank{r}.json").read_text())["traceEvents"] if e["ph"] == "X"]
        for op in ("F", "B"):
            assert sorted(n for n in names if n.startswith(op + " ")) == sorted([f"{op} mb{i} s{r}" for i in range(4)] * 4), names
        assert sum(n.startswith("SEND_ACT" if r == 0 else "SEND_GRAD") for n in names) == 16, names


@pytest.mark.timeout(120)
def test_a_schedule_that_does_not_fit_stops_every_rank() -> None:
    res = run_ranks(2, [*GPT, "--pp", "2", "--schedule", "interleaved", "--micro-batches", "3", "--global-batch", "6",
                        "--steps", "1"], module=True, timeout=100)
    for r, (rc, _, se) in enumerate(res):
        assert rc == 2, (r, se[-2000:])
        assert f"rank {r}: the interleaved schedule needs micro-batches divisible by pipeline ranks: m=3, P=2" in se, se[-2000:]


@pytest.mark.timeout(200)
def test_tessera_plan_measure_runs_the_top_candidates() -> None:
    cmd = [sys.executable, "-m", "tessera.cli", "plan", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
           "--batch", "8", "--vocab", "64", "--gpus", "2", "--gpu-mem", "1", "--precision", "fp32", "--measure",
           "--measure-top", "2", "--measure-steps", "3", "--measure-device", "cpu"]
    p = subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.split("measured on this machine (2 ranks, 3 steps each)")
    assert len(out) == 2, p.stdout
    rows = [line for line in out[1].splitlines() if line[:2] in ("* ", "  ") and " T1 " in line]
    assert len(rows) == 2 and sum(r.startswith("*") for r in rows) == 1, out[1]
    assert "measured pick: D" in out[1], out[1]


@pytest.mark.timeout(240)
def test_plan_measure_runs_tensor_parallel_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """``--measure`` runs every layout ``tessera peer`` runs: here the T=2 candidates (plain, with
    sequence parallelism, with recompute through the pipeline path, ZeRO-1) on 2 ranks; each one
    reports a measured step time; ZeRO-2/3 with TP or PP are offered too (tessera peer runs them)."""
    from worker.peer.planner import (
        Hardware,
        Layout,
        ModelSpec,
        estimate,
        measure,
        runnable,
    )

    spec = ModelSpec(layers=2, hidden=32, heads=2, seq=16, batch=8, vocab=64)
    hw = Hardware(gpus=2, gpu_mem_gib=1, precision="fp32")
    lays = [Layout(T=2, m=1), Layout(T=2, m=1, sequence_parallel=True), Layout(T=2, m=2, recompute=True),
            Layout(T=2, zero=1, m=1)]
    assert all(runnable(lay) for lay in lays) and runnable(Layout(T=2, zero=2)) and runnable(Layout(P=2, zero=3, recompute=True))
    plans = [estimate(spec, lay, hw) for lay in lays]
    assert measure(spec, plans, gpus=2, top=len(plans), steps=2, device="cpu") is not None
    out = capsys.readouterr().out
    assert "failed" not in out, out
    rows = [line for line in out.split("measured on this machine")[1].splitlines() if line[:2] in ("* ", "  ") and " T2 " in line]
    assert len(rows) == len(lays) and sum(" T2 P1 SP " in r for r in rows) == 1, out
