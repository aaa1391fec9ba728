"""Mixture-of-experts and expert parallelism on CPU with Gloo, against one process.

One process group of 4 ranks (tests/multiproc/moe_child.py) runs every check. Reference: one
process training a deep copy of the same initial MoE ``gpt`` (E=4 experts in each of its 2 blocks)
with SGD on the global batch, compared at every step (fp32, rtol 1e-5): the global loss, all the
parameters (experts gathered from their ranks), and the token assignments the capacity dropped.

- EP=1, 2, 4, top-2, capacity factor 2 (no drops): the same losses and parameters.
- Capacity factor 0.5 (top-2 at EP=2 and 4, top-1 at EP=4): drops happen, and they are the
  reference's drops, rank by rank.
- ZeRO-2 (EP=2) and ZeRO-3 (EP=4) on the non-expert parameters: the same (capacity 0.5).
- EP=2 x TP=2 (a (2, 2, 1) mesh: attention split by heads, every expert's MLP by hidden, the
  router replicated, EP groups carved from the DP dimension): the same losses and parameters at
  capacity factor 2 (no drops), and at 0.5 the reference's drops; EP=1 x TP=2 too (each expert
  shard on 2 replicas: its gradient summed over them); a checkpoint of it (momentum SGD)
  saved after 3 steps resumes at EP=1 / TP=1 (4 data-parallel ranks) with the same step 3, and
  one saved at EP=2 without TP resumes at EP=2 x TP=2 with the same step 3.
- Metrics: all-to-all bytes over the ranks equal 4 exchanges of every routed token's row per layer.
- A checkpoint saved at EP=4 after 3 steps resumes at EP=2 with the same step 3.
- Load balance: routers start skewed to expert 0 (top-1, 40 Adam steps): the metrics report the
  skew (CV of tokens per expert > 1, expert 0 holding most tokens); with the balance loss on (0.1)
  the CV falls below a quarter of its start and below the run without it.

`test_moe_layouts_equal_one_process`: every layout `tessera peer` takes with MoE layers (pipelines with
recompute, bf16, --pp-split, --tp-plan, sequence parallelism, a stage without an MoE layer, the PS
hybrid) in one launch of 4 ranks, against one process (its docstring says how); in the same launch one
`--checkpoint-dir` carried from EP=2 x PP=2 x ZeRO-1 to EP=2 x DP=2 x TP=2 x ZeRO-3 to TP=2 x PP=2 x ZeRO-2,
then loaded by one process (``_check_checkpoint_runs``).
"""
from __future__ import annotations

import os

import pytest
import test_peer_equivalence as tpe  # type: ignore[import-not-found]
import torch

CHILD = os.path.join(tpe.ROOT, "tests", "multiproc", "moe_child.py")

CHECKS = ["ep1", "ep2", "ep4", "drop-2-2", "drop-2-4", "drop-1-4", "zero2-ep2", "zero3-ep4", "eptp-2-2-2.0", "eptp-2-2-0.5", "eptp-1-2-2.0", "eptp-2-2-2.0-zero2", "eptp-ckpt", "metrics", "ckpt", "balance"]


@pytest.mark.timeout(300)
def test_moe_expert_parallel_equals_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpe, "CHILD", CHILD)  # the rank launcher of the peer tests, with this file's child
    tpe._check(tpe.run_ranks(4, CHECKS, timeout=280), CHECKS)


