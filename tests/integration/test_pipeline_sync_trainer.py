"""``PipelineSync`` driven by the ``Trainer``'s one loop, in this process (a real Gloo group of one
rank, a one-stage pipeline: the executor, the schedule's micro-batches, the stages' ZeRO, the
trainer's evaluation through the sync; the multi-rank runs are tests/multiproc/test_pipeline_*.py).

Reference: a deep copy of the same float64 MLP trained by ``torch.optim`` (Adam) in this process
on the whole batch: the trainer's global loss of every step, the parameters after every step and
the final evaluation within 1e-10 relative, for 1 and 4 micro-batches, without ZeRO and with
ZeRO-3. Batches are (x, y) tuples: the schedule cuts them and hands the last stage whole
micro-batches for the task's own loss. A trainer asking the sync for another number of
micro-batches than its schedule runs is refused.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.tasks import Task
from worker.trainer import TrainConfig, Trainer

STEPS = 3



def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    return x, torch.stack([x.sum(1), x[:, 0]], 1)


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


TEST = _batch(999, 16)


def _task() -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()

    def batches(worker_index: int, num_workers: int, batch_size: int, start: int) -> Iterator[Any]:
        step = start
        while True:
            yield _batch(step, batch_size)
            step += 1

    def evaluate(m: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {"test_loss": float(_loss(m, TEST))}

    return Task("mlp", model, batches, _loss, evaluate=evaluate, metric="test_loss",
                dense_optimizer=OptimizerSpec("adam", {"lr": 0.05}))


def _pipeline_sync(task: Task, mode: str, m: int) -> Any:
    from worker.peer import SyncPlan, make_sync
    from worker.peer.mesh import ParallelMesh
    from worker.peer.pipeline import PipelinePlan
    from worker.peer.split import pipeline_source

    mesh = ParallelMesh.build(1, 1, 1, seed=0)
    src = pipeline_source(task.loss, task.model, 1, _batch(0, 8 // m))
    plan = SyncPlan(mode, task.dense_optimizer, pipeline=PipelinePlan(src, "1f1b", m))
    return make_sync(plan, task.model, mesh)


def _close(a: torch.Tensor | float, b: torch.Tensor | float) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm()) <= 1e-10 * float(b.norm())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["dp", "zero3"])
@pytest.mark.parametrize("m", [1, 4])
def test_trainer_runs_the_pipeline_like_one_process(gloo_group: None, mode: str, m: int) -> None:
    from worker.peer.pipeline import PipelineSync

    task = _task()
    ref = copy.deepcopy(task.model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    want_losses, want_params = [], []
    for t in range(STEPS):
        opt.zero_grad()
        loss = _loss(ref, _batch(t))
        loss.backward()
        opt.step()
        want_losses.append(float(loss.detach()))
        want_params.append(torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))
    sync = _pipeline_sync(task, mode, m)
    assert isinstance(sync, PipelineSync)
    got_losses, got_params = [], []

    def on_step(step: int, trainer: Trainer) -> None:
        got_losses.append(trainer.last_loss)
        got_params.append(trainer.flat)

    cfg = TrainConfig(mode=mode, steps=STEPS, batch_size=8, accumulate=m, progress=False)
    summary = Trainer(task, sync, cfg, on_step=on_step).run()
    assert summary.steps == STEPS
    for t in range(STEPS):
        assert _close(got_losses[t], want_losses[t]), (t, got_losses, want_losses)
        assert _close(got_params[t], want_params[t]), (t, got_params[t], want_params[t])
    assert _close(summary.metrics["test_loss"], float(_loss(ref, TEST).detach()))


@pytest.mark.timeout(60)
def test_other_micro_batch_count_is_refused(gloo_group: None) -> None:
    from worker.peer.pipeline import ScheduleError

    task = _task()
    sync = _pipeline_sync(task, "dp", 2)
    cfg = TrainConfig(mode="dp", steps=1, batch_size=8, accumulate=4, progress=False)
    with pytest.raises(ScheduleError, match="the pipeline runs 2 micro-batches per step, asked for 4"):
        Trainer(task, sync, cfg).run()
