"""Worker step benchmark: where does a training step against the PS spend its time?

Measures in one run, on loopback, every worker and shard its own process:

(1) ``ctr`` (26 Zipf id fields + 13 dense features, embeddings + MLP) with 2
    workers against 2 fresh shard processes per mode (``start_local_shards(2,
    ("--lease", "5"))``): examples/s for sync, ssp (K=4) and async, each with
    overlap (prefetch of step t+1, background push of step t: the default) and
    again without (every pull and push waited for in line). Every mode runs
    ``--repeats`` times (default 2; the with/without order alternates) and the
    repeats' blocks are pooled. Per mode the step
    time splits into compute, waiting on pulls, waiting on pushes and the rest
    (data generation, copying into the model: the worker's own bookkeeping),
    summed over both workers.
(2) The local baseline: the same ctr model (same MLP weights, same data, same
    batch size) in one process with no PS: the embedding holds the rows of the
    ids seen so far in one array grown by doubling (id -> row by a sorted-key
    index, vectorised), looks up a leaf of the batch's unique rows like
    ``PSEmbedding`` does, and applies the shards' Adagrad to those rows; Adam
    (torch.optim) on the MLP. It runs with one torch thread and again with as
    many as the cluster used cores (2; each worker has one); the faster is the
    baseline. It runs after the last ctr run's shards have exited.
(3) A dense ~5M-parameter MLP (784 -> 1024 x 5 -> 10, synthetic data from a
    hidden linear teacher; the user task ``bench.worker_step:dense_task``) with
    2 workers in sync mode against 2 shards (Adam on the shards), and the same
    model with ``torch.nn.parallel.DistributedDataParallel`` (Gloo, 2
    processes, same per-worker batch, Adam on each rank). In the same Gloo
    group: raw ``all_reduce`` of a float32 tensor of the model's size (bus
    bandwidth, = algorithm bandwidth for 2 ranks). DDP is timed after the
    PS run's shard processes have exited.

How. Two long-lived worker processes (this script with ``--child``; torch with
one intra-op thread, like ``tessera worker --torch-threads 1``) take jobs over
stdin: a PS job builds the task with ``worker.tasks.load_task``, a ``PSClient``
and a ``worker.trainer.Trainer`` and runs it exactly as ``tessera worker``
does; the parent starts and stops the shards. Keeping the workers alive saves
their start-up (imports) per mode, so the run fits in 1-2 minutes. The DDP
ranks run in the same two processes: rank 0 binds a ``TCPStore`` on port 0 and
reports the port, rank 1 connects to it.

Figures. The trainer logs a record every ``block`` steps (compute, pull wait,
push wait and the block's wall time); the first ``warmup`` steps are dropped.
The trainer sends a step's push and the next fetch as one Step call per shard
(``PSSync.push_fetch``): waiting for that call counts as push wait where the
window waits for it (async/ssp, and every mode without overlap) and as pull wait
where the next step's values are waited for first (sync with overlap).
For each block, examples/s are summed over the workers: a run's ``*_eps`` is
the median block, ``*_eps_best`` the best block, ``*_eps_mean`` all steady
examples over their time. Step times (``*_step_ms``) are the mean step time of
a block (averaged over the workers): median block, ``_min`` the best block,
``_mean`` over all steady steps. ``*_eps_span``: all steady examples of all
workers over the shared wall-clock span (the first worker's first steady step
to the last worker's last step, from the records' wall-clock times): what the
cluster delivers, also when the workers do not run at the same time;
``async_vs_local`` is async's over the local baseline's. ``cpu_per_example_ratio``:
CPU seconds of the workers and shards (async, whole run, OS process times) per
example over the local baseline's. ``cpu wkr`` / ``cpu shd``: CPU time of the
worker processes / of both shard processes (Linux /proc) over the whole run,
per worker step: what a step costs, whatever the machine's load. The machine
is shared and noisy: compare ratios from the same run; the JSON records the
load average at the start and the end.

Transport (``--transport``): the shards serve their bulk port and the workers use it (default
``bulk``); ``async_grpc`` is the async run again over gRPC, once per repeat, with its
``async_vs_local_grpc`` and ``cpu_per_example_ratio_grpc``. ``cpu_per_example_ratio_cheapest`` (the
headline, printed first): the same CPU over the one-process run that spends the least CPU per example
(one torch thread, as a rule), where ``cpu_per_example_ratio`` uses the faster baseline (which may be
the 2-thread one, whose extra CPU flatters the ratio).

Hot-row cache (``--emb-cache-rows N``, default off): async once more per repeat with each worker's
``worker.emb_cache`` of N rows, refreshed every ``--emb-cache-staleness`` steps (``tessera worker
--emb-cache-rows``), as ``async_cache``: ``async_vs_local_cache``, ``cpu_per_example_ratio_cache``,
``cache_hit_rate`` (lookups) and ``cache_row_hit_rate`` (unique rows of a step).

DDP ranks are left to exit without tearing the process group down (torch
2.13 can deadlock freeing a DDP ``ProcessGroupGloo``: its destructor joins
Gloo's work thread while holding the GIL that thread may need).

Run (about 1.5-2 minutes on 2 cores)::

    python bench/worker_step.py                    # full run
    python bench/worker_step.py --quick            # smoke run (~25 s idle, more under load): few steps, small dense model
    python bench/worker_step.py --json-out bench/out/worker.json
    python bench/worker_step.py --repeats 4        # every ctr mode 4 times (blocks pooled)
    python bench/worker_step.py --device cuda      # workers (and DDP ranks' compute) on the GPU
    python bench/worker_step.py --wire-dtype bfloat16   # PS pushes/pulls at half precision

It prints a table and, as its last line, one line of JSON with at least
sync_eps, ssp_eps, async_eps, local_eps, sync_noov_eps, ssp_noov_eps,
async_noov_eps, async_vs_local, cpu_per_example_ratio_cheapest, cpu_per_example_ratio (with the raw figures
behind them: *_eps_span, *_span_s, *_steady_examples, async_cpu_s,
async_examples, local_cpu_s, local_examples), overlap_speedup (async with overlap / async without),
async_wait_fraction (share of async step time spent waiting on the PS),
sync_step_ms, ddp_step_ms, sync_vs_ddp (PS sync step / DDP step) and
gloo_allreduce_gbps. Every child process is stopped on exit, also on Ctrl-C.
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
import traceback
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch
    from torch import nn

    from worker.tasks import Task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE_TASK = "bench.worker_step:dense_task"
MARK = "@@bench "  # prefix of protocol lines on a child's stdout (anything else there is ignored)
LEASE_S = 5.0
WORKERS = 2
SHARDS = 2


# =========================================================================== the dense user task
def make_mlp(in_dim: int, width: int, depth: int, classes: int) -> "nn.Module":
    """in_dim -> width (depth hidden layers, ReLU) -> classes."""
    from torch import nn

    layers: list[nn.Module] = []
    d = in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, classes))
    return nn.Sequential(*layers)


def dense_task(
    seed: int = 0, in_dim: int = 784, width: int = 1024, depth: int = 5, classes: int = 10, pool: int = 8,
    lr: float = 1e-3, **_: object,
) -> "Task":
    """A dense MLP (default 5,012,490 parameters) on synthetic data: a user task for ``tessera worker``.

    ``tessera worker --task bench.worker_step:dense_task --task-opt width=1024 ...`` (run from the
    repository root, so that ``bench`` is importable). Inputs are N(0, 1); the label is the argmax of
    a hidden linear teacher. ``pool`` global batches are drawn once per (num_workers, batch_size)
    and cycled, so data generation stays out of the step time; worker i's batch at step t is slice i
    of global batch t (sync mode equals one process with the global batch). No test metric.
    """
    import torch
    import torch.nn.functional as F

    from ps import OptimizerSpec
    from worker.tasks import Task

    torch.manual_seed(seed)
    model = make_mlp(in_dim, width, depth, classes)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(in_dim, classes, generator=gen)
    pools: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def batches(worker_index: int, num_workers: int, batch_size: int, start_step: int) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        key = (num_workers, batch_size)
        if key not in pools:
            g = torch.Generator().manual_seed(seed + 2)
            xs = [torch.randn(num_workers * batch_size, in_dim, generator=g) for _ in range(pool)]
            pools[key] = [(x, (x @ teacher).argmax(1)) for x in xs]
        lo, hi = worker_index * batch_size, (worker_index + 1) * batch_size
        step = start_step
        while True:
            x, y = pools[key][step % pool]
            yield x[lo:hi], y[lo:hi]
            step += 1

    def loss(m: "nn.Module", batch: tuple["torch.Tensor", "torch.Tensor"]) -> "torch.Tensor":
        x, y = batch
        return F.cross_entropy(m(x), y)

    n = sum(p.numel() for p in model.parameters())
    return Task(
        "dense", model, batches, loss, None, metric="loss", higher_is_better=False,
        dense_optimizer=OptimizerSpec("adam", {"lr": lr}), info={"params": float(n)},
    )


# =========================================================================== the local ctr baseline
def make_local_embedding(dim: int, lr: float, initial_accumulator: float, eps: float = 1e-10, std: float = 0.01,
                         seed: int = 0) -> "nn.Module":
    """Stand-in for ``PSEmbedding`` in one process, doing what the worker + shards do, minus the PS.

    Rows of the ids seen so far live in one weight array grown by doubling, with an Adagrad
    accumulator per element (the shards' ``adagrad``: sum += g^2; w -= lr * g / (sqrt(sum) + eps)).
    id -> row is a sorted key array (searchsorted; new ids inserted with one O(rows) memmove per
    step, no Python loop over ids). ``forward(ids)`` (int64, CPU, any shape) -> ``ids.shape + (dim,)``:
    like PSEmbedding it looks up a leaf tensor of the batch's unique rows; ``step()`` after backward
    applies Adagrad to those rows.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    class LocalEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = torch.Generator().manual_seed(seed)
            self.weight = torch.empty(0, dim)
            self.acc = torch.empty(0, dim)
            self.keys = np.empty(0, np.int64)  # sorted ids
            self.slots = np.empty(0, np.int64)  # row of keys[i]
            self.rows = 0
            self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

        def _grow(self, need: int) -> None:
            cap = max(1024, self.weight.shape[0])
            while cap < need:
                cap *= 2
            if cap > self.weight.shape[0]:
                w, a = torch.empty(cap, dim), torch.empty(cap, dim)
                w[: self.rows], a[: self.rows] = self.weight[: self.rows], self.acc[: self.rows]
                self.weight, self.acc = w, a

        def index(self, uniq: np.ndarray) -> np.ndarray:
            """Rows of the sorted unique ``uniq``, created (normal init) where new."""
            pos = np.searchsorted(self.keys, uniq)
            hit = pos < len(self.keys)
            hit[hit] = self.keys[pos[hit]] == uniq[hit]
            slot = np.empty(len(uniq), np.int64)
            slot[hit] = self.slots[pos[hit]]
            new = ~hit
            k = int(new.sum())
            if k:
                self._grow(self.rows + k)
                fresh = np.arange(self.rows, self.rows + k, dtype=np.int64)
                self.weight[self.rows : self.rows + k] = torch.randn(k, dim, generator=self.gen) * std
                self.acc[self.rows : self.rows + k] = initial_accumulator
                slot[new] = fresh
                self.keys = np.insert(self.keys, pos[new], uniq[new])
                self.slots = np.insert(self.slots, pos[new], fresh)
                self.rows += k
            return slot

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            uniq, inverse = np.unique(ids.numpy().reshape(-1), return_inverse=True)
            rows = torch.from_numpy(self.index(uniq))
            leaf = self.weight[rows].requires_grad_(True)
            self._pending.append((rows, leaf))
            return F.embedding(torch.from_numpy(inverse.reshape(tuple(ids.shape))), leaf)

        @torch.no_grad()
        def step(self) -> None:
            for rows, leaf in self._pending:
                if leaf.grad is None:
                    continue
                g = leaf.grad
                acc = self.acc[rows].addcmul_(g, g)
                self.acc[rows] = acc
                self.weight[rows] = leaf.detach().addcdiv_(g, acc.sqrt_().add_(eps), value=-lr)
            self._pending.clear()

    return LocalEmbedding()


def torch_adam(params: Any, h: Any) -> "torch.optim.Optimizer":
    """``torch.optim.Adam`` with a PS ``adam`` spec's hyperparameters (lr, beta1, beta2, eps, weight_decay)."""
    import torch

    return torch.optim.Adam(
        params, lr=h.get("lr", 1e-3), betas=(h.get("beta1", 0.9), h.get("beta2", 0.999)), eps=h.get("eps", 1e-8),
        weight_decay=h.get("weight_decay", 0.0),
    )


def run_local(steps: int, batch: int, warmup: int, block: int, seed: int = 0) -> dict[str, Any]:
    """Train the ctr model with no PS; returns per-block wall times (steps after ``warmup``)."""
    import numpy as np
    import torch

    from worker.tasks import load_task

    task = load_task("ctr", seed=seed, test_size=100)  # the workers' model: same MLP init, same data
    from worker.binding import PSEmbedding
    from worker.tasks.ctr import CTRModel

    model = task.model
    assert isinstance(model, CTRModel) and isinstance(model.emb, PSEmbedding)
    emb = model.emb  # its dim and optimizer hyperparameters (the shards' adagrad)
    h = emb.optimizer.hparams
    local = make_local_embedding(emb.dim, h["lr"], h["initial_accumulator"], h["eps"], seed=seed)
    model.emb = local  # type: ignore[assignment]  # same forward contract: ids -> ids.shape + (dim,)
    opt_mlp = torch_adam(model.mlp.parameters(), task.dense_optimizer.hparams)
    data = task.batches(0, 1, batch, 0)
    model.train()
    marks: list[float] = []
    losses: list[float] = []
    span0 = 0.0
    for step in range(steps):
        if step == warmup:
            span0 = time.time()  # the steady span on the wall clock the PS runs' records use
        if step >= warmup and (step - warmup) % block == 0:
            marks.append(time.perf_counter())
        b = next(data)
        opt_mlp.zero_grad(set_to_none=True)
        loss = task.loss(model, b)
        loss.backward()
        local.step()  # type: ignore[operator]
        opt_mlp.step()
        losses.append(float(loss.detach()))  # the workers read the loss every step too
    marks.append(time.perf_counter())
    span = (span0, time.time())
    walls = [b - a for a, b in zip(marks, marks[1:])]
    ns = [block] * (len(walls) - 1) + [steps - warmup - block * (len(walls) - 1)]
    return {"walls": walls, "steps": ns, "rows": local.rows, "loss": float(np.mean(losses[-block:])), "span": span,
            "threads": torch.get_num_threads()}


# =========================================================================== DDP + Gloo all-reduce
_DDP: dict[str, Any] = {}  # this process's DDP rank, once set up: never torn down (see ddp_init)


def ddp_init(job: dict[str, Any], say: Any) -> dict[str, Any]:
    """Become DDP rank ``job["rank"]`` of 2 (Gloo) with the dense task's model, Adam on each rank.

    Rank 0 binds a ``TCPStore`` on port 0 and reports it (``say({"port": p})``); rank 1 connects to
    it. The group stays up for later ``ddp_steps`` jobs (PS runs may come in between) and is never
    torn down: the child leaves with ``os._exit``. (torch 2.13 can deadlock freeing a DDP
    ``ProcessGroupGloo``: its destructor joins Gloo's work thread while holding the GIL that the
    thread may need to free a finished work's tensors; we hit it about every other run.)"""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.tasks import load_task

    rank, world = job["rank"], WORKERS
    timeout = timedelta(seconds=120)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        say({"port": store.port})
    else:
        store = dist.TCPStore("127.0.0.1", job["port"], world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    device = torch.device(job["device"])
    task = load_task(job["task"], **job["task_opts"])  # same seed: the PS workers' initial weights
    model = DDP(task.model.to(device))
    _DDP.update(
        store=store, model=model, task=task, device=device, to_dev=task.to_device or _move,
        opt=torch_adam(model.parameters(), task.dense_optimizer.hparams),
        data=task.batches(rank, world, job["batch"], 0),
        numel=sum(p.numel() for p in model.parameters()),
    )
    dist.barrier()
    return {"numel": _DDP["numel"]}


def ddp_steps(job: dict[str, Any]) -> dict[str, Any]:
    """``job["steps"]`` DDP steps (wall time of each, CPU time of the process over all), then
    ``ar_warmup + ar_repeats`` raw Gloo all-reduces of a float32 tensor of the model's size."""
    import torch
    import torch.distributed as dist

    d = _DDP
    model, opt, task = d["model"], d["opt"], d["task"]
    walls: list[float] = []
    dist.barrier()
    c0 = time.process_time()
    for _ in range(job["steps"]):
        t0 = time.perf_counter()
        b = d["to_dev"](next(d["data"]), d["device"])
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, b)
        loss.backward()
        opt.step()
        float(loss.detach())  # as the PS workers do: the loss is read every step
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - c0
    t = torch.ones(d["numel"], dtype=torch.float32)  # CPU: Gloo's home
    times: list[float] = []
    for i in range(job["ar_warmup"] + job["ar_repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= job["ar_warmup"]:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"walls": walls, "cpu_s": cpu, "ar_times": times, "loss": float(loss.detach())}


def _move(batch: Any, device: Any) -> Any:
    from worker.tasks import move

    return move(batch, device)


# =========================================================================== worker child: serves jobs
def run_ps_job(job: dict[str, Any]) -> dict[str, Any]:
    """One worker of a PS run, as ``tessera worker`` runs it (task, PSClient, Trainer)."""
    from ps import PSClient
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    task = load_task(job["task"], **job["task_opts"])
    opts = dict(job["cfg"])
    wire_dtype = opts.pop("wire_dtype", None)  # the client's settings, not the trainer's
    transport = opts.pop("transport", "auto")
    cache_rows, cache_staleness = opts.pop("emb_cache_rows", 0), opts.pop("emb_cache_staleness", 4)
    cfg = TrainConfig(**opts)
    caches: dict[str, Any] = {}
    if cache_rows:  # as tessera worker --emb-cache-rows N --emb-cache-staleness K does
        from worker.emb_cache import attach_caches
        from worker.trainer import resolve_device

        caches = attach_caches(task.model, cache_rows, cache_staleness, cfg.mode, resolve_device(cfg.device))
    with PSClient(job["addrs"], timeout=max(60.0, 3 * cfg.lease_s), wire_dtype=wire_dtype, transport=transport) as client:
        client.wait_ready(timeout=60)
        summary = Trainer(task, client, cfg).run()
    out: dict[str, Any] = {"summary": asdict(summary)}
    if caches:
        st = [c.stats for c in caches.values()]
        out["cache"] = {"lookups": sum(x.lookups for x in st), "hits": sum(x.hits for x in st),
                        "rows": sum(x.rows for x in st), "row_hits": sum(x.row_hits for x in st),
                        "transferred": sum(x.transferred for x in st)}
    return out


def child_main() -> int:
    """Serve jobs (JSON lines on stdin) until EOF or {"job": "exit"}; reply with MARK + JSON lines."""
    sys.path.insert(0, ROOT)  # `bench.worker_step:dense_task` must be importable, as from the repo root
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (Ctrl-C reaches the whole group)
    import torch

    import worker.trainer  # noqa: F401 - import before "ready": jobs then time training, not imports

    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (seconds)

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    say({"ready": os.getpid()})
    for line in sys.stdin:
        job = json.loads(line)
        kind = job.get("job")
        if kind == "exit":
            break
        try:
            if kind == "ps":
                res = run_ps_job(job)
            elif kind == "local":
                # the one-process baseline may use every core the cluster uses (the workers keep one each)
                torch.set_num_threads(job.get("threads", 1))
                try:
                    res = run_local(job["steps"], job["batch"], job["warmup"], job["block"])
                finally:
                    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
            elif kind == "ddp_init":
                res = ddp_init(job, say)
            elif kind == "ddp_steps":
                res = ddp_steps(job)
            else:
                raise ValueError(f"unknown job {kind!r}")
            say({"ok": True, **res})
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the run
            say({"ok": False, "error": traceback.format_exc()})
    if _DDP:
        os._exit(0)  # skip the process group's teardown (see ddp_init)
    return 0


class Child:
    """A worker child process (this script with ``--child``) and its job pipe.

    A reader thread moves the child's stdout lines into a queue, so ``recv`` has a deadline and
    never blocks on a line already buffered."""

    def __init__(self, index: int) -> None:
        import queue
        import threading

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", "BENCH_TORCH_THREADS": "1"}
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"child{index}-stdout", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        """The child's next protocol message (raises on a failed job, exit or deadline)."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"worker child {self.index}: no reply within {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"worker child {self.index} exited (code {self.proc.wait()})")
            if line.startswith(MARK):
                msg: dict[str, Any] = json.loads(line[len(MARK):])
                if msg.get("ok") is False:
                    raise RuntimeError(f"worker child {self.index} failed:\n{msg['error']}")
                return msg

    def stop(self) -> None:
        """Ask the child to exit (after its job in flight, if any)."""
        if self.proc.poll() is None:
            try:
                self.send({"job": "exit"})
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass


# =========================================================================== figures
@dataclass
class Run:
    """One measured configuration: per worker, its steady blocks (steps, wall s, compute, pull, push)."""

    name: str
    batch: int
    blocks: list[list[tuple[int, float, float, float, float]]]  # [worker][block]
    summaries: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""
    worker_cpu_s: float = float("nan")  # CPU seconds of the worker processes over the whole run
    shard_cpu_s: float = float("nan")  # and of the shard processes
    worker_steps: int = 0  # steps trained, summed over workers (whole run)
    loss: float = float("nan")  # training loss at the end (mean over workers of their last window)
    # per repeat: each worker's steady span on the shared wall clock (first steady step's start, last
    # step's end); steady examples summed over workers and repeats
    spans: list[list[tuple[float, float]]] = field(default_factory=list)
    steady_examples: int = 0
    threads: int = 1  # torch intra-op threads per worker process
    cache: dict[str, int] = field(default_factory=dict)  # hot-row cache counters summed over workers (worker.emb_cache)

    @property
    def span_s(self) -> float:
        """Seconds of the shared steady span: per repeat, first worker's start to last worker's end."""
        return sum(max(t1 for _, t1 in rep) - min(t0 for t0, _ in rep) for rep in self.spans)

    @property
    def eps_span(self) -> float:
        """Examples/s of the cluster: all steady examples over the shared wall-clock span (a worker
        that runs while the other waits counts its time once, not per worker)."""
        return self.steady_examples / self.span_s if self.span_s > 0 else float("nan")

    @property
    def cpu_s(self) -> float:
        return self.worker_cpu_s + self.shard_cpu_s

    @property
    def cpu_per_example_s(self) -> float:
        """CPU seconds of all processes (workers and shards, whole run) per example trained."""
        return self.cpu_s / (self.worker_steps * self.batch) if self.worker_steps else float("nan")

    @property
    def worker_cpu_ms(self) -> float:
        """Worker CPU per worker step (ms, whole run)."""
        return 1e3 * self.worker_cpu_s / self.worker_steps if self.worker_steps else float("nan")

    @property
    def shard_cpu_ms(self) -> float:
        """Shard CPU (all shards) per worker step (ms, whole run)."""
        return 1e3 * self.shard_cpu_s / self.worker_steps if self.worker_steps else float("nan")

    def _aligned(self) -> list[list[tuple[int, float, float, float, float]]]:
        k = min(len(b) for b in self.blocks)
        return [[b[i] for b in self.blocks] for i in range(k)]

    @property
    def block_eps(self) -> list[float]:
        return [sum(n * self.batch / w for n, w, *_ in blk) for blk in self._aligned()]

    @property
    def eps(self) -> float:
        return statistics.median(self.block_eps)

    @property
    def eps_best(self) -> float:
        return max(self.block_eps)

    @property
    def eps_mean(self) -> float:
        return sum(sum(n for n, *_ in b) * self.batch / sum(w for _, w, *_ in b) for b in self.blocks)

    @property
    def block_step_s(self) -> list[float]:
        return [statistics.mean(w / n for n, w, *_ in blk) for blk in self._aligned()]

    @property
    def step_ms(self) -> float:
        return 1e3 * statistics.median(self.block_step_s)

    @property
    def step_ms_min(self) -> float:
        return 1e3 * min(self.block_step_s)

    @property
    def step_ms_mean(self) -> float:
        return 1e3 * statistics.mean(sum(w for _, w, *_ in b) / sum(n for n, *_ in b) for b in self.blocks)

    def split(self) -> dict[str, float]:
        """Seconds summed over workers and steady blocks: wall, compute, pull, push, other."""
        wall = sum(x[1] for b in self.blocks for x in b)
        c = sum(x[2] for b in self.blocks for x in b)
        pl = sum(x[3] for b in self.blocks for x in b)
        ps = sum(x[4] for b in self.blocks for x in b)
        return {"wall": wall, "compute": c, "pull": pl, "push": ps, "other": max(0.0, wall - c - pl - ps)}

    @property
    def wait_fraction(self) -> float:
        s = self.split()
        return (s["pull"] + s["push"]) / s["wall"] if s["wall"] else 0.0

    def merge(self, other: "Run") -> None:
        """Pool another repeat's blocks (and summaries) into this run."""
        self.blocks = [a + b for a, b in zip(self.blocks, other.blocks)]
        self.summaries += other.summaries
        self.wall_s += other.wall_s
        self.worker_cpu_s += other.worker_cpu_s
        self.shard_cpu_s += other.shard_cpu_s
        self.worker_steps += other.worker_steps
        self.spans += other.spans
        self.steady_examples += other.steady_examples
        self.cache = {k: self.cache.get(k, 0) + other.cache.get(k, 0) for k in {*self.cache, *other.cache}}


def blocks_from_file(path: str, warmup: int, batch: int, start: int = 0) -> list[tuple[int, float, float, float, float]]:
    """Steady blocks from a trainer's metrics file: (steps, wall s, compute s, pull wait s, push wait s).

    A block is one ``kind == "step"`` record (``log_every`` steps); its wall time is
    ``steps * batch / examples_per_s`` (the trainer's own window clock). Blocks that begin before
    step ``start + warmup`` are dropped."""
    out = []
    prev = start
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "step":
                continue
            n = r["step"] - prev
            if prev >= start + warmup and n > 0 and r["examples_per_s"] > 0:
                out.append((n, n * batch / r["examples_per_s"], r["compute_s"], r["pull_wait_s"], r["push_wait_s"]))
            prev = r["step"]
    return out


def span_from_file(path: str, warmup: int, batch: int, start: int = 0) -> tuple[tuple[float, float], int]:
    """(wall-clock span of the steady steps, steady examples) from a trainer's metrics file: from
    the record that closes step ``start + warmup`` (the first steady step starts then) to the last
    step record; examples: the steady steps times the batch."""
    t0 = t1 = float("nan")
    last_step = first = None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "step":
                continue
            if r["step"] <= start + warmup:
                t0, first = r["time"], r["step"]
            else:
                t1, last_step = r["time"], r["step"]
    if first is None or last_step is None:
        return (t0, t1), 0
    return (t0, t1), (last_step - first) * batch


# =========================================================================== orchestration
def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc; nan elsewhere or if one is gone)."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")
    return total


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ShardSets:
    """Fresh shard processes (``start_local_shards(2, ("--lease", "5"))``) for every run.

    ``take()`` returns a started set; ``retire(procs)`` sends SIGTERM and returns at once: the next
    ``take()`` starts its set while the old one exits, and waits for the old one to be gone before
    returning (nothing else runs while a run is measured). With ``ahead`` (quick mode, where start-up
    is most of the time and the figures are not compared) the next set starts in the background while
    the current one is in use, and retired sets are reaped only at ``close()``.
    """

    def __init__(self, ahead: bool) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self.ahead = ahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-start")
        self._next: Future | None = None
        self._retired: list[subprocess.Popen] = []
        self._live: list[subprocess.Popen] = []

    def prestart(self) -> None:
        from ps.cli import start_local_shards

        if self._next is None:
            # every shard also serves its bulk port: workers use it unless their transport is "grpc"
            self._next = self._pool.submit(start_local_shards, SHARDS, ("--lease", str(LEASE_S), "--bulk-port", "0"))

    def take(self, more: bool) -> tuple[list[subprocess.Popen], list[str]]:
        """A started set; ``more``: another set will be wanted after this one."""
        from ps.cli import stop_processes

        self.prestart()
        assert self._next is not None
        fut, self._next = self._next, None
        procs, addrs = fut.result()
        self._live += procs
        if not self.ahead:
            stop_processes(self._retired)  # already signalled: normally gone by now
            self._retired.clear()
        elif more:
            self.prestart()
        return procs, addrs

    def retire(self, procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            self._live.remove(p)
            self._retired.append(p)

    def drain(self) -> None:
        """Wait until every retired set has exited (nothing of the PS runs while the next figure is timed)."""
        from ps.cli import stop_processes

        stop_processes(self._retired)
        self._retired.clear()

    def close(self) -> None:
        from ps.cli import stop_processes

        if self._next is not None:
            try:
                self._live += self._next.result()[0]
            except Exception:  # noqa: BLE001 - a set that failed to start stopped its own processes
                pass
            self._next = None
        self._pool.shutdown(wait=True)
        stop_processes(self._live + self._retired)
        self._live.clear()
        self._retired.clear()


def ps_run(
    children: list[Child], sets: ShardSets, more: bool, name: str, task: str, task_opts: dict[str, Any],
    cfg: dict[str, Any], steps: int, warmup: int, tmp: str, step_timeout: float,
) -> Run:
    """Fresh shards, one Trainer per worker child, shards retired; the steady blocks of each worker."""
    t0 = time.perf_counter()
    procs, addrs = sets.take(more)
    t_shards = time.perf_counter() - t0
    files = [os.path.join(tmp, f"{name}-w{i}-{time.monotonic_ns()}.jsonl") for i in range(len(children))]
    wpids, spids = [ch.proc.pid for ch in children], [p.pid for p in procs]
    cpu0 = cpu_seconds(wpids), cpu_seconds(spids)
    try:
        for i, ch in enumerate(children):
            ch.send({
                "job": "ps", "task": task, "task_opts": task_opts, "addrs": addrs,
                "cfg": {**cfg, "steps": steps, "worker_index": i, "num_workers": len(children), "metrics_out": files[i],
                        "lease_s": LEASE_S, "progress": False, "evaluate": False, "start_timeout_s": 60.0},
            })
        replies = [ch.recv(60 + steps * step_timeout) for ch in children]
        summaries = [r["summary"] for r in replies]
        cpu1 = cpu_seconds(wpids), cpu_seconds(spids)
    finally:
        sets.retire(procs)
    batch = cfg["batch_size"]
    blocks = [blocks_from_file(f, warmup, batch) for f in files]
    if any(not b for b in blocks):
        raise RuntimeError(f"{name}: no steady blocks (steps {steps}, warm-up {warmup}, block {cfg['log_every']})")
    spans = [span_from_file(f, warmup, batch) for f in files]
    run = Run(name, batch, blocks, summaries, time.perf_counter() - t0, worker_cpu_s=cpu1[0] - cpu0[0],
              shard_cpu_s=cpu1[1] - cpu0[1], worker_steps=sum(x["steps"] for x in summaries),
              loss=statistics.mean(x["loss"] for x in summaries), spans=[[sp for sp, _ in spans]],
              steady_examples=sum(n for _, n in spans))
    for r in replies:
        for k, v in r.get("cache", {}).items():
            run.cache[k] = run.cache.get(k, 0) + v
    log(f"  {name}: {run.eps:,.0f} ex/s (median block), step {run.step_ms:.1f} ms; {run.wall_s:.1f} s "
        f"(waiting for shards {t_shards:.1f} s, training {max(x['seconds'] for x in summaries):.1f} s)")
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run (< 30 s): a few steps, a small dense model")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    ap.add_argument("--repeats", type=int, default=None, help="run every ctr mode this many times, blocks pooled (default 2, quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="ctr steps per mode and repeat (default 80, quick 8)")
    ap.add_argument("--batch-size", type=int, default=256, help="ctr per-worker batch (default 256)")
    ap.add_argument("--dense-steps", type=int, default=None, help="dense MLP steps, PS sync and DDP (default 35, quick 6)")
    ap.add_argument("--dense-batch", type=int, default=None, help="dense MLP per-worker batch (default 128, quick 32)")
    ap.add_argument("--dense-repeats", type=int, default=None, help="PS sync / DDP rounds, interleaved (default 2, quick 1)")
    ap.add_argument("--dense-width", type=int, default=None, help="dense MLP width (default 1024: 5.0M params; quick 128)")
    ap.add_argument("--device", default="cpu", help="workers' device: cpu, cuda, cuda:N (default cpu)")
    ap.add_argument("--wire-dtype", default=None, choices=["float32", "float16", "bfloat16"], help="PS wire precision (default float32)")
    ap.add_argument(
        "--transport", default="bulk", choices=["bulk", "grpc"],
        help="the workers' PS transport (default bulk: the shards' --bulk-port; with bulk, async also runs over gRPC "
        "once per repeat, as async_grpc)",
    )
    ap.add_argument(
        "--emb-cache-rows", type=int, default=0,
        help="also run async with each worker's hot-row cache of this many rows (tessera worker --emb-cache-rows; "
        "refreshed every --emb-cache-staleness steps), once per repeat, as async_cache (default 0: not run)",
    )
    ap.add_argument("--emb-cache-staleness", type=int, default=4, help="the async_cache run's refresh period in steps (default 4)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: serve jobs on stdin
    args = ap.parse_args(argv)
    if args.child:
        return child_main()

    quick = args.quick
    steps = args.steps or (8 if quick else 80)
    args.repeats = args.repeats or (1 if quick else 2)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    block = 2 if quick else 5
    warmup = 2 if quick else 10
    if steps < warmup + block:
        ap.error(f"--steps must be at least {warmup + block} (warm-up {warmup} + one block of {block})")
    dense_steps = args.dense_steps or (6 if quick else 35)
    dense_warmup = 2 if quick else 5
    if dense_steps < dense_warmup + block:
        ap.error(f"--dense-steps must be at least {dense_warmup + block}")
    dense_batch = args.dense_batch or (32 if quick else 128)
    dense_repeats = args.dense_repeats or (1 if quick else 2)
    dense_opts = {"width": args.dense_width or (128 if quick else 1024), "depth": 5, "in_dim": 784}
    batch = args.batch_size
    ctr_opts = {"test_size": 100}  # no evaluation in the benchmark: keep the test set tiny
    step_timeout = 30.0  # generous per-step deadline

    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="tessera-worker-bench-")
    children: list[Child] = []
    sets = ShardSets(ahead=quick)
    runs: dict[str, Run] = {}
    local: Run | None = None
    local_variants: dict[str, float] = {}
    ddp: dict[str, Any] = {}
    try:
        log("starting 2 worker processes (and the first 2 shards)")
        sets.prestart()
        children = [Child(i) for i in range(WORKERS)]
        for ch in children:
            ch.recv(120)

        # (1) ctr: every mode, with and without overlap, fresh shards each
        modes = [("sync", {}), ("ssp", {"staleness": 4}), ("async", {})]
        with_grpc = args.transport == "bulk"  # async over gRPC too, for the comparison
        with_cache = args.emb_cache_rows > 0
        left = 1 + (3 * 2 + with_grpc + with_cache) * args.repeats  # shard sets still wanted (the first dense run's included)
        transport = "auto" if args.transport == "bulk" else "grpc"
        cached = {"emb_cache_rows": args.emb_cache_rows, "emb_cache_staleness": args.emb_cache_staleness}
        for rep in range(args.repeats):
            extra_runs = ([("async", {}, "grpc")] if with_grpc else []) + ([("async", cached, transport)] if with_cache else [])
            for mode, extra, tr in [(m, e, transport) for m, e in modes] + extra_runs:
                plain = tr == transport and "emb_cache_rows" not in extra
                for overlap in ((True, False) if rep % 2 == 0 else (False, True)) if plain else (True,):  # alternate: drift hits both
                    left -= 1
                    name = mode + ("" if overlap else "_noov") + ("_grpc" if tr != transport else "") + ("_cache" if "emb_cache_rows" in extra else "")
                    log(f"ctr {name}: 2 workers x {steps} steps, batch {batch}, 2 fresh shards" + (f" (repeat {rep + 1})" if args.repeats > 1 else ""))
                    cfg = {"mode": mode, **extra, "batch_size": batch, "overlap": overlap, "log_every": block, "device": args.device,
                           "wire_dtype": args.wire_dtype, "transport": tr}
                    r = ps_run(children, sets, left > 0, name, "ctr", ctr_opts, cfg, steps, warmup, tmp, step_timeout)
                    if name in runs:
                        runs[name].merge(r)
                    else:
                        runs[name] = r

        # (2) the local baseline, in worker process 0 (one torch thread, like a worker)
        log(f"ctr local baseline: one process, no PS, {steps * args.repeats} steps, batch {batch}")
        t0 = time.perf_counter()
        lsteps = steps * args.repeats
        sets.drain()  # the last ctr run's shards are gone: the baseline has the machine to itself
        # one torch thread, and as many as the cluster used cores (2): the baseline is the faster (an
        # OpenMP pool of 2 on a loaded 2-core machine can be far slower than 1 thread)
        locals_: list[Run] = []
        for threads in sorted({1, min(WORKERS, os.cpu_count() or 1)}):
            t0 = time.perf_counter()
            cpu0 = cpu_seconds([children[0].proc.pid])
            children[0].send({"job": "local", "steps": lsteps, "batch": batch, "warmup": warmup, "block": block, "threads": threads})
            res = children[0].recv(60 + lsteps * step_timeout)
            locals_.append(Run(
                "local", batch, [[(n, w, w, 0.0, 0.0) for n, w in zip(res["steps"], res["walls"])]],
                wall_s=time.perf_counter() - t0,
                note=f"{res['rows']:,} rows, loss {res['loss']:.4f}, {res['threads']} torch thread(s)",
                worker_cpu_s=cpu_seconds([children[0].proc.pid]) - cpu0, shard_cpu_s=0.0, worker_steps=lsteps,
                loss=res["loss"], spans=[[tuple(res["span"])]], steady_examples=(lsteps - warmup) * batch,
                threads=res["threads"],
            ))
            log(f"  local, {threads} thread(s): {locals_[-1].eps_span:,.0f} ex/s over its steady span")
        local = max(locals_, key=lambda r: r.eps_span)
        local_variants.update({f"local_{r.threads}t_eps_span": round(r.eps_span, 1) for r in locals_})
        local_variants.update({f"local_{r.threads}t_cpu_per_example_us": round(1e6 * r.cpu_per_example_s, 2) for r in locals_})
        log(f"  local: {local.eps:,.0f} ex/s (median block); {local.wall_s:.1f} s")

        # (3) dense MLP: DDP group set up once in the two worker processes, then PS sync and DDP
        # interleaved, dense_repeats times (fresh shards for each PS run)
        log(f"dense MLP (width {dense_opts['width']}): DDP group (Gloo, the 2 worker processes)")
        job = {"task": DENSE_TASK, "task_opts": dense_opts, "batch": dense_batch, "device": args.device}
        children[0].send({"job": "ddp_init", **job, "rank": 0})
        port = children[0].recv(120)["port"]
        children[1].send({"job": "ddp_init", **job, "rank": 1, "port": port})
        numel = [ch.recv(120) for ch in children][0]["numel"]
        dcfg = {"mode": "sync", "batch_size": dense_batch, "overlap": True, "log_every": block, "device": args.device,
                "wire_dtype": args.wire_dtype, "transport": transport}
        ddp_walls: list[list[list[float]]] = [[], []]  # [rank][round][step]
        ddp_cpu = 0.0
        ar: list[float] = []
        t_ddp = 0.0
        for rep in range(dense_repeats):
            left = dense_repeats - 1 - rep
            log(f"dense MLP: 2 workers sync x {dense_steps} steps, batch {dense_batch}, 2 fresh shards" + (f" (repeat {rep + 1})" if dense_repeats > 1 else ""))
            # no set started ahead, and the retired one waited for: DDP is timed with no shard process alive
            r = ps_run(children, sets, False, "dense_sync", DENSE_TASK, dense_opts, dcfg, dense_steps, dense_warmup, tmp, step_timeout)
            if "dense_sync" in runs:
                runs["dense_sync"].merge(r)
            else:
                runs["dense_sync"] = r
            sets.drain()
            log(f"dense MLP: DDP x {dense_steps} steps, then raw all-reduce of {numel * 4 / 1e6:.1f} MB")
            t0 = time.perf_counter()
            for ch in children:
                ch.send({"job": "ddp_steps", "steps": dense_steps, "ar_warmup": 2, "ar_repeats": 4 if quick else 8})
            res_ddp = [ch.recv(120 + dense_steps * step_timeout) for ch in children]
            t_ddp += time.perf_counter() - t0
            for i, rr in enumerate(res_ddp):
                ddp_walls[i].append(rr["walls"])
                ddp_cpu += rr["cpu_s"]
            ar += res_ddp[0]["ar_times"]
            log(f"  ddp: step {1e3 * statistics.median(res_ddp[0]['walls'][dense_warmup:]):.1f} ms (median)")
        ddp = {"walls": ddp_walls, "ar": ar, "numel": numel, "wall_s": t_ddp, "cpu_s": ddp_cpu}
    except BaseException as e:
        if not interrupted and not isinstance(e, KeyboardInterrupt):
            raise
        log(f"interrupted ({type(e).__name__}); stopping child processes")
        return 130 if not interrupted or interrupted[0] == signal.SIGINT else 143
    finally:
        for ch in children:
            ch.stop()
        sets.close()
        for ch in children:
            try:
                ch.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                ch.proc.kill()
                ch.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    assert local is not None
    wall = time.perf_counter() - t_start
    return report(args, runs, local, ddp, wall, steps, warmup, block, dense_steps, dense_warmup, dense_batch, dense_opts, load0,
                  local_variants)


def report(
    args: argparse.Namespace, runs: dict[str, Run], local: Run, ddp: dict[str, Any], wall: float, steps: int, warmup: int,
    block: int, dense_steps: int, dense_warmup: int, dense_batch: int, dense_opts: dict[str, Any], load0: float,
    local_variants: dict[str, float] | None = None,
) -> int:
    # DDP: per-step walls of both ranks after warm-up, in blocks like the PS runs
    def ddp_blocks(rounds: list[list[float]]) -> list[tuple[int, float, float, float, float]]:
        out = []
        for walls in rounds:
            w = walls[dense_warmup:]
            # the whole step counts as compute: DDP's all-reduce runs inside backward
            out += [(len(w[i : i + block]), sum(w[i : i + block]), sum(w[i : i + block]), 0.0, 0.0) for i in range(0, len(w), block)]
        return out

    ddp_run = Run("ddp", dense_batch, [ddp_blocks(ddp["walls"][0]), ddp_blocks(ddp["walls"][1])], wall_s=ddp["wall_s"],
                  worker_cpu_s=ddp["cpu_s"], shard_cpu_s=0.0, worker_steps=sum(len(w) for r in ddp["walls"] for w in r))
    nbytes = ddp["numel"] * 4
    busbw = [nbytes * 2 * (WORKERS - 1) / WORKERS / t / 1e9 for t in ddp["ar"]]
    dense = runs["dense_sync"]

    # ------------------------------------------------------------------ table
    hdr = (f"{'run':<12} {'ex/s med':>9} {'ex/s best':>9} {'ex/s mean':>9} {'step ms':>8} {'compute':>8} "
           f"{'pull wait':>9} {'push wait':>9} {'other':>6} {'stale':>7} {'cpu wkr':>8} {'cpu shd':>8}  notes")
    lines = [hdr, "-" * len(hdr)]

    def row(r: Run, note: str = "") -> str:
        s = r.split()
        pct = lambda k: f"{100 * s[k] / s['wall']:.0f}%" if s["wall"] else "-"  # noqa: E731
        st = "-"
        if r.summaries:
            st = f"{statistics.mean(x['mean_staleness'] for x in r.summaries):.1f}/{max(x['max_staleness'] for x in r.summaries)}"
        cw = f"{r.worker_cpu_ms:.1f}" if r.worker_cpu_ms == r.worker_cpu_ms else "-"  # nan: not measured
        cs = f"{r.shard_cpu_ms:.1f}" if r.shard_cpu_ms == r.shard_cpu_ms else "-"
        return (f"{r.name:<12} {r.eps:>9,.0f} {r.eps_best:>9,.0f} {r.eps_mean:>9,.0f} {r.step_ms:>8.1f} {pct('compute'):>8} "
                f"{pct('pull'):>9} {pct('push'):>9} {pct('other'):>6} {st:>7} {cw:>8} {cs:>8}  {note or r.note}")

    over = " (bulk)" if args.transport == "bulk" else ""
    for name in ("sync", "sync_noov", "ssp", "ssp_noov", "async", "async_noov"):
        lines.append(row(runs[name], ("" if "noov" in name else "overlap on") + over))
    if "async_grpc" in runs:
        lines.append(row(runs["async_grpc"], "overlap on, over gRPC"))
    if "async_cache" in runs:
        c = runs["async_cache"].cache
        lines.append(row(runs["async_cache"], f"hot-row cache {args.emb_cache_rows:,} rows, refresh every {args.emb_cache_staleness} steps: "
                         f"{c.get('row_hits', 0) / max(1, c.get('rows', 0)):.0%} of rows served from it"))
    lines.append(row(local, f"one process, no PS; {local.note}"))
    lines.append("")
    lines.append(row(dense, f"{int(_params(dense_opts)):,} params, 2 shards"))
    lines.append(row(ddp_run, "DDP Gloo, 2 ranks, Adam on each; compute includes the all-reduce"))
    print(
        f"\nWorker step benchmark: ctr, 2 workers x 2 shards per mode (fresh shards), batch {args.batch_size}/worker, "
        f"{steps} steps ({warmup} warm-up, blocks of {block}) x {args.repeats}; dense MLP batch {dense_batch}/worker, "
        f"{dense_steps} steps ({dense_warmup} warm-up); device {args.device}; {os.cpu_count()} CPUs\n"
        "ex/s: summed over workers (median / best block, mean over steady steps); step ms: median block; "
        "compute / waits / other: share of the workers' step time; stale: mean/max staleness;\n"
        "cpu wkr / cpu shd: CPU ms of the worker processes / of all shard processes per worker step (whole run)\n"
    )
    print("\n".join(lines))
    a, an = runs["async"], runs["async_noov"]
    out: dict[str, Any] = {}
    for name, r in [*runs.items(), ("local", local)]:
        out[f"{name}_eps"] = round(r.eps, 1)
        if r.spans:
            out[f"{name}_eps_span"] = round(r.eps_span, 1)
            out[f"{name}_span_s"] = round(r.span_s, 4)
            out[f"{name}_steady_examples"] = r.steady_examples
        out[f"{name}_eps_best"] = round(r.eps_best, 1)
        out[f"{name}_eps_mean"] = round(r.eps_mean, 1)
        if r.loss == r.loss:  # not nan
            out[f"{name}_loss"] = round(r.loss, 4)
        if r.summaries:
            s = r.split()
            for k in ("compute", "pull", "push", "other"):
                out[f"{name}_{k}_frac"] = round(s[k] / s["wall"], 4)
            out[f"{name}_wait_fraction"] = round(r.wait_fraction, 4)
            out[f"{name}_mean_staleness"] = round(statistics.mean(x["mean_staleness"] for x in r.summaries), 3)
            if name != "dense_sync":  # (its step time is sync_step_ms below)
                out[f"ctr_{name}_step_ms"] = round(r.step_ms, 2)
        if r.worker_steps:
            out[f"{name}_worker_cpu_ms"] = round(r.worker_cpu_ms, 2)
            out[f"{name}_shard_cpu_ms"] = round(r.shard_cpu_ms, 2)
    out.update({
        "overlap_speedup": round(a.eps / an.eps, 4),
        "overlap_speedup_best": round(a.eps_best / an.eps_best, 4),
        "overlap_speedup_mean": round(a.eps_mean / an.eps_mean, 4),
        "sync_overlap_speedup": round(runs["sync"].eps / runs["sync_noov"].eps, 4),
        "ssp_overlap_speedup": round(runs["ssp"].eps / runs["ssp_noov"].eps, 4),
        "async_wait_fraction": round(a.wait_fraction, 4),
        # examples/s: all steady examples over the shared wall-clock span; the baseline on the same cores
        "async_vs_local": round(a.eps_span / local.eps_span, 4),
        "async_vs_local_blocks": round(a.eps / local.eps, 4),  # the older per-block figure, for comparison
        "cpu_per_example_ratio": round(a.cpu_per_example_s / local.cpu_per_example_s, 4),
        "transport": args.transport,
        **({
            "async_vs_local_grpc": round(runs["async_grpc"].eps_span / local.eps_span, 4),
            "cpu_per_example_ratio_grpc": round(runs["async_grpc"].cpu_per_example_s / local.cpu_per_example_s, 4),
        } if "async_grpc" in runs else {}),
        **({
            "async_vs_local_cache": round(runs["async_cache"].eps_span / local.eps_span, 4),
            "cpu_per_example_ratio_cache": round(runs["async_cache"].cpu_per_example_s / local.cpu_per_example_s, 4),
            "cache_rows": args.emb_cache_rows, "cache_staleness": args.emb_cache_staleness,
            "cache_hit_rate": round(runs["async_cache"].cache.get("hits", 0) / max(1, runs["async_cache"].cache.get("lookups", 0)), 4),
            "cache_row_hit_rate": round(runs["async_cache"].cache.get("row_hits", 0) / max(1, runs["async_cache"].cache.get("rows", 0)), 4),
        } if "async_cache" in runs else {}),
        "async_cpu_s": round(a.cpu_s, 3), "async_examples": a.worker_steps * a.batch,
        "local_cpu_s": round(local.cpu_s, 3), "local_examples": local.worker_steps * local.batch,
        "local_threads": local.threads, "ddp_after_shards_exit": True, **(local_variants or {}),
        "sync_step_ms": round(dense.step_ms, 2),
        "sync_step_ms_min": round(dense.step_ms_min, 2),
        "sync_step_ms_mean": round(dense.step_ms_mean, 2),
        "ddp_step_ms": round(ddp_run.step_ms, 2),
        "ddp_step_ms_min": round(ddp_run.step_ms_min, 2),
        "ddp_step_ms_mean": round(ddp_run.step_ms_mean, 2),
        "sync_vs_ddp": round(dense.step_ms / ddp_run.step_ms, 4),
        "sync_vs_ddp_min": round(dense.step_ms_min / ddp_run.step_ms_min, 4),
        "sync_vs_ddp_mean": round(dense.step_ms_mean / ddp_run.step_ms_mean, 4),
        # CPU per worker step (worker + shards) over DDP's: what the PS costs whatever the load
        "sync_vs_ddp_cpu": round((dense.worker_cpu_ms + dense.shard_cpu_ms) / ddp_run.worker_cpu_ms, 4),
        "ddp_worker_cpu_ms": round(ddp_run.worker_cpu_ms, 2),
        "dense_sync_compute_frac": round(dense.split()["compute"] / dense.split()["wall"], 4),
        "dense_sync_pull_frac": round(dense.split()["pull"] / dense.split()["wall"], 4),
        "dense_sync_push_frac": round(dense.split()["push"] / dense.split()["wall"], 4),
        "dense_params": int(_params(dense_opts)),
        "gloo_allreduce_gbps": round(max(busbw), 4),
        "gloo_allreduce_gbps_median": round(statistics.median(busbw), 4),
        "gloo_allreduce_ms": round(1e3 * min(ddp["ar"]), 2),
        "batch_size": args.batch_size, "dense_batch": dense_batch, "steps": steps, "dense_steps": dense_steps,
        "dense_repeats": len(ddp["walls"][0]),
        "repeats": args.repeats, "quick": args.quick, "device": args.device, "cpus": os.cpu_count(),
        "wall_s": round(wall, 1), "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2), "wire_dtype": args.wire_dtype or "float32",
    })
    # the same against the one-process run that spends the least CPU per example (one torch thread, as a
    # rule: the faster baseline above may be the 2-thread one, which spends more CPU for its speed)
    cheapest_us = min((v for k, v in out.items() if k.startswith("local_") and k.endswith("t_cpu_per_example_us")),
                      default=1e6 * local.cpu_per_example_s)
    for name, key in (("async", ""), ("async_grpc", "_grpc"), ("async_cache", "_cache")):
        if name in runs:
            out[f"cpu_per_example_ratio_cheapest{key}"] = round(1e6 * runs[name].cpu_per_example_s / cheapest_us, 4)
    print(
        f"\ncpu_per_example_ratio_cheapest {out['cpu_per_example_ratio_cheapest']:.2f} (goal <= 1.5: async workers + shards CPU "
        f"per example over the one-process run that spends the least; {out['cpu_per_example_ratio']:.2f} over the faster "
        f"baseline's, cpu_per_example_ratio), async_vs_local {out['async_vs_local']:.2f} (goal >= 0.9: cluster examples/s over "
        f"the shared span / the baseline's, {out['local_threads']} torch threads)"
    )
    print(
        f"overlap_speedup {out['overlap_speedup']:.2f} (goal >= 1.3), async_wait_fraction {out['async_wait_fraction']:.2f} "
        f"(goal <= 0.2), sync_vs_ddp {out['sync_vs_ddp']:.2f} (goal <= 1.5): PS sync {dense.step_ms:.1f} ms vs DDP "
        f"{ddp_run.step_ms:.1f} ms per step; Gloo all-reduce of {nbytes / 1e6:.1f} MB: {max(busbw):.3f} GB/s bus bandwidth best, "
        f"{statistics.median(busbw):.3f} median; wall {wall:.1f} s\n"
    )
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


def _params(opts: dict[str, Any]) -> float:
    d, w, depth = opts["in_dim"], opts["width"], opts["depth"]
    return d * w + w + (depth - 1) * (w * w + w) + w * 10 + 10


if __name__ == "__main__":
    sys.exit(main())
