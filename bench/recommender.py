"""Recommender benchmark: the ``mf`` task (matrix factorisation) on 2 shards x 2 async workers,
against the same model in one torch process. Same test RMSE? At what wall time?

The cluster: 2 ``tessera ps serve`` processes with no transport flags (the default transport: what
``tessera ps serve`` and ``tessera worker`` do unless told otherwise; the JSON says which it was)
and 2 ``tessera worker --task mf --mode async`` processes, each with its own ``--steps`` x
``--batch-size`` examples (worker i takes slice i of every step's global batch, so together they see
stream positions ``[0, 2 x steps x batch)`` of the task's training stream). The user and item
embeddings live on the shards (Adagrad), the MLP is the shards' dense table (Adam).

The reference: ``worker.tasks.mf.torch_reference``, the same model in this process: the MLP with the
same initial weights, ``nn.Embedding(sparse=True)`` tables holding the rows the shards create,
``torch.optim.Adagrad`` with the tables' hyperparameters on the embeddings, ``torch.optim.Adam`` with
the dense table's on the MLP; batch ``--batch-size`` for ``2 x steps`` steps: the same examples in
the same order, and the same number of updates of the same size as the two async workers apply. It
runs while no cluster process is alive (before the cluster in odd repeats, after it in even ones,
so that load drifting over the run hits both alike), with 1 torch thread (as each worker has), and with
every count ``--local-threads`` lists (e.g. ``1,2``); the fastest is the baseline. The default is 1
alone: on this 2-core machine, beside other work, 2 threads took 169 s where 1 took 11 s (torch's
thread pool on ops this small).

Figures, per repeat (``--repeats``, default 2):
* ``rmse_ps``: test RMSE of the parameters on the shards once both workers finished (pulled by this
  process: the dense table and the rows, evaluated by the task's own ``evaluate``); ``rmse_local``:
  the reference's. ``rmse_gap`` = ``rmse_ps - rmse_local`` (goal: |gap| <= 0.01).
* Staleness alone (once, untimed, after the timed runs): the reference's training with every
  gradient computed on the parameters as they were ``stale_delay`` updates before (the cluster's
  mean staleness, rounded; 2 so far), in one process: ``rmse_local_stale`` and ``rmse_stale_gap``
  (its gap to the reference); over the last 15% of its steps, evaluated every 10 steps, the range
  (``rmse_stale_spread``) and the mean change from one evaluation to the next (``rmse_stale_jitter``);
  the same with no delay (``rmse_fresh*``: the reference itself). Async training's final RMSE is
  one draw from that jitter: it says how far apart two runs that differ only in staleness end.
* ``wall_ps``: the cluster's training span, from the first worker's first step (its ``start``
  record, after the tables exist and both workers joined) to the last worker's last step;
  ``wall_local``: the reference's training loop. ``wall_ratio`` = ``wall_ps / wall_local`` (goal
  <= 1.5). Process start-up (imports, shard start) is outside both and reported apart
  (``startup_ps_s``).
* Where the cluster's time goes: CPU of the worker processes and of the shard processes over the
  span (Linux /proc, sampled every 50 ms), per worker step; and the workers' own split of their
  step time into compute and waiting on pulls and pushes (the trainer's summary).
* ``cpu_ratio``: CPU of the workers and shards over the span over the reference's (same examples).
  Both sides are CPU-bound, so on C cores the cluster's wall cannot go below ``cpu_ratio / C`` of the
  reference's. On a machine shared with other work the wall ratio moves a lot (the 4 cluster
  processes get another share of the cores than the one reference process: 1.45-3.6 over seven
  runs here); the CPU ratio moves less.
Reported: min and median over the repeats (the JSON's headline ``wall_ratio`` is the median
repeat's, the higher of two; ``wall_ratio_min`` the best; ``rmse_gap`` the largest |gap| of any repeat).

Run (about a minute on 2 cores, 20 s with ``--quick``; more beside other work)::

    python bench/recommender.py                  # 2 repeats
    python bench/recommender.py --quick          # smoke run: 300 steps per worker, a smaller task, 1 repeat
    python bench/recommender.py --local-threads 1,2   # the reference also with 2 torch threads
    python bench/recommender.py --json-out bench/out/recommender.json
    python bench/recommender.py --ps-transport grpc   # the workers on gRPC even where shards serve bulk

Prints a table and, as its last line, one line of JSON with at least ``rmse_ps``, ``rmse_local``,
``rmse_gap``, ``wall_ratio`` (and ``wall_ps_s``, ``wall_local_s``, the CPU split, ``best_rmse``: the
noise floor, the ``rmse_*stale*`` / ``rmse_fresh*`` figures). Every process it starts is stopped on exit, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKERS = 2
SHARDS = 2
LEASE_S = 5.0
POLL_S = 0.05


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (Linux /proc; nan elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def start_shards(tmp: str) -> tuple[list[subprocess.Popen], list[str], str]:
    """``SHARDS`` ``tessera ps serve`` processes with no transport flags: (processes, addresses, the
    transport they serve data calls on: "bulk" when their ready line names a bulk port, else "grpc")."""
    from ps.cli import read_first_line, stop_processes

    procs: list[subprocess.Popen] = []
    try:
        for i in range(SHARDS):
            err = open(os.path.join(tmp, f"shard{i}.log"), "w")  # a file: a chatty shard never blocks on a pipe
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tessera.cli", "ps", "serve", "--shard-index", str(i), "--num-shards", str(SHARDS),
                 "--lease", str(LEASE_S)],
                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ))
            err.close()
        deadline = time.monotonic() + 120
        lines = [read_first_line(p, deadline) for p in procs]
        for i, ln in enumerate(lines):
            if "listening on" not in ln:
                with open(os.path.join(tmp, f"shard{i}.log")) as f:
                    raise RuntimeError(f"shard {i} failed to start: {ln!r}; its log ends:\n{f.read()[-2000:]}")
        transport = "bulk" if all(" bulk " in ln for ln in lines) else "grpc"
        return procs, [ln.split("listening on ")[1].split()[0] for ln in lines], transport
    except BaseException:
        stop_processes(procs)
        raise


def records(path: str) -> list[dict[str, Any]]:
    """A worker's metrics records so far (complete lines only)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln.strip()]


