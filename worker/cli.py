"""``tessera worker``: train a task against PS shards; ``tessera demo``: a whole local cluster in one command."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["add_worker_commands"]


def _kv(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--task-opt expects KEY=VALUE, got {item!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def add_worker_commands(sub: Any) -> None:
    w = sub.add_parser("worker", help="train a task against PS shards (one worker process)")
    w.add_argument("--ps", required=True, help="HOST:PORT,... of every shard, in shard order")
    w.add_argument("--task", default="ctr", help="ctr, digits, or package.module:function")
    w.add_argument("--task-opt", action="append", default=[], metavar="KEY=VALUE", help="option for the task (repeatable)")
    w.add_argument("--mode", default="async", choices=["sync", "async", "ssp", "hybrid"])
    w.add_argument("--staleness", type=int, default=4, help="SSP bound K (default 4)")
    w.add_argument("--backup-workers", type=int, default=0, help="sync: apply the first W-b gradients of each step")
    w.add_argument("--staleness-aware-lr", action="store_true", help="async/ssp: scale each update's lr by 1/staleness")
    w.add_argument("--steps", type=int, default=1000, help="train until the cluster's clock reaches this")
    w.add_argument("--batch-size", type=int, default=256)
    w.add_argument("--worker-index", type=int, default=0)
    w.add_argument("--num-workers", type=int, default=1)
    w.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    w.add_argument("--lease", type=float, default=10.0, help="lease in seconds; heartbeats every lease/4")
    w.add_argument("--no-overlap", action="store_true", help="no prefetch, no background pushes (for comparison)")
    w.add_argument("--eval-every", type=int, default=0, help="worker 0 evaluates every N steps (0: at the end)")
    w.add_argument("--max-seconds", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--wire-dtype", default=None, choices=["float32", "float16", "bfloat16"])
    w.add_argument("--metrics-out", default=None, help="append JSON lines (steps, evals, summary) here")
    w.add_argument("--no-progress", action="store_true")
    w.add_argument("--name", default="", help="worker name on the shards (default w<index>)")
    w.add_argument("--torch-threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    w.set_defaults(func=_worker)

    d = sub.add_parser("demo", help="start 2 shards + 2 workers locally, train ctr for about a minute, plot it")
    d.add_argument("--shards", type=int, default=2)
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--mode", default="ssp", choices=["sync", "async", "ssp", "hybrid"])
    d.add_argument("--staleness", type=int, default=4)
    d.add_argument("--seconds", type=float, default=60.0, help="training time (default 60)")
    d.add_argument("--batch-size", type=int, default=256)
    d.add_argument("--device", default="auto")
    d.add_argument("--task", default="ctr")
    d.add_argument("--out", default="tessera-demo", help="directory for metrics, summary and plot")
    d.set_defaults(func=_demo)


def _worker(args: argparse.Namespace) -> int:
    import torch

    from ps import PSClient
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    cfg = TrainConfig(
        mode=args.mode, staleness=args.staleness, backup_workers=args.backup_workers,
        staleness_aware_lr=args.staleness_aware_lr, steps=args.steps, batch_size=args.batch_size,
        worker_index=args.worker_index, num_workers=args.num_workers, device=args.device, lease_s=args.lease,
        overlap=not args.no_overlap, eval_every=args.eval_every, max_seconds=args.max_seconds, seed=args.seed,
        wire_dtype=args.wire_dtype, progress=not args.no_progress, metrics_out=args.metrics_out, name=args.name,
    )
    stop = threading.Event()
    # SIGTERM/SIGINT: finish the step in flight (its push completes), leave the shards, exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    task = load_task(args.task, seed=args.seed, **_kv(args.task_opt))
    with PSClient(args.ps, timeout=max(60.0, 3 * args.lease), wire_dtype=args.wire_dtype) as client:
        client.wait_ready(timeout=60)
        summary = Trainer(task, client, cfg, stop=stop).run()
    metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
    print(
        f"{summary.worker} {summary.mode}: {summary.steps} steps ({summary.start_clock}->{summary.final_clock}) in "
        f"{summary.seconds:.1f} s, {summary.examples_per_s:,.0f} examples/s, loss {summary.loss:.4f}, "
        f"waiting {100 * summary.wait_fraction:.0f}% of step time, staleness mean {summary.mean_staleness:.2f} "
        f"max {summary.max_staleness}{' (stopped early)' if summary.stopped_early else ''} {metrics}",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------------- demo
def _tail(path: str, pos: int) -> tuple[list[dict], int]:
    if not os.path.exists(path):
        return [], pos
    with open(path) as f:
        f.seek(pos)
        chunk = f.read()
    lines = chunk.split("\n")
    complete, rest = lines[:-1], lines[-1]
    return [json.loads(x) for x in complete if x.strip()], pos + len(chunk) - len(rest)


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ps.cli import start_local_shards, stop_processes

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    files = [os.path.join(out, f"metrics-w{i}.jsonl") for i in range(args.workers)]
    for f in files:
        if os.path.exists(f):
            os.remove(f)
    procs: list[subprocess.Popen] = []
    print(f"tessera demo: {args.shards} shards + {args.workers} workers ({args.mode}) on loopback, task {args.task}, ~{args.seconds:.0f} s")
    t_start = time.monotonic()
    try:
        shard_procs, addresses = start_local_shards(args.shards, ("--lease", "5"))
        procs += shard_procs
        print("shards at", ",".join(addresses))
        threads = max(1, (os.cpu_count() or 2) // max(1, args.workers))
        for i in range(args.workers):
            cmd = [
                sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", args.task,
                "--mode", args.mode, "--staleness", str(args.staleness), "--steps", "1000000000",
                "--max-seconds", str(args.seconds), "--batch-size", str(args.batch_size), "--worker-index", str(i),
                "--num-workers", str(args.workers), "--device", args.device, "--metrics-out", files[i], "--no-progress",
                "--lease", "5", "--eval-every", "200", "--torch-threads", str(threads),
            ]
            procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
        workers = procs[len(shard_procs):]
        records: list[dict] = []
        pos = [0] * len(files)
        bar = tqdm(total=round(args.seconds), desc="training", unit="s", dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
        last: dict[str, dict] = {}
        best: dict[str, float] = {}
        t_train = None
        while any(p.poll() is None for p in workers):
            time.sleep(0.5)
            for i, f in enumerate(files):
                recs, pos[i] = _tail(f, pos[i])
                records += recs
                for r in recs:
                    if r["kind"] == "step":
                        last[r["worker"]] = r
                        t_train = t_train or time.monotonic()
                    elif r["kind"] == "eval":
                        best = r
            if t_train is not None:
                bar.n = min(args.seconds, time.monotonic() - t_train)
                eps = sum(r["examples_per_s"] for r in last.values())
                loss = sum(r["loss"] for r in last.values()) / max(1, len(last))
                post = f"loss {loss:.4f}  {eps:,.0f} ex/s"
                if best:
                    post += f"  test auc {best.get('auc', float('nan')):.4f}"
                bar.set_postfix_str(post)
                bar.refresh()
        bar.close()
        for i, f in enumerate(files):
            recs, pos[i] = _tail(f, pos[i])
            records += recs
        failed = [(i, p.returncode, p.stderr.read() if p.stderr else "") for i, p in enumerate(workers) if p.returncode]
        if failed:
            for i, code, err in failed:
                print(f"worker {i} exited with {code}:\n{err[-2000:]}", file=sys.stderr)
            return 1
        return _report(records, out, args, time.monotonic() - t_start)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process", file=sys.stderr)
        return 130
    finally:
        stop_processes(procs, grace=10)


def _report(records: list[dict], out: str, args: argparse.Namespace, wall: float) -> int:
    from worker.tasks import load_task

    finals = [r for r in records if r["kind"] == "eval" and r.get("final")]
    summaries = [r for r in records if r["kind"] == "summary"]
    task = load_task(args.task)
    best = task.info.get("best_auc")
    metric = task.metric
    final = finals[-1] if finals else {}
    eps = sum(s["examples_per_s"] for s in summaries)
    result = {
        "task": args.task, "mode": args.mode, "workers": args.workers, "shards": args.shards, "wall_s": wall,
        "final": final, "best_achievable": best, "examples_per_s": eps, "summaries": summaries,
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    png = _plot(records, out, metric, best)
    got = final.get(metric, float("nan"))
    print(f"\nfinal test {metric}: {got:.4f}" + (f"  (best achievable {best:.4f}, {100 * got / best:.1f}% of it)" if best else ""))
    print(f"throughput: {eps:,.0f} examples/s over {len(summaries)} workers; steps per worker: "
          + ", ".join(f"{s['worker']}={s['steps']}" for s in summaries))
    print(f"wrote {out}/results.json, {out}/metrics-w*.jsonl" + (f", {png}" if png else ""))
    return 0


def _plot(records: list[dict], out: str, metric: str, best: float | None) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t0 = min(r["time"] for r in records) if records else 0.0
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for w in sorted({r["worker"] for r in records}):
        steps = [r for r in records if r["kind"] == "step" and r["worker"] == w]
        a1.plot([r["time"] - t0 for r in steps], [r["loss"] for r in steps], label=w, lw=1)
    a1.set_xlabel("seconds")
    a1.set_ylabel("training loss")
    a1.set_title("loss vs time")
    a1.legend()
    evals = [r for r in records if r["kind"] == "eval" and metric in r]
    a2.plot([r["time"] - t0 for r in evals], [r[metric] for r in evals], "o-", label=f"test {metric}")
    if best:
        a2.axhline(best, color="gray", ls="--", label=f"best achievable {best:.3f}")
    a2.set_xlabel("seconds")
    a2.set_ylabel(metric)
    a2.set_title(f"test {metric} vs time")
    a2.legend()
    fig.tight_layout()
    path = os.path.join(out, "training.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
