"""The parallelism planner: which (D, T, P, ZeRO stage, micro-batches, recompute) to run a gpt model with.

``tessera plan --layers L --hidden H --heads A --seq S --batch B --gpus N --gpu-mem GiB`` lists the
candidate layouts with their memory per GPU, communication time and pipeline bubble per step,
and picks one. Everything is computed from formulas (no GPU needed):

Parameters (the ``gpt`` task's model): a block has 12 H^2 + 13 H (qkv, projection, 4x MLP, two
layer norms); embeddings V H + S H; the untied head V H; the final norm 2 H. With tensor
parallelism (T) the block's matrices and the vocabulary are split T ways (Megatron: column- then
row-parallel, biases of row-parallel layers and layer norms replicated). Pipeline stages split
the layer list [embeddings, blocks..., norm + head] by parameter count, exactly as
``worker.peer.pipeline.partition`` does; a GPU's figures are those of its heaviest stage.

Model states per parameter (ZeRO paper, Adam, K = 12 for mixed precision): bf16 compute keeps
2 bytes of weights + 2 of gradients + 12 of fp32 master weights and moments; fp32 training keeps
4 + 4 + 8. ZeRO-1 divides the optimizer part by D, ZeRO-2 also the gradients, ZeRO-3 also the
weights.

Activations per layer and token (Megatron, "Reducing Activation Recomputation in Large
Transformer Models", Korthikanti et al. 2022: 34 s b h + 5 a s^2 b bytes per layer in 16-bit, with
dropout): our blocks have no dropout (-2 s b h bytes of masks) and use fused attention
(``scaled_dot_product_attention`` keeps its output and the log-sum-exp, not the a s^2 score
matrix: +2 s b h for the output, -5 a s^2 b), so 17 H elements per token: 4 H replicated
(the two layer norms' inputs and the inputs of qkv and of the MLP) and 13 H split by T (q, k, v,
the attention output and its projection's input, the MLP's 4H and GELU's 4H); with sequence
parallelism all 17 H are split. With full recompute (``--recompute``: checkpointing per layer) a
layer keeps only its input (H) and one layer's activations live again during its backward. With
selective recompute (``--recompute selective``: the attention core, q k^T, softmax, dropout and
the product with v, runs again in backward; Megatron's accounting gives 34 s b h / t bytes per
layer with sequence parallelism: its a s^2 b score term gone) our fused core keeps no scores
anyway, so a block keeps 16 H / T elements per token with SP (4 H + 12 H / T without): the core's
output is dropped, its input (q, k, v) kept; the step pays the core's forward once more
(4 S H FLOPs per token and layer). With attention dropout the TP model's core is unfused and
keeps the scores; bench/peer.py measures that case against Megatron's formula. The
last stage adds the final norm's input and output (2 H) and the fp32 log-softmax of the logits
(V / T, 4 bytes) per token. Micro-batches in flight per stage come from simulating the schedule
(``worker.peer.pipeline.simulate``): m for GPipe, P - r on rank r for 1F1B. Transients, at
different moments of a step (so the largest one counts): a block's backward workspace (8 H per
token of one micro-batch: the gradients of the MLP's output and of GELU's input), plus one
block's activations when recomputed; the backward's fp32 logit and log-softmax gradients
(2 V / T per token); a data-parallel all-reduce bucket (25 MiB, or all the gradients if fewer).
Checked against torch's allocator on CPU (tests/multiproc/test_planner_memory.py: within 15%,
a few percent in practice).

Time per step: compute 6 N_params + 12 L H S FLOPs per token (x 4/3 with recompute: one forward
more) at ``--tflops`` per GPU, stretched by the bubble (P-1)/(m+P-1) (interleaved: (P-1)/(V m+P-1));
data-parallel ring all-reduce 2 (D-1)/D x gradient bytes (ZeRO-3: 3 (D-1)/D, its extra all-gather
of the weights); tensor parallel all-reduces 2 (T-1)/T x (b s h) activations, 4 per layer and
micro-batch (6 with recompute); pipeline point-to-point of one activation and one gradient per
micro-batch per stage boundary. NVLink for TP (and DP / PP while their groups stay inside a
node of ``--gpus-per-node``), the network link otherwise; communication is not assumed to
overlap compute (an upper bound).

Choice: among the layouts that fit ``--gpu-mem`` (with 10% headroom for the allocator and
workspace), the smallest estimated step time; ties go to less memory. ``--measure`` then runs the
best ``--measure-top`` candidates that ``tessera peer`` can run (no tensor parallelism yet; ZeRO
without pipelines or recompute) with ``--gpus`` ranks on this machine for ``--measure-steps``
steps each, and picks the fastest measured.
"""
from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Hardware", "Layout", "ModelSpec", "Plan", "add_plan_command", "candidates", "estimate", "plan_table", "rank_memory"]

