"""`tessera peer`'s composing flags through the real command line (torchrun's agent, Gloo ranks) on a
user model the tests did not write for this (tests/multiproc/user_models.py `gated_task`: plain
nn.Linear q/k/v, a gated MLP):

- `--zero N` (0-3) on every layout, as the issue's command line has it (`--tp 2 --pp 2 --zero 2`);
  `--mode zeroN` is its alias, and a `--mode`/`--zero` pair that contradicts is one line, exit 2;
- `--compress bf16|fp16` with a mesh (`--dp`/`--tp`) and with a pipeline, at ZeRO 0 and 1-3;
- `--accumulate k` with a pipeline (its k micro-batches) and `--debug-collectives` with a pipeline
  (each group's collectives checked among its own ranks: the stages' differ in size).

Reference: one process training a deep copy of the same model with torch.optim on the global
batch of 8 (`_reference`): the global loss of every step (rank 0's --metrics-out, --log-every 1).
Exact runs (fp64) within 1e-10 relative. Compressed runs within 1e-3 relative: each gradient
element is rounded once or twice to bf16 (8 significant bits, relative error <= 2^-9 = 2e-3) before
an fp32 sum, so each step's update is off by about that fraction of one learning-rate step, and a
few small steps move the loss by far less than that (measured below 1e-4); they must also differ
from the exact run (the 16-bit transport really ran).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_peer_equivalence import ROOT  # type: ignore[import-not-found]

MULTIPROC = os.path.join(ROOT, "tests", "multiproc")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, MULTIPROC]), "PYTHONWARNINGS": "ignore::FutureWarning",
       "OMP_NUM_THREADS": "1"}
BASE = ["--task", "user_models:gated_task", "--global-batch", "8", "--task-opt", "dtype=float64", "--task-opt", "opt=adamw",
        "--task-opt", "lr=0.01", "--log-every", "1", "--no-progress", "--no-eval", "--torch-threads", "1"]
STEPS = 3


def _reference(steps: int = STEPS) -> list[float]:
    """One process: the gated model in fp64, AdamW (lr 0.01), the global batch of 8, every step's loss."""
    sys.path.insert(0, MULTIPROC)
    import user_models  # type: ignore[import-not-found]

    return user_models.one_process_losses(user_models.gated_task(dtype="float64", opt="adamw", lr=0.01), steps, 8)


def _peer(ranks: int, flags: list[str], tmp_path, timeout: float = 240) -> tuple[dict, list[float]]:
    """`tessera peer` on `ranks` ranks: (rank 0's report, the global loss of every step)."""
    p = subprocess.run([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", str(ranks), *BASE, "--steps",
                        str(STEPS), "--metrics-out", str(tmp_path), *flags],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    report = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    steps = [json.loads(line) for line in open(tmp_path / "rank0.jsonl") if '"kind": "step"' in line]
    return report, [r["loss"] for r in steps]


def _close(got: list[float], want: list[float], rtol: float) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want))


@pytest.mark.timeout(300)
def test_zero_flag_on_tp2_x_pp2_equals_one_process(tmp_path) -> None:
    """The issue's line, `tessera peer --task mod:fn --tp 2 --pp 2 --zero 2` (4 ranks: ZeRO-2 over the
    DP dimension of each stage, here D=1): every step's loss equals one process within 1e-10."""
    report, got = _peer(4, ["--tp", "2", "--pp", "2", "--zero", "2"], tmp_path)
    assert report["mode"] == "zero2" and report["zero"] == 2 and (report["tp"], report["pp"]) == (2, 2), report
    want = _reference()
    assert _close(got, want, 1e-10), (got, want)


@pytest.mark.timeout(300)
def test_pipeline_takes_accumulate_as_micro_batches_and_checks_collectives_per_group(tmp_path) -> None:
    """`--pp 2 --dp 2 --zero 3 --accumulate 4 --debug-collectives` (4 ranks): the pipeline runs 4
    micro-batches, every collective is fingerprinted within its own group (the two stages' DP groups
    reduce different sizes; a world-wide check would stop the run), and every step's loss equals one
    process within 1e-10."""
    report, got = _peer(4, ["--pp", "2", "--dp", "2", "--zero", "3", "--accumulate", "4", "--debug-collectives"], tmp_path)
    assert report["micro_batches"] == 4 and report["zero"] == 3 and len(report["stages"]) == 2, report
    want = _reference()
    assert _close(got, want, 1e-10), (got, want)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout,compress", [
    (["--dp", "2", "--tp", "2"], "bf16"),  # a mesh, ZeRO 0: the reducer's all-to-all + fp32 sum + all-gather
    (["--dp", "2", "--pp", "2", "--zero", "1"], "fp16"),  # a pipeline, ZeRO-1: the 16-bit reduce-scatter
])
def test_compressed_gradients_with_a_mesh_and_a_pipeline_stay_close_to_one_process(layout: list[str], compress: str,
                                                                                  tmp_path) -> None:
    """16-bit gradients on the wire, fp32 sums: within 1e-3 of one process (why: the module's
    docstring), and not equal to it (the compression ran)."""
    report, got = _peer(4, [*layout, "--compress", compress], tmp_path)
    want = _reference()
    assert _close(got, want, 1e-3), (got, want)
    assert not _close(got, want, 1e-13), (got, want)


def _refused(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=110)


@pytest.mark.timeout(120)
def test_mode_and_zero_that_contradict_are_one_line_exit_2() -> None:
    """`tessera peer` refuses before starting a rank: one line, exit 2; under a torchrun you start
    yourself every rank says it once (each exits 2)."""
    for flags, message in [
        (["--mode", "zero1", "--zero", "3"], "--mode zero1 (ZeRO stage 1) and --zero 3 contradict: give --zero 3 alone"),
        (["--mode", "zero2", "--zero", "1"], "--mode zero2 (ZeRO stage 2) and --zero 1 contradict: give --zero 1 alone"),
    ]:
        p = _refused(["tessera.cli", "peer", "--nproc-per-node", "2", *BASE, "--steps", "1", *flags])
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"tessera peer: error: {message}"), p.stderr[-3000:]
    p = _refused(["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "worker.peer", *BASE, "--steps", "1",
                  "--mode", "zero1", "--zero", "3"])
    assert p.returncode != 0, p.stderr[-3000:]  # torchrun's own report follows the ranks' lines
    for r in range(2):
        lines = [line for line in p.stderr.splitlines() if f"tessera peer: rank {r}: " in line]
        assert len(lines) == 1 and "--mode zero1 (ZeRO stage 1) and --zero 3 contradict" in lines[0], (r, p.stderr[-3000:])