def cpu_at(samples: list[tuple[float, list[float]]], t: float, after: bool) -> list[float]:
    """Per-process CPU seconds at wall-clock time ``t``: each process's last sample before it
    (``after`` False) or first sample after it (True), at most ``POLL_S`` off; a process that
    exited before that sample (nan: /proc has it no more) counts its last sample."""
    n = len(samples[0][1])
    seq = samples if after else samples[::-1]
    out = []
    for k in range(n):
        ok = [(ts, c[k]) for ts, c in seq if c[k] == c[k]]
        out.append(next((c for ts, c in ok if (ts >= t if after else ts <= t)), ok[-1][1] if ok else float("nan")))
    return out


def evaluate_on_shards(addrs: list[str], task_opts: dict[str, Any], transport: str) -> dict[str, float]:
    """The task's test metrics on the parameters the shards hold now: the dense table loaded into a
    fresh model's flat buffer, its ``PSEmbedding`` tables bound to a client (rows pulled as read)."""
    import torch

    from ps import PSClient
    from worker.binding import PSEmbedding
    from worker.flat import FlatParams
    from worker.tasks import load_task

    task = load_task("mf", **task_opts)
    model = task.model
    flat = FlatParams.of(model)
    with PSClient(addrs, timeout=60, transport=transport) as client:
        values = client.pull_dense(f"{task.name}/dense", out=torch.empty(flat.numel))
        flat.load_(torch.as_tensor(values))
        for m in model.modules():
            if isinstance(m, PSEmbedding):
                m.client = client
        assert task.evaluate is not None
        return task.evaluate(model)