GiB = 2**30
BUCKET_BYTES = 25 * 2**20
HEADROOM = 0.9


@dataclass(frozen=True)
class ModelSpec:
    """A gpt model and its global batch (sequences per step)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int = 50304

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")


@dataclass(frozen=True)
class Hardware:
    """The GPUs: count, memory each, nodes of ``gpus_per_node``, bandwidths, achievable TFLOP/s."""

    gpus: int
    gpu_mem_gib: float
    link_gbps: float = 100.0  # between nodes, Gbit/s
    nvlink_gbps: float = 3600.0  # inside a node, Gbit/s
    gpus_per_node: int = 8
    tflops: float = 400.0
    precision: str = "bf16"  # bf16 (mixed: fp32 master weights) or fp32

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpu_mem_gib <= 0 or self.gpus_per_node < 1:
            raise ValueError("gpus, gpu memory and gpus per node must be positive")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r}")


@dataclass(frozen=True)
class Layout:
    """One candidate: D x T x P ranks, ZeRO stage, m micro-batches per step, recompute, schedule."""

    D: int = 1
    T: int = 1
    P: int = 1
    zero: int = 0
    m: int = 1
    recompute: bool = False
    schedule: str = "1f1b"
    V: int = 1
    sequence_parallel: bool = False
    selective: bool = False  # selective recompute: only the attention core (not with full recompute)

    def __post_init__(self) -> None:
        if self.recompute and self.selective:
            raise ValueError("recompute: full (per layer) or selective (the attention core), not both")

    def recompute_name(self) -> str:
        """``full``, ``selective`` or ``none``: the value of ``tessera peer --recompute``."""
        return "full" if self.recompute else "selective" if self.selective else "none"

    def name(self) -> str:
        return f"D{self.D} T{self.T} P{self.P}" + (f" V{self.V}" if self.V > 1 else "") + (" SP" if self.sequence_parallel else "")


@dataclass
class Plan:
    """One layout's estimate: memory per GPU (the heaviest rank), times per step, bubble."""

    layout: Layout
    memory: dict[str, float]
    total_bytes: float
    compute_s: float
    comm_s: dict[str, float]
    bubble: float
    step_s: float
    fits: bool
    notes: list[str] = field(default_factory=list)


def layer_params(spec: ModelSpec, T: int = 1) -> list[float]:
    """Parameters per TP rank of each layer of [embeddings, blocks..., final norm + head]."""
    H, V, S = spec.hidden, spec.vocab, spec.seq
    block = (3 * H * H + 3 * H) / T + H * H / T + H + (4 * H * H + 4 * H) / T + 4 * H * H / T + H + 4 * H
    return [V * H / T + S * H] + [block] * spec.layers + [2 * H + V * H / T]


def _stages(spec: ModelSpec, lay: Layout) -> list[tuple[int, int]]:
    from worker.peer.pipeline import partition

    return partition(layer_params(spec, lay.T), lay.P * lay.V)


def _in_flight(lay: Layout) -> list[int]:
    """Micro-batches whose activations a pipeline rank holds at once (the schedule simulated)."""
    if lay.P == 1:
        return [1]
    return list(_peak_in_flight(lay.schedule, lay.P, lay.m, lay.V))


@functools.cache
def _peak_in_flight(kind: str, P: int, m: int, V: int) -> tuple[int, ...]:
    from worker.peer.pipeline import schedule, simulate

    return tuple(simulate(schedule(kind, P, m, V), m, V)["peak_in_flight"])


