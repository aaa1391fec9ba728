"""bench/peer.py still runs end to end (--quick) and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check; the machine is shared): only that the run
succeeds, that the last stdout line is the JSON also written to --json-out, that every figure is
there and positive, that the memory relations ZeRO promises hold at D=2 (optimizer state,
gradients, parameters per rank about half of plain DP's), that sequence parallelism at T=2 keeps
fewer activation bytes per rank than plain TP, selective recompute fewer still, as the fp32 version
of Megatron's formula counts them, and that no process is left behind.
"""
from __future__ import annotations

import pytest
from bench_run import TEST_TIMEOUT_S, run_quick

KEYS = [
    "allreduce_ratio", "dp_step_ratio", "zero1_state_ratio", "zero2_grad_ratio", "zero3_param_ratio",
    "ours_step_ms", "ddp_step_ms", "ours_tokens_per_s", "raw_4mib_busbw_gbps", "ours_16mib_busbw_gbps",
    "alltoall_ratio", "moe_step_ratio", "raw_alltoall_busbw_gbps", "moe_step_ms", "dense_step_ms",
    "bubble_measured", "bubble_theory", "bubble_theory_corrected", "bubble_theory_corrected_sends", "pipeline_stage_imbalance",
    "tp_step_ms", "tp_sp_step_ms", "tp_dp_step_ms", "tp_vs_dp_step_ratio", "sp_activation_ratio", "sp_activation_ratio_vs_t1",
    "sp_selective_activation_ratio", "sp_selective_activation_ratio_vs_t1", "sp_selective_activation_ratio_megatron",
]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_peer_bench_quick(tmp_path) -> None:
    out = tmp_path / "peer.json"
    last, stdout = run_quick("peer.py", str(out))
    for k in KEYS:
        assert k in last, k
        assert last[k] > 0, (k, last[k])
    assert last["quick"] is True and last["world"] == 2
    # ZeRO at D=2: each rank keeps half (plus the padding of each unit to an even split)
    assert last["zero1_state_ratio"] <= 0.55, last
    assert last["zero2_grad_ratio"] <= 0.55, last
    assert last["zero3_param_ratio"] <= 0.6, last
    assert last["zero2_peak_grad_ratio"] < 1.0, last  # full gradients are freed as they are reduce-scattered
    # sequence parallelism at T=2: fewer activation bytes than plain TP, half of one process's
    assert last["sp_activation_ratio"] < 0.9, last
    assert last["sp_activation_ratio_vs_t1"] <= 0.55, last
    # selective recompute on top drops the attention scores: the count follows the fp32 version of
    # Megatron's formula (4-byte values, 1-byte masks) within 2% (layer-norm statistics, the causal mask)
    assert last["sp_selective_activation_ratio"] < last["sp_activation_ratio"], last
    for fig in ("sp_activation_ratio", "sp_selective_activation_ratio", "sp_selective_activation_ratio_vs_t1"):
        assert abs(last[fig] / last[fig + "_fp32_formula"] - 1) < 0.02, (fig, last)
    assert "ours / DDP step time" in stdout and "all-reduce" in stdout and "MoE / dense step time" in stdout
    assert "TP=2 + SP" in stdout
