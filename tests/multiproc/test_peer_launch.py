"""Launching peer mode: `tessera peer` (torchrun's elastic agent), `torchrun -m worker.peer`, and
the start checks that stop every rank with one message (never a hang)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from test_peer_equivalence import ROOT, run_ranks  # type: ignore[import-not-found]

ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
GPT = ["--task", "gpt", "--task-opt", "dim=32", "--task-opt", "seq=16", "--task-opt", "layers=1", "--no-progress",
       "--torch-threads", "1"]


@pytest.mark.timeout(150)
def test_tessera_peer_trains_gpt_on_two_ranks_and_reports_tokens_per_s_and_mfu(tmp_path) -> None:
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", *GPT, "--steps", "30", "--global-batch", "16",
           "--metrics-out", str(tmp_path), "--trace", str(tmp_path / "trace"), "--bucket-mb", "0.05"]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert report["world"] == 2 and report["steps"] == 30
    assert report["loss"] < math.log(256) - 1.0, report  # it learns the chain (ln(vocab) at the start)
    assert report["tokens_per_s"] > 0 and 0 < report["mfu"] < 1, report
    for r in range(2):  # --metrics-out: one JSON-lines file per rank, ending with the summary
        records = [json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 30, records[-1]
        # --trace: a Chrome trace per rank: each step's compute and push, each bucket's all-reduce
        events = json.loads((tmp_path / "trace" / f"trace-rank{r}.json").read_text())["traceEvents"]
        names = [e["name"] for e in events if e["ph"] == "X"]
        assert names.count("compute") == 30 and names.count("push") == 30, names[:20]
        buckets = {n for n in names if n.startswith("all_reduce bucket ")}
        assert len(buckets) >= 2 and sum(n.startswith("all_reduce bucket ") for n in names) == 30 * len(buckets), buckets


@pytest.mark.timeout(150)
def test_tessera_peer_hybrid_trains_ctr_with_rows_on_the_ps(proc_cluster) -> None:
    addresses = proc_cluster(2)
    cmd = [sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", "--mode", "hybrid", "--ps", ",".join(addresses),
           "--task", "ctr", "--task-opt", "vocab=5000", "--task-opt", "test_size=2000", "--steps", "60", "--global-batch", "128",
           "--no-progress", "--torch-threads", "1"]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert report["mode"] == "hybrid" and report["steps"] == 60 and report["auc"] > 0.55, report  # 0.5: chance


@pytest.mark.timeout(120)
def test_torchrun_module_form_refuses_an_indivisible_batch_on_every_rank() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "worker.peer",
           *GPT, "--steps", "2", "--global-batch", "7"]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode != 0
    for r in range(2):
        assert f"rank {r}: global batch 7 is not divisible by world size 2 x accumulate 1" in p.stderr, p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_ranks_that_disagree_stop_at_start_naming_the_setting_and_values() -> None:
    base = [*GPT, "--steps", "2", "--backend", "gloo", "--device", "cpu"]
    results = run_ranks(2, [[*base, "--global-batch", "8"], [*base, "--global-batch", "12"]], module=True, timeout=100)
    for r, (rc, _, err) in enumerate(results):
        assert rc == 2, (r, rc, err[-3000:])
        assert "peer ranks disagree on 'global_batch': rank 0: 8, rank 1: 12" in err, err[-3000:]


@pytest.mark.timeout(120)
def test_a_world_size_other_than_asked_for_and_a_ps_model_are_refused_at_start() -> None:
    base = [*GPT, "--steps", "2", "--backend", "gloo", "--device", "cpu", "--global-batch", "8"]
    for extra, msg in [  # one rank is enough: these checks need no collective (so every rank makes them alike)
        (["--world-size", "3"], "world size is 1 but --world-size 3 was asked for"),
        (["--task", "ctr", "--task-opt", "vocab=1000"], "the model has PSEmbedding layers"),
    ]:
        [(rc, _, err)] = run_ranks(1, [*base, *extra], module=True, timeout=100)
        assert rc == 2 and msg in err, (rc, err[-3000:])


@pytest.mark.timeout(60)
def test_old_hybrid_mode_name_points_to_dense_sync() -> None:
    p = subprocess.run([sys.executable, "-m", "tessera.cli", "worker", "--ps", "127.0.0.1:1", "--mode", "hybrid"],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert p.returncode == 2 and "'hybrid' was renamed 'dense-sync'" in p.stderr, p.stderr
