"""The worker's step pipeline, the same for every ``ParamSync`` (PS modes and peer mode).

One step t, for a pipelined sync (the PS) with overlap on (the default):

    wait for fetch(t)            dense params + the batch's sparse rows, as the sync's rule allows
    start fetch(t+1)             in the background, for the next batch (prefetch)
    forward, backward            on the worker's device (k micro-batches with gradient accumulation)
    wait for push(t-1)           the window: at most one push in flight while computing
    start push(t)                the step's gradients, in the background

The sync enforces the consistency rule (for the PS: the shards do, and the sync says which rule a
request follows; in sync mode fetch(t+1) blocks on the shards until every live worker's push(t)
is in and applied). With overlap off, or for a sync whose fetch and push are collectives (peer
mode), every fetch and push runs in line on the main thread.

A sync with a ``lookahead`` L (the PS) does the push and a fetch in one exchange, ``push_fetch``:
step t's push carries the fetch of step t + L (L = 1 for BSP: the values of the round step t's push
completes; L = 2 for async/SSP: step t + 1 computes while the exchange is in flight). Only the first
L steps are fetched on their own.

PS modes: ``sync`` (BSP), ``async`` (ASP), ``ssp`` (bounded staleness), ``dense-sync`` (dense
tables BSP, sparse tables async; formerly called ``hybrid``). Peer modes (``worker.peer``): ``dp``,
``zero1``, ``zero2``, ``zero3``, and ``hybrid`` (PS embeddings, all-reduced dense part).
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TextIO, cast

import numpy as np
import torch

from worker.modes import PEER_MODES, PS_MODES, check_mode
from worker.sync_api import (
    Fetched,
    Grads,
    ParamSync,
    PushResult,
    check_ps_mode,
    split_batch,
)
from worker.tasks import Task, move

if TYPE_CHECKING:
    from ps import PSClient

__all__ = ["MODES", "PEER_MODES", "Summary", "TrainConfig", "Trainer", "resolve_device", "split_batch"]

log = logging.getLogger(__name__)

MODES = PS_MODES


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return d


@dataclass(frozen=True)
class TrainConfig:
    """One worker's run. ``steps``: the clock the run trains to (a worker that joins late runs fewer).

    ``batch_size`` is this worker's batch per step; with ``accumulate`` = k it is cut into k equal
    micro-batches whose gradients are summed (scaled by 1/k) before the one push of the step (a
    pipeline's sync runs its schedule over them: k is its number of micro-batches).
    """

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
    accumulate: int = 1  # micro-batches per step (gradient accumulation)
    reset: bool = False  # PS modes: a fresh run on shards holding an earlier one (PSSync.start_fresh; every worker)

    def __post_init__(self) -> None:
        check_mode(self.mode)  # the registry (worker.modes) is the one place mode names are checked
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"worker index {self.worker_index} out of range for {self.num_workers} workers")
        if not 0 <= self.backup_workers < self.num_workers:
            raise ValueError(f"backup_workers must be in [0, num_workers), got {self.backup_workers}")
        if self.backup_workers and self.mode not in ("sync", "dense-sync"):
            raise ValueError("backup workers apply to sync/dense-sync mode")
        if self.slowdown < 1 or self.jitter_ms < 0:
            raise ValueError("slowdown must be >= 1 and jitter_ms >= 0")
        if self.steps < 0 or self.batch_size < 1 or self.lease_s <= 0:
            raise ValueError("steps must be >= 0, batch_size >= 1, lease_s > 0")
        if self.accumulate < 1 or self.batch_size % self.accumulate:
            raise ValueError(
                f"batch size {self.batch_size} is not divisible into {self.accumulate} accumulation micro-batches"
            )

    @property
    def worker_name(self) -> str:
        """The worker's name on the shards and in metrics: ``name``, or ``w<index>``."""
        return self.name or f"w{self.worker_index}"


@dataclass
class Summary:
    """What one worker's run did: steps and clocks, throughput, the split of its time into compute
    and waiting, the staleness of its updates, and the final test metrics (worker 0)."""

    worker: str
    mode: str
    steps: int  # steps this worker trained
    start_clock: int
    final_clock: int
    examples: int
    seconds: float
    examples_per_s: float
    loss: float  # mean over the last log window of each step's global loss (peer: mean over the DP ranks)
    compute_s: float
    pull_wait_s: float
    push_wait_s: float
    mean_staleness: float
    max_staleness: int
    late_pushes: int
    stopped_early: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)  # staleness of this worker's applied updates
    last_loss: float = math.nan  # the global loss of the last step trained (independent of --log-every)

    @property
    def wait_fraction(self) -> float:
        """The share of step time spent waiting on fetches and pushes."""
        total = self.compute_s + self.pull_wait_s + self.push_wait_s
        return (self.pull_wait_s + self.push_wait_s) / total if total else 0.0


