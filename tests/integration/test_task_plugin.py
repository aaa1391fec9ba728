"""The README's user-task example runs as written: loaded by `package.module:function`, trained
against real shards, its PSEmbedding rows created on the PS."""
from __future__ import annotations

import os
import re
import sys

import pytest

from worker import TrainConfig, Trainer, load_task

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_task_example_trains(inproc_cluster, tmp_path, monkeypatch) -> None:
    text = open(README).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# mytask.py"))
    (tmp_path / "mytask.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("mytask", None)
    task = load_task("mytask:make", hidden=16)
    cluster = inproc_cluster(2)
    s = Trainer(task, cluster.client(), TrainConfig(mode="async", steps=20, batch_size=32, progress=False, eval_every=10)).run()
    assert s.steps == 20 and s.loss == s.loss  # finite
    assert task.metric == "accuracy" and 0.0 <= s.metrics["accuracy"] <= 1.0  # the example's evaluation ran
    rows = sum(t.rows for sh in cluster.shards for t in sh.stats().tables if t.name == "my/emb")
    assert rows > 20 * 32  # fresh random ids every step: rows created on the shards


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_task("nope")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_task("worker.tasks:missing")


def _tiny_task(**kw):
    import torch

    from worker import Task

    model = torch.nn.Linear(2, 1)
    return Task("t", model, lambda *a: iter(()), lambda m, b: m(b).mean(), **kw)


def test_task_defaults_agree_metric_direction_follows_its_name() -> None:
    """Issue 31 item 5: the default metric ("loss") is lower-is-better; a metric named for a loss or
    an error is too, anything else higher-is-better, and an explicit higher_is_better wins."""
    assert _tiny_task().metric == "loss" and _tiny_task().higher_is_better is False
    for metric, want in [("accuracy", True), ("auc", True), ("test_loss", False), ("mse", False), ("RMSE", False),
                         ("val_error", False), ("perplexity", False), ("f1", True)]:
        assert _tiny_task(metric=metric).higher_is_better is want, metric
    assert _tiny_task(metric="loss", higher_is_better=True).higher_is_better is True  # the task's say wins


@pytest.mark.parametrize("name, metric, higher", [("ctr", "auc", True), ("digits", "accuracy", True), ("gpt", "test_loss", False)])
def test_every_built_in_task_states_its_metric_and_direction(name: str, metric: str, higher: bool) -> None:
    opts = {"ctr": {"vocab": 1000, "test_size": 64}, "gpt": {"test_size": 4}}.get(name, {})
    task = load_task(name, **opts)
    assert (task.metric, task.higher_is_better) == (metric, higher)
    if name != "ctr":  # ctr's evaluation reads its PSEmbedding rows from shards
        assert metric in task.evaluate(task.model)  # the metric it names is one its evaluation returns


def test_task_opt_values_are_typed_as_the_help_says(tmp_path, monkeypatch) -> None:
    """`--task-opt` values reach the task's function as --help and the README say: JSON when the
    value is JSON, else the string as written (through the real command line parser)."""
    from tessera.cli import build_parser, parse_key_values

    (tmp_path / "echo_task.py").write_text(
        "from worker.tasks import load_task\nSEEN = {}\n"
        "def make(seed=0, **opts):\n    SEEN.update(opts)\n    return load_task('digits')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("echo_task", None)
    argv = ["worker", "--ps", "127.0.0.1:1", "--task", "echo_task:make"]
    for kv in ["n=3", "lr=1e-3", "on=true", "off=True", "none=null", "sizes=[1, 2]", "d={\"a\": 1}", "q=\"7\"",
               "name=abc", "eq=a=b", "empty="]:
        argv += ["--task-opt", kv]
    args = build_parser().parse_args(argv)
    load_task(args.task, **parse_key_values(args.task_opt))
    seen = sys.modules["echo_task"].SEEN
    assert seen == {"n": 3, "lr": 1e-3, "on": True, "off": "True", "none": None, "sizes": [1, 2], "d": {"a": 1},
                    "q": "7", "name": "abc", "eq": "a=b", "empty": ""}
    assert type(seen["n"]) is int and type(seen["lr"]) is float
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["worker"].format_help().split())
    assert "VALUE is parsed as JSON when it is JSON" in help_text and "anything else is the string as written" in help_text
