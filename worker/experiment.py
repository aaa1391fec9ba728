"""`tessera experiment consistency`: how much does staleness cost, and when does async win in wall time?

Runs each mode of a grid (sync, async, ssp:K, dense-sync, each optionally with the
staleness-aware learning rate) on the same task, seed and data split, each on a
fresh local PS cluster of real processes, with optional perturbations (a
straggler, per-step jitter, delay on one worker's RPCs). Worker 0 evaluates the
test metric every ``eval_every`` steps. Writes:

- ``results.json``: every setting (so a run can be repeated), the target metric,
  per mode the series (wall time, step, applied updates, test metric, loss) and
  a summary (final metric, time and updates to the target, staleness
  distribution, examples/s, share of time blocked on the PS);
- ``summary.md``: the table;
- ``metric_vs_time.png``, ``metric_vs_updates.png``, ``staleness.png``.

Ctrl-C stops every process and keeps the results of the modes finished so far
(and the partial series of the one in progress).
"""
from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ExperimentConfig", "ModeSpec", "parse_modes", "run_experiment", "summarize", "time_to_target"]


@dataclass(frozen=True)
class ModeSpec:
    mode: str  # sync | async | ssp | dense-sync
    staleness: int = 0
    staleness_aware_lr: bool = False

    @property
    def label(self) -> str:
        base = f"ssp:{self.staleness}" if self.mode == "ssp" else self.mode
        return base + ("+salr" if self.staleness_aware_lr else "")


def parse_modes(spec: str, staleness_aware_lr: str = "off") -> list[ModeSpec]:
    """``"sync,async,ssp:4"`` -> ModeSpecs; ``staleness_aware_lr``: off | on | both (a grid factor,
    for the modes it applies to: async and ssp)."""
    if staleness_aware_lr not in ("off", "on", "both"):
        raise ValueError("--staleness-aware-lr must be off, on or both")
    out: list[ModeSpec] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, _, k = item.partition(":")
        if name == "hybrid":
            raise ValueError("mode 'hybrid' was renamed 'dense-sync' (dense tables BSP, sparse tables async, both on the PS)")
        if name not in ("sync", "async", "ssp", "dense-sync"):
            raise ValueError(f"unknown mode {item!r}: use sync, async, ssp:K or dense-sync")
        if name == "ssp" and not k.isdigit():
            raise ValueError(f"{item!r}: ssp needs a bound, e.g. ssp:4")
        if name != "ssp" and k:
            raise ValueError(f"{item!r}: only ssp takes a bound")
        staleness = int(k) if k else 0
        salr = [False, True] if staleness_aware_lr == "both" else [staleness_aware_lr == "on"]
        for flag in salr if name in ("async", "ssp") else [False]:
            out.append(ModeSpec(name, staleness, flag))
    if not out:
        raise ValueError("no modes given")
    return out


@dataclass(frozen=True)
class ExperimentConfig:
    task: str = "ctr"
    workers: int = 4
    shards: int = 2
    modes: tuple[ModeSpec, ...] = ()
    steps: int = 600
    batch_size: int = 128
    eval_every: int = 50
    seed: int = 0
    straggler: str = ""  # "I x F": worker I computes F times slower
    jitter_ms: float = 0.0
    net_delay_ms: float = 0.0  # added to the RPCs of the last worker
    netem: bool = False  # net_delay_ms as a real link delay (tc netem, network namespace; root only)
    target: float | None = None  # test metric to reach (default: 99% of the worst mode's best)
    task_opts: dict[str, Any] = field(default_factory=dict)
    out: str = "tessera-experiment"

    def __post_init__(self) -> None:
        if self.workers < 1 or self.shards < 1 or self.steps < 1 or self.eval_every < 1:
            raise ValueError("workers, shards, steps and eval_every must be >= 1")
        if self.straggler:
            self.straggler_of()
        if self.netem and not self.net_delay_ms:
            raise ValueError("--netem needs --net-delay MS")

    def straggler_of(self) -> tuple[int, float]:
        i, sep, f = self.straggler.partition("x")
        try:
            idx, factor = int(i), float(f)
        except ValueError:
            raise ValueError(f"--straggler {self.straggler!r}: use WORKERxFACTOR, e.g. 1x4") from None
        if not sep or not 0 <= idx < self.workers or factor < 1:
            raise ValueError(f"--straggler {self.straggler!r}: worker in [0, {self.workers}), factor >= 1")
        return idx, factor