@pytest.mark.timeout(200)
def test_moe_flags_metrics_and_start_checks(tmp_path) -> None:
    """``python -m worker.peer --moe-experts 4 --ep 2 --accumulate 2`` (2 ranks): trains, and the
    metrics file's step records carry tokens per expert (per step, not per micro-batch), the dropped
    share, the balance loss and all-to-all time and bytes, and the same (global) loss on both ranks;
    ``--ep 3`` on 2 ranks stops every rank at start with one message (exit 2)."""
    import json

    flags = ["--task", "gpt", "--task-opt", "dim=16", "--task-opt", "seq=16", "--task-opt", "vocab=32", "--moe-experts", "4",
             "--global-batch", "4", "--steps", "4", "--log-every", "2", "--no-progress", "--no-eval"]
    res = tpe.run_ranks(2, [*flags, "--ep", "2", "--accumulate", "2", "--metrics-out", str(tmp_path)], module=True, timeout=120)
    for r, (rc, _, se) in enumerate(res):
        assert rc == 0, f"rank {r}: {se[-3000:]}"
    summary = json.loads(res[0][1].strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["mfu"] > 0, summary
    recs = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == 2, steps
    for rec in steps:
        tpe_ = rec["moe_tokens_per_expert"]
        assert len(tpe_) == 2 and all(len(c) == 4 for c in tpe_), rec  # 2 MoE layers x 4 experts
        # 2 sequences x 16 tokens x top-2 assignments per layer and step on this rank (2 micro-batches of 1)
        assert all(abs(sum(c) - 2 * 16 * 2) < 1e-6 for c in tpe_), rec
        assert 0 <= rec["moe_dropped"] < 1 and rec["moe_balance_loss"] > 0 and rec["a2a_ms"] > 0 and rec["a2a_mb"] > 0, rec
    assert next(r for r in recs if r["kind"] == "summary")["ep"] == 2
    # the logged loss is the global one (mean over the DP ranks): both ranks' records carry the same,
    # though each rank computed a different batch; the printed report is it too
    recs0 = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    pick = [(r["kind"], r.get("loss"), r.get("last_loss")) for r in recs0 if r["kind"] in ("step", "summary")]
    assert pick == [(r["kind"], r.get("loss"), r.get("last_loss")) for r in recs if r["kind"] in ("step", "summary")], pick
    assert summary["loss"] == pick[-1][1], (summary, pick)
    bad = tpe.run_ranks(2, [*flags, "--ep", "3"], module=True, timeout=120)
    for r, (rc, _, se) in enumerate(bad):
        assert rc == 2 and "--ep 3 does not divide the 2 data-parallel ranks" in se, (r, rc, se[-2000:])
    i = flags.index("--moe-experts")
    no_moe = flags[:i] + flags[i + 2 :]
    (rc, _, se), = tpe.run_ranks(1, [*no_moe, "--ep", "2", "--global-batch", "2"], module=True, timeout=60)
    assert rc == 2 and "--ep 2 needs a model with MoE layers: add --moe-experts E" in se, se[-2000:]


@pytest.mark.timeout(200)
def test_moe_tensor_parallel_flags(tmp_path) -> None:
    """``python -m worker.peer --moe-experts 4 --tp 2 --ep 2`` on 4 ranks (D=2 x T=2): trains, reports
    the layout, and its metrics file's step records carry the MoE fields (all-to-all bytes > 0: EP
    is on); ``--tp 2 --ep 2`` on 2 ranks (D=1) stops every rank at start with one message (exit 2)."""
    import json

    flags = ["--task", "gpt", "--task-opt", "dim=16", "--task-opt", "seq=16", "--task-opt", "vocab=32", "--task-opt", "heads=2",
             "--moe-experts", "4", "--global-batch", "4", "--steps", "2", "--log-every", "1", "--no-progress", "--no-eval",
             "--tp", "2"]
    res = tpe.run_ranks(4, [*flags, "--ep", "2", "--metrics-out", str(tmp_path)], module=True, timeout=150)
    for r, (rc, _, se) in enumerate(res):
        assert rc == 0, f"rank {r}: {se[-3000:]}"
    summary = json.loads(res[0][1].strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["tp"] == 2 and summary["dp"] == 2, summary
    recs = [json.loads(line) for line in (tmp_path / "rank3.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) == 2, steps
    for rec in steps:  # 2 sequences of 16 tokens, top-2, per layer and step on this replica
        assert all(abs(sum(c) - 2 * 16 * 2) < 1e-6 for c in rec["moe_tokens_per_expert"]), rec
        assert rec["a2a_mb"] > 0, rec
    assert next(r for r in recs if r["kind"] == "summary")["ep"] == 2
    msg = "--ep 2 does not divide the 1 data-parallel replicas"
    for r, (rc, _, se) in enumerate(tpe.run_ranks(2, [*flags, "--ep", "2"], module=True, timeout=90)):
        assert rc == 2 and msg in se, (r, rc, se[-2000:])


def _one_process_losses(steps: int, batch: int, **opts) -> list[float]:
    """One process: the MoE gpt task (same options, fp64) trained with its own optimizer (Adam) on the
    global batch; the loss of every step (the task's: cross-entropy + the layers' balance and z-losses)."""
    from user_models import one_process_losses  # type: ignore[import-not-found]

    from worker.tasks import load_task

    return one_process_losses(load_task("gpt", seed=0, **opts), steps, batch)


# `tessera peer --moe-experts 4` runs on 4 ranks, all in one launch (tests/multiproc/peer_layouts_child.py runs each
# through the command line's rank code): (flags, task options besides OPTS, tolerance, (dp, tp, pp, zero, ep))
OPTS = dict(dim=16, seq=16, vocab=32, layers=2, dtype="float64")
PIPELINES = [
    (["--pp", "2", "--ep", "2", "--zero", "1"], {}, 1e-10, (2, 1, 2, 1, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "2"], {}, 1e-10, (1, 2, 2, 2, 1)),
    (["--pp", "2", "--ep", "2", "--zero", "2", "--recompute", "full"], {}, 1e-10, (2, 1, 2, 2, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "3", "--recompute", "full"], {}, 1e-10, (1, 2, 2, 3, 1)),
    (["--pp", "2", "--tp", "2", "--zero", "1", "--recompute", "selective"], {}, 1e-10, (1, 2, 2, 1, 1)),
    (["--pp", "2", "--ep", "2", "--zero", "3", "--pp-split", "blocks.1"], {}, 1e-10, (2, 1, 2, 3, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "1", "--tp-plan", "auto"], {}, 1e-10, (1, 2, 2, 1, 1)),
    (["--dp", "2", "--tp", "2", "--zero", "2", "--tp-plan", "auto", "--ep", "2"], {}, 1e-10, (2, 2, 1, 2, 2)),
    (["--dp", "2", "--tp", "2", "--zero", "1", "--ep", "2", "--sequence-parallel"], {}, 1e-10, (2, 2, 1, 1, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "2", "--sequence-parallel", "--recompute", "full"], {}, 1e-10, (1, 2, 2, 2, 1)),
    (["--dp", "2", "--tp", "2", "--zero", "3", "--ep", "2", "--tp-plan", "auto", "--sequence-parallel"], {}, 1e-10, (2, 2, 1, 3, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "1", "--tp-plan", "auto", "--sequence-parallel", "--moe-capacity", "0.5"],
     {"moe_capacity": 0.5}, 1e-10, (1, 2, 2, 1, 1)),
    (["--pp", "2", "--ep", "2", "--zero", "0", "--moe-every", "2"], {"moe_every": 2}, 1e-10, (2, 1, 2, 0, 2)),
    (["--pp", "2", "--ep", "2", "--zero", "0", "--precision", "bf16", "--task-opt", "dtype=float32"], {"dtype": "float32"}, 2e-3, (2, 1, 2, 0, 2)),
    (["--pp", "2", "--tp", "2", "--zero", "0", "--precision", "bf16", "--recompute", "full", "--task-opt", "dtype=float32"], {"dtype": "float32"},
     2e-3, (1, 2, 2, 0, 1)),
]


@pytest.mark.timeout(400)
def test_moe_layouts_equal_one_process(tmp_path, proc_cluster) -> None:
    """MoE (E=4, top-2) in every layout `tessera peer` takes, one launch of 4 ranks, 3 steps each:
    pipelines with EP (each stage's experts over its DP ranks) or TP (each expert's MLP split by
    hidden), with `--recompute full|selective`, `--pp-split`, `--tp-plan auto` (the MoE layers split
    as `experts`, also without a pipeline: DP=2 x TP=2 x EP=2), `--sequence-parallel` (the built-in
    split and the auto plan, with and without a pipeline; each MoE layer gathers whole sequences, at
    capacity 0.5 too, where tokens are dropped per whole sequence), a stage without an MoE layer
    (`--moe-every 2`: block 0 has none), `--precision bf16`, the PS hybrid (HYBRID: its rows beside DP, TP, SP, PP, EP and
    ZeRO; and `--checkpoint-dir` refused), and a checkpoint across MoE layouts into one process (CHECKPOINTS). Reference: one process training the
    same model with its own optimizer (Adam) on the global batch of 8
    (``user_models.one_process_losses``): the global loss of every step (cross-entropy on the last
    stage plus each stage's balance and z-losses) within 1e-10 relative in fp64. bf16 compute (fp32
    master weights, fp32 routing): within 2e-3 (bf16 keeps 8 significant bits, a relative rounding
    of 2^-9 = 2e-3 per product, averaged over the sums; measured 2e-5), and not within 1e-6 of it
    (an exact fp32 run is, to about 1e-7: the bf16 compute ran). Rank 3's step records carry its
    stage's MoE metrics, tokens per expert counted once per step (a recomputation in backward
    routes them again, uncounted)."""
    argv = _gpt_runs(PIPELINES, tmp_path) + _checkpoint_runs(tmp_path)
    hybrid = len(PIPELINES) + len(CHECKPOINTS)
    argv += _hybrid_runs(",".join(proc_cluster(2)), tmp_path)
    res, reports = _launch(4, argv, hybrid + len(HYBRID) + 1, refused={hybrid + len(HYBRID)})
    assert "blocks.1.mlp: experts" in res[0][2], res[0][2][-3000:]  # the auto plan, printed: the MoE layers split as experts
    _check_gpt_runs(PIPELINES, reports, tmp_path, 4)
    _check_checkpoint_runs(reports, len(PIPELINES), tmp_path)
    _check_hybrid_runs(res, reports, hybrid, tmp_path)


# one checkpoint directory across MoE layouts, in the same launch: (flags, (dp, tp, pp, zero), steps it ends at); each
# run resumes from the previous one's newest checkpoint and saves after every step. Then one process loads the last one
CHECKPOINTS = [
    (["--pp", "2", "--ep", "2", "--zero", "1"], (2, 1, 2, 1), 2),  # EP=2 x PP=2 x ZeRO-1: steps 1-2
    (["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "3"], (2, 2, 1, 3), 3),  # EP=2 x DP=2 x TP=2 x ZeRO-3: step 3
    (["--pp", "2", "--tp", "2", "--zero", "2"], (1, 2, 2, 2), 4),  # TP=2 x PP=2 x ZeRO-2 (EP=1): step 4
]


def _checkpoint_runs(tmp_path) -> list[str]:
    """The child's command line of the CHECKPOINTS runs, all on tmp_path/moe-ckpt."""
    argv: list[str] = []
    base = BASE[: BASE.index("--steps")] + BASE[BASE.index("--steps") + 2 :]
    for flags, _, steps in CHECKPOINTS:
        argv += ["::", *base, *flags, "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "moe-ckpt"),
                 "--checkpoint-every", "1"]
    return argv


def _one_process(steps: int, checkpoint: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process training the MoE gpt (OPTS, E=4, fp64) with torch Adam on the global batch of 8 up to
    ``steps``, from the start or from ``checkpoint`` (its parameters, Adam's moments and step count read by
    their plain names, the data skipped to its step): the losses of the steps it ran and the parameters."""
    from worker.peer.checkpoint import CheckpointReader
    from worker.peer.mesh import torch_optimizer
    from worker.tasks import load_task

    task = load_task("gpt", seed=0, **OPTS, moe_experts=4)
    params = dict(task.model.named_parameters())
    opt = torch_optimizer(task.dense_optimizer)(params.values())
    data, start = task.batches(0, 1, 8, 0), 0
    if checkpoint is not None:
        reader = CheckpointReader(checkpoint)
        start = reader.step
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(reader.read(f"param/{n}", 0, p.numel()).view(p.shape))
                opt.state[p] = {k: reader.read(f"state/{k}/{n}", 0, p.numel()).view(p.shape) for k in ("exp_avg", "exp_avg_sq")}
                opt.state[p]["step"] = torch.tensor(reader.scalars["step"])
        for _ in range(start):
            next(data)
    losses = []
    for _ in range(steps - start):
        opt.zero_grad()
        loss = task.loss(task.model, next(data))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in params.items()}


def _check_checkpoint_runs(reports: dict[int, dict], first: int, tmp_path) -> None:
    """Each CHECKPOINTS run starts at the step the previous one saved and its losses equal one process
    trained without a break (fp64 Adam, 1e-10 relative: a run that lost Adam's moments or step count,
    or read an expert into the wrong rank, would differ from the next step on); the parameters its last
    checkpoint holds (whole, by plain name, experts of every EP rank) equal that process's after the
    same steps (rtol 1e-10, atol 1e-12; measured 4e-12 relative); and one process loading the last
    checkpoint (no process group: the plain model and torch Adam) trains one more step to the same
    loss and parameters."""
    from worker.peer.checkpoint import CheckpointReader

    last = CHECKPOINTS[-1][2]
    want, whole = _one_process(last + 1)
    start = 0
    for i, (flags, (dp, tp, pp, zero), steps) in enumerate(CHECKPOINTS):
        report = reports[first + i]
        assert (report["dp"], report["tp"], report["pp"], report["zero"], report["start_step"]) == (dp, tp, pp, zero, start), (flags, report)
        got = report["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want[start:steps]))
        assert len(got) == steps - start and rel <= 1e-10, (flags, got, want[start:steps], rel)
        print(f"checkpoint {' '.join(flags)}: steps {start + 1}-{steps} max relative loss difference {rel:.2e}")
        start = steps
    path = str(tmp_path / "moe-ckpt" / f"step-{last}")
    _, at_last = _one_process(last)
    reader = CheckpointReader(path)
    for n, p in at_last.items():
        torch.testing.assert_close(reader.read(f"param/{n}", 0, p.numel()).view(p.shape), p, rtol=1e-10, atol=1e-12, msg=n)
    loss, params = _one_process(last + 1, path)
    assert len(loss) == 1 and abs(loss[0] - want[last]) <= 1e-10 * abs(want[last]), (loss, want)
    for n, p in whole.items():
        torch.testing.assert_close(params[n], p, rtol=1e-10, atol=1e-12, msg=n)


# the PS hybrid: PSEmbedding token rows on 2 PS shards (BSP), beside the dense sync of each layout: (task, flags, (dp, tp, zero));
# each run its own tables (--task-opt name=...)
HYBRID = [
    ("rows_moe_task", ["--ep", "2"], (4, 1, 0)),  # the experts over EP=2, the rest all-reduced
    ("rows_task", ["--tp", "2", "--zero", "1"], (2, 2, 1)),
    ("rows_task", ["--tp", "2", "--sequence-parallel", "--zero", "2"], (2, 2, 2)),
    ("rows_task", ["--zero", "3", "--accumulate", "2"], (4, 1, 3)),
    ("rows_moe_task", ["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "3"], (2, 2, 3)),
    ("rows_task", ["--pp", "2", "--zero", "1"], (2, 1, 1)),  # the rows on stage 0's ranks
    ("rows_task", ["--tp", "2", "--pp", "2", "--zero", "2"], (1, 2, 2)),
    ("rows_moe_task", ["--pp", "2", "--ep", "2", "--zero", "3", "--recompute", "full"], (2, 1, 3)),
]
HYBRID_REFUSED = ["--checkpoint-dir", "/nonexistent"]
HYBRID_REFUSED_LINE = "--checkpoint-dir: hybrid mode's rows live on the PS (use its checkpoints); not supported here"


def _hybrid_runs(ps: str, tmp_path) -> list[str]:
    """The child's command line of the HYBRID runs (metrics in tmp_path/hybrid<i>) and, last, the refused one."""
    argv: list[str] = []
    base = ["--mode", "hybrid", "--ps", ps, "--sparse-mode", "sync", *BASE[BASE.index("--steps"):]]
    for i, (task, flags, _) in enumerate([*HYBRID, ("rows_task", HYBRID_REFUSED, None)]):
        argv += ["::", "--task", f"user_models:{task}", "--task-opt", f"name=h{i}", *base, *flags,
                 "--metrics-out", str(tmp_path / f"hybrid{i}")]
    return argv


def _check_hybrid_runs(res: list, reports: dict[int, dict], first: int, tmp_path) -> None:
    """Each HYBRID run: fp32 rows (the PS stores them so) and SGD on the dense part, within 1e-5 of one
    process training the same model with the rows as an nn.Embedding (Adagrad, the table's optimizer) on the
    global batch (``user_models.rows_reference``); the refused layout: one line on every rank."""
    import json

    import user_models  # type: ignore[import-not-found]

    for r, (_, _, se) in enumerate(res):
        lines = [line for line in se.splitlines() if "hybrid" in line and line.startswith("tessera peer:")]
        assert lines == [f"tessera peer: rank {r}: {HYBRID_REFUSED_LINE}"], (r, se[-3000:])
    for i, (task, flags, (dp, tp, zero)) in enumerate(HYBRID):
        report = reports[first + i]
        got, want = report["losses"], user_models.rows_reference(getattr(user_models, task), 3, 8, name=f"h{i}")  # its rows' init
        assert report["mode"] == "hybrid" and report["zero"] == zero and report.get("dp", 4) == dp and report.get("tp", 1) == tp, report
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert len(got) == 3 and rel <= 1e-5, (flags, got, want)
        print(f"hybrid {task} {' '.join(flags)}: max relative loss difference {rel:.2e}")
        if task == "rows_moe_task" and "--pp" not in flags:  # rank 3's MoE metrics: 8 / dp sequences of 8 tokens, top-2, per step
            steps = [r for r in map(json.loads, (tmp_path / f"hybrid{i}" / "rank3.jsonl").read_text().splitlines()) if r["kind"] == "step"]
            assert len(steps) == 3 and all(abs(sum(r["moe_tokens_per_expert"][0]) - 8 // dp * 8 * 2) < 1e-6 and r["a2a_mb"] > 0
                                           for r in steps), steps



# EP x TP x PP at once: 8 ranks (D=2 x T=2 x P=2), each stage's experts over its 2 DP replicas, each expert's MLP split
# over TP; one launch
EP_TP_PP = [
    (["--pp", "2", "--tp", "2", "--ep", "2", "--zero", "1", "--sequence-parallel"], {}, 1e-10, (2, 2, 2, 1, 2)),
    (["--pp", "2", "--tp", "2", "--ep", "2", "--zero", "3", "--tp-plan", "auto", "--recompute", "full", "--moe-capacity", "0.5"],
     {"moe_capacity": 0.5}, 1e-10, (2, 2, 2, 3, 2)),
]


@pytest.mark.timeout(400)
def test_moe_ep_x_tp_x_pp_on_8_ranks_equals_one_process(tmp_path) -> None:
    """EP=2 x TP=2 x PP=2 (8 ranks) with ZeRO-1 and sequence parallelism, and with ZeRO-3, the auto plan,
    full recompute and capacity 0.5 (drops): as `test_moe_layouts_equal_one_process`, the global loss of
    every step within 1e-10 of one process (fp64, Adam), and the last rank's MoE metrics."""
    _, reports = _launch(8, _gpt_runs(EP_TP_PP, tmp_path), len(EP_TP_PP))
    _check_gpt_runs(EP_TP_PP, reports, tmp_path, 8)


BASE = ["--task", "gpt", *[a for k, v in OPTS.items() for a in ("--task-opt", f"{k}={v}")], "--moe-experts", "4",
        "--steps", "3", "--global-batch", "8", "--log-every", "1", "--no-progress", "--no-eval", "--torch-threads", "1"]


def _gpt_runs(runs: list, tmp_path) -> list[str]:
    """The child's command line for ``runs`` (flags added to BASE; metrics in tmp_path/run<i>)."""
    argv: list[str] = []
    for i, (flags, _, _, _) in enumerate(runs):
        argv += (["::"] if i else []) + [*BASE, *flags, "--metrics-out", str(tmp_path / f"run{i}")]
    return argv


def _launch(world: int, argv: list[str], n: int, refused: set[int] = frozenset()) -> tuple[list, dict[int, dict]]:  # type: ignore[assignment]
    """``n`` runs on ``world`` ranks in one launch (tests/multiproc/peer_layouts_child.py): every rank's
    results, and rank 0's report of each run. Every run exits 0 but those in ``refused`` (2)."""
    import json

    res = tpe.run_ranks(world, argv, timeout=380, child=os.path.join(tpe.ROOT, "tests", "multiproc", "peer_layouts_child.py"))
    for r, (rc, so, se) in enumerate(res):
        assert rc == 0, f"rank {r}: {se[-3000:]}"
        assert all(f"RC {i} {2 if i in refused else 0}" in so for i in range(n)), f"rank {r}:\n{so}\n{se[-3000:]}"
    return res, {int(line.split(" ", 2)[1]): json.loads(line.split(" ", 2)[2]) for line in res[0][1].splitlines()
                 if line.startswith("REPORT ")}


def _check_gpt_runs(runs: list, reports: dict[int, dict], tmp_path, world: int) -> None:
    """Each run's layout and losses against one process (its tolerance; bf16: and not within 1e-6), and
    the last rank's step records (it holds block 1, an MoE layer: 8 / dp sequences x 16 tokens x top-2
    per step and layer, counted once)."""
    import json

    wants: dict[str, list[float]] = {}
    for i, (flags, extra, tol, (dp, tp, pp, zero, ep)) in enumerate(runs):
        report = reports[i]
        assert (report["dp"], report["tp"], report["pp"], report["zero"]) == (dp, tp, pp, zero), (flags, report)
        key = json.dumps(extra, sort_keys=True)
        if key not in wants:
            wants[key] = _one_process_losses(3, 8, **{**OPTS, **extra}, moe_experts=4)
        want, got = wants[key], report["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert len(got) == 3 and rel <= tol, (flags, got, want, rel)
        if tol > 1e-10:
            assert rel > 1e-6, (flags, got, want, rel)
        print(f"{' '.join(flags)}: max relative loss difference {rel:.2e}")
        for flag, name in (("--recompute", "recompute_mode"), ("--precision", "precision")):
            if flag in flags:
                assert report[name] == flags[flags.index(flag) + 1], (flags, report)
        recs = [json.loads(line) for line in (tmp_path / f"run{i}" / f"rank{world - 1}.jsonl").read_text().splitlines()]
        assert next(r for r in recs if r["kind"] == "summary")["ep"] == ep, flags
        steps = [r for r in recs if r["kind"] == "step"]
        layers = 2 if pp == 1 else 1
        assert len(steps) == 3 and all(len(r.get("moe_tokens_per_expert", [])) == layers and all(
            abs(sum(c) - 8 // dp * 16 * 2) < 1e-6 for c in r["moe_tokens_per_expert"]) for r in steps), (flags, steps)
        assert all(r["a2a_mb"] > 0 for r in steps) == (ep > 1), (flags, steps)
        if "--moe-capacity" in flags:  # tokens were dropped (per whole sequence), as in one process
            assert all(r["moe_dropped"] > 0 for r in steps), (flags, steps)
