"""The README's "Your own model in peer mode" runs as written: its `my_lm.py` block is saved in a
fresh directory and its shell block's commands run there (`--steps 20` cut to 3), under `tessera
peer` and under `torchrun`. The TP=2 x PP=2 command, run in fp64 (`--task-opt dtype=float64`), is
compared with one process: the same `my_lm.make()` model trained by torch.optim's AdamW on the global
batch, the loss at every step within 1e-10 relative."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def block(lang: str, marker: str) -> str:
    text = open(README).read()
    return next(b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if marker in b)


def commands() -> list[str]:
    lines = block("bash", "--task my_lm:make").splitlines()
    return [line.replace("--steps 20", "--steps 3") for line in lines if line and not line.startswith("#")]


def run(cmd: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # my_lm is found in the current directory (or by the command's own PYTHONPATH=.)
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=280)


def report(p: subprocess.CompletedProcess[str]) -> dict:
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", [0, 2], ids=["tessera-peer", "torchrun"])
def test_readme_user_model_under_tessera_peer_and_torchrun(tmp_path, which: int) -> None:
    (tmp_path / "my_lm.py").write_text(block("python", "my_lm.py:"))
    p = run(commands()[which], str(tmp_path))
    rec = report(p)
    assert rec["tp"] == 2 and rec["steps"] == 3, rec
    assert "tensor-parallel plan (auto, tp=2)" in p.stderr and "pos: replicated (a position embedding)" in p.stderr
    assert "blocks.0.attn.q: colwise" in p.stderr and "blocks.3.down: rowwise" in p.stderr


@pytest.mark.timeout(300)
def test_readme_user_model_tp2_x_pp2_equals_one_process(tmp_path) -> None:
    (tmp_path / "my_lm.py").write_text(block("python", "my_lm.py:"))
    _, tppp, _ = commands()
    rec = report(run(tppp + " --task-opt dtype=float64", str(tmp_path)))
    assert (rec["tp"], rec["pp"], rec["stages"]) == (2, 2, [[0, 1], [1, 2]]), rec
    sys.path.insert(0, str(tmp_path))
    try:
        import my_lm  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    task = my_lm.make(dtype="float64")
    model = copy.deepcopy(task.model)
    opt = torch.optim.AdamW(model.parameters(), lr=task.dense_optimizer.hparams["lr"], weight_decay=0.01)
    data = task.batches(0, 1, 8, 0)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = task.loss(model, next(data))
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    assert len(rec["losses"]) == 3
    for got, ref in zip(rec["losses"], want):
        assert abs(got - ref) <= 1e-10 * abs(ref), (rec["losses"], want)