def _worker_flags(cfg: ExperimentConfig, m: ModeSpec, i: int) -> dict[str, Any]:
    flags: dict[str, Any] = dict(
        task=cfg.task, mode=m.mode, staleness=m.staleness, staleness_aware_lr=m.staleness_aware_lr,
        steps=cfg.steps, batch_size=cfg.batch_size, seed=cfg.seed, eval_every=cfg.eval_every, device="cpu",
        torch_threads=1, jitter_ms=cfg.jitter_ms or None,
    )
    flags["task_opt"] = [f"{k}={json.dumps(v)}" for k, v in cfg.task_opts.items()]
    if cfg.straggler:
        idx, factor = cfg.straggler_of()
        if i == idx:
            flags["slowdown"] = factor
    if cfg.net_delay_ms and not cfg.netem and i == cfg.workers - 1:
        flags["rpc_delay_ms"] = cfg.net_delay_ms  # in software; with netem the link itself is slow
    return flags


def _series(records: list[dict], metric: str) -> list[dict]:
    """Worker 0's evaluations in time order: wall time since the mode's first step record."""
    steps = [r for r in records if r["kind"] == "step"]
    t0 = min((r["time"] for r in records if r["kind"] == "start"), default=0.0)  # training began (after startup)
    evals = sorted((r for r in records if r["kind"] == "eval" and metric in r), key=lambda r: r["time"])
    loss_at = sorted((r["time"], r["loss"]) for r in steps if r["worker"] == "w0")
    times = [t for t, _ in loss_at]
    out = []
    for r in evals:
        k = bisect.bisect_right(times, r["time"])  # worker 0's last loss record at the evaluation
        out.append({
            "time_s": r["time"] - t0, "step": r["step"], "updates": r.get("updates", 0.0), "metric": r[metric],
            "loss": loss_at[k - 1][1] if k else math.nan,
        })
    return out


def time_to_target(series: list[dict], target: float, higher_is_better: bool = True) -> tuple[float | None, float | None]:
    """(seconds, applied updates) at the first evaluation that reached ``target``; None if never."""
    for p in series:
        if (p["metric"] >= target) if higher_is_better else (p["metric"] <= target):
            return p["time_s"], p["updates"]
    return None, None


def summarize(modes: dict[str, dict], target: float, higher_is_better: bool = True) -> None:
    """Fill in each mode's time and updates to ``target`` (in place)."""
    for m in modes.values():
        t, u = time_to_target(m["series"], target, higher_is_better)
        m["summary"]["time_to_target_s"] = t
        m["summary"]["updates_to_target"] = u