class _Later:
    """A future whose work completes on the thread that first asks for its ``result()`` (then kept)."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._value = finish()
            except BaseException as e:  # noqa: BLE001 - raised to every caller, as a Future's
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Trainer:
    """Trains ``task.model`` with ``sync`` (a ``ParamSync``; a ``PSClient`` is wrapped in a ``PSSync``
    configured from ``config``, and its ``worker`` name set).

    ``stop`` (an Event) ends the run after the step in flight: its push is
    finished, the worker leaves, and ``run`` returns the summary.
    ``on_step(step, trainer)`` is called after each step's push was *issued*
    (tests use it with overlap off to compare parameters step by step).
    """

    def __init__(
        self, task: Task, sync: ParamSync | PSClient, config: TrainConfig, stop: threading.Event | None = None,
        on_step: Callable[[int, Trainer], None] | None = None,
    ) -> None:
        self.task = task
        self.cfg = config
        self.stop = stop or threading.Event()
        self.on_step = on_step
        self.device = resolve_device(config.device)
        # PSClient and PSSync load grpc, which a peer rank (handed its ParamSync) never imports: a
        # PSClient instance means ps.client is loaded, so look the class up only then
        client_mod = sys.modules.get("ps.client")
        if client_mod is not None and isinstance(sync, client_mod.PSClient):
            from worker.paramsync import PSSync

            if config.mode == "hybrid":
                check_ps_mode("hybrid")  # the PS-only mode once called hybrid is dense-sync: say so
            if config.mode in PEER_MODES:
                raise ValueError(f"mode {config.mode!r} is a peer mode: pass its ParamSync (worker.peer), not a PSClient")
            sync = PSSync(
                task.model, sync, task.name, mode=config.mode, staleness=config.staleness,
                backup_workers=config.backup_workers, staleness_aware_lr=config.staleness_aware_lr,
                worker_index=config.worker_index, num_workers=config.num_workers, worker_name=config.worker_name,
                lease_s=config.lease_s, start_timeout_s=config.start_timeout_s, dense_optimizer=task.dense_optimizer,
                device=self.device, stop=self.stop, sparse_ids=task.sparse_ids, steps=config.steps, reset=config.reset,
            )
        self.sync: ParamSync = cast("ParamSync", sync)  # a PSClient was wrapped above
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{config.worker_name}-io")  # fetch + push
        self.tracer: Any = None  # a worker.peer.trace.Tracer (or anything with .span(name, cat)) for a timeline
        self.clock = 0  # the step being computed
        self.last_loss = math.nan  # the global loss of the last step (peer: mean over the DP ranks; PS: this worker's)
        self._rng = np.random.default_rng([config.seed, config.worker_index, 99])
        self.metrics_file: TextIO | None = None
        self._t0 = time.monotonic()

    @property
    def flat(self) -> torch.Tensor:
        """The model's dense parameters as one flat tensor (a copy; a collective where they are sharded)."""
        return self.sync.parameters()

    def _perturb(self, compute_s: float) -> None:
        delay = (self.cfg.slowdown - 1.0) * compute_s
        if self.cfg.jitter_ms:
            delay += self._rng.exponential(self.cfg.jitter_ms / 1000.0)
        if delay > 0:
            time.sleep(delay)

    # ------------------------------------------------------------------ run
    def run(self) -> Summary:
        """Join, train to ``steps`` (or until ``stop`` / ``max_seconds``), leave; blocking. Returns the summary."""
        cfg = self.cfg
        if cfg.metrics_out:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_out)), exist_ok=True)
            self.metrics_file = open(cfg.metrics_out, "a")
        try:
            start = self.clock = self.sync.join()
            if start >= cfg.steps > 0:
                log.warning("%s: the run is at step %d already, --steps is %d: nothing to train (raise --steps "
                            "to continue it; start every worker with --reset for a fresh run)", cfg.worker_name, start, cfg.steps)
            return self._loop(start)
        finally:
            self.sync.leave()
            self._pool.shutdown(wait=True)
            self.sync.close()
            if self.metrics_file:
                self.metrics_file.close()

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """In the background for a pipelined sync, else in line (collectives stay on the main thread)."""
        if self.sync.pipelined:
            return self._pool.submit(fn, *args)
        with self._span(fn.__name__, "sync", step=args[0]):
            return _done(fn(*args))

    def _push_fetch(self, step: int, grads: Grads, next_step: int | None, next_batch: Any) -> Future | _Later:
        """``push_fetch`` under way: sent from here where the sync splits it (``push_fetch_begin``: no
        thread hand-off), else in the background as ``_submit``."""
        finish = self.sync.push_fetch_begin(step, grads, next_step, next_batch) if self.sync.pipelined else None
        return _Later(finish) if finish is not None else self._submit(self.sync.push_fetch, step, grads, next_step, next_batch)

    def _span(self, name: str, cat: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        return self.tracer.span(name, cat, **args) if self.tracer is not None else contextlib.nullcontext()

    def _loop(self, start: int) -> Summary:
        cfg, task, s = self.cfg, self.task, self.sync
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
        push_fut: Future | _Later | None = None
        step = start
        metrics: dict[str, float] = {}
        stopped_early = False
        overlap = cfg.overlap and s.pipelined
        evaluates = cfg.evaluate and task.evaluate is not None and (cfg.worker_index == 0 or not s.pipelined)
        k = cfg.accumulate

        # a sync with a lookahead pushes step t and fetches step t + lookahead in one exchange (push_fetch);
        # ``ahead`` holds the futures of the fetches already under way, in step order
        lookahead = (s.lookahead if overlap else min(s.lookahead, 1)) if s.pipelined else 0
        ahead: collections.deque[Future | _Later] = collections.deque()

        def finish_push(f: Future | _Later) -> float:
            """Wait for a push; collect the staleness it measured. Returns the seconds waited."""
            nonlocal push_wait, late
            t1 = time.perf_counter()
            r: PushResult = _pushed(f.result())
            stale_all.extend(r.staleness)
            late += r.late
            waited = time.perf_counter() - t1
            push_wait += waited
            window["push"] += waited
            return waited

        self._record(kind="start", step=step)
        fut: Future | _Later | None = self._submit(s.fetch, step, next(data)) if step < cfg.steps else None
        if lookahead > 1 and step + 1 < cfg.steps:
            ahead.append(self._submit(s.fetch, step + 1, next(data)))
        while fut is not None:
            t0 = time.perf_counter()
            f: Fetched = _fetched(fut.result())
            pull_wait += (w := time.perf_counter() - t0)
            window["pull"] += w
            while f.step < step:  # the sync went back (a BSP shard restored at an older clock): train on from there
                step, data = f.step, task.batches(cfg.worker_index, cfg.num_workers, cfg.batch_size, f.step)
                f = _fetched(s.fetch(step, next(data)))
                if bar is not None:
                    bar.n = step
            # the step may be later than planned: a worker dropped and rejoined (BSP) catches up
            step = max(step, f.clock)
            self.clock = step
            s.load(f)
            if step >= cfg.steps:  # caught up to a clock past the end (a straggler that skipped ahead)
                s.discard()
                break
            over = bool(cfg.max_seconds) and time.monotonic() - t_start > cfg.max_seconds
            if cfg.max_seconds:  # ranks running collectives stop at the same step (any rank over: all stop)
                over = s.agree_stop(over)
            if over or self.stop.is_set():
                stopped_early = True
                s.discard()
                break
            fut = None
            if step + 1 < cfg.steps and overlap and not lookahead:
                fut = self._submit(s.fetch, step + 1, next(data))

            t0 = time.perf_counter()
            batch = to_dev(f.batch, self.device)
            s.zero_grad()
            with self._span("compute", "compute", step=step):
                loss_t = s.forward_backward(model, batch, task.loss, k)
                grads = s.gradients(step)
            self._perturb(time.perf_counter() - t0)
            if push_fut is not None:  # the window: the previous push must be done before this one starts
                t0 += finish_push(push_fut)
            compute += (c := time.perf_counter() - t0)
            window["compute"] += c
            if lookahead:
                nxt = step + lookahead
                has = nxt < cfg.steps
                push_fut = self._push_fetch(step, grads, nxt if has else None, next(data) if has else None)
                if has:
                    ahead.append(push_fut)
                fut = ahead.popleft() if ahead else None
            else:
                push_fut = self._submit(s.push, step, grads)
            if not overlap:
                finish_push(push_fut)
                push_fut = None
                if step + 1 < cfg.steps and not lookahead:
                    fut = self._submit(s.fetch, step + 1, next(data))
            # after the push (nothing of the sync's in flight): the step's loss over the data-parallel ranks
            last_loss = self.last_loss = s.global_loss(loss_t)
            losses.append(last_loss)
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
                # a sync's own per-window metrics (MoE: tokens per expert, drops, all-to-all time and bytes)
                extra = s.window_metrics()
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", eps=f"{eps:,.0f}", stale=f"{st:.1f}",
                                    **{key: f"{v:.3g}" for key, v in extra.items() if isinstance(v, float)})
                self._record(
                    kind="step", step=step, loss=mean_loss, last_loss=last_loss, examples_per_s=eps, staleness=st,
                    compute_s=window["compute"], pull_wait_s=window["pull"], push_wait_s=window["push"], **extra,
                )
                window = dict(t=now, n=0, compute=0.0, pull=0.0, push=0.0)
            if cfg.eval_every and evaluates and step % cfg.eval_every == 0 and fut is not None:
                metrics = self._evaluate(step, push_fut)
        if push_fut is not None:
            finish_push(push_fut)
        if bar is not None:
            bar.close()
        seconds = time.monotonic() - t_start
        trained = step - start
        if evaluates:
            metrics = self._evaluate(step, None, final=True)
        summary = Summary(
            cfg.worker_name, cfg.mode, trained, start, step, trained * cfg.batch_size, seconds,
            trained * cfg.batch_size / seconds if seconds > 0 else 0.0,
            float(np.mean(losses[-cfg.log_every :])) if losses else math.nan,
            compute, pull_wait, push_wait,
            float(np.mean(stale_all)) if stale_all else 0.0, max(stale_all, default=0), late, stopped_early, metrics,
            {int(k): int(v) for k, v in zip(*np.unique(np.asarray(stale_all, np.int64), return_counts=True))},
            losses[-1] if losses else math.nan,
        )
        self._record(kind="summary", **{k: v for k, v in asdict(summary).items() if k != "metrics"}, **summary.metrics, **s.stats())
        return summary

    def _evaluate(self, step: int, push_fut: Future | _Later | None, final: bool = False) -> dict[str, float]:
        """Evaluate on the latest parameters (as the sync defines them)."""
        evaluate = self.task.evaluate
        assert evaluate is not None
        if push_fut is not None:
            push_fut.result()
        model = self.task.model
        metrics, extra = self.sync.evaluate(step, final, lambda: evaluate(model))
        self._record(kind="eval", step=step, final=final, **extra, **metrics)
        return metrics

    def _record(self, **rec: Any) -> None:
        if self.metrics_file is None:
            return
        rec = {"worker": self.cfg.worker_name, "mode": self.cfg.mode, "time": time.time(), "elapsed": time.monotonic() - self._t0, **rec}
        self.metrics_file.write(json.dumps(rec) + "\n")
        self.metrics_file.flush()


def _pushed(r: Any) -> PushResult:
    """A push future's result: ``push``'s PushResult, or ``push_fetch``'s (PushResult, Fetched)."""
    return r[0] if isinstance(r, tuple) else r


def _fetched(r: Any) -> Fetched:
    """A fetch future's result: ``fetch``'s Fetched, or ``push_fetch``'s (PushResult, Fetched)."""
    return r[1] if isinstance(r, tuple) else r


def _progress(cfg: TrainConfig, start: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.steps, initial=start, desc=f"{cfg.worker_name} {cfg.mode}", unit="step", dynamic_ncols=True,
        mininterval=0.5,
    )
