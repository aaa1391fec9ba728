"""A pipeline runs inside the trainer's one loop (``PipelineSync``): what every other layout gets
from the trainer, a pipeline gets too.

`tessera peer --pp 2 --dp 2 --mode zero3 --schedule interleaved` (4 ranks, two model chunks per rank,
the gpt task in float64, Adam) with
``--metrics-out --log-every 1 --eval-every 2``: every rank's step records carry the step's global
loss (the last stage's mean over the micro-batches, averaged over the two pipelines), the same on
every rank; the evaluation at step 2 and the final one at step 4 run the whole model (each stage's
parameters, gathered over ZeRO-3's shards, shared over the pipeline) on every rank. Reference: one
process training a copy of the model with torch Adam on the global batch: losses at every step and
the test loss after steps 2 and 4 within 1e-10 relative. ``--max-seconds`` on a pipeline: every
rank stops after the same step (a rank that stopped alone would leave the others in a collective)
and the run exits 0.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 3, "heads": 2, "test_size": 16, "dtype": "float64"}
GPT = ["--task", "gpt", *[a for k, v in OPTS.items() for a in ("--task-opt", f"{k}={v}")], "--no-progress", "--torch-threads", "1"]


def _peer(nproc: int, args: list[str], timeout: float = 200) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", str(nproc), *GPT, *args]
    return subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _records(path: str) -> list[dict]:  # type: ignore[type-arg]
    with open(path) as f:
        return [json.loads(line) for line in f]


def _reference(steps: int, evals: list[int]) -> tuple[list[float], dict[int, float]]:
    """One process, torch Adam on the global batch of 8: the loss of every step, and the task's
    test loss after each step in ``evals``."""
    from worker.peer.mesh import torch_optimizer
    from worker.tasks import load_task

    task = load_task("gpt", seed=0, **OPTS)
    model = copy.deepcopy(task.model)
    opt = torch_optimizer(task.dense_optimizer)(model.parameters())
    data, losses, tests = task.batches(0, 1, 8, 0), [], {}
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step in evals:
            assert task.evaluate is not None
            tests[step] = task.evaluate(model)["test_loss"]
    return losses, tests


def _close(a: float, b: float, rel: float = 1e-10) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.timeout(300)
def test_pipeline_zero3_metrics_and_evaluation_come_from_the_trainer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _peer(4, ["--pp", "2", "--dp", "2", "--mode", "zero3", "--schedule", "interleaved", "--virtual-stages", "2",
                  "--micro-batches", "2", "--global-batch", "8", "--steps", "4",
                  "--log-every", "1", "--eval-every", "2", "--metrics-out", str(tmp_path)], timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    want, tests = _reference(4, [2, 4])
    for r in range(4):
        recs = _records(str(tmp_path / f"rank{r}.jsonl"))
        got = [x["loss"] for x in recs if x["kind"] == "step"]
        assert len(got) == 4 and all(_close(a, b) for a, b in zip(got, want)), (r, got, want)
        evals = {x["step"]: x for x in recs if x["kind"] == "eval"}
        assert sorted(evals) == [2, 4] and evals[4]["final"] and not evals[2]["final"], (r, evals)
        for step, ref in tests.items():
            assert _close(evals[step]["test_loss"], ref), (r, step, evals[step]["test_loss"], ref)
        summary = [x for x in recs if x["kind"] == "summary"]
        assert len(summary) == 1 and _close(summary[0]["last_loss"], want[-1]), (r, summary)
    report = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert (report["pp"], report["dp"], report["micro_batches"], report["virtual_stages"]) == (2, 2, 2, 2), report
    assert len(report["stages"]) == 4, report  # 2 x 2 virtual stages over the 5 layers
    assert _close(report["test_loss"], tests[4]) and _close(report["last_loss"], want[-1]), report


@pytest.mark.timeout(200)
def test_pipeline_max_seconds_stops_every_rank_at_the_same_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _peer(2, ["--pp", "2", "--micro-batches", "4", "--global-batch", "8", "--steps", "1000000", "--max-seconds", "3",
                  "--no-eval", "--metrics-out", str(tmp_path)], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    summaries = [[x for x in _records(str(tmp_path / f"rank{r}.jsonl")) if x["kind"] == "summary"] for r in range(2)]
    assert all(len(s) == 1 and s[0]["stopped_early"] for s in summaries), summaries
    assert summaries[0][0]["steps"] == summaries[1][0]["steps"] >= 1, summaries