def _mode_summary(records: list[dict], series: list[dict], metric: str) -> dict[str, Any]:
    summaries = [r for r in records if r["kind"] == "summary"]
    hist: dict[int, int] = {}
    for s in summaries:
        for k, v in (s.get("staleness_hist") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    n = sum(hist.values())
    compute = sum(s["compute_s"] for s in summaries)
    blocked = sum(s["pull_wait_s"] + s["push_wait_s"] for s in summaries)
    finals = [r for r in records if r["kind"] == "eval" and r.get("final")]
    return {
        "final_metric": finals[-1][metric] if finals else (series[-1]["metric"] if series else None),
        "wall_s": max((s["seconds"] for s in summaries), default=None),
        "examples_per_s": sum(s["examples_per_s"] for s in summaries),
        "mean_staleness": sum(k * v for k, v in hist.items()) / n if n else 0.0,
        "max_staleness": max(hist, default=0),
        "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "blocked_fraction": blocked / (compute + blocked) if compute + blocked else 0.0,
        "late_pushes": sum(s.get("late_pushes", 0) for s in summaries),
        "workers_finished": len(summaries),
    }


def run_experiment(cfg: ExperimentConfig, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from worker.launch import LocalRun
    from worker.netem import NetemLink
    from worker.tasks import load_task

    task = load_task(cfg.task, seed=cfg.seed, **cfg.task_opts)
    metric, hib = task.metric, task.higher_is_better
    out = os.path.abspath(cfg.out)
    os.makedirs(out, exist_ok=True)
    results: dict[str, Any] = {
        "settings": {**asdict(cfg), "modes": [m.label for m in cfg.modes]}, "metric": metric,
        "higher_is_better": hib, "task_info": task.info, "modes": {}, "complete": False,
    }
    bar = tqdm(total=len(cfg.modes) * cfg.steps, desc="experiment", unit="step", dynamic_ncols=True, disable=not progress)
    records: list[dict] = []  # the metrics of the mode in progress
    label = ""
    try:
        for m in cfg.modes:
            bar.set_description(f"experiment {m.label}")
            records, label = [], m.label
            results["modes"][m.label] = {"spec": asdict(m), "series": [], "summary": {}, "complete": False}
            done_before = bar.n
            with contextlib.ExitStack() as stack:
                link = stack.enter_context(NetemLink(cfg.net_delay_ms)) if cfg.netem else None
                run = stack.enter_context(LocalRun(out, cfg.shards, host=link.host_address if link else "127.0.0.1"))
                flags = [_worker_flags(cfg, m, i) for i in range(cfg.workers)]
                wrap = {cfg.workers - 1: link.prefix()} if link else None
                run.start_workers(cfg.workers, f"{m.label.replace(':', '')}-", flags, wrap)
                while run.running():
                    time.sleep(0.3)
                    new = run.poll()
                    records += new
                    steps0 = [r["step"] for r in new if r["kind"] == "step" and r["worker"] == "w0"]
                    if steps0:
                        bar.n = done_before + min(cfg.steps, max(steps0))
                    last = [r for r in new if r["kind"] == "eval"]
                    if last:
                        bar.set_postfix_str(f"{metric} {last[-1][metric]:.4f}")
                    bar.refresh()
                records += run.poll()
                failed = run.failures()
                if failed:
                    raise RuntimeError(f"mode {m.label}: " + "\n".join(failed))
            series = _series(records, metric)
            results["modes"][m.label].update(series=series, summary=_mode_summary(records, series, metric), complete=True)
            bar.n = done_before + cfg.steps
            bar.refresh()
        results["complete"] = True
    finally:
        bar.close()
        if label and not results["modes"][label]["complete"]:  # interrupted: keep what it measured
            results["modes"][label]["series"] = _series(records, metric)
        finish(results, cfg, out)
    return results


def finish(results: dict[str, Any], cfg: ExperimentConfig, out: str) -> None:
    """Target, summaries, files: also for partial results after Ctrl-C."""
    metric, hib = results["metric"], results["higher_is_better"]
    modes = results["modes"]
    bests = [max(p["metric"] for p in m["series"]) if hib else min(p["metric"] for p in m["series"]) for m in modes.values() if m["series"]]
    target = cfg.target
    if target is None and bests:
        target = 0.99 * min(bests) if hib else 1.01 * max(bests)
    results["target"] = target
    if target is not None:
        summarize(modes, target, hib)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary_table(results))
    plot(results, out)


def summary_table(results: dict[str, Any]) -> str:
    metric, target = results["metric"], results.get("target")
    s = results["settings"]
    lines = [
        f"task {s['task']}, {s['workers']} workers, {s['shards']} shards, {s['steps']} steps x batch {s['batch_size']}, "
        f"seed {s['seed']}" + (f", straggler {s['straggler']}" if s["straggler"] else "")
        + (f", jitter {s['jitter_ms']} ms" if s["jitter_ms"] else "")
        + (f", net delay {s['net_delay_ms']} ms{' (tc netem)' if s.get('netem') else ''}" if s["net_delay_ms"] else ""),
        "",
        f"target {metric}: {target:.4f}" if target is not None else "target: none",
        "",
        f"| mode | final {metric} | time to target (s) | updates to target | mean / max staleness | examples/s | blocked |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def fmt(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for label, m in results["modes"].items():
        sm = m["summary"]
        if not m.get("complete") or "mean_staleness" not in sm:
            lines.append(f"| {label} | (interrupted) | | | | | |")
            continue
        lines.append(
            f"| {label} | {fmt(sm.get('final_metric'), '.4f')} | {fmt(sm.get('time_to_target_s'), '.1f')} | "
            f"{fmt(sm.get('updates_to_target'), '.0f')} | {sm['mean_staleness']:.2f} / {sm['max_staleness']} | "
            f"{sm['examples_per_s']:,.0f} | {100 * sm['blocked_fraction']:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, target = results["metric"], results.get("target")
    paths = []
    for x, name, xlabel in [("time_s", "metric_vs_time.png", "wall time (s)"), ("updates", "metric_vs_updates.png", "applied updates")]:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for label, m in results["modes"].items():
            if m["series"]:
                ax.plot([p[x] for p in m["series"]], [p["metric"] for p in m["series"]], marker=".", label=label)
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"test {metric}")
        ax.set_title(f"test {metric} vs {xlabel}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [lb for lb, m in results["modes"].items() if m["summary"].get("staleness_hist")]
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        hist = {int(k): v for k, v in results["modes"][label]["summary"]["staleness_hist"].items()}
        total = sum(hist.values())
        ks = sorted(hist)
        ax.bar([k + j * width for k in ks], [hist[k] / total for k in ks], width=width, label=label)
    ax.set_xlabel("staleness of applied updates (versions)")
    ax.set_ylabel("fraction of updates")
    ax.set_title("staleness distribution")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "staleness.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
