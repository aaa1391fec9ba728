"""Fault benchmark: what replication costs, and what a primary's crash costs, on loopback.

Measures in one run (every shard and worker its own process, all on 127.0.0.1):

(1) ``ctr`` in async mode, 2 ``tessera worker`` processes, against 2 shards each with a backup
    (4 ``tessera ps serve`` processes: the primaries, then one ``--backup-of`` each; the run
    starts once every primary reports its backup attached). Workers get ``--ps P0|B0,P1|B1``.
    Run A trains undisturbed; run B is the same run (same seed, fresh shards) in which primary
    P0 is SIGKILLed as soon as worker 0's metrics file shows a step past ``steps / 2``.
(2) The baseline for replication's cost, measured in the same run: run C, the same training
    against 2 plain shards (``--ps P0,P1``, no backups). Replicated and plain runs alternate
    (A1 C1 [B] C2 A2 with ``--repeats 2``) so that drift of the machine's load hits both.
(3) A load test: one shard (no backup), ``--load-clients`` client *processes* (8, --quick 2; processes
    because in threads the clients' own Python work, serialised by one GIL, would be what is
    measured, not the shard) that each loop pull_sparse + push_sparse of 1024 ids x dim 16 (from
    a pre-populated table of ``--load-rows`` rows, so the table does not grow during the test)
    and a push_dense of 4096 floats, for ``--load-seconds`` (30). Every op's latency is recorded;
    every exception counts as an error. The shard's RSS (/proc/<pid>/status VmRSS) is read when
    the clients start, every 0.5 s, and when they end.

Figures.
- ``failover_s``: from the SIGKILL to the first worker step record written after the backup
  reported itself primary: the time training stood still (within one metrics block, 10 steps).
  Also ``promote_s`` (kill -> backup's Stats say role "primary", polled every 50 ms) and
  ``write_resume_s`` (kill -> the first push issued after the kill by a separate probe client,
  through ``P0|B0``, acknowledged: what any client sees, its backoff included).
- ``lost_updates``: acknowledged updates the shards do not hold. Every client counts its
  acknowledged updates per ``table@shard`` (``PSClient.acked``: dense = async pushes applied,
  sparse = rows applied; the workers report them in their ``summary`` record). After the run a
  checkpoint of every shard (``PSClient.checkpoint(-1)``, each shard has a ``--checkpoint-dir``)
  says what was applied: dense = the slice's version (pushes applied; the initial ASSIGN does not
  count), sparse = the sum of the row versions (rows applied). lost = sum(max(0, acked -
  applied)), ``double_applied`` = sum(max(0, applied - acked)). The same accounting runs for the
  fault-free runs, where both must be 0 for the method to be trusted (``fault_free_lost``,
  ``fault_free_double``). The shards' ``Stats`` counts are reported beside (``stats_*``).
- ``metric_delta``: final test AUC of run B minus run A (worker 0's final eval; async runs vary a
  little between identical runs: ``auc_repeat_delta`` is A2 - A1 when there are 2 repeats).
- ``replication_throughput_ratio``: steady examples/s (both workers summed, metrics records
  after the first 20% of steps) replicated / unreplicated: median of the A runs over median of
  the C runs; ``_min``/``_max`` are the pairs' (A_i / C_i) extremes.
- Load: p50/p99 latency per op (ms), ops/s, ``load_errors``, shard ``rss_start_mb``,
  ``rss_mid_mb`` (half-way), ``rss_end_mb``, ``rss_peak_mb``, ``rss_growth_mb`` (end - start).
  The baseline in the same run: one client alone for ``--load-base-seconds`` first (``base_*``).
  CPU (Linux /proc, cores used over the phase): ``load_shard_cpu`` / ``base_shard_cpu`` for the
  shard, ``load_clients_cpu`` / ``base_client_cpu`` for the client processes.

Goals (issue): lost_updates == 0, failover_s <= 5, |metric_delta| <= 0.01,
replication_throughput_ratio >= 0.7, load_errors == 0. The JSON's ``goals`` says which are met;
the exit code is 0 whenever the measurements completed (goals missed included), 1 when a run
failed (a worker crashed, no summary...): the JSON is printed either way, with null where a
figure could not be measured.

Run (about 2-3 minutes on 2 cores)::

    python bench/faults.py                   # full run
    python bench/faults.py --quick           # smoke run (45-75 s): few steps, 1 repeat, 3 s load test of 2 clients
    python bench/faults.py --json-out bench/out/faults.json

It prints a table and, as its last line, one line of JSON. Every child process is stopped on
exit, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
SHARDS = 2
WORKERS = 2
LOAD_IDS, LOAD_DIM, LOAD_DENSE = 1024, 16, 4096
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[faults {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MB (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


# =========================================================================== cluster
@dataclass
class Shard:
    proc: subprocess.Popen
    address: str
    log: str
    ckpt: str


@dataclass
class Cluster:
    """2 shards, optionally each with a backup. ``spec`` is what ``--ps`` gets."""

    primaries: list[Shard]
    backups: list[Shard]

    @property
    def spec(self) -> str:
        if self.backups:
            return ",".join(f"{p.address}|{b.address}" for p, b in zip(self.primaries, self.backups))
        return ",".join(p.address for p in self.primaries)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [s.proc for s in self.primaries + self.backups]


def spawn_shards(
    specs: list[tuple[int, list[str]]], tmp: str, tag: str, timeout: float = 90.0, num_shards: int = SHARDS
) -> list[Shard]:
    """Start one ``tessera ps serve`` per (shard index, extra args), concurrently; wait for each port.

    Each gets its own checkpoint directory and a log file for its stderr."""
    from ps.cli import read_first_line

    started: list[tuple[subprocess.Popen, str, str]] = []
    try:
        for k, (i, extra) in enumerate(specs):
            logp = os.path.join(tmp, f"{tag}-shard{i}-{k}.log")
            ckpt = os.path.join(tmp, f"{tag}-ckpt{i}-{k}")
            with open(logp, "w") as lf:
                p = subprocess.Popen(
                    [sys.executable, "-m", "tessera.cli", "ps", "serve", "--shard-index", str(i), "--num-shards", str(num_shards),
                     "--checkpoint-dir", ckpt, *extra],
                    stdout=subprocess.PIPE, stderr=lf, text=True, env=_env(), cwd=ROOT,
                )
            started.append((p, logp, ckpt))
        deadline = time.monotonic() + timeout
        out = []
        for p, logp, ckpt in started:
            line = read_first_line(p, deadline)
            if "listening on" not in line:
                raise RuntimeError(f"shard failed to start: {line!r}\n{tail(logp)}")
            out.append(Shard(p, line.split("listening on ")[1].split()[0], logp, ckpt))
        return out
    except BaseException:
        stop_all([p for p, _, _ in started])
        raise


def stop_all(procs: list[subprocess.Popen]) -> None:
    from ps.cli import stop_processes

    stop_processes(procs, grace=5.0)
    for p in procs:
        if p.stdout is not None:
            p.stdout.close()


def start_cluster(replicated: bool, tmp: str, tag: str, failover: float, timeout: float = 90.0) -> Cluster:
    primaries = spawn_shards([(i, []) for i in range(SHARDS)], tmp, tag, timeout)
    backups: list[Shard] = []
    try:
        if replicated:
            backups = spawn_shards(
                [(i, ["--backup-of", p.address, "--failover", str(failover)]) for i, p in enumerate(primaries)], tmp, tag, timeout
            )
            wait_attached(primaries, backups, timeout)
    except BaseException:
        stop_all([s.proc for s in primaries + backups])
        raise
    return Cluster(primaries, backups)


def wait_attached(primaries: list[Shard], backups: list[Shard], timeout: float) -> None:
    """Until every primary's Stats name its backup as attached."""
    from ps.client import PSClient

    deadline = time.monotonic() + timeout
    for p, b in zip(primaries, backups):
        with PSClient([p.address], timeout=5, retry_timeout=5) as c:
            while True:
                try:
                    if c.stats()[0].backup:
                        break
                except Exception:  # noqa: BLE001 - not up yet: retry until the deadline
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"backup {b.address} did not attach to {p.address} within {timeout:.0f} s\n{tail(b.log)}")
                time.sleep(0.05)


