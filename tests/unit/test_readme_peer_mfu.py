"""README (Peer mode): rank 0 reports `mfu`, "model FLOPs utilisation: 6 x non-embedding parameters
+ 12 x layers x dim x seq FLOPs per token, against --peak-tflops, a table of known GPUs, or on CPU a
matmul measured at start" (helper Y's README audit, /work/notes/Y-audit.md)."""
from __future__ import annotations

import torch

from worker.peer.cli import peak_tflops
from worker.tasks import load_task


def test_gpt_flops_per_token_is_the_readme_formula() -> None:
    layers, dim, seq = 3, 32, 16
    task = load_task("gpt", vocab=64, seq=seq, dim=dim, layers=layers, heads=4)
    non_embedding = sum(p.numel() for n, p in task.model.named_parameters() if n not in ("tok.weight", "pos.weight"))
    assert non_embedding < sum(p.numel() for p in task.model.parameters())  # the embeddings were left out
    assert task.info["flops_per_token"] == 6 * non_embedding + 12 * layers * dim * seq


def test_peak_tflops_given_wins_else_measured_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, torch.float32, 123.0) == (123.0, "--peak-tflops")
    peak, source = peak_tflops(cpu, torch.float32)
    assert source == "measured 512x512 matmul" and 0 < peak < 1000, (peak, source)
