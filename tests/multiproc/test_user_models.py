"""Peer mode on user models the project did not know (tests/multiproc/user_models.py): a pre-norm
transformer written with nn.MultiheadAttention and nn.TransformerEncoderLayer, and a causal LM with
plain nn.Linear q/k/v and a gated MLP, split by ``worker.peer.parallelize(plan="auto")`` and, with
pipeline stages, cut by ``worker.peer.split.pipeline_layers``.

Each launch starts one rank process per rank running tests/multiproc/user_child.py over several
layouts. Reference: one process training a deep copy of the same source model with torch.optim on
the global batch: losses at every step and parameters after every step within 1e-10 relative (fp64,
SGD and AdamW) and 1e-5 (fp32, SGD); the auto plan ends at the same parameters as the explicit plan;
the source model is unchanged by training its split copy; with T > 1 sequence parallelism (the auto
plan's blocks and final norm on a chunk of the sequence) matches the same reference (fp64 AdamW); and
TPMultiheadAttention equals nn.MultiheadAttention on a sequence-first nn.TransformerDecoderLayer (masks,
cross-attention) and with other key/value widths returning per-head and averaged weights.
"""
from __future__ import annotations

import os

import pytest
from test_tensor_parallel import run_mesh  # type: ignore[import-not-found]
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

CHILD = os.path.join(ROOT, "tests", "multiproc", "user_child.py")
CONFIGS = ["float64 sgd", "float64 adamw", "float32 sgd"]


def _launch(world: int, layouts: list[str]) -> None:
    # run_mesh starts world = D x T x P ranks and passes "D T P" before the checks (user_child skips them)
    results = run_mesh(world, 1, 1, layouts, child=CHILD, timeout=300.0)
    failed = [(r, rc, so, se) for r, (rc, so, se) in enumerate(results) if rc != 0]
    assert not failed, "\n".join(f"rank {r} failed (rc {rc}):\n{so[-1500:]}\n{se[-3000:]}" for r, rc, so, se in failed)
    for r, (_, so, se) in enumerate(results):
        for layout in layouts:
            d, t, p = (int(x) for x in layout.split(","))
            if t > 1 and p == 1:  # TPMultiheadAttention's other paths against nn.MultiheadAttention
                for case in ("decoder", "weights"):
                    assert f"OK {layout} attention-{case}" in so, f"rank {r}: {layout} attention-{case} not OK:\n{se[-2000:]}"
            for model in ("mha", "gated"):
                for c in CONFIGS:
                    assert f"OK {layout} {model} {c}" in so, f"rank {r}: {layout} {model} {c} not OK:\n{so}\n{se[-2000:]}"
                if t > 1:
                    assert f"OK {layout} {model} sequence-parallel" in so
                if t > 1 and p == 1:
                    assert f"OK {layout} {model} auto-vs-explicit" in so


# the layouts of one world size share one launch: each rank builds a fresh mesh per layout (the
# checks of one layout do not depend on another's), and the ranks start (torch, the group) once
@pytest.mark.timeout(400)
def test_tp2_and_pp2_match_one_process() -> None:
    _launch(2, ["1,2,1", "1,1,2"])


@pytest.mark.timeout(400)
def test_tp2_x_pp2_and_dp2_x_tp2_match_one_process() -> None:
    _launch(4, ["1,2,2", "2,2,1"])


BAD = {
    "plan names no module": (2, ["--tp", "2", "--tp-plan", '{"blocks.*.attn.nope": "colwise"}'],
                             "tensor-parallel plan: 'blocks.*.attn.nope' names no module of the model"),
    "heads not divisible": (2, ["--tp", "2", "--tp-plan", '{"blocks.*.attn.q": "colwise"}', "--task-opt", "heads=3",
                                "--task-opt", "dim=18"], "blocks.0.attn.n_heads = 3 heads not divisible by tp 2"),
    "split after the last layer": (2, ["--pp", "2", "--pp-split", "blocks.9"],
                                   "pipeline split point 'blocks.9': not a module the model's forward calls at the top level"),
    "world not the layout's product": (3, ["--tp", "2"], "world size 3 is not divisible by tp 2 x pp 1"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_on_every_rank_exit_2(case: str) -> None:
    """Through `tessera peer` (torchrun): every rank prints one line naming the module or number, exit 2."""
    import subprocess
    import sys

    world, flags, message = BAD[case]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "multiproc")]),
           "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", str(world), "--task",
                        "user_models:gated_task", "--steps", "1", "--global-batch", "12", "--no-progress", *flags],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for r in range(world):
        # "in", not startswith: the ranks share one stderr, and a C++ warning (written by std::cerr a
        # piece at a time) can leave a fragment on the line another rank's message then follows
        lines = [line for line in p.stderr.splitlines() if f"tessera peer: rank {r}: " in line]
        assert len(lines) == 1 and message in lines[0], (r, p.stderr[-3000:])


@pytest.mark.timeout(200)
def test_gpt_split_by_the_auto_plan_equals_its_built_in_split() -> None:
    """The built-in gpt task as a user of parallelize: `--tp 2 --tp-plan auto` (qkv colwise:3, proj
    rowwise, fc/out, vocab embedding and head: printed) reports the same loss after 3 fp64 steps as
    `--tp 2` with its built-in TensorParallelGPT (both equal one process: test_tensor_parallel.py)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    losses = []
    for extra in ([], ["--tp-plan", "auto"]):
        p = subprocess.run([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", "--task", "gpt", "--tp", "2",
                            "--steps", "3", "--global-batch", "8", "--task-opt", "dtype=float64", "--task-opt", "seq=16",
                            "--task-opt", "vocab=64", "--no-progress", "--no-eval", *extra],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=190)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        losses.append(json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])["loss"])
        if extra:
            assert "blocks.1.qkv: colwise:3" in p.stderr and "head: vocab" in p.stderr, p.stderr[-2000:]
    assert abs(losses[0] - losses[1]) <= 1e-10 * abs(losses[0]), losses


def _reference_losses(steps: int) -> list[float]:
    """One process: the gated user model in fp64, AdamW, the global batch of 8."""
    import user_models  # type: ignore[import-not-found]

    return user_models.one_process_losses(user_models.gated_task(dtype="float64", opt="adamw", lr=0.01), steps, 8)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
def test_cli_dp2_x_tp2_with_zero_equals_one_process(mode: str, tmp_path) -> None:
    """`tessera peer --task user_models:gated_task --tp 2 --mode zeroK` on 4 ranks (DP=2 x TP=2, the
    sync side's ZeRO over the DP dimension of the parallelize()d model): the global loss of every step
    (--metrics-out, --log-every 1) equals one process within 1e-10 (fp64, AdamW)."""
    import json
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tests", "multiproc"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "multiproc")]),
           "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "4", "--task", "user_models:gated_task",
                        "--tp", "2", "--mode", mode, "--steps", "3", "--global-batch", "8", "--task-opt", "dtype=float64",
                        "--task-opt", "opt=adamw", "--task-opt", "lr=0.01", "--log-every", "1", "--no-progress", "--no-eval",
                        "--metrics-out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    steps = [json.loads(line) for line in open(tmp_path / "rank0.jsonl") if '"kind": "step"' in line]
    got = [r["loss"] for r in steps]
    want = _reference_losses(3)
    assert len(got) == 3 and all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(got, want)), (got, want)
