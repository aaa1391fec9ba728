"""Overhead of the tensor- and pipeline-parallel code paths at T = P = 1 against plain torch.

Issue 12 asks that a ``gpt`` step run through the TP and PP code paths on one GPU cost at most 5%
more than the same model in plain torch. One process, a process group of size 1 (Gloo on CPU,
NCCL on CUDA), three ways to train the same model from the same initial weights and batches:

* ``plain``: the ``gpt`` task's ``GPT`` module, its loss, ``torch.optim.Adam`` (fused on CUDA).
* ``tp``: ``TensorParallelGPT`` over the size-1 group (column/row-parallel linears, vocab-parallel
  embedding and cross-entropy, their autograd functions and the group calls that become no-ops).
* ``pp``: ``PipelineEngine`` with one stage and one micro-batch (the 1F1B executor, the stage
  wrapper, the loss broadcast), the same Adam.

Rounds alternate the three (``--rounds`` of ``--steps`` timed steps after warm-up); step time
min and median; tokens/s and MFU (``6 N + 12 L H S`` FLOPs per token, the task's own count, over
``--peak-tflops``: default 989 for an H200's dense bf16, 0 on CPU = not reported). The losses of
the three after the same steps are printed too: the paths compute the same function, so a
diverging loss means the comparison is not like for like.

Output: a table, then one line of JSON: ``tp_overhead`` and ``pp_overhead`` (median step time
over plain's, minus 1), ``tokens_per_s_*``, ``mfu_*``, ``loss_*``.

Run::

    python bench/tp_overhead.py --quick                      # CPU smoke, seconds
    python bench/tp_overhead.py --device cuda --precision bf16  # the GPU figure (defaults sized for an H200)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _adam(params: Any, dev: torch.device, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, fused=dev.type == "cuda")


def build(args: argparse.Namespace, dev: torch.device) -> tuple[dict[str, Callable[[torch.Tensor], float]], Any]:
    """The three step functions over copies of one initial model, and the task."""
    from worker.peer.pipeline import PipelineEngine, gpt_layers
    from worker.peer.tensor_parallel import TensorParallelGPT
    from worker.tasks import load_task

    task = load_task("gpt", seed=0, vocab=args.vocab, seq=args.seq, dim=args.dim, layers=args.layers, heads=args.heads)
    autocast: Any = (lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16)) if args.precision == "bf16" else None

    def ctx() -> Any:
        import contextlib

        return autocast() if autocast is not None else contextlib.nullcontext()

    plain = copy.deepcopy(task.model).to(dev)
    opt_plain = _adam(plain.parameters(), dev, args.lr)

    def step_plain(batch: torch.Tensor) -> float:
        opt_plain.zero_grad(set_to_none=False)
        with ctx():
            loss = task.loss(plain, batch)
        loss.backward()
        opt_plain.step()
        return float(loss.detach())

    tp = TensorParallelGPT(copy.deepcopy(task.model), dist.group.WORLD).to(dev)
    opt_tp = _adam(tp.parameters(), dev, args.lr)

    def step_tp(batch: torch.Tensor) -> float:
        opt_tp.zero_grad(set_to_none=False)
        with ctx():
            loss = tp.loss(batch)
        loss.backward()
        opt_tp.step()
        return float(loss.detach())

    eng = PipelineEngine(gpt_layers(copy.deepcopy(task.model)), pp_ranks=[0], micro_batches=1, device=dev,
                         precision=args.precision)
    opt_pp = _adam(eng.parameters(), dev, args.lr)
    shape = (args.batch, args.seq, args.dim)

    def step_pp(batch: torch.Tensor) -> float:
        eng.zero_grad()
        loss = eng.step([batch[:, :-1]], [batch[:, 1:]], shape)
        opt_pp.step()
        return float(loss)

    return {"plain": step_plain, "tp": step_tp, "pp": step_pp}, task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (CPU smoke)")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: 989 on cuda, none on cpu)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    big = cuda and not args.quick
    for k, small, large in (("dim", 64, 1024), ("layers", 2, 8), ("heads", 4, 16), ("seq", 64, 1024), ("vocab", 256, 32768),
                            ("batch", 8, 8), ("steps", 3, 20), ("rounds", 2, 5)):
        if getattr(args, k) is None:
            setattr(args, k, large if big else small)
    if args.peak_tflops is None:
        args.peak_tflops = 989.0 if cuda else 0.0
    if not cuda:
        torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        steps, task = build(args, dev)
        batches = task.batches(0, 1, args.batch, 0)
        data = [next(batches).to(dev) for _ in range(args.steps)]
        times: dict[str, list[float]] = {k: [] for k in steps}
        losses: dict[str, float] = {}
        for name, fn in steps.items():  # warm-up: allocator, kernels, fused Adam's state
            fn(data[0])
        for _ in range(args.rounds):
            for name, fn in steps.items():
                for b in data:
                    _sync(dev)
                    t0 = time.perf_counter()
                    losses[name] = fn(b)
                    _sync(dev)
                    times[name].append(time.perf_counter() - t0)
        tokens = args.batch * args.seq
        flops_tok = float(task.info["flops_per_token"])
        out: dict[str, Any] = {"device": str(dev), "precision": args.precision, "dim": args.dim, "layers": args.layers,
                               "seq": args.seq, "batch": args.batch, "vocab": args.vocab, "peak_tflops": args.peak_tflops}
        med_plain = statistics.median(times["plain"])
        print(f"{'path':<8}{'ms min':>10}{'ms med':>10}{'tokens/s':>12}{'MFU':>8}{'x plain':>9}{'loss':>10}")
        for name, ts in times.items():
            med = statistics.median(ts)
            tps = tokens / med
            mfu = flops_tok * tps / (args.peak_tflops * 1e12) if args.peak_tflops else None
            print(f"{name:<8}{min(ts) * 1e3:>10.2f}{med * 1e3:>10.2f}{tps:>12.0f}{(mfu or 0):>8.3f}{med / med_plain:>9.3f}"
                  f"{losses[name]:>10.4f}")
            out.update({f"ms_min_{name}": round(min(ts) * 1e3, 3), f"ms_med_{name}": round(med * 1e3, 3),
                        f"tokens_per_s_{name}": round(tps, 1), f"loss_{name}": losses[name]})
            if mfu is not None:
                out[f"mfu_{name}"] = round(mfu, 4)
        out["tp_overhead"] = round(statistics.median(times["tp"]) / med_plain - 1, 4)
        out["pp_overhead"] = round(statistics.median(times["pp"]) / med_plain - 1, 4)
        line = json.dumps(out)
        print(line)
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(line + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
