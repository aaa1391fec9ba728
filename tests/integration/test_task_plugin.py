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
