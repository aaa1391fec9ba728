"""The planner's formulas (worker.peer.planner) on known cases, no communication: parameter counts,
ZeRO's model-state division (ZeRO paper: 16 bytes per parameter with Adam, K = 12 in mixed precision),
pipeline in-flight micro-batches (GPipe m, 1F1B P - r), the bubble, and the choice; `tessera plan`."""
from __future__ import annotations

import pytest

from worker.peer.planner import (
    GiB,
    Hardware,
    Layout,
    ModelSpec,
    candidates,
    estimate,
    layer_params,
    rank_memory,
)

SPEC = ModelSpec(layers=8, hidden=1024, heads=16, seq=1024, batch=64, vocab=32000)


def test_parameter_count_matches_the_gpt_task() -> None:
    from worker.tasks import load_task

    task = load_task("gpt", vocab=64, seq=16, dim=32, layers=3, heads=4)
    want = sum(p.numel() for p in task.model.parameters())
    assert sum(layer_params(ModelSpec(3, 32, 4, 16, 1, 64))) == want


def test_zero_stages_divide_model_states() -> None:
    psi = sum(layer_params(SPEC))
    m0 = rank_memory(SPEC, Layout(D=4, zero=0), 0)
    assert m0["weights"] + m0["grads"] + m0["optimizer"] == pytest.approx(16 * psi)
    m1 = rank_memory(SPEC, Layout(D=4, zero=1), 0)
    assert m1["optimizer"] == pytest.approx(12 * psi / 4) and m1["grads"] == pytest.approx(2 * psi)
    m2 = rank_memory(SPEC, Layout(D=4, zero=2), 0)
    assert m2["grads"] == pytest.approx(2 * psi / 4)
    m3 = rank_memory(SPEC, Layout(D=4, zero=3), 0)
    assert m3["weights"] + m3["grads"] + m3["optimizer"] == pytest.approx(16 * psi / 4)


def test_activations_follow_the_schedule() -> None:
    g = [rank_memory(SPEC, Layout(P=2, m=8, schedule="gpipe"), r)["activations"] for r in range(2)]
    f = [rank_memory(SPEC, Layout(P=2, m=8, schedule="1f1b"), r)["activations"] for r in range(2)]
    assert g[0] == pytest.approx(f[0] * 8 / 2)  # rank 0: m in flight against P - 0 = 2
    rec = rank_memory(SPEC, Layout(P=2, m=8, recompute=True), 0)["activations"]
    assert rec < f[0] / 5
    # interleaved (V=2): rank 0 holds 2 (P - 1) + (V - 1) P + 1 = 5 chunk-micro-batches of half a stage each
    i0 = rank_memory(SPEC, Layout(P=2, m=8, schedule="interleaved", V=2), 0)["activations"]
    hw = Hardware(gpus=2, gpu_mem_gib=80)
    assert estimate(SPEC, Layout(P=2, m=8, schedule="interleaved", V=2), hw).bubble == pytest.approx(1 / 17)
    assert i0 > f[0]


def test_plan_picks_the_fastest_layout_that_fits() -> None:
    hw = Hardware(gpus=8, gpu_mem_gib=16)
    plans = candidates(SPEC, hw)
    best = plans[0]
    assert best.fits and best.total_bytes <= 16 * GiB * 0.9
    assert all(best.step_s <= p.step_s for p in plans if p.fits)
    assert estimate(SPEC, Layout(D=1, T=1, P=8, m=8), hw).bubble == pytest.approx(7 / 15)


def test_bad_model_is_refused() -> None:
    with pytest.raises(ValueError, match="not divisible by heads"):
        ModelSpec(layers=2, hidden=100, heads=3, seq=8, batch=8)


def test_tessera_plan_prints_candidates_and_a_pick(capsys: pytest.CaptureFixture[str]) -> None:
    from tessera.cli import main

    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "2048", "--batch", "512", "--gpus", "16",
            "--link-gbps", "400"]
    assert main([*args, "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    assert "6,864.6M parameters" in out and "pick: D" in out and "bubble" in out, out
    # too little memory: says so
    assert main([*args, "--gpu-mem", "1"]) == 0
    assert "no layout fits 1 GiB per GPU" in capsys.readouterr().out
    # bad input: one line, exit 2
    bad = ["plan", "--layers", "2", "--hidden", "100", "--heads", "3", "--seq", "8", "--batch", "8", "--gpus", "2", "--gpu-mem", "8"]
    assert main(bad) == 2
    assert "hidden 100 is not divisible by heads 3" in capsys.readouterr().err


def test_selective_recompute_drops_the_attention_core_output() -> None:
    """Selective recompute (the attention core again in backward): our fused core keeps no scores, so a
    block keeps its core's output less, H/T elements per token (16 H/T of 17 with SP); the step pays
    the core's forward once more, less than full recompute's whole extra forward; not both at once."""
    sp = Layout(T=2, sequence_parallel=True)
    sel = Layout(T=2, sequence_parallel=True, selective=True)
    a, b = rank_memory(SPEC, sp, 0)["activations"], rank_memory(SPEC, sel, 0)["activations"]
    assert a - b == pytest.approx(SPEC.layers * SPEC.batch * SPEC.seq * SPEC.hidden / 2 * 2)  # bf16 activations
    hw = Hardware(gpus=2, gpu_mem_gib=80)
    none, full = estimate(SPEC, sp, hw).compute_s, estimate(SPEC, Layout(T=2, sequence_parallel=True, recompute=True), hw).compute_s
    assert none < estimate(SPEC, sel, hw).compute_s < full
    assert sel.recompute_name() == "selective" and Layout(recompute=True).recompute_name() == "full"
    with pytest.raises(ValueError, match="not both"):
        Layout(recompute=True, selective=True)