# =========================================================================== training runs
@dataclass
class Run:
    name: str
    replicated: bool
    fault: bool
    records: dict[str, list[dict]] = field(default_factory=dict)  # worker -> step/eval/summary records
    summaries: dict[str, dict] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    eps: float | None = None  # steady examples/s, workers summed
    eps_summary: float | None = None  # summaries' examples/s, workers summed
    auc: float | None = None
    acked: Counter = field(default_factory=Counter)
    applied: Counter = field(default_factory=Counter)
    stats_applied: Counter = field(default_factory=Counter)
    lost: int | None = None
    double: int | None = None
    stats_lost: int | None = None
    wall_s: float = 0.0
    # fault runs
    kill_step: int | None = None
    promote_s: float | None = None
    write_resume_s: float | None = None
    failover_s: float | None = None
    max_gap_s: float | None = None


class MetricsTail:
    """Reads the complete JSON lines appended to a metrics file so far."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.buf = path, 0, ""

    def read(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def train(run: Run, cluster: Cluster, args: argparse.Namespace, tmp: str, tag: str) -> None:
    """``WORKERS`` ``tessera worker`` processes against ``cluster``; with ``run.fault``, SIGKILL
    primary 0 once worker 0 is past half its steps and time the failover."""
    from ps.client import PSClient

    steps = args.steps
    procs: list[subprocess.Popen] = []
    tails: dict[str, MetricsTail] = {}
    logs: dict[str, str] = {}
    probe: PSClient | None = None
    watch: PSClient | None = None
    t_kill: float | None = None
    t_promoted: list[float] = []
    t_write: list[float] = []
    probe_err: list[str] = []
    if run.fault:
        # a probe client of our own, to time when writes through P0|B0 are acknowledged again
        probe = PSClient(cluster.spec, timeout=5, retry_timeout=60)
        probe.create_dense("fault_probe", (64,), "sgd", lr=0.01)  # zeros are pushed: values stay
        probe.push_dense("fault_probe", __import__("numpy").zeros(64, "float32"))
        watch = PSClient([cluster.backups[0].address], timeout=1, retry_timeout=0.2, retries=0)
    t_start = time.monotonic()
    try:
        for i in range(WORKERS):
            name = f"w{i}"
            mpath = os.path.join(tmp, f"{tag}-metrics-{name}.jsonl")
            logs[name] = os.path.join(tmp, f"{tag}-{name}.log")
            tails[name] = MetricsTail(mpath)
            run.records[name] = []
            with open(logs[name], "w") as lf:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tessera.cli", "worker", "--ps", cluster.spec, "--task", "ctr",
                     "--task-opt", f"test_size={args.test_size}", "--mode", "async", "--steps", str(steps),
                     "--batch-size", str(args.batch_size), "--worker-index", str(i), "--num-workers", str(WORKERS),
                     "--seed", str(args.seed), "--metrics-out", mpath, "--no-progress", "--torch-threads", "1",
                     "--device", "cpu", "--retry-timeout", str(args.retry_timeout)],
                    stdout=subprocess.DEVNULL, stderr=lf, env=_env(), cwd=ROOT,
                ))
        deadline = time.monotonic() + args.run_timeout
        last_step = {n: 0 for n in tails}

        def on_kill() -> None:
            assert probe is not None and watch is not None and t_kill is not None
            try:  # one push issued after the kill: returns once the shard group takes writes again
                probe.push_dense("fault_probe", __import__("numpy").zeros(64, "float32"))
                t_write.append(time.time())
            except Exception as e:  # noqa: BLE001 - reported
                probe_err.append(f"{type(e).__name__}: {e}")

        def on_watch() -> None:
            assert watch is not None
            end = time.monotonic() + max(30.0, args.retry_timeout)
            while time.monotonic() < end:
                try:
                    if watch.stats()[0].role == "primary":
                        t_promoted.append(time.time())
                        return
                except Exception:  # noqa: BLE001 - busy or not answering: poll again
                    pass
                time.sleep(0.05)

        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run.name}: workers still running after {args.run_timeout:.0f} s")
            for n, t in tails.items():
                for r in t.read():
                    run.records[n].append(r)
                    if r.get("kind") == "step":
                        last_step[n] = r["step"]
            if run.fault and t_kill is None and last_step["w0"] > steps // 2:
                run.kill_step = last_step["w0"]
                cluster.primaries[0].proc.send_signal(signal.SIGKILL)
                t_kill = time.time()
                log(f"{run.name}: SIGKILL primary 0 ({cluster.primaries[0].address}) at worker 0 step {run.kill_step}")
                threading.Thread(target=on_kill, daemon=True).start()
                threading.Thread(target=on_watch, daemon=True).start()
            time.sleep(0.02)
        for n, t in tails.items():
            run.records[n] += t.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        run.wall_s = time.monotonic() - t_start
    for (n, p) in zip(tails, procs):
        if p.returncode != 0:
            run.failures.append(f"{run.name}: worker {n} exited with {p.returncode}:\n{tail(logs[n], 2000)}")
    for n, recs in run.records.items():
        s = [r for r in recs if r.get("kind") == "summary"]
        if s:
            run.summaries[n] = s[-1]
        elif not any(n in f for f in run.failures):
            run.failures.append(f"{run.name}: worker {n} wrote no summary:\n{tail(logs[n], 2000)}")
    # throughput
    if len(run.summaries) == WORKERS:
        run.eps_summary = sum(s["examples_per_s"] for s in run.summaries.values())
    per = []
    for n, recs in run.records.items():
        st = [r for r in recs if r.get("kind") == "step"]
        warm = [r for r in st if r["step"] >= max(1, int(0.2 * steps))]
        if len(warm) >= 2 and warm[-1]["time"] > warm[0]["time"]:
            per.append((warm[-1]["step"] - warm[0]["step"]) * args.batch_size / (warm[-1]["time"] - warm[0]["time"]))
    run.eps = sum(per) if len(per) == WORKERS else None
    finals = [r for r in run.records.get("w0", []) if r.get("kind") == "eval" and r.get("final")]
    run.auc = finals[-1].get("auc") if finals else run.summaries.get("w0", {}).get("auc")
    # acknowledged updates (the probe's too)
    for s in run.summaries.values():
        run.acked.update({k: int(v) for k, v in (s.get("acked") or {}).items()})
    if probe is not None:
        run.acked.update(probe.acked)
        probe.close()
    if watch is not None:
        watch.close()
    if run.fault:
        if probe_err:
            run.failures.append(f"{run.name}: the probe push after the kill failed: {probe_err[0]}")
        if t_kill is None:
            run.failures.append(f"{run.name}: worker 0 never got past step {steps // 2}; no kill")
        else:
            run.write_resume_s = t_write[0] - t_kill if t_write else None
            run.promote_s = t_promoted[0] - t_kill if t_promoted else None
            after = [r["time"] for recs in run.records.values() for r in recs
                     if r.get("kind") == "step" and t_promoted and r["time"] > t_promoted[0]]
            run.failover_s = min(after) - t_kill if after else None
            gaps = []
            for recs in run.records.values():
                ts = [r["time"] for r in recs if r.get("kind") == "step"]
                gaps += [b - a for a, b in zip(ts, ts[1:]) if b > t_kill]
            run.max_gap_s = max(gaps) if gaps else None
            if run.promote_s is None:
                run.failures.append(f"{run.name}: backup 0 never reported role 'primary' after the kill")


def account(run: Run, cluster: Cluster) -> None:
    """What the shards applied (a checkpoint of each, and their Stats) against what was acked."""
    import numpy as np

    from ps.checkpoint import read_checkpoint
    from ps.cli import is_internal_table
    from ps.client import PSClient

    with PSClient(cluster.spec, timeout=30, retry_timeout=10) as c:
        stats = c.stats()
        paths = c.checkpoint(-1)
    for i, s in enumerate(stats):
        for t in s.tables:
            run.stats_applied[f"{t.name}@{i}"] += t.version
    for i, (path, _) in enumerate(paths):
        snap = read_checkpoint(path)
        for t in snap.tables:
            key = f"{t['spec']['name']}@{i}"
            if t["kind"] == "dense":
                run.applied[key] += int(t["version"])
            else:
                run.applied[key] += int(np.asarray(t["versions"], np.int64).sum())

    def diff(applied: Counter) -> tuple[int, int]:
        # the trainer's own bookkeeping tables (each worker's clock record, the ready mark) left out
        keys = {k for k in set(run.acked) | set(applied) if not is_internal_table(k.rsplit("@", 1)[0])}
        lost = sum(max(0, run.acked[k] - applied[k]) for k in keys)
        double = sum(max(0, applied[k] - run.acked[k]) for k in keys)
        return lost, double

    run.lost, run.double = diff(run.applied)
    run.stats_lost, _ = diff(run.stats_applied)


def training_run(name: str, replicated: bool, fault: bool, args: argparse.Namespace, tmp: str, live: list) -> Run:
    run = Run(name, replicated, fault)
    log(f"{name}: starting {'2 primaries + 2 backups' if replicated else '2 plain shards'}")
    cluster = start_cluster(replicated, tmp, name, args.failover)
    live.append(cluster)
    try:
        log(f"{name}: training ({WORKERS} workers, {args.steps} steps x {args.batch_size}, --ps {cluster.spec})")
        train(run, cluster, args, tmp, name)
        if len(run.summaries) == WORKERS:
            account(run, cluster)
            if run.lost or run.double:
                log(f"{name}: acked {dict(run.acked)} applied {dict(run.applied)}")
    except Exception as e:  # noqa: BLE001 - a failed run is reported, the others still run
        run.failures.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    finally:
        stop_all(cluster.procs)
        live.remove(cluster)
    extra = ""
    if fault:
        extra = f", promote {_f(run.promote_s, 2)} s, writes back {_f(run.write_resume_s, 2)} s, training back {_f(run.failover_s, 2)} s"
    log(f"{name}: {_f(run.eps, 0)} ex/s, auc {_f(run.auc, 4)}, lost {run.lost}, double {run.double}{extra}"
        + (f"; FAILED: {run.failures[0].splitlines()[0]}" if run.failures else ""))
    return run


# =========================================================================== load test
def load_client(address: str, rows: int, index: int) -> int:
    """One load-test client process. Prints "ready"; then for every "go SECONDS" line on stdin
    loops pull_sparse + push_sparse + push_dense for SECONDS and prints one JSON line (latencies in
    ms per op, errors, the loop's own span); exits at EOF."""
    import numpy as np

    from ps.client import PSClient

    rng = np.random.default_rng(1000 + index)
    with PSClient([address], timeout=30, retry_timeout=5) as c:
        c.describe("load_emb")
        c.describe("load_dense")
        grads = (rng.standard_normal((LOAD_IDS, LOAD_DIM)) * 1e-3).astype(np.float32)
        dense = (rng.standard_normal(LOAD_DENSE) * 1e-3).astype(np.float32)
        print("ready", flush=True)
        for cmd in sys.stdin:
            if not cmd.startswith("go "):
                break
            seconds = float(cmd.split()[1])
            lat: dict[str, list[float]] = {"pull_sparse": [], "push_sparse": [], "push_dense": []}
            errors: list[str] = []
            nerr = 0
            t_begin = time.perf_counter()
            end = t_begin + seconds
            while time.perf_counter() < end:
                ids = rng.integers(0, rows, LOAD_IDS, dtype=np.int64)
                for op, fn in (
                    ("pull_sparse", lambda: c.pull_sparse("load_emb", ids)),
                    ("push_sparse", lambda: c.push_sparse("load_emb", ids, grads)),
                    ("push_dense", lambda: c.push_dense("load_dense", dense)),
                ):
                    t0 = time.perf_counter()
                    try:
                        fn()
                        lat[op].append((time.perf_counter() - t0) * 1e3)
                    except Exception as e:  # noqa: BLE001 - every failure counts
                        nerr += 1
                        if len(errors) < 5:
                            errors.append(f"{op}: {type(e).__name__}: {e}"[:500])
            span = time.perf_counter() - t_begin
            print(json.dumps({"lat": lat, "errors": nerr, "samples": errors, "span": span}), flush=True)
    return 0


def _phase(clients: list[subprocess.Popen], seconds: float, timeout: float, on_tick: Any = None) -> list[dict | str]:
    """Send "go SECONDS" to every client; each one's JSON result (or why there is none)."""
    from ps.cli import read_first_line

    for q in clients:
        assert q.stdin is not None
        q.stdin.write(f"go {seconds}\n")
        q.stdin.flush()
    deadline = time.monotonic() + seconds + timeout
    out: list[dict | str] = []
    for q in clients:
        while True:
            line = read_first_line(q, min(deadline, time.monotonic() + 0.5))
            if line == "timed out" and time.monotonic() < deadline:
                if on_tick is not None:
                    on_tick()
                continue
            break
        out.append(json.loads(line) if line.startswith("{") else f"client {clients.index(q)}: {line.strip() or 'no output'}")
    return out


def _pool(results: list[dict | str], label: str) -> dict[str, Any]:
    """Latency percentiles per op and errors over the clients' results of one phase."""
    import numpy as np

    lat: dict[str, list[float]] = {}
    errors, samples, spans = 0, [], []
    for r in results:
        if isinstance(r, str):
            errors += 1
            samples.append(r)
            continue
        errors += r["errors"]
        samples += r["samples"]
        spans.append(r["span"])
        for op, v in r["lat"].items():
            lat.setdefault(op, []).extend(v)
    span = statistics.mean(spans) if spans else 0.0
    ops = {}
    for op, v in lat.items():
        a = np.asarray(v)
        ops[op] = {
            "n": int(a.size), "per_s": a.size / span if span else 0.0,
            "p50_ms": float(np.percentile(a, 50)) if a.size else None,
            "p99_ms": float(np.percentile(a, 99)) if a.size else None,
            "max_ms": float(a.max()) if a.size else None,
        }
    return {"label": label, "errors": errors, "samples": samples[:5], "seconds": span, "ops": ops}


def load_test(args: argparse.Namespace, tmp: str, live: list) -> dict[str, Any]:
    """One shard; first one client alone (the unloaded baseline), then all clients at once."""
    import numpy as np

    from ps.cli import read_first_line
    from ps.client import PSClient

    res: dict[str, Any] = {"failures": []}
    log(f"load: 1 shard, 1 client for {args.load_base_seconds:.0f} s, then {args.load_clients} client processes for {args.load_seconds:.0f} s")
    (shard,) = spawn_shards([(0, [])], tmp, "load", num_shards=1)
    cluster = Cluster([shard], [])
    live.append(cluster)
    clients: list[subprocess.Popen] = []
    pid = shard.proc.pid
    try:
        with PSClient([shard.address], timeout=60) as c:
            c.create_sparse("load_emb", LOAD_DIM, "adagrad", lr=0.01)
            c.create_dense("load_dense", (LOAD_DENSE,), "sgd", lr=0.01)
            for lo in range(0, args.load_rows, 1 << 15):  # every row exists before the clock starts
                c.pull_sparse("load_emb", np.arange(lo, min(args.load_rows, lo + (1 << 15)), dtype=np.int64))
            for i in range(args.load_clients):
                with open(os.path.join(tmp, f"load-client{i}.log"), "w") as lf:
                    clients.append(subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--load-client", shard.address,
                         "--load-rows", str(args.load_rows), "--client-index", str(i)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=lf, text=True, env=_env(), cwd=ROOT,
                    ))
            deadline = time.monotonic() + 120
            for i, q in enumerate(clients):
                got = read_first_line(q, deadline)
                if got.strip() != "ready":
                    raise RuntimeError(f"load client {i} failed to start: {got!r}\n{tail(os.path.join(tmp, f'load-client{i}.log'))}")
            if args.load_base_seconds > 0:
                c0, t0, k0 = cpu_s(pid), time.monotonic(), cpu_s(clients[0].pid) or 0
                res["base"] = _pool(_phase(clients[:1], args.load_base_seconds, 120), "1 client")
                res["base"]["clients_cpu"] = ((cpu_s(clients[0].pid) or 0) - k0) / (time.monotonic() - t0)
                res["base"]["shard_cpu"] = ((cpu_s(pid) or 0) - (c0 or 0)) / (time.monotonic() - t0)
            rss0 = rss_mb(pid)
            samples: list[tuple[float, float | None]] = [(0.0, rss0)]
            c0, t0 = cpu_s(pid), time.monotonic()
            k0 = sum(cpu_s(q.pid) or 0 for q in clients)
            res["load"] = _pool(
                _phase(clients, args.load_seconds, 120, lambda: samples.append((time.monotonic() - t0, rss_mb(pid)))),
                f"{len(clients)} clients",
            )
            res["load"]["clients_cpu"] = (sum(cpu_s(q.pid) or 0 for q in clients) - k0) / (time.monotonic() - t0)
            res["load"]["shard_cpu"] = ((cpu_s(pid) or 0) - (c0 or 0)) / (time.monotonic() - t0)
            rss1 = rss_mb(pid)
            mid = [r for t, r in samples if t >= args.load_seconds / 2 and r is not None]
            res["rss_mid_mb"] = mid[0] if mid else None
            stats = c.stats()[0]
        res.update(
            rss_start_mb=rss0, rss_end_mb=rss1, rss_peak_mb=max(x for x in [r for _, r in samples] + [rss1] if x is not None) if rss0 else None,
            shard_errors=sum(stats.errors.values()), rows=sum(t.rows for t in stats.tables if t.name == "load_emb"),
        )
    except Exception as e:  # noqa: BLE001 - reported
        res["failures"].append(f"load: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    finally:
        for q in clients:
            for s_ in (q.stdin,):
                if s_ is not None:
                    try:
                        s_.close()  # EOF: the client exits
                    except OSError:
                        pass
        end = time.monotonic() + 10
        for q in clients:
            try:
                q.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait()
            if q.stdout is not None:
                q.stdout.close()
        stop_all(cluster.procs)
        live.remove(cluster)
    return res


# =========================================================================== report
def _f(x: float | None, nd: int) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 60 steps x 128, 1 repeat, 3 s load test of 2 clients")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    ap.add_argument("--steps", type=int, default=None, help="steps per worker per run (default 300; quick 60)")
    ap.add_argument("--batch-size", type=int, default=None, help="per worker (default 256; quick 128)")
    ap.add_argument("--repeats", type=int, default=None, help="replicated / plain runs for the throughput ratio (default 2; quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-size", type=int, default=None, help="ctr test examples for the AUC (default 10000; quick 2000)")
    ap.add_argument("--failover", type=float, default=2.0, help="backups' --failover seconds (default 2, the CLI's)")
    ap.add_argument("--retry-timeout", type=float, default=60.0, help="workers' --retry-timeout (default 60)")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="give up on a training run after this long")
    ap.add_argument("--load-seconds", type=float, default=None, help="load test length (default 30; quick 3)")
    ap.add_argument("--load-base-seconds", type=float, default=None, help="one client alone first, the unloaded baseline (default 5; quick 0.5)")
    ap.add_argument("--load-clients", type=int, default=None, help="load test client processes (default 8; quick 2)")
    ap.add_argument("--load-rows", type=int, default=None, help="rows of the load test's sparse table (default 100000; quick 20000)")
    ap.add_argument("--skip-load", action="store_true", help="no load test")
    ap.add_argument("--skip-training", action="store_true", help="load test only")
    ap.add_argument("--load-client", default=None, help=argparse.SUPPRESS)  # internal: be one load-test client
    ap.add_argument("--client-index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    args.steps = args.steps or (60 if q else 300)
    args.batch_size = args.batch_size or (128 if q else 256)
    args.repeats = args.repeats or (1 if q else 2)
    args.test_size = args.test_size or (2000 if q else 10000)
    args.load_seconds = args.load_seconds if args.load_seconds is not None else (3.0 if q else 30.0)
    args.load_base_seconds = args.load_base_seconds if args.load_base_seconds is not None else (0.5 if q else 5.0)
    # quick: 2 clients still load the shard concurrently (each client process starts torch: 6 fewer starts)
    args.load_clients = args.load_clients or (2 if q else 8)
    args.load_rows = args.load_rows or (20_000 if q else 100_000)
    if args.load_client:
        return load_client(args.load_client, args.load_rows, args.client_index)

    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    t_start = time.monotonic()
    live: list[Cluster] = []
    reps: list[Run] = []
    plains: list[Run] = []
    fault: Run | None = None
    load: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="tessera-faults-")
    try:
        if not args.skip_training:
            # A1 C1 B C2 A2 ...: replicated and plain runs alternate around the fault run
            reps.append(training_run("A1", True, False, args, tmp, live))
            plains.append(training_run("C1", False, False, args, tmp, live))
            fault = training_run("B", True, True, args, tmp, live)
            for k in range(2, args.repeats + 1):
                if k % 2 == 0:
                    plains.append(training_run(f"C{k}", False, False, args, tmp, live))
                    reps.append(training_run(f"A{k}", True, False, args, tmp, live))
                else:
                    reps.append(training_run(f"A{k}", True, False, args, tmp, live))
                    plains.append(training_run(f"C{k}", False, False, args, tmp, live))
        if not args.skip_load:
            load = load_test(args, tmp, live)
    except KeyboardInterrupt:
        log(f"interrupted; stopping child processes (logs in {tmp})")
        return 130 if not interrupted or interrupted[0] == signal.SIGINT else 143
    finally:
        for c in list(live):
            stop_all(c.procs)
    wall = time.monotonic() - t_start

    # ------------------------------------------------------------------ figures
    runs = reps + plains + ([fault] if fault else [])
    failures = [f for r in runs for f in r.failures] + load.get("failures", [])
    a = reps[0] if reps else None
    rep_eps = [r.eps for r in reps if r.eps is not None]
    plain_eps = [r.eps for r in plains if r.eps is not None]
    ratio = statistics.median(rep_eps) / statistics.median(plain_eps) if rep_eps and plain_eps else None
    pairs = [r.eps / p.eps for r, p in zip(reps, plains) if r.eps and p.eps]
    metric_delta = fault.auc - a.auc if fault and a and fault.auc is not None and a.auc is not None else None
    ff = [r for r in reps + plains if r.lost is not None]
    main_phase = load.get("load", {})
    base_phase = load.get("base", {})
    ops = main_phase.get("ops", {})
    load_errors = main_phase.get("errors", 0) + base_phase.get("errors", 0) if main_phase else None
    rss_growth = (
        load["rss_end_mb"] - load["rss_start_mb"] if load.get("rss_end_mb") is not None and load.get("rss_start_mb") is not None else None
    )
    out: dict[str, Any] = {
        "failover_s": _r(fault.failover_s, 3) if fault else None,
        "promote_s": _r(fault.promote_s, 3) if fault else None,
        "write_resume_s": _r(fault.write_resume_s, 3) if fault else None,
        "max_step_gap_s": _r(fault.max_gap_s, 3) if fault else None,
        "lost_updates": fault.lost if fault else None,
        "double_applied": fault.double if fault else None,
        "stats_lost_updates": fault.stats_lost if fault else None,
        "fault_free_lost": sum(r.lost or 0 for r in ff) if ff else None,
        "fault_free_double": sum(r.double or 0 for r in ff) if ff else None,
        "acked_updates": sum(fault.acked.values()) if fault else None,
        "kill_step": fault.kill_step if fault else None,
        "auc_fault_free": _r(a.auc, 5) if a else None,
        "auc_fault": _r(fault.auc, 5) if fault else None,
        "auc_plain": _r(plains[0].auc, 5) if plains else None,
        "auc_repeat_delta": _r(reps[1].auc - reps[0].auc, 5) if len(reps) > 1 and reps[1].auc is not None and reps[0].auc is not None else None,
        "metric_delta": _r(metric_delta, 5),
        "replication_throughput_ratio": _r(ratio, 4),
        "replication_throughput_ratio_min": _r(min(pairs), 4) if pairs else None,
        "replication_throughput_ratio_max": _r(max(pairs), 4) if pairs else None,
        "eps_replicated": _r(statistics.median(rep_eps), 1) if rep_eps else None,
        "eps_unreplicated": _r(statistics.median(plain_eps), 1) if plain_eps else None,
        "eps_fault_run": _r(fault.eps, 1) if fault else None,
        "load_errors": load_errors,
        "load_shard_errors": load.get("shard_errors"),
        "load_clients": args.load_clients,
        "load_seconds": _r(main_phase.get("seconds"), 2),
        "rss_start_mb": _r(load.get("rss_start_mb"), 1),
        "rss_end_mb": _r(load.get("rss_end_mb"), 1),
        "rss_peak_mb": _r(load.get("rss_peak_mb"), 1),
        "rss_mid_mb": _r(load.get("rss_mid_mb"), 1),
        "load_shard_cpu": _r(main_phase.get("shard_cpu"), 3),
        "base_shard_cpu": _r(base_phase.get("shard_cpu"), 3),
        "load_clients_cpu": _r(main_phase.get("clients_cpu"), 3),
        "base_client_cpu": _r(base_phase.get("clients_cpu"), 3),
        "rss_growth_mb": _r(rss_growth, 2),
        "steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats, "failover": args.failover,
        "quick": q, "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
        "failures": len(failures), "wall_s": round(wall, 1),
    }
    for op, v in ops.items():
        out[f"load_{op}_p50_ms"] = _r(v["p50_ms"], 2)
        out[f"load_{op}_p99_ms"] = _r(v["p99_ms"], 2)
        out[f"load_{op}_per_s"] = _r(v["per_s"], 1)
        b = base_phase.get("ops", {}).get(op)
        if b:
            out[f"base_{op}_p50_ms"] = _r(b["p50_ms"], 2)
            out[f"base_{op}_per_s"] = _r(b["per_s"], 1)
    if ops and base_phase.get("ops"):
        # a round (pull + push sparse + push dense) per second, all clients vs one client alone
        out["load_rounds_per_s"] = _r(ops["push_dense"]["per_s"], 1)
        out["base_rounds_per_s"] = _r(base_phase["ops"]["push_dense"]["per_s"], 1)
    for r in runs:
        out[f"eps_{r.name}"] = _r(r.eps, 1)
    goals = {
        "lost_updates": out["lost_updates"] == 0,
        "failover_s": out["failover_s"] is not None and out["failover_s"] <= 5,
        "metric_delta": metric_delta is not None and abs(metric_delta) <= 0.01,
        "replication_throughput_ratio": ratio is not None and ratio >= 0.7,
        "load_errors": out["load_errors"] == 0,
    }
    out["goals"] = goals

    # ------------------------------------------------------------------ table
    hdr = f"{'run':<5} {'shards':<16} {'ex/s steady':>11} {'ex/s summ':>10} {'auc':>7} {'acked':>9} {'lost':>5} {'double':>6} {'wall s':>7}  notes"
    lines = [hdr, "-" * len(hdr)]
    for r in sorted(runs, key=lambda r: (r.name[0] != "A", r.name[0] != "C", r.name)):
        notes = []
        if r.fault:
            notes.append(f"P0 killed at w0 step {r.kill_step}: promoted {_f(r.promote_s, 2)} s, writes {_f(r.write_resume_s, 2)} s, "
                         f"training {_f(r.failover_s, 2)} s after the kill (longest record gap {_f(r.max_gap_s, 2)} s)")
        if r.stats_lost:
            notes.append(f"Stats-based lost {r.stats_lost}")
        if r.failures:
            notes.append("FAILED")
        lines.append(
            f"{r.name:<5} {'2 x (P+B)' if r.replicated else '2 plain':<16} {_f(r.eps, 0):>11} {_f(r.eps_summary, 0):>10} {_f(r.auc, 4):>7} "
            f"{sum(r.acked.values()):>9} {_f(r.lost, 0):>5} {_f(r.double, 0):>6} {r.wall_s:>7.1f}  {'; '.join(notes)}"
        )
    print(f"\nfault benchmark: ctr async, {WORKERS} workers x {args.steps} steps x {args.batch_size}, {SHARDS} shards; "
          f"{os.cpu_count()} CPUs; load avg {os.getloadavg()[0]:.1f}\n")
    print("\n".join(lines))
    if ops:
        print(f"\nload test: 1 shard, {LOAD_IDS} ids x {LOAD_DIM} of {args.load_rows} rows (pull_sparse then push_sparse) "
              f"+ push_dense of {LOAD_DENSE} floats per round; one client alone, then {args.load_clients} client processes")
        print(f"{'phase':<11} {'op':<12} {'n':>7} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>6}")
        for ph in (base_phase, main_phase):
            for op, v in ph.get("ops", {}).items():
                print(f"{ph['label']:<11} {op:<12} {v['n']:>7} {v['per_s']:>8.1f} {_f(v['p50_ms'], 2):>8} {_f(v['p99_ms'], 2):>8} "
                      f"{_f(v['max_ms'], 1):>8} {ph['errors']:>6}")
        print(f"{main_phase['label']}: {_f(main_phase.get('seconds'), 1)} s; errors {load_errors} (shard-side {load.get('shard_errors')}); "
              f"shard RSS {_f(load.get('rss_start_mb'), 1)} -> {_f(load.get('rss_mid_mb'), 1)} (half-way) -> {_f(load.get('rss_end_mb'), 1)} MB "
              f"(peak {_f(load.get('rss_peak_mb'), 1)}); shard CPU {_f(main_phase.get('shard_cpu'), 2)} cores "
              f"(one client alone: {_f(base_phase.get('shard_cpu'), 2)}), clients' CPU {_f(main_phase.get('clients_cpu'), 2)} cores "
              f"(one alone: {_f(base_phase.get('clients_cpu'), 2)})")
        for ph in (base_phase, main_phase):
            for e in ph.get("samples", []):
                print(f"  error: {e}")
    print(f"\nfailover {_f(out['failover_s'], 2)} s, lost {out['lost_updates']}, metric_delta {_f(metric_delta, 4)}, "
          f"replication ratio {_f(ratio, 3)} (pairs {', '.join(f'{x:.3f}' for x in pairs) or '-'}), "
          f"load errors {out['load_errors']}, rss growth {_f(rss_growth, 1)} MB; wall {wall:.0f} s")
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    for f in failures:
        print(f"\nFAILURE: {f}", file=sys.stderr)
    if failures:
        print(f"(logs kept in {tmp})", file=sys.stderr)
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print()
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