def rank_memory(spec: ModelSpec, lay: Layout, pp_rank: int, precision: str = "bf16", in_flight: int | None = None) -> dict[str, float]:
    """Bytes on one GPU of pipeline rank ``pp_rank``: weights, gradients, optimizer state,
    activations (the micro-batches in flight), transient (logit gradients, one DP bucket, one
    recomputed layer)."""
    H, S, T = spec.hidden, spec.seq, lay.T
    per_layer = layer_params(spec, T)
    bounds = _stages(spec, lay)
    mine = [bounds[s] for s in range(pp_rank, lay.P * lay.V, lay.P)]
    psi = sum(sum(per_layer[lo:hi]) for lo, hi in mine)
    w, g, o = (2, 2, 12) if precision == "bf16" else (4, 4, 8)
    act_b = 2 if precision == "bf16" else 4
    D = lay.D
    weights = psi * w / (D if lay.zero >= 3 else 1)
    grads = psi * g / (D if lay.zero >= 2 else 1)
    state = psi * o / (D if lay.zero >= 1 else 1)
    b = spec.batch / (D * lay.m)  # sequences per micro-batch
    tokens = b * S
    n_layers = spec.layers + 2
    full = (17 * H / T) if lay.sequence_parallel else (4 * H + 13 * H / T)  # elements per token per block
    if lay.selective:  # the attention core's output is recomputed (its input q, k, v is kept)
        full -= H / T
    act_chunk = 0.0  # bytes of one micro-batch's saved activations, summed over this rank's chunks
    # transients, at different moments of the step (the largest counts): the backward's workspace
    # (a block's 4H gradients of the MLP output and of GELU's input at once), a recomputed block's
    # activations, the fp32 logit and log-softmax gradients, one data-parallel bucket
    transient = [0.0]
    for lo, hi in mine:
        for i in range(lo, hi):
            if 1 <= i <= spec.layers:
                act_chunk += tokens * (H if lay.recompute else full) * act_b
                work = tokens * 8 * H / (1 if lay.sequence_parallel else T) * act_b
                transient.append(work + (tokens * full * act_b if lay.recompute else 0.0))
            elif i == n_layers - 1:  # final norm + head: norm in/out, fp32 log-softmax of the logits
                head = tokens * (2 * H * act_b + spec.vocab / T * 4)
                act_chunk += tokens * H * act_b if lay.recompute else head
                transient.append(tokens * 2 * spec.vocab / T * 4 + (head if lay.recompute else 0.0))
    flights = in_flight if in_flight is not None else _in_flight(lay)[pp_rank]
    acts = act_chunk / lay.V * flights
    if D > 1:
        transient.append(min(BUCKET_BYTES, psi * g))
    transient_bytes = max(transient)
    return {"weights": weights, "grads": grads, "optimizer": state, "activations": acts, "transient": transient_bytes}