def run_ps(args: argparse.Namespace, task_opts: dict[str, Any], tmp: str, rep: int) -> dict[str, Any]:
    """One cluster run: fresh shards, 2 async workers to ``--steps``, the shards' final RMSE."""
    from ps.cli import stop_processes
    from worker.launch import worker_command

    t0 = time.time()
    shards, addrs, transport = start_shards(tmp)
    workers: list[subprocess.Popen] = []
    logs = [os.path.join(tmp, f"r{rep}-w{i}.log") for i in range(WORKERS)]
    files = [os.path.join(tmp, f"r{rep}-w{i}.jsonl") for i in range(WORKERS)]
    try:
        t_shards = time.time() - t0
        opts = [f"{k}={json.dumps(v)}" for k, v in task_opts.items()]
        for i in range(WORKERS):
            cmd = worker_command(
                addrs, i, WORKERS, files[i], task="mf", task_opt=opts, mode="async", steps=args.steps,
                batch_size=args.batch_size, lease=LEASE_S, seed=args.seed, ps_transport=args.ps_transport,
            )
            with open(logs[i], "w") as err:
                workers.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err))
        pids = [p.pid for p in workers] + [p.pid for p in shards]
        samples: list[tuple[float, list[float]]] = []
        limit = 120 + args.steps * 2.0  # a hang, never a speed limit
        deadline = time.monotonic() + limit
        while any(p.poll() is None for p in workers):
            samples.append((time.time(), [cpu_seconds(pid) for pid in pids]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not finish in {limit:.0f} s")
            time.sleep(POLL_S)
        for i, p in enumerate(workers):
            if p.returncode != 0:
                with open(logs[i]) as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"worker {i} exited with code {p.returncode}:\n{tail}")
        recs = [records(f) for f in files]
        starts = [r["time"] for rs in recs for r in rs if r["kind"] == "start"]
        ends = [max(r["time"] for r in rs if r["kind"] == "step") for rs in recs]
        summaries = [next(r for r in rs if r["kind"] == "summary") for rs in recs]
        span0, span1 = min(starts), max(ends)
        per = [b - a for a, b in zip(cpu_at(samples, span0, after=False), cpu_at(samples, span1, after=True))]
        evals = [r for r in recs[0] if r["kind"] == "eval" and r.get("final")]
        t_eval = time.time()
        metrics = evaluate_on_shards(addrs, {"seed": args.seed, **task_opts}, "grpc" if args.ps_transport == "grpc" else "auto")
        t_eval = time.time() - t_eval
    finally:
        stop_processes(workers)
        stop_processes(shards, grace=0.5)  # nothing to keep: no drain (~4 s) before the next timed run
    steps = sum(s["steps"] for s in summaries)
    return {
        "rmse": metrics["rmse"], "rmse_w0": evals[-1]["rmse"] if evals else float("nan"),
        "wall": span1 - span0, "startup": span0 - t0, "shard_start": t_shards, "eval_s": t_eval,
        "worker_cpu": sum(per[:WORKERS]), "shard_cpu": sum(per[WORKERS:]), "worker_steps": steps,
        "compute": sum(s["compute_s"] for s in summaries), "pull_wait": sum(s["pull_wait_s"] for s in summaries),
        "push_wait": sum(s["push_wait_s"] for s in summaries), "worker_seconds": sum(s["seconds"] for s in summaries),
        # what the workers' data calls went over: the shards' bulk port where they serve one, unless told gRPC
        "staleness": statistics.mean(s["mean_staleness"] for s in summaries),
        "transport": "grpc" if args.ps_transport == "grpc" else transport,
        "loadavg": os.getloadavg()[0],
    }


def _reference(args: argparse.Namespace, task_opts: dict[str, Any]) -> tuple[Any, Any, list[Any], Any]:
    """The one-process reference's (task, model, optimizers, batches): ``worker.tasks.mf.torch_reference``."""
    import warnings

    from worker.tasks import load_task
    from worker.tasks.mf import MFModel, torch_reference

    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad on sparse grads, every run

    task = load_task("mf", seed=args.seed, **task_opts)
    assert isinstance(task.model, MFModel) and task.evaluate is not None
    model, optimizers = torch_reference(task.model, task.dense_optimizer)
    model.train()
    return task, model, optimizers, task.batches(0, 1, args.batch_size, 0)


def run_local(args: argparse.Namespace, task_opts: dict[str, Any], threads: int) -> dict[str, Any]:
    """The reference in this process: ``WORKERS x steps`` steps of batch ``--batch-size``."""
    import torch

    task, model, optimizers, data = _reference(args, task_opts)
    steps = WORKERS * args.steps
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            b = next(data)
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            loss = task.loss(model, b)
            loss.backward()
            for o in optimizers:
                o.step()
            float(loss.detach())  # as a worker does: the loss is read every step
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(before)
    return {"rmse": task.evaluate(model)["rmse"], "wall": wall, "cpu": cpu, "steps": steps, "threads": threads,
            "best_rmse": task.info["best_rmse"]}


def stale_curve(args: argparse.Namespace, task_opts: dict[str, Any], delay: int) -> dict[str, Any]:
    """What staleness alone does to the test RMSE: the reference's training (same model, examples,
    optimizers) with every step's gradient computed on the parameters as they were ``delay`` updates
    before (0: the reference itself), evaluated every 10 steps over the last 15% of the steps.
    Untimed; one thread. Returns its final RMSE, the range of the evaluations and their mean absolute
    change from one to the next (``jitter``)."""
    import collections
    import copy

    import torch

    task, model, optimizers, data = _reference(args, task_opts)
    stale = copy.deepcopy(model)  # computes each gradient, from a snapshot
    params, stale_params = list(model.parameters()), list(stale.parameters())
    ring = collections.deque([[p.detach().clone() for p in params]], maxlen=delay + 1)  # ring[0]: `delay` updates ago
    steps = WORKERS * args.steps
    curve = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(steps):
            with torch.no_grad():
                for q, old in zip(stale_params, ring[0]):
                    q.copy_(old)
            for q in stale_params:
                q.grad = None
            task.loss(stale, next(data)).backward()
            for p, q in zip(params, stale_params):
                p.grad = q.grad
            for o in optimizers:
                o.step()
            ring.append([p.detach().clone() for p in params])
            if s >= 0.85 * steps and s % 10 == 9:
                curve.append(task.evaluate(model)["rmse"])
    finally:
        torch.set_num_threads(before)
    # how much it moves from one evaluation to the next, 10 steps apart (the trend alone: ~0.0002 per 10 steps at the end)
    jitter = statistics.mean(abs(b - a) for a, b in zip(curve, curve[1:]))
    return {"delay": delay, "rmse": curve[-1], "min": min(curve), "max": max(curve), "jitter": jitter}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 steps per worker, 1 repeat, 300 users x 150 items, 40k ratings")
    ap.add_argument("--repeats", type=int, default=None, help="cluster + reference runs (default 2, quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per worker (default 1000, quick 300); the reference runs 2x")
    ap.add_argument("--local-threads", default="1", help="torch thread counts of the reference's runs, comma-separated (default 1); the fastest is the baseline")
    ap.add_argument("--batch-size", type=int, default=256, help="per worker and the reference's (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="the task's seed (data, initial weights)")
    ap.add_argument("--ps-transport", default="auto", choices=["auto", "grpc"], help="the workers' --ps-transport (default auto)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.steps = args.steps or (300 if args.quick else 1000)
    try:
        args.local_threads = sorted({int(x) for x in args.local_threads.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--local-threads: comma-separated thread counts, e.g. 1,2; got {args.local_threads!r}")
    if args.repeats < 1 or args.steps < 10 or args.batch_size < 1 or not args.local_threads or min(args.local_threads) < 1:
        ap.error("--repeats must be >= 1, --steps >= 10, --batch-size >= 1, --local-threads counts >= 1")
    task_opts: dict[str, Any] = {"users": 300, "items": 150, "train_size": 40_000, "test_size": 5000} if args.quick else {}

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    tmp = tempfile.mkdtemp(prefix="tessera-recommender-")
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    ps_runs: list[dict[str, Any]] = []
    local_runs: list[dict[str, Any]] = []
    try:
        import worker.tasks.mf  # noqa: F401 - torch and the task imported before any timing

        for rep in range(args.repeats):
            log(f"repeat {rep + 1}/{args.repeats}: 2 shards + 2 async workers x {args.steps} steps, batch {args.batch_size}; "
                f"one process x {WORKERS * args.steps} steps ({'cluster first' if rep % 2 == 0 else 'one process first'})")
            # the order alternates: load that drifts over the run hits both alike
            for what in ("ps", "local") if rep % 2 == 0 else ("local", "ps"):
                if what == "ps":
                    r = run_ps(args, task_opts, tmp, rep)
                    ps_runs.append(r)
                    log(f"  cluster: rmse {r['rmse']:.4f}, training {r['wall']:.2f} s (start-up {r['startup']:.1f} s, "
                        f"transport {r['transport']})")
                    continue
                for threads in args.local_threads:
                    lr = run_local(args, task_opts, threads)
                    lr["rep"] = rep
                    local_runs.append(lr)
                    log(f"  one process, {threads} thread(s): rmse {lr['rmse']:.4f}, training {lr['wall']:.2f} s")
        # the cluster's staleness alone, in one process (untimed, after every timed run): how far apart two
        # runs that differ only in it end, and how much the async model's RMSE moves from one step to the next
        delay = max(1, round(statistics.mean(r["staleness"] for r in ps_runs)))
        curves = [stale_curve(args, task_opts, d) for d in (0, delay)]
        log(f"  one process, gradients {delay} updates stale: rmse {curves[1]['rmse']:.4f}, moving {curves[1]['jitter']:.4f} per 10 steps "
            f"at the end ({curves[0]['jitter']:.4f} with fresh gradients)")
    except KeyboardInterrupt:
        log("interrupted: every process stopped")
        return 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report(args, ps_runs, local_runs, curves, load0, time.perf_counter() - t_start)


def report(args: argparse.Namespace, ps_runs: list[dict[str, Any]], local_runs: list[dict[str, Any]], curves: list[dict[str, Any]],
           load0: float, total_s: float) -> int:
    # per repeat: the cluster against that repeat's faster reference (1 or 2 threads)
    rows = []
    for rep, p in enumerate(ps_runs):
        loc = min((x for x in local_runs if x["rep"] == rep), key=lambda x: x["wall"])
        rows.append((p, loc, p["wall"] / loc["wall"], p["rmse"] - loc["rmse"]))
    # the median repeat; of an even count the higher one (the figures never flatter the cluster)
    med = sorted(rows, key=lambda r: r[2])[len(rows) // 2]
    p, loc = med[0], med[1]
    examples = args.steps * WORKERS * args.batch_size
    hdr = f"{'run':<26} {'test rmse':>9} {'wall s':>7} {'ex/s':>9} {'cpu wkr':>8} {'cpu shd':>8} {'compute':>8} {'pull w':>7} {'push w':>7}  notes"
    lines = [hdr, "-" * len(hdr)]
    for rep, (pr, lr_, ratio, gap) in enumerate(rows):
        wall_w = pr["worker_seconds"] or 1.0
        lines.append(
            f"{f'2x2 async, repeat {rep + 1}':<26} {pr['rmse']:>9.4f} {pr['wall']:>7.2f} {examples / pr['wall']:>9,.0f} "
            f"{1e3 * pr['worker_cpu'] / pr['worker_steps']:>8.2f} {1e3 * pr['shard_cpu'] / pr['worker_steps']:>8.2f} "
            f"{pr['compute'] / wall_w:>8.0%} {pr['pull_wait'] / wall_w:>7.0%} {pr['push_wait'] / wall_w:>7.0%}  "
            f"wall ratio {ratio:.2f}, cpu ratio {(pr['worker_cpu'] + pr['shard_cpu']) / lr_['cpu']:.2f}, gap {gap:+.4f}, "
            f"{pr['transport']}, staleness {pr['staleness']:.1f}"
        )
        for x in (x for x in local_runs if x["rep"] == rep):
            lines.append(
                f"{'  one process, %d thread(s)' % x['threads']:<26} "
                f"{x['rmse']:>9.4f} {x['wall']:>7.2f} {examples / x['wall']:>9,.0f} {1e3 * x['cpu'] / x['steps']:>8.2f} {'-':>8} "
                f"{'100%':>8} {'-':>7} {'-':>7}  {'baseline' if x is lr_ else ''}"
            )
    ratios: list[float] = [float(r[2]) for r in rows]
    gaps: list[float] = [float(r[3]) for r in rows]
    print(
        f"\nRecommender benchmark: mf ({args.steps} steps x batch {args.batch_size} per worker, 2 workers async, 2 shards) "
        f"vs one torch process ({WORKERS * args.steps} steps x batch {args.batch_size}); {os.cpu_count()} CPUs, "
        f"load average {load0:.1f} at the start\n"
        "wall: training span; cpu wkr / cpu shd: CPU ms of the worker / shard processes per worker step over the span "
        "(one process: its CPU per step of its own); compute / pull w / push w: shares of the workers' step time\n"
    )
    print("\n".join(lines))
    out: dict[str, Any] = {
        "rmse_ps": round(p["rmse"], 5), "rmse_local": round(loc["rmse"], 5),
        "rmse_gap": round(float(max(gaps, key=abs)), 5), "rmse_gap_median_repeat": round(med[3], 5),
        "rmse_ps_w0": round(p["rmse_w0"], 5), "best_rmse": round(loc["best_rmse"], 5),
        "wall_ratio": round(med[2], 4), "wall_ratio_min": round(min(ratios), 4), "wall_ratio_median": round(statistics.median(ratios), 4),
        "wall_ps_s": round(p["wall"], 3), "wall_local_s": round(loc["wall"], 3), "local_threads": loc["threads"],
        "wall_ps_min_s": round(min(r["wall"] for r in ps_runs), 3),
        "wall_local_min_s": round(min(x["wall"] for x in local_runs), 3),
        "startup_ps_s": round(p["startup"], 2),
        "worker_cpu_ms_per_step": round(1e3 * p["worker_cpu"] / p["worker_steps"], 3),
        "shard_cpu_ms_per_step": round(1e3 * p["shard_cpu"] / p["worker_steps"], 3),
        "local_cpu_ms_per_step": round(1e3 * loc["cpu"] / loc["steps"], 3),
        # CPU of workers + shards over the span / the one process's (same examples): on C cores the
        # cluster's wall cannot go below cpu_ratio / C of a CPU-bound one-process run
        "cpu_ratio": round((p["worker_cpu"] + p["shard_cpu"]) / loc["cpu"], 4),
        "compute_frac": round(p["compute"] / p["worker_seconds"], 4),
        "pull_wait_frac": round(p["pull_wait"] / p["worker_seconds"], 4),
        "push_wait_frac": round(p["push_wait"] / p["worker_seconds"], 4),
        "mean_staleness": round(p["staleness"], 3), "transport": p["transport"], "ps_transport": args.ps_transport,
        "steps": args.steps, "batch_size": args.batch_size, "workers": WORKERS, "shards": SHARDS, "examples": examples,
        "repeats": args.repeats, "quick": args.quick, "cpus": os.cpu_count(), "total_s": round(total_s, 1),
        "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
        # the reference trained on gradients `stale_delay` updates old (the cluster's mean staleness): its final
        # RMSE, and the spread of its RMSE over the last 15% of its steps; the same spread with fresh gradients
        "stale_delay": curves[1]["delay"], "rmse_local_stale": round(curves[1]["rmse"], 5),
        "rmse_stale_gap": round(curves[1]["rmse"] - loc["rmse"], 5),
        "rmse_stale_spread": [round(curves[1]["min"], 5), round(curves[1]["max"], 5)], "rmse_stale_jitter": round(curves[1]["jitter"], 5),
        "rmse_fresh": round(curves[0]["rmse"], 5), "rmse_fresh_spread": [round(curves[0]["min"], 5), round(curves[0]["max"], 5)], "rmse_fresh_jitter": round(curves[0]["jitter"], 5),
    }
    print(
        f"\nrmse_ps {out['rmse_ps']:.4f} vs rmse_local {out['rmse_local']:.4f} (median repeat; largest gap of any repeat "
        f"{out['rmse_gap']:+.4f}, goal |gap| <= 0.01; "
        f"noise floor {out['best_rmse']:.4f}; staleness alone, in one process with gradients {out['stale_delay']} updates old: "
        f"gap {out['rmse_stale_gap']:+.4f}; over the last 15% of its steps the RMSE moves {out['rmse_stale_jitter']:.4f} per 10 "
        f"steps, against {out['rmse_fresh_jitter']:.4f} with fresh gradients); wall_ratio {out['wall_ratio']:.2f} (median repeat, the higher of two; min {out['wall_ratio_min']:.2f}; "
        f"goal <= 1.5): cluster {out['wall_ps_s']:.2f} s vs one process {out['wall_local_s']:.2f} s ({loc['threads']} thread(s)); "
        f"CPU per worker step: workers {out['worker_cpu_ms_per_step']:.2f} ms + shards {out['shard_cpu_ms_per_step']:.2f} ms "
        f"vs {out['local_cpu_ms_per_step']:.2f} ms per one-process step; total {total_s:.0f} s\n"
    )
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
