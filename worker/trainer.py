"""The worker's training loop against the PS: sync (BSP), async (ASP), SSP, hybrid.

One step t, with overlap on (the default):

    wait for fetch(t)            dense params + the batch's sparse rows, pulled as the mode allows
    start fetch(t+1)             in the background, for the next batch (prefetch)
    forward, backward            on the worker's device
    wait for push(t-1)           the window: at most one push in flight while computing
    start push(t)                dense gradient + sparse row gradients, in the background

The shards enforce the consistency rule; the worker only says which rule a
request follows (``SyncPolicy``): in sync mode fetch(t+1) blocks on the shards
until every live worker's push(t) is in and applied, so only what BSP forces
is waited for. With overlap off, every pull and push is waited for in line.

Membership: the worker joins every shard, renews its lease with heartbeats
from a background thread, and leaves when done. A worker joining mid-run
starts from the cluster's current clock and parameters.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TextIO

import numpy as np
import torch

from ps import PSClient, SyncPolicy
from worker.binding import ModelBinding, SparseGrad, _Rows
from worker.tasks import Task, move

__all__ = ["TrainConfig", "Trainer", "Summary", "MODES", "resolve_device"]

log = logging.getLogger(__name__)

MODES = ("sync", "async", "ssp", "hybrid")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return d


@dataclass(frozen=True)
class TrainConfig:
    """One worker's run. ``steps``: the clock the run trains to (a worker that joins late runs fewer)."""

    mode: str = "async"
    staleness: int = 4
    backup_workers: int = 0
    staleness_aware_lr: bool = False
    steps: int = 1000
    batch_size: int = 64
    worker_index: int = 0
    num_workers: int = 1
    device: str = "cpu"
    lease_s: float = 10.0
    overlap: bool = True
    eval_every: int = 0  # steps between evaluations on worker 0 (0: only at the end)
    log_every: int = 10  # steps per metrics record
    max_seconds: float = 0.0  # stop after this long (0: no limit)
    seed: int = 0
    progress: bool = True
    metrics_out: str | None = None
    name: str = ""  # worker name on the shards (default: w<index>)
    evaluate: bool = True  # worker 0 evaluates (set False to skip, e.g. in benchmarks)
    start_timeout_s: float = 300.0  # how long to wait for all workers at the start of a run
    # perturbations for experiments: compute takes `slowdown` times longer (a straggler), and each step
    # adds a random delay (exponential, mean `jitter_ms`), drawn from a generator seeded by (seed, worker)
    slowdown: float = 1.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"worker index {self.worker_index} out of range for {self.num_workers} workers")
        if not 0 <= self.backup_workers < self.num_workers:
            raise ValueError(f"backup_workers must be in [0, num_workers), got {self.backup_workers}")
        if self.backup_workers and self.mode not in ("sync", "hybrid"):
            raise ValueError("backup workers apply to sync/hybrid mode")
        if self.slowdown < 1 or self.jitter_ms < 0:
            raise ValueError("slowdown must be >= 1 and jitter_ms >= 0")
        if self.steps < 0 or self.batch_size < 1 or self.lease_s <= 0:
            raise ValueError("steps must be >= 0, batch_size >= 1, lease_s > 0")

    @property
    def worker_name(self) -> str:
        return self.name or f"w{self.worker_index}"


@dataclass
class Summary:
    worker: str
    mode: str
    steps: int  # steps this worker trained
    start_clock: int
    final_clock: int
    examples: int
    seconds: float
    examples_per_s: float
    loss: float  # mean loss over the last log window
    compute_s: float
    pull_wait_s: float
    push_wait_s: float
    mean_staleness: float
    max_staleness: int
    late_pushes: int
    stopped_early: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)  # staleness of this worker's applied updates

    @property
    def wait_fraction(self) -> float:
        total = self.compute_s + self.pull_wait_s + self.push_wait_s
        return (self.pull_wait_s + self.push_wait_s) / total if total else 0.0


@dataclass
class _Fetched:
    step: int
    batch: Any
    clock: int
    versions: tuple[int, ...]
    rows: dict[str, _Rows]


