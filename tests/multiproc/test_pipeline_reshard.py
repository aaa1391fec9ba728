"""Resharding checkpoints across (D, T, P): `tessera peer --checkpoint-dir` saved by one layout resumes
in another, with the optimizer state, and the next losses match one process.

One checkpoint directory, five runs of the gpt task (Adam): (2,2,1) with ZeRO-2 (the trainer's
tensor-parallel path; Adam's state and the gradients split over the D replicas) trains steps 1-2 and
saves; (1,1,2) (the pipeline, with ZeRO-3's flag at D=1) resumes from it, trains steps 3-4 and saves; (2,2,1)
without ZeRO resumes from that and trains steps 5-6; a (1,2,2) pipeline (tensor-parallel stages) trains steps 7-8 from that,
and one plain data-parallel process step 9. Every checkpoint holds the plain model's tensors whole under their
plain names, Adam's moments included. Reference: one process training the same model with torch
Adam on the global batch for 9 steps without a break: the pipeline's losses (global batch means)
at steps 3-4 and 7-8, the (2,2,1) runs' logged losses (the global loss: mean over the D replicas)
at steps 2 and 6, and the last process's at step 9 equal it (rtol 1e-5): a resumed run that lost Adam's moments or step count, or read a tensor into
the wrong shard, would differ (so did one that shared Adam's loaded ``step`` tensor between its parameters).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 3, "heads": 2}
GPT = ["--task", "gpt", *[a for k, v in OPTS.items() for a in ("--task-opt", f"{k}={v}")], "--no-progress",
       "--torch-threads", "1", "--no-eval", "--log-every", "1", "--global-batch", "8"]
G = 8


def _reference(steps: int) -> list[float]:
    """Per step: the global batch's mean loss, before the update."""
    from worker.tasks import load_task

    task = load_task("gpt", seed=0, **OPTS)
    opt = torch.optim.Adam(task.model.parameters(), lr=task.dense_optimizer.hparams["lr"])
    glob = task.batches(0, 1, G, 0)
    out_g = []
    for _ in range(steps):
        opt.zero_grad()
        loss = task.loss(task.model, next(glob))
        loss.backward()
        opt.step()
        out_g.append(float(loss.detach()))
    return out_g


def _peer(nproc: int, args: list[str]) -> dict:  # type: ignore[type-arg]
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", str(nproc), *GPT, *args]
    p = subprocess.run(cmd, check=False, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(400)
def test_checkpoint_reshards_221_to_112_to_221_to_122_to_111(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ck = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    ref_g = _reference(9)
    a = _peer(4, ["--dp", "2", "--tp", "2", "--mode", "zero2", "--steps", "2", *ck])
    assert a["tp"] == 2 and a["dp"] == 2, a
    assert sorted(os.listdir(tmp_path)) == ["step-2"]
    names = {e["name"] for e in json.loads((tmp_path / "step-2" / "manifest.json").read_text())["pieces"]}
    assert {"param/blocks.0.qkv.weight", "state/exp_avg/blocks.0.qkv.weight", "state/exp_avg_sq/head.weight"} <= names
    assert a["loss"] == pytest.approx(ref_g[1], rel=1e-5)
    b = _peer(2, ["--pp", "2", "--micro-batches", "2", "--mode", "zero3", "--steps", "4", *ck])
    assert b["start_step"] == 2 and b["pp"] == 2 and b["tp"] == 1, b
    assert b["losses"] == pytest.approx(ref_g[2:4], rel=1e-5), (b["losses"], ref_g)
    c = _peer(4, ["--dp", "2", "--tp", "2", "--steps", "6", *ck])
    assert c["steps"] == 2, c
    assert c["loss"] == pytest.approx(ref_g[5], rel=1e-5), (c["loss"], ref_g)
    # a tensor-parallel pipeline (1,2,2) resumes from it and saves (shards gathered over TP) ...
    d = _peer(4, ["--tp", "2", "--pp", "2", "--micro-batches", "2", "--steps", "8", *ck])
    assert d["start_step"] == 6 and d["tp"] == 2 and d["pp"] == 2, d
    assert d["losses"] == pytest.approx(ref_g[6:8], rel=1e-5), (d["losses"], ref_g)
    # ... and one plain data-parallel process resumes from that
    e = _peer(1, ["--steps", "9", *ck])
    assert e["steps"] == 1, e
    assert e["loss"] == pytest.approx(ref_g[8], rel=1e-5), (e["loss"], ref_g)
