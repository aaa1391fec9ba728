"""tessera worker: train a task against PS shards; tessera demo: a whole local cluster in one command;
tessera experiment: consistency modes compared on local clusters."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from tessera.argtypes import shard_list_arg
from tessera.cli import KEY_VALUE_HELP, parse_key_values
from tessera.service import UsageError, add_client_security_args, client_security_from

__all__ = ["add_worker_commands", "explain_error", "default_torch_threads"]



def _kv(items: list[str]) -> dict[str, Any]:
    try:
        return parse_key_values(items)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _ps_mode(value: str) -> str:
    """argparse type for --mode: the old name 'hybrid' gets a message naming 'dense-sync'."""
    if value == "hybrid":
        raise argparse.ArgumentTypeError("'hybrid' was renamed 'dense-sync' (dense tables BSP, sparse tables async, both on the PS)")
    return value


def add_worker_commands(sub: Any) -> None:
    w = sub.add_parser("worker", help="train a task against PS shards (one worker process)")
    w.add_argument(
        "--ps", required=True, type=shard_list_arg(),
        help="HOST:PORT,... of every shard, in shard order; PRIMARY|BACKUP for a replicated shard",
    )
    w.add_argument(
        "--retry-timeout", type=float, default=60.0, metavar="SECONDS",
        help="how long the worker waits for its shards at start, and a call keeps retrying (and failing over) an unreachable shard, before it gives up",
    )
    add_client_security_args(w)
    w.add_argument("--task", default="ctr", help="ctr, digits, mf, or module:function (a module in the current directory or on PYTHONPATH)")
    w.add_argument("--task-opt", action="append", default=[], metavar="KEY=VALUE",
                   help=f"keyword argument for the task's function (repeatable; {KEY_VALUE_HELP})")
    w.add_argument(
        "--mode", default="async", type=_ps_mode, choices=["sync", "async", "ssp", "dense-sync"],
        help="sync (BSP), async (ASP), ssp (bounded staleness), dense-sync (dense tables sync, sparse async)",
    )
    w.add_argument("--staleness", type=int, default=4, help="SSP bound K, in steps: a pull for step c waits until the slowest worker finished step c-K-1")
    w.add_argument("--backup-workers", type=int, default=0, help="sync: apply the first W-b gradients of each step")
    w.add_argument("--staleness-aware-lr", action="store_true", help="async/ssp: scale each update's lr by 1/staleness (staleness in versions: updates applied since its pull)")
    w.add_argument("--steps", type=int, default=1000, help="train until the cluster's clock reaches this")
    w.add_argument(
        "--reset", action="store_true",
        help="start a fresh run on shards that hold an earlier run of this task: worker 0 drops its tables and "
        "creates them afresh once all --num-workers joined (needs an admin token where shards check tokens); give "
        "every worker --reset (without it a restarted run continues from the shards' clock)",
    )
    w.add_argument("--batch-size", type=int, default=256, help="examples per step on this worker")
    w.add_argument("--worker-index", type=int, default=0, help="this worker's index, 0..num-workers-1 (worker 0 creates the tables)")
    w.add_argument("--num-workers", type=int, default=1, help="workers in the run (each takes its slice of every step's data)")
    w.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    w.add_argument("--lease", type=float, default=10.0, help="lease in seconds; heartbeats every lease/4")
    w.add_argument("--emb-cache-rows", type=int, default=0, metavar="N", help="keep the N most used rows of each PS embedding on the worker's device (0: no cache)")
    w.add_argument("--emb-cache-staleness", type=int, default=4, metavar="K", help="emb cache: ssp serves a cached row at most K steps after its pull, async refreshes it every K steps (sync: never stale)")
    w.add_argument("--no-overlap", action="store_true", help="no prefetch, no background pushes (for comparison)")
    w.add_argument("--eval-every", type=int, default=0, help="worker 0 evaluates every N steps (0: at the end)")
    w.add_argument("--max-seconds", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    w.add_argument("--seed", type=int, default=0, help="seed of the task's data and model (same on every worker)")
    w.add_argument(
        "--ps-transport", default="auto", choices=["auto", "grpc"],
        help="auto (default): data calls go over a shard's bulk port when it serves one (tessera ps serve --bulk-port); "
        "grpc: always gRPC",
    )
    w.add_argument(
        "--wire-dtype", default=None, choices=["float32", "float16", "bfloat16"],
        help="precision of pushes and pulls on the wire (tables stay float32; default float32)",
    )
    w.add_argument(
        "--row-dtype", default=None, choices=["float32", "float16", "bfloat16"],
        help="how the shards store the rows of the task's PSEmbedding tables (default: as the task says, float32); "
        "rows are pulled as stored, computed in float32",
    )
    w.add_argument("--metrics-out", default=None, help="append JSON lines (steps, evals, summary) here")
    from tessera.metrics import add_metrics_args

    add_metrics_args(w)  # --metrics-port/--metrics-host: Prometheus endpoint over the trainer's records
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--name", default="", help="worker name on the shards (default w<index>)")
    w.add_argument(
        "--torch-threads", type=int, default=0,
        help="torch intra-op threads (default 0: the machine's cores divided among --local-workers; -1: torch's default, one per core)",
    )
    w.add_argument(
        "--local-workers", type=int, default=0, metavar="N",
        help="worker processes on this machine, for dividing its cores (default 0: --num-workers if every --ps address is loopback, else 1)",
    )
    w.add_argument("--slowdown", type=float, default=1.0, help="experiments: compute takes this many times longer")
    w.add_argument("--jitter-ms", type=float, default=0.0, help="experiments: random per-step delay, exponential with this mean")
    w.add_argument("--rpc-delay-ms", type=float, default=0.0, help="experiments: delay added to every RPC this worker sends")
    w.set_defaults(func=_worker)

    d = sub.add_parser("demo", help="start 2 shards + 2 workers locally, train ctr for about a minute, plot it")
    d.add_argument("--shards", type=int, default=2, help="shard processes")
    d.add_argument("--workers", type=int, default=2, help="worker processes (each gets the machine's cores divided among the workers)")
    d.add_argument(
        "--mode", default="ssp", type=_ps_mode, choices=["sync", "async", "ssp", "dense-sync"],
        help="consistency mode (see tessera worker --help)",
    )
    d.add_argument("--staleness", type=int, default=4, help="SSP bound K, in steps")
    d.add_argument("--seconds", type=float, default=60.0, help="training time in seconds")
    d.add_argument("--batch-size", type=int, default=256, help="examples per step per worker")
    d.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    d.add_argument("--task", default="ctr", help="ctr, digits, mf, or module:function")
    d.add_argument("--out", default="tessera-demo", help="directory for metrics, summary and plot")
    d.set_defaults(func=_demo)

    e = sub.add_parser("experiment", help="experiments on a local cluster").add_subparsers(dest="experiment", required=True)
    c = e.add_parser("consistency", help="sync vs async vs SSP on one task: metric vs time and updates, staleness")
    c.add_argument("--task", default="ctr", help="ctr, digits, mf, or module:function")
    c.add_argument("--task-opt", action="append", default=[], metavar="KEY=VALUE",
                   help=f"keyword argument for the task's function (repeatable; {KEY_VALUE_HELP})")
    c.add_argument("--workers", type=int, default=4, help="worker processes per mode")
    c.add_argument("--shards", type=int, default=2, help="shard processes per mode")
    c.add_argument("--modes", default="sync,async,ssp:1,ssp:4,ssp:16", help="comma-separated: sync, async, ssp:K, dense-sync")
    c.add_argument("--staleness-aware-lr", default="off", choices=["off", "on", "both"],
                   help="scale async/ssp updates' lr by 1/staleness; 'both' runs each async/ssp mode with and without")
    c.add_argument("--steps", type=int, default=None, help="steps per mode (default 600; --quick 120)")
    c.add_argument("--batch-size", type=int, default=None, help="per worker (default 128; --quick 64)")
    c.add_argument("--eval-every", type=int, default=None, help="worker 0 evaluates every N steps (default steps/12)")
    c.add_argument("--seed", type=int, default=0, help="seed of the task's data and model (same for every mode)")
    c.add_argument("--straggler", default="", help="WORKERxFACTOR, e.g. 1x4: worker 1 computes 4x slower")
    c.add_argument("--jitter", type=float, default=0.0, metavar="MS", help="random per-step delay on every worker (mean MS)")
    c.add_argument("--net-delay", type=float, default=0.0, metavar="MS", help="delay added to the last worker's RPCs")
    c.add_argument("--netem", action="store_true",
                   help="make --net-delay a real link delay: the last worker runs in a network namespace behind tc netem (root)")
    c.add_argument("--target", type=float, default=None, help="test metric to reach (default: 99%% of the worst mode's best)")
    c.add_argument("--quick", action="store_true", help="a small run (~2 minutes on 2 cores)")
    c.add_argument("--out", default="tessera-experiment", help="directory for results.json, summary.md and the plots")
    c.set_defaults(func=_experiment)


def default_torch_threads(addresses: str, num_workers: int, local_workers: int = 0) -> int:
    """Torch intra-op threads for one worker: this machine's cores divided among the worker
    processes on it (``local_workers``; 0: ``num_workers`` if every shard address is loopback,
    i.e. the whole run is on this machine, else 1). At least 1."""
    from tessera.service import is_loopback

    if local_workers <= 0:
        hosts = [a.rpartition(":")[0].strip("[]") for spec in addresses.split(",") for a in spec.split("|") if a]
        local_workers = num_workers if hosts and all(is_loopback(h) for h in hosts) else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_workers))


def explain_error(exc: BaseException) -> tuple[str, int] | None:
    """One line and an exit code for a worker-side error a user can cause (None: not one)."""
    from worker.tasks import TaskLoadError

    if isinstance(exc, TaskLoadError):
        return str(exc), 2
    return None


def _worker(args: argparse.Namespace) -> int:
    import torch

    from ps import PSClient
    from ps.cli import check_shards, wait_for_shards
    from tessera.rpc import DelayInterceptor
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    if args.num_workers < 1:
        raise UsageError(f"--num-workers must be at least 1, got {args.num_workers}")
    if not 0 <= args.worker_index < args.num_workers:
        raise UsageError(
            f"--worker-index {args.worker_index} is out of range for --num-workers {args.num_workers}: "
            f"give each worker one index of 0..{args.num_workers - 1}"
        )
    if args.metrics_port:
        from tessera.metrics import TrainerCollector, metrics_file, start_from_args

        args.metrics_out = metrics_file(args)
        start_from_args(args, [TrainerCollector(args.metrics_out)], what="tessera worker")
    threads = args.torch_threads if args.torch_threads != 0 else default_torch_threads(args.ps, args.num_workers, args.local_workers)
    if threads > 0:
        torch.set_num_threads(threads)
    cfg = TrainConfig(
        mode=args.mode, staleness=args.staleness, backup_workers=args.backup_workers,
        staleness_aware_lr=args.staleness_aware_lr, steps=args.steps, batch_size=args.batch_size,
        worker_index=args.worker_index, num_workers=args.num_workers, device=args.device, lease_s=args.lease,
        overlap=not args.no_overlap, eval_every=args.eval_every, max_seconds=args.max_seconds, seed=args.seed,
        progress=not args.no_progress, metrics_out=args.metrics_out, name=args.name,
        slowdown=args.slowdown, jitter_ms=args.jitter_ms, reset=args.reset,
    )
    stop = threading.Event()
    # SIGTERM/SIGINT: finish the step in flight (its push completes), leave the shards, exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    task = load_task(args.task, seed=args.seed, **_kv(args.task_opt))
    if args.row_dtype is not None:
        from worker.binding import PSEmbedding

        for m in task.model.modules():
            if isinstance(m, PSEmbedding):
                m.row_dtype = args.row_dtype
    caches: dict[str, Any] = {}
    if args.emb_cache_rows:
        from worker.emb_cache import attach_caches
        from worker.trainer import resolve_device

        try:
            caches = attach_caches(task.model, args.emb_cache_rows, args.emb_cache_staleness, args.mode, resolve_device(args.device))
        except ValueError as e:
            raise UsageError(f"--emb-cache-rows/--emb-cache-staleness: {e}") from None
    if args.eval_every > 0 and task.evaluate is None:
        print(
            f"tessera worker: warning: --eval-every {args.eval_every}: task {task.name!r} has no evaluation "
            "(its Task.evaluate is None), so nothing is evaluated",
            file=sys.stderr,
        )
    security = client_security_from(args)
    addresses = [a for a in args.ps.split(",") if a]
    wait_for_shards(
        addresses, security, timeout=args.retry_timeout, say=lambda text: print(f"tessera worker: {text}", file=sys.stderr),
    )
    interceptors = [DelayInterceptor(args.rpc_delay_ms / 1000.0)] if args.rpc_delay_ms > 0 else []
    with PSClient(
        addresses, timeout=max(60.0, 3 * args.lease), wire_dtype=args.wire_dtype, interceptors=interceptors,
        retry_timeout=args.retry_timeout, security=security, transport=args.ps_transport,
    ) as client:
        check_shards(client, addresses)
        summary = Trainer(task, client, cfg, stop=stop).run()
    metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
    print(
        f"{summary.worker} {summary.mode}: {summary.steps} steps ({summary.start_clock}->{summary.final_clock}) in "
        f"{summary.seconds:.1f} s, {summary.examples_per_s:,.0f} examples/s, loss {summary.loss:.4f}, "
        f"waiting {100 * summary.wait_fraction:.0f}% of step time, staleness (in versions) mean {summary.mean_staleness:.2f} "
        f"max {summary.max_staleness}{' (stopped early)' if summary.stopped_early else ''} {metrics}",
        file=sys.stderr,
    )
    for name, c in caches.items():
        print(f"{summary.worker} emb cache {name}: hit rate {c.stats.hit_rate:.3f} of lookups, {c.stats.row_hit_rate:.3f} of rows; "
              f"{c.stats.pulled} rows pulled, {c.stats.copied} copied to the device", file=sys.stderr)
    return 0


def _ctrl_c_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt (so every child is stopped), even where SIGINT was inherited as
    ignored (a shell starts background jobs that way)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---------------------------------------------------------------------- experiment
def _experiment(args: argparse.Namespace) -> int:
    from worker.experiment import ExperimentConfig, parse_modes, run_experiment
    from worker.tasks import resolve_task

    resolve_task(args.task)  # a bad --task is one line now, not after the shards started

    steps = args.steps or (120 if args.quick else 600)
    opts = _kv(args.task_opt)
    if args.task == "ctr":
        opts.setdefault("test_size", 4000)  # evaluation is on worker 0's clock: keep it short
    cfg = ExperimentConfig(
        task=args.task, workers=args.workers, shards=args.shards,
        modes=tuple(parse_modes(args.modes, args.staleness_aware_lr)), steps=steps,
        batch_size=args.batch_size or (64 if args.quick else 128), eval_every=args.eval_every or max(1, steps // 12),
        seed=args.seed, straggler=args.straggler, jitter_ms=args.jitter, net_delay_ms=args.net_delay, netem=args.netem,
        target=args.target, task_opts=opts, out=args.out,
    )
    if cfg.netem:
        from worker.netem import netem_available

        why = netem_available()
        if why:
            print(f"tessera experiment: --netem {why}; use --net-delay alone for a delay in software", file=sys.stderr)
            return 2
    _ctrl_c_interrupts()
    try:
        results = run_experiment(cfg)
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopped every process; partial results in {os.path.abspath(args.out)}", file=sys.stderr)
        return 130
    out = os.path.abspath(args.out)
    with open(os.path.join(out, "summary.md")) as f:
        print(f.read())
    print(f"wrote {out}/results.json, summary.md, metric_vs_time.png, metric_vs_updates.png, staleness.png")
    return 0 if results["complete"] else 1


# ---------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from worker.launch import LocalRun
    from worker.tasks import resolve_task

    resolve_task(args.task)  # a bad --task is one line now, not after the shards started
    _ctrl_c_interrupts()
    out = os.path.abspath(args.out)
    print(f"tessera demo: {args.shards} shards + {args.workers} workers ({args.mode}) on loopback, task {args.task}, ~{args.seconds:.0f} s")
    t_start = time.monotonic()
    threads = max(1, (os.cpu_count() or 2) // max(1, args.workers))
    flags = dict(
        task=args.task, mode=args.mode, staleness=args.staleness, steps=10**9, max_seconds=args.seconds,
        batch_size=args.batch_size, device=args.device, eval_every=200, torch_threads=threads,
    )
    try:
        with LocalRun(out, args.shards) as run:
            print("shards at", ",".join(run.addresses))
            run.start_workers(args.workers, "metrics-", [flags] * args.workers)
            records: list[dict] = []
            last: dict[str, dict] = {}
            latest: dict = {}
            t_train = None
            bar = tqdm(total=round(args.seconds), desc="training", unit="s", dynamic_ncols=True,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s{postfix}")
            while run.running():
                time.sleep(0.5)
                for r in run.poll():
                    records.append(r)
                    if r["kind"] == "step":
                        last[r["worker"]] = r
                        t_train = t_train or time.monotonic()
                    elif r["kind"] == "eval":
                        latest = r
                if t_train is not None:
                    bar.n = min(args.seconds, time.monotonic() - t_train)
                    eps = sum(r["examples_per_s"] for r in last.values())
                    loss = sum(r["loss"] for r in last.values()) / max(1, len(last))
                    post = f"loss {loss:.4f}  {eps:,.0f} ex/s"
                    if latest:
                        post += f"  test auc {latest.get('auc', float('nan')):.4f}"
                    bar.set_postfix_str(post)
                    bar.refresh()
            bar.close()
            records += run.poll()
            failed = run.failures()
            if failed:
                print("\n".join(failed), file=sys.stderr)
                return 1
            return _report(records, out, args, time.monotonic() - t_start)
    except KeyboardInterrupt:
        print("\ninterrupted: stopped every process", file=sys.stderr)
        return 130


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