def estimate(spec: ModelSpec, lay: Layout, hw: Hardware) -> Plan:
    """The memory (heaviest rank), time per step and bubble of ``lay``."""
    flights = _in_flight(lay)
    mems = [rank_memory(spec, lay, r, hw.precision, flights[r]) for r in range(lay.P)]
    worst = max(mems, key=lambda d: sum(d.values()))
    total = sum(worst.values())
    H, S, L = spec.hidden, spec.seq, spec.layers
    nonembed = L * (12 * H * H + 13 * H) + 2 * H + spec.vocab * H
    tokens = spec.batch * S
    flops = tokens * (6 * nonembed + 12 * L * H * S) * (4 / 3 if lay.recompute else 1)
    if lay.selective:  # the attention core's forward once more: q k^T and the product with v
        flops += tokens * 4 * L * H * S
    compute = flops / (hw.gpus * hw.tflops * 1e12)
    from worker.peer.pipeline import bubble_theory

    bubble = bubble_theory(lay.P, lay.m, lay.V) if lay.P > 1 else 0.0
    compute_b = compute / (1 - bubble)
    act_b = 2 if hw.precision == "bf16" else 4
    g_b = 2 if hw.precision == "bf16" else 4
    psi = max(sum(layer_params(spec, lay.T)[lo:hi]) for lo, hi in _stages(spec, lay))
    nv, link = hw.nvlink_gbps * 1e9 / 8, hw.link_gbps * 1e9 / 8
    dp_bw = nv if lay.T * lay.D <= hw.gpus_per_node else link
    pp_bw = nv if lay.D * lay.T * lay.P <= hw.gpus_per_node else link
    comm: dict[str, float] = {}
    if lay.D > 1:
        factor = (3 if lay.zero >= 3 else 2) * (lay.D - 1) / lay.D
        comm["dp"] = factor * psi * lay.V * g_b / dp_bw
    b = spec.batch / (lay.D * lay.m)
    if lay.T > 1:
        per = 2 * (lay.T - 1) / lay.T * b * S * H * act_b / nv
        comm["tp"] = per * (6 if lay.recompute else 4) * math.ceil(L / lay.P) * lay.m
    if lay.P > 1:
        comm["pp"] = 2 * lay.m * b * S * H / lay.T * act_b / pp_bw * (2 if lay.V > 1 else 1)
    step = compute_b + sum(comm.values())
    return Plan(lay, worst, total, compute, comm, bubble, step, total <= hw.gpu_mem_gib * GiB * HEADROOM)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(spec: ModelSpec, hw: Hardware) -> Iterator[Layout]:
    """Every valid candidate layout for ``hw.gpus`` GPUs."""
    for T in _divisors(hw.gpus):
        if T > hw.gpus_per_node or spec.heads % T or spec.hidden % T:
            continue
        for P in _divisors(hw.gpus // T):
            D = hw.gpus // (T * P)
            if P > spec.layers + 2 or spec.batch % D:
                continue
            per_dp = spec.batch // D
            ms = [m for m in _divisors(per_dp) if (m >= P or P == 1) and m <= 64]
            if P == 1:
                ms = [m for m in ms if m in (1, 2, 4, 8)]
            for m in ms:
                for zero in (0, 1, 2, 3) if D > 1 else (0,):
                    if P > 1 and zero >= 2:
                        continue  # ZeRO-2/3 shard gradients per micro-batch: not with pipelines (as DeepSpeed)
                    for recompute, selective in ((False, False), (True, False), (False, True)):
                        yield Layout(D=D, T=T, P=P, zero=zero, m=m, recompute=recompute, selective=selective)
                        if P > 1 and m % P == 0 and spec.layers + 2 >= 2 * P:  # interleaved, 2 chunks per rank
                            yield Layout(D=D, T=T, P=P, zero=zero, m=m, recompute=recompute, selective=selective,
                                         schedule="interleaved", V=2)


def candidates(spec: ModelSpec, hw: Hardware) -> list[Plan]:
    """Every layout's estimate, best first: fitting ones by step time (then memory), then the rest by memory."""
    plans = [estimate(spec, lay, hw) for lay in layouts(spec, hw)]
    return sorted(plans, key=lambda p: (not p.fits, p.step_s if p.fits else p.total_bytes, p.total_bytes))


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 1 else f"{ms:.3g}"


def _fmt_bytes(b: float) -> str:
    return f"{b / GiB:.2f}" if b >= 0.01 * GiB else f"{b / 2**20:.1f}M"


def plan_table(plans: list[Plan], hw: Hardware, top: int = 12) -> str:
    """The candidates as a table (GiB per GPU, ms per step) and a few lines on the choice."""
    lines = [
        (f"{'':2}{'layout':<12}{'zero':>5}{'m':>4}{'recompute':>10}{'weights':>9}{'grads':>8}{'optim':>8}{'activ':>8}"
         f"{'transient':>10}{'total':>8}{'bubble':>8}{'comm ms':>9}{'step ms':>9}  fits"),
    ]
    for i, p in enumerate(plans[:top]):
        lay, mm = p.layout, p.memory
        lines.append(
            f"{'*' if i == 0 and p.fits else ' ':2}{lay.name():<12}{lay.zero:>5}{lay.m:>4}{lay.recompute_name():>10}"
            f"{_fmt_bytes(mm['weights']):>9}{_fmt_bytes(mm['grads']):>8}{_fmt_bytes(mm['optimizer']):>8}{_fmt_bytes(mm['activations']):>8}"
            f"{_fmt_bytes(mm['transient']):>10}{_fmt_bytes(p.total_bytes):>8}{p.bubble:>8.3f}{_ms(sum(p.comm_s.values())):>9}"
            f"{_ms(p.step_s):>9}  {'yes' if p.fits else 'NO'}"
        )
    lines.append("(GiB per GPU, the heaviest rank; M: MiB)")
    lines += explain(plans, hw)
    return "\n".join(lines)


def explain(plans: list[Plan], hw: Hardware) -> list[str]:
    """Why the first plan was picked (or why none fits)."""
    fit = [p for p in plans if p.fits]
    cap = hw.gpu_mem_gib * HEADROOM
    if not fit:
        least = min(plans, key=lambda p: p.total_bytes) if plans else None
        more = f"; the smallest needs {least.total_bytes / GiB:.2f} GiB ({least.layout.name()}, ZeRO-{least.layout.zero}, recompute)" if least else ""
        return [f"no layout fits {hw.gpu_mem_gib:g} GiB per GPU ({cap:.1f} GiB usable){more}: more GPUs, or a smaller batch"]
    best = fit[0]
    lay = best.layout
    why = [
        f"pick: {lay.name()}, ZeRO-{lay.zero}, {lay.m} micro-batches, recompute {lay.recompute_name()}"
        + (f", schedule {lay.schedule}" if lay.P > 1 else ""),
        f"  fits: {_fmt_bytes(best.total_bytes)} of {cap:.1f} GiB usable per GPU; estimated step {_ms(best.step_s)} ms "
        f"(compute {_ms(best.compute_s)} ms, bubble {best.bubble:.1%}, communication "
        + (", ".join(f"{k} {_ms(v)} ms" for k, v in best.comm_s.items()) or "none") + ")",
    ]
    no_fit = [p for p in plans if not p.fits]
    if no_fit:
        why.append(f"  {len(no_fit)} of {len(plans)} layouts do not fit in memory")
    others = [p for p in fit[1:] if p.layout.D != lay.D or p.layout.T != lay.T or p.layout.P != lay.P]
    if others:
        nxt = others[0]
        why.append(f"  next other mesh: {nxt.layout.name()} (ZeRO-{nxt.layout.zero}, m {nxt.layout.m}), "
                   f"{(nxt.step_s / best.step_s - 1):.0%} slower")
    return why


# ---------------------------------------------------------------- command line


def add_plan_command(sub: Any) -> None:
    """``tessera plan``."""
    p = sub.add_parser("plan", help="parallelism planner: candidate (D, T, P, ZeRO, micro-batches, recompute) layouts for a gpt model")
    p.add_argument("--task", default="gpt", choices=["gpt"], help="the model family (the gpt task's transformer)")
    p.add_argument("--layers", type=int, required=True, help="transformer blocks")
    p.add_argument("--hidden", type=int, required=True, help="model width H")
    p.add_argument("--heads", type=int, required=True, help="attention heads")
    p.add_argument("--seq", type=int, required=True, help="sequence length")
    p.add_argument("--batch", type=int, required=True, help="global batch in sequences per step")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all (D x T x P)")
    p.add_argument("--gpu-mem", type=float, required=True, help="GiB per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (TP stays inside one)")
    p.add_argument("--link-gbps", type=float, default=100.0, help="network between nodes, Gbit/s")
    p.add_argument("--nvlink-gbps", type=float, default=3600.0, help="inside a node, Gbit/s")
    p.add_argument("--tflops", type=float, default=400.0, help="achievable TFLOP/s per GPU")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="bf16: mixed precision, fp32 master weights")
    p.add_argument("--top", type=int, default=12, help="rows of the table")
    p.add_argument("--measure", action="store_true",
                   help="run the best candidates that run here (no TP) for a few steps on this machine and pick the fastest")
    p.add_argument("--measure-top", type=int, default=3, help="--measure: how many candidates to run")
    p.add_argument("--measure-steps", type=int, default=5, help="--measure: steps per candidate (the first is not timed)")
    p.add_argument("--measure-device", default="auto", help="--measure: auto, cpu or cuda (--gpus ranks on this machine)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    try:
        spec = ModelSpec(args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab)
        hw = Hardware(args.gpus, args.gpu_mem, args.link_gbps, args.nvlink_gbps, args.gpus_per_node, args.tflops, args.precision)
    except ValueError as e:
        from tessera.service import UsageError

        raise UsageError(f"tessera plan: {e}") from None
    plans = candidates(spec, hw)
    if not plans:
        from tessera.service import UsageError

        raise UsageError(f"tessera plan: no valid layout of {args.gpus} GPUs for batch {args.batch}, heads {args.heads}, layers {args.layers}")
    params = sum(layer_params(spec))
    print(f"gpt: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}: "
          f"{params / 1e6:,.1f}M parameters; batch {args.batch}; {args.gpus} GPUs of {args.gpu_mem:g} GiB, {args.precision}")
    print(plan_table(plans, hw, args.top))
    if args.measure:
        measure(spec, plans, args.gpus, args.measure_top, args.measure_steps, args.measure_device)
    return 0


def runnable(lay: Layout) -> bool:
    """Whether ``tessera peer`` runs this layout today: any D x T x P with ZeRO 0-3, recompute,
    and sequence parallelism where there is TP to shard the sequence over."""
    return not (lay.sequence_parallel and lay.T == 1)


def peer_argv(spec: ModelSpec, lay: Layout, steps: int) -> list[str]:
    """The rank flags of ``python -m worker.peer`` (``tessera peer``) for ``lay`` on the gpt task."""
    opts = {"vocab": spec.vocab, "seq": spec.seq, "dim": spec.hidden, "layers": spec.layers, "heads": spec.heads}
    argv = ["--task", "gpt", *[a for k, v in opts.items() for a in ("--task-opt", f"{k}={v}")], "--steps", str(steps),
            "--global-batch", str(spec.batch), "--no-eval", "--no-progress", "--log-every", "0"]
    if lay.T > 1:
        argv += ["--tp", str(lay.T), "--dp", str(lay.D)] + (["--sequence-parallel"] if lay.sequence_parallel else [])
    if lay.P > 1 or lay.recompute_name() != "none":
        argv += ["--pp", str(lay.P), "--schedule", lay.schedule, "--micro-batches", str(lay.m), "--virtual-stages", str(lay.V)]
        argv += ["--recompute", lay.recompute_name()] if lay.recompute_name() != "none" else []
    else:
        argv += ["--accumulate", str(lay.m)]
    return argv + ["--zero", str(lay.zero)]


def measure(spec: ModelSpec, plans: list[Plan], gpus: int, top: int, steps: int, device: str = "auto") -> Plan | None:
    """Run the ``top`` best fitting candidates that run here, ``gpus`` ranks each under torchrun on
    this machine, ``steps`` steps; print estimated against measured step times and pick the fastest
    (the step time is the run's, over its steps: the same warm-up for every candidate)."""
    import json
    import subprocess
    import sys
    import time

    chosen = [p for p in plans if p.fits and runnable(p.layout)][:top]
    if not chosen:
        print("--measure: no fitting candidate runs here (ZeRO-2/3 run only without TP, pipeline or recompute)")
        return None
    rows = []
    for p in chosen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m", "worker.peer",
               *peer_argv(spec, p.layout, steps), "--device", device]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            err = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"--measure: {p.layout.name()} ZeRO-{p.layout.zero} m {p.layout.m} failed: {err[:200]}")
            continue
        rep = json.loads(lines[-1])
        rows.append((p, 1e3 * rep["seconds"] / max(1, rep["steps"]), time.perf_counter() - t0))
    if not rows:
        return None
    print(f"\nmeasured on this machine ({gpus} ranks, {steps} steps each)")
    print(f"{'':2}{'layout':<12}{'zero':>5}{'m':>4}{'recompute':>10}{'estimate ms':>13}{'measured ms':>13}")
    best = min(rows, key=lambda t: t[1])
    for p, ms, _ in rows:
        lay = p.layout
        print(f"{'*' if p is best[0] else ' ':2}{lay.name():<12}{lay.zero:>5}{lay.m:>4}{lay.recompute_name():>10}"
              f"{_ms(p.step_s):>13}{ms:>13.1f}")
    lay = best[0].layout
    print(f"measured pick: {lay.name()}, ZeRO-{lay.zero}, {lay.m} micro-batches, recompute {lay.recompute_name()} "
          f"({best[1]:.1f} ms per step)")
    return best[0]