class Trainer:
    """Trains ``task.model`` against the shards behind ``client`` (whose ``worker`` name it sets).

    ``stop`` (an Event) ends the run after the step in flight: its push is
    finished, the worker leaves the shards, and ``run`` returns the summary.
    ``on_step(step, trainer)`` is called after each step's push was *issued*
    (tests use it with overlap off to compare parameters step by step).
    """

    def __init__(
        self, task: Task, client: PSClient, config: TrainConfig, stop: threading.Event | None = None,
        on_step: Callable[[int, "Trainer"], None] | None = None,
    ) -> None:
        self.task = task
        self.client = client
        self.cfg = config
        self.stop = stop or threading.Event()
        self.on_step = on_step
        client.worker = config.worker_name
        self.device = resolve_device(config.device)
        self.binding = ModelBinding(task.model, client, task.name, self.device)
        cuda = self.device.type == "cuda"
        n = self.binding.numel
        # host buffers the PS reads from / writes into; pinned so copies to and from the GPU are async
        # two, by step parity: fetch(t+1) fills one while step t's (possibly asynchronous) copy to the
        # device reads the other
        self._staging = [torch.empty(n, pin_memory=cuda) for _ in range(2)]
        self._send = [torch.empty(n, pin_memory=cuda) for _ in range(2)]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{config.worker_name}-io")  # fetch + push
        # one thread per table each for fetches and pushes: a BSP fetch blocks its thread until the round
        # completes, and the pushes that complete it must never queue behind it
        per = max(1, len(self.binding.embeddings))
        self._fetch_pool = ThreadPoolExecutor(max_workers=per, thread_name_prefix=f"{config.worker_name}-fetch")
        self._push_pool = ThreadPoolExecutor(max_workers=per, thread_name_prefix=f"{config.worker_name}-push")
        self._hb_stop = threading.Event()
        self.clock = 0  # the step being computed
        self.committed = 0  # steps whose pushes have completed (what heartbeats report)
        self._rng = np.random.default_rng([config.seed, config.worker_index, 99])
        self.metrics_file: TextIO | None = None
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ policies
    def dense_policy(self, step: int) -> SyncPolicy:
        return self._policy(step, sync=self.cfg.mode in ("sync", "hybrid"))

    def sparse_policy(self, step: int) -> SyncPolicy:
        return self._policy(step, sync=self.cfg.mode == "sync")  # hybrid: sparse tables are async

    def _policy(self, step: int, sync: bool) -> SyncPolicy:
        c = self.cfg
        if sync:
            return SyncPolicy(clock=step, sync=True, backup_workers=c.backup_workers)
        return SyncPolicy(clock=step, staleness=c.staleness if c.mode == "ssp" else -1, staleness_aware_lr=c.staleness_aware_lr)

    # ------------------------------------------------------------------ io
    def _fetch(self, step: int, batch: Any) -> _Fetched:
        """Dense parameters and the batch's sparse rows for ``step``: the tables concurrently."""
        clock, versions = 0, ()
        futs = {}
        policy = self.sparse_policy(step)
        if self.task.sparse_ids is not None:
            for name, ids in self.task.sparse_ids(batch).items():
                futs[name] = self._fetch_pool.submit(self.binding.embeddings[name].fetch, ids, policy)
        if self.binding.numel:
            _, (clock, versions) = self.client.pull_dense(
                self.binding.dense_table, out=self._staging[step % 2], policy=self.dense_policy(step), return_clock=True
            )
        rows = {}
        for name, fut in futs.items():
            rows[name] = r = fut.result()
            if policy.sync:
                clock = min(clock, r.clock) if self.binding.numel else r.clock
        return _Fetched(step, batch, clock, versions, rows)

    def _push(self, step: int, grad: torch.Tensor | None, versions: tuple[int, ...], sparse: list[SparseGrad]) -> tuple[list[int], int]:
        """Returns (staleness values measured by the shards, late shards)."""
        stale: list[int] = []
        late = 0
        jobs: list[Callable[[], Any]] = []
        if grad is not None:
            jobs.append(lambda: self.client.push_dense(
                self.binding.dense_table, grad, base_version=versions or -1, policy=self.dense_policy(step)
            ))
        for g in sparse:
            jobs.append(functools.partial(
                self.client.push_sparse, g.table, g.ids, g.grads, g.base_versions, policy=self.sparse_policy(step)
            ))
        futs = [self._push_pool.submit(j) for j in jobs[1:]]  # tables concurrently; the first in this thread
        results = [jobs[0]()] if jobs else []
        results += [f.result() for f in futs]
        self.committed = max(self.committed, step + 1)
        for r in results:
            late += r.late
            if hasattr(r, "versions"):
                stale.extend(s for s in r.staleness if s >= 0)
            elif r.mean_staleness >= 0:
                stale.append(round(r.mean_staleness))
        return stale, late

    def _perturb(self, compute_s: float) -> None:
        delay = (self.cfg.slowdown - 1.0) * compute_s
        if self.cfg.jitter_ms:
            delay += self._rng.exponential(self.cfg.jitter_ms / 1000.0)
        if delay > 0:
            time.sleep(delay)

    def _heartbeats(self) -> None:
        period = self.cfg.lease_s / 4
        while not self._hb_stop.wait(period):
            try:
                self.client.heartbeat(self.committed)
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is retried; the lease absorbs it
                log.warning("heartbeat failed: %s", e)

    # ------------------------------------------------------------------ run
    def join(self) -> int:
        """Create or find the tables, join the shards; returns the clock this worker starts at."""
        self.binding.create_tables(self.task.dense_optimizer, creator=self.cfg.worker_index == 0)
        views = self.client.join(self.cfg.lease_s)
        # at the start of a run, wait for all num_workers (so step 0 is everyone's); a worker that joins
        # a run already under way starts at once from the current clock
        joining_late = self._under_way(views)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self._under_way(views) and min(len(v.live) for v in views) < self.cfg.num_workers:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.cfg.worker_name}: only {min(len(v.live) for v in views)} of {self.cfg.num_workers} workers "
                    f"joined within {self.cfg.start_timeout_s:.0f} s"
                )
            if self.stop.wait(0.05):
                break
            views = self.client.heartbeat(0)
        if self.cfg.mode in ("sync", "hybrid"):
            return min(v.sync_clock for v in views)
        others = [v.min_clock for v in views if v.min_clock >= 0]
        start = min(others) if others and joining_late else 0
        if start:
            self.client.heartbeat(start)  # the shards count this worker from its start, for SSP waits
        return start

    @staticmethod
    def _under_way(views: list[Any]) -> bool:
        return any(v.sync_clock > 0 or v.min_clock > 0 for v in views)

    def run(self) -> Summary:
        cfg = self.cfg
        if cfg.metrics_out:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_out)), exist_ok=True)
            self.metrics_file = open(cfg.metrics_out, "a")
        start = self.clock = self.committed = self.join()
        hb = threading.Thread(target=self._heartbeats, name=f"{cfg.worker_name}-heartbeat", daemon=True)
        hb.start()
        try:
            return self._loop(start)
        finally:
            self._hb_stop.set()
            try:
                self.client.leave()
            except Exception as e:  # noqa: BLE001 - the lease will expire instead
                log.warning("leave failed: %s", e)
            self._pool.shutdown(wait=True)
            self._fetch_pool.shutdown(wait=True)
            self._push_pool.shutdown(wait=True)
            if self.metrics_file:
                self.metrics_file.close()

    def _loop(self, start: int) -> Summary:
        cfg, task, b = self.cfg, self.task, self.binding
        model = task.model
        model.train()
        data = task.batches(cfg.worker_index, cfg.num_workers, cfg.batch_size, start)
        to_dev = task.to_device or move
        bar = _progress(cfg, start)
        t_start = time.monotonic()
        compute = pull_wait = push_wait = 0.0
        stale_all: list[int] = []
        late = 0
        losses: list[float] = []
        window: dict[str, float] = dict(t=time.monotonic(), n=0, compute=0.0, pull=0.0, push=0.0)
        push_fut: Future | None = None
        step = start
        last_loss = math.nan
        metrics: dict[str, float] = {}
        stopped_early = False

        def finish_push(f: Future) -> float:
            """Wait for a push; collect the staleness it measured. Returns the seconds waited."""
            nonlocal push_wait, late
            t1 = time.perf_counter()
            measured, lates = f.result()
            stale_all.extend(measured)
            late += lates
            waited = time.perf_counter() - t1
            push_wait += waited
            window["push"] += waited
            return waited

        self._record(kind="start", step=step)
        fut: Future | None = self._pool.submit(self._fetch, step, next(data)) if step < cfg.steps else None
        while fut is not None:
            t0 = time.perf_counter()
            f = fut.result()
            pull_wait += (w := time.perf_counter() - t0)
            window["pull"] += w
            # the step may be later than planned: a worker dropped and rejoined (BSP) catches up
            step = max(step, f.clock) if cfg.mode in ("sync", "hybrid") else step
            self.clock = step
            if b.numel:
                b.load_flat(self._staging[f.step % 2])
                if step != f.step and self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # the next fetch may reuse this buffer
            for name, rows in f.rows.items():
                b.embeddings[name].prefetched(rows)
            b.set_policy(self.sparse_policy(step))
            if step >= cfg.steps:  # caught up to a clock past the end (a straggler that skipped ahead)
                for m in b.embeddings.values():
                    m.discard()
                break
            over = cfg.max_seconds and time.monotonic() - t_start > cfg.max_seconds
            if over or self.stop.is_set():
                stopped_early = True
                for m in b.embeddings.values():
                    m.discard()
                break
            fut = None
            if step + 1 < cfg.steps and cfg.overlap:
                fut = self._pool.submit(self._fetch, step + 1, next(data))

            t0 = time.perf_counter()
            batch = to_dev(f.batch, self.device)
            b.flat_grad.zero_()
            loss = task.loss(model, batch)
            loss.backward()
            sparse = b.sparse_gradients()
            self._perturb(time.perf_counter() - t0)
            send = self._send[step % 2]
            if push_fut is not None:  # the window: the previous push must be done before this one starts
                t0 += finish_push(push_fut)
            if b.numel:
                send.copy_(b.flat_grad, non_blocking=True)
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
            last_loss = float(loss.detach())
            compute += (c := time.perf_counter() - t0)
            window["compute"] += c
            push_fut = self._pool.submit(self._push, step, send if b.numel else None, f.versions, sparse)
            losses.append(last_loss)
            if not cfg.overlap:
                finish_push(push_fut)
                push_fut = None
                if step + 1 < cfg.steps:
                    fut = self._pool.submit(self._fetch, step + 1, next(data))
            if self.on_step is not None:
                self.on_step(step, self)
            step += 1
            self.clock = step
            window["n"] += 1
            if bar is not None:
                bar.update(1)
            if window["n"] >= cfg.log_every or fut is None:
                now = time.monotonic()
                eps = window["n"] * cfg.batch_size / max(now - window["t"], 1e-9)
                mean_loss = float(np.mean(losses[-int(window["n"]) :]))
                st = float(np.mean(stale_all[-50:])) if stale_all else 0.0
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", eps=f"{eps:,.0f}", stale=f"{st:.1f}")
                self._record(
                    kind="step", step=step, loss=mean_loss, examples_per_s=eps, staleness=st,
                    compute_s=window["compute"], pull_wait_s=window["pull"], push_wait_s=window["push"],
                )
                window = dict(t=now, n=0, compute=0.0, pull=0.0, push=0.0)
            if cfg.eval_every and cfg.worker_index == 0 and cfg.evaluate and task.evaluate and step % cfg.eval_every == 0 and fut is not None:
                metrics = self._evaluate(step, push_fut)
        if push_fut is not None:
            finish_push(push_fut)
        if bar is not None:
            bar.close()
        seconds = time.monotonic() - t_start
        trained = step - start
        if cfg.worker_index == 0 and cfg.evaluate and task.evaluate is not None:
            metrics = self._evaluate(step, None, final=True)
        summary = Summary(
            cfg.worker_name, cfg.mode, trained, start, step, trained * cfg.batch_size, seconds,
            trained * cfg.batch_size / seconds if seconds > 0 else 0.0,
            float(np.mean(losses[-cfg.log_every :])) if losses else math.nan,
            compute, pull_wait, push_wait,
            float(np.mean(stale_all)) if stale_all else 0.0, max(stale_all, default=0), late, stopped_early, metrics,
            {int(k): int(v) for k, v in zip(*np.unique(np.asarray(stale_all, np.int64), return_counts=True))},
        )
        self._record(
            kind="summary", **{k: v for k, v in asdict(summary).items() if k != "metrics"}, **summary.metrics,
            acked=dict(self.client.acked), duplicates=self.client.duplicates,
        )
        return summary

    def _evaluate(self, step: int, push_fut: Future | None, final: bool = False) -> dict[str, float]:
        """Evaluate on the latest parameters (pulled now, so the model reflects every applied push)."""
        assert self.task.evaluate is not None
        if push_fut is not None:
            push_fut.result()
        b = self.binding
        saved = b.flat.clone() if not final else None
        # at the end, sync modes wait for the last round to be applied (the other workers' last pushes)
        waits = final and self.cfg.mode in ("sync", "hybrid")
        updates = 0.0
        if b.numel:
            # into a buffer of its own: a prefetch may be filling the staging buffers right now
            values, (_, versions) = self.client.pull_dense(
                b.dense_table, out=torch.empty(b.numel), policy=self.dense_policy(step) if waits else None, return_clock=True
            )
            b.load_flat(values.to(self.device))
            updates = float(np.mean([v for v in versions if v >= 0]))  # optimizer steps applied to the model
        b.set_policy(self.sparse_policy(step) if waits and self.cfg.mode == "sync" else None)
        metrics = self.task.evaluate(self.task.model)
        if saved is not None:
            with torch.no_grad():
                b.flat.copy_(saved)  # the step in progress keeps the parameters it fetched
        self._record(kind="eval", step=step, final=final, updates=updates, **metrics)
        return metrics

    def _record(self, **rec: Any) -> None:
        if self.metrics_file is None:
            return
        rec = {"worker": self.cfg.worker_name, "mode": self.cfg.mode, "time": time.time(), "elapsed": time.monotonic() - self._t0, **rec}
        self.metrics_file.write(json.dumps(rec) + "\n")
        self.metrics_file.flush()


def _progress(cfg: TrainConfig, start: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.steps, initial=start, desc=f"{cfg.worker_name} {cfg.mode}", unit="step", dynamic_ncols=True,
        mininterval=0.5,
    )
