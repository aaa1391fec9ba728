"""Peer mode's command line.

- ``tessera peer --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT] [--max-restarts K] --task gpt ...``
  runs torchrun's elastic agent (``torch.distributed.run``, c10d rendezvous; ``--standalone`` when
  no endpoint is given), which starts N ranks of ``python -m worker.peer ...`` on this node.
- ``torchrun --nproc-per-node N -m worker.peer --task gpt ...`` is the same rank program under a
  torchrun you start yourself.
- ``--zero N`` (0-3; ``--mode zeroN`` is an alias): the ZeRO stage over the data-parallel ranks of
  any layout (``resolve_mode``: checked by the mode registry, a contradicting pair refused).
- ``--dp D --tp T [--sequence-parallel]`` (world = D x T x P): any task's model split over T ranks
  by a plan (``worker.peer.parallelize``; the gpt task's built-in Megatron split without
  ``--tp-plan``), D replicas averaged over their DP group.
- ``--pp P`` (with any ``--tp``/``--dp``), ``--recompute`` or ``--precision bf16``: a pipeline
  (``worker.peer.pipeline``: P stages of tensor-parallel layers, D pipelines, ZeRO 0-3 over D, bf16
  compute with fp32 master weights), its schedule run by the ``PipelineSync`` inside the same trainer.

Each rank joins the group, checks that every rank agrees on the run (one clear message on every
rank otherwise), and trains with the trainer's step pipeline and the mode's ``ParamSync``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tessera.argtypes import shard_list_arg
from tessera.cli import KEY_VALUE_HELP, parse_key_values
from worker.modes import PEER_MODES, check_mode
from worker.peer.flags import add_pipeline_args

__all__ = ["add_peer_commands", "add_train_args", "launcher_argv", "main", "run_rank"]

log = logging.getLogger(__name__)


class _StoppedWaiting(BaseException):
    """SIGTERM while a hybrid rank waits for its shards (not an Exception: no probe's handler swallows it)."""


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The flags of one rank (``python -m worker.peer``); ``tessera peer`` passes them through."""
    p.add_argument("--task", default="gpt", help="gpt, digits, ctr (hybrid), or package.module:function")
    p.add_argument("--task-opt", action="append", default=[], metavar="KEY=VALUE",
                   help=f"option for the task (repeatable; {KEY_VALUE_HELP})")
    p.add_argument("--mode", default="dp", choices=list(PEER_MODES),
                   help="dp (data parallel; its ZeRO stage from --zero) or hybrid (PSEmbedding rows on the PS given by --ps, "
                        "the dense part as dp in the same layout); zero1-3: aliases of --zero 1-3")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage over the data-parallel ranks (of every layout): 0 all-reduce, 1 optimizer state "
                        "sharded, 2 and gradients, 3 and parameters (default: 0, or the stage --mode zeroK names)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel replicas (0: world size / (tp x pp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica (ranks r..r+T-1 share a layer)")
    p.add_argument("--tp-plan", default="",
                   help="how --tp splits the model: auto (found by structure and name, printed), a JSON file or inline JSON "
                        "{module or pattern: colwise|rowwise|vocab|sequence|replicate} (empty: auto; the gpt task: its built-in split)")
    p.add_argument("--pp-split", default="",
                   help="with --pp: module names where stages start, comma-separated, e.g. blocks.2,blocks.4 "
                        "(empty: balanced by parameter count)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorm/dropout regions split along the sequence (all-gather/reduce-scatter)")
    p.add_argument("--ps", default="", type=shard_list_arg(allow_empty=True),  # malformed: refused at once
                   help="hybrid: HOST:PORT,... of every PS shard, in shard order")
    p.add_argument("--retry-timeout", type=float, default=60.0,
                   help="hybrid: seconds to wait for the PS shards to come up (rank 0 says every 5 s what it waits for), "
                        "then one line per rank and exit 1 (default 60)")
    p.add_argument("--sparse-mode", default="async", choices=["async", "ssp", "sync"], help="hybrid: the rows' consistency on the PS")
    p.add_argument("--moe-experts", type=int, default=0, help="gpt: experts per MoE layer (0: dense MLPs)")
    p.add_argument("--moe-top-k", type=int, default=2, choices=[1, 2], help="experts per token")
    p.add_argument("--moe-every", type=int, default=1, help="an MoE MLP in every N-th block")
    p.add_argument("--moe-capacity", type=float, default=1.25, help="capacity factor: assignments past it are dropped")
    p.add_argument("--moe-aux", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--moe-z", type=float, default=0.001, help="router z-loss coefficient")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism: experts split over groups of EP data-parallel ranks")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to train")
    p.add_argument("--global-batch", type=int, default=64, help="examples per step over all ranks (divisible by world size x accumulate)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no all-reduce on accumulation micro-batches)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="all-reduce bucket size in MiB (dp)")
    p.add_argument("--compress", default="none", choices=["none", "bf16", "fp16"], help="dp: 16-bit gradients on the wire, fp32 sums")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: NCCL on CUDA, Gloo on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds: a dead rank stops the others within it")
    p.add_argument("--world-size", type=int, default=0, help="expected world size; the run refuses to start on any other (0: any)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task's data and model (the same on every rank)")
    p.add_argument("--log-every", type=int, default=10, help="steps between the logged loss records")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end only)")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--metrics-out", default=None, help="directory: rank<r>.jsonl per rank")
    p.add_argument("--torch-threads", type=int, default=0, help="intra-op threads per rank (0: cores / local ranks)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak of one device for MFU (0: a table for known GPUs; CPU: measured matmul)")
    p.add_argument("--checkpoint-dir", default=None, help="sharded checkpoints here (a directory every rank can read); a run resumes from the newest")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--debug-collectives", action="store_true",
                   help="fingerprint every collective (op, dtype, shape, sequence number); name the rank and op on a mismatch or stall")
    p.add_argument("--trace", default=None, metavar="DIR", help="write a Chrome trace per rank: DIR/trace-rank<r>.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port + LOCAL_RANK (GET /metrics; 0: no endpoint)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    add_pipeline_args(p)  # --pp, --schedule, --micro-batches, --recompute, --precision


def _kv(items: list[str]) -> dict[str, Any]:
    try:
        return parse_key_values(items)
    except ValueError as e:
        raise SystemExit(str(e)) from None


_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}  # dense bf16/fp16


def peak_tflops(device: Any, dtype: Any, given: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from) for MFU."""
    import torch

    if given > 0:
        return given, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in _PEAK_TFLOPS.items():
            if key in name:
                return (tf if dtype in (torch.bfloat16, torch.float16) else tf / 2 if "H" in key else tf / 16), f"table ({name})"
    # CPU (or an unknown GPU): the best fp32 matmul this process achieves, measured now
    n = 512
    a = torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12, "measured 512x512 matmul"


def resolve_mode(args: argparse.Namespace) -> None:
    """``args.mode`` the registry's entry of ``--mode`` at ``--zero`` (``dp`` with ``--zero 2``: ``zero2``),
    ``args.zero`` its stage (``hybrid``: its dense part's); ``ValueError`` (one line) for a contradicting
    pair (``--mode zero1 --zero 3``)."""
    mode = check_mode(args.mode, "peer", zero=args.zero)
    args.mode, args.zero = mode.name, mode.stage


def run_rank(args: argparse.Namespace) -> int:
    """One rank: join, check, train, report. Returns the exit code."""
    import torch
    import torch.distributed as dist

    from worker.peer import PeerConfigError, PeerError, SyncPlan, init_mesh, make_sync, shutdown_group
    from worker.peer.mesh import Liveness
    from worker.peer.moe import moe_layers
    from worker.peer.flags import recompute_mode, takes_pipeline_path
    from worker.peer.pipeline import pipeline_config, pipeline_layout
    from worker.tasks import load_task
    from worker.trainer import TrainConfig, Trainer

    mesh = init_mesh(args.backend, args.device, args.timeout)
    rank, world = mesh.rank, mesh.world
    client: Any = None
    ok = False
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = args.torch_threads or max(1, (os.cpu_count() or 1) // local)
        if mesh.device.type == "cpu":
            torch.set_num_threads(threads)
        # checks every rank makes alike, before any collective of training: one message everywhere
        try:
            resolve_mode(args)
        except ValueError as e:
            raise PeerConfigError(str(e)) from None
        if args.world_size and args.world_size != world:
            raise PeerConfigError(f"world size is {world} but --world-size {args.world_size} was asked for")
        # --pp > 1, --recompute, --precision bf16 (with any --tp/--dp): a pipeline, checked by its own rules first
        piped = takes_pipeline_path(args)
        if piped:
            pipeline_config(args, world)
        pp = getattr(args, "pp", 1)
        split = args.tp * pp
        if args.tp < 1 or pp < 1 or args.dp < 0:
            raise PeerConfigError(f"--dp must be >= 0, --tp and --pp >= 1 (got dp={args.dp} tp={args.tp} pp={pp})")
        if world % split:
            raise PeerConfigError(f"world size {world} is not divisible by tp {args.tp} x pp {pp}")
        dp = args.dp or world // split
        meshed = split > 1 or args.sequence_parallel or dp != world or piped
        if args.global_batch % (dp * args.accumulate):
            raise PeerConfigError(
                f"global batch {args.global_batch} is not divisible by {'dp' if meshed else 'world size'} {dp} x "
                f"accumulate {args.accumulate}"
            )
        per_rank = args.global_batch // dp
        opts = _kv(args.task_opt)
        if args.moe_experts:
            opts.update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k, moe_every=args.moe_every,
                        moe_capacity=args.moe_capacity, moe_aux=args.moe_aux, moe_z=args.moe_z)
        task = load_task(args.task, seed=args.seed, **opts)
        settings = {
            "task": args.task, "task_opts": json.dumps(opts, sort_keys=True), "global_batch": args.global_batch,
            "accumulate": args.accumulate, "steps": args.steps, "seed": args.seed,
        }
        plan = SyncPlan(args.mode, task.dense_optimizer, bucket_mb=args.bucket_mb, compress=args.compress,
                        sequence_parallel=args.sequence_parallel, ep=args.ep, device=mesh.device, sparse_mode=args.sparse_mode,
                        sparse_ids=task.sparse_ids, prefix=task.name, settings=settings, zero=args.zero)
        if args.moe_experts and not moe_layers(task.model):
            raise PeerConfigError(f"--moe-experts: task {args.task!r} has no MoE layers (the gpt task builds them)")
        if args.mode == "hybrid":  # the PS shards holding the rows, then the layout as without them
            from ps import PSClient

            if args.checkpoint_dir:
                raise PeerConfigError("--checkpoint-dir: hybrid mode's rows live on the PS (use its checkpoints); not supported here")

            if not args.ps:
                raise PeerConfigError("--mode hybrid needs --ps HOST:PORT,... (the shards holding the embeddings)")
            from ps.cli import wait_for_shards
            from tessera.service import ServerUnreachableError

            def say(text: str) -> None:  # as the worker: rank 0 says every 5 s which shard it waits for and why
                if rank == 0:
                    print(f"tessera peer: rank 0: {text}", file=sys.stderr, flush=True)

            def stopped(*_: Any) -> None:  # the launcher stops the other ranks when one gives up: they say so too
                raise _StoppedWaiting(
                    f"stopped (SIGTERM) while waiting for the shards at {args.ps}; the launcher stops every rank once one gives up"
                )

            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGTERM, stopped) if main else None
            try:  # then one line per rank if they never come
                wait_for_shards(args.ps.split(","), None, timeout=args.retry_timeout, say=say)
            except (ServerUnreachableError, _StoppedWaiting) as e:
                print(f"tessera peer: rank {rank}: {e}", file=sys.stderr, flush=True)
                return 1
            finally:
                if main:
                    signal.signal(signal.SIGTERM, previous)
            client = PSClient(args.ps.split(","), timeout=max(60.0, args.timeout))
        worker_index = rank
        where: Any = None
        pipeline: Any = None
        if piped:  # the mesh, the task's (tensor-parallel) model and its stages: make_sync builds a PipelineSync
            where, task, pipeline = pipeline_layout(args, task, world, mesh.device)
            plan = replace(plan, pipeline=pipeline)
            worker_index = where.dp_idx
        elif meshed:
            where, task = _mesh(args, task, dp, mesh.device)
            worker_index = where.dp_idx
        sync: Any = make_sync(plan, task.model, where, client)
        if args.checkpoint_dir:
            sync.set_checkpointing(args.checkpoint_dir, args.checkpoint_every)
        metrics_out = os.path.join(args.metrics_out, f"rank{rank}.jsonl") if args.metrics_out else None
        if args.metrics_port:  # Prometheus over this rank's trainer records (one port per local rank)
            from tessera.metrics import TrainerCollector, metrics_file, serve_metrics

            metrics_out = metrics_out or metrics_file(argparse.Namespace(), prefix=f"tessera-rank{rank}-")
            port = serve_metrics(args.metrics_port + int(os.environ.get("LOCAL_RANK", "0")), args.metrics_host,
                                 [TrainerCollector(metrics_out)])
            print(f"tessera peer: rank {rank} metrics on {args.metrics_host}:{port}", file=sys.stderr, flush=True)
        cfg = TrainConfig(
            mode=args.mode, steps=args.steps, batch_size=per_rank, worker_index=worker_index, num_workers=dp,
            device=str(mesh.device), accumulate=pipeline.micro_batches if pipeline is not None else args.accumulate,
            eval_every=args.eval_every, log_every=args.log_every,
            max_seconds=args.max_seconds, seed=args.seed, progress=rank == 0 and not args.no_progress,
            metrics_out=metrics_out, name=f"rank{rank}", evaluate=not args.no_eval,
        )
        if args.debug_collectives:
            from worker.peer import debug

            debug.enable(rank, world, timeout_s=min(30.0, args.timeout))
        liveness = Liveness(rank, world)
        losses: list[float] = []  # the global loss of every step, for the report
        trainer = Trainer(task, sync, cfg, on_step=lambda step, t: losses.append(t.last_loss))
        if args.trace:
            from worker.peer.trace import Tracer

            trainer.tracer = sync.tracer = Tracer(rank)
        try:
            summary = trainer.run()
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, PeerConfigError):
                raise
            if isinstance(e, PeerError):  # named already (e.g. --debug-collectives)
                print(f"tessera peer: rank {rank}: {e}", file=sys.stderr, flush=True)
                return 1
            # a collective failed or timed out: name the rank that is gone (one line, exit 1)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"tessera peer: rank {rank}: a collective failed: {liveness.dead()} ({type(e).__name__}: {first[:200]})",
                  file=sys.stderr, flush=True)
            return 1
        finally:
            liveness.close()
            if args.trace:
                trainer.tracer.save(os.path.join(args.trace, f"trace-rank{rank}.json"))
        tokens = task.info.get("tokens_per_example", 0.0)
        report: dict[str, Any] = {
            "rank": rank, "world": world, "mode": args.mode, "zero": args.zero, "steps": summary.steps, "seconds": round(summary.seconds, 3),
            "loss": summary.loss, "last_loss": summary.last_loss, "losses": losses, "start_step": summary.start_clock,
            **summary.metrics, "examples_per_s": summary.examples_per_s * dp,
        }
        if meshed:
            report.update(dp=dp, tp=args.tp, pp=pp, sequence_parallel=args.sequence_parallel)
        if pipeline is not None:
            report.update((sync.dense if args.mode == "hybrid" else sync).describe(), recompute=recompute_mode(args) != "none", recompute_mode=recompute_mode(args))
        if tokens:
            tps = summary.examples_per_s * dp * tokens
            report["tokens_per_s"] = tps
            flops = task.info.get("flops_per_token", 0.0)
            if flops:
                dtype = next(task.model.parameters()).dtype if args.zero != 3 else torch.float32
                peak, source = peak_tflops(mesh.device, dtype, args.peak_tflops)
                report["mfu"] = tps * flops / (peak * 1e12 * world)
                report["peak_tflops"], report["peak_source"] = peak, source
        if rank == 0:
            print(json.dumps(report), flush=True)
        ok = True
        return 0
    except PeerConfigError as e:
        print(f"tessera peer: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if client is not None:
            client.close()
        shutdown_group(barrier=ok)


def _mesh(args: argparse.Namespace, task: Any, dp: int, device: Any) -> tuple[Any, Any]:
    """The (D, T, P) mesh of this run, checked on every rank, and the task with its tensor-parallel
    model: (mesh, task). The sync over it comes from ``make_sync``. The model is split by
    ``worker.peer.parallelize`` with ``--tp-plan`` (default auto) for any task; the gpt task without
    ``--tp-plan`` keeps its built-in split (``TensorParallelGPT``: vocab-parallel loss, dropout,
    selective recompute, MoE layers)."""
    from worker.peer.mesh import ParallelMesh, PeerConfigError

    pp = 1  # a pipeline's mesh is worker.peer.pipeline.pipeline_layout's
    check = {"global_batch": args.global_batch, "micro_batches": args.accumulate}
    if args.task == "gpt" and not args.tp_plan:
        from worker.peer.tensor_parallel import tensor_parallel_task

        m = task.model
        check.update(heads=m.blocks[0].heads, dim=m.tok.embedding_dim, layers=len(m.blocks), vocab=m.tok.num_embeddings,
                     seq=m.pos.num_embeddings, sequence_parallel=args.sequence_parallel)
        mesh = ParallelMesh.build(dp, args.tp, pp, device=device, seed=args.seed, check=check)
        return mesh, tensor_parallel_task(task, mesh, sequence_parallel=args.sequence_parallel)
    from worker.peer.parallelize import parallelize, plan_arg, resolve_plan

    plan = plan_arg(args.tp_plan or "auto")
    resolve_plan(task.model, plan, args.tp, args.sequence_parallel)  # every size checked before any collective
    mesh = ParallelMesh.build(dp, args.tp, pp, device=device, seed=args.seed, check=check)
    model = parallelize(task.model, mesh, plan, sequence_parallel=args.sequence_parallel).to(device)
    return mesh, replace(task, model=model)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.peer ...`` (one rank, under torchrun)."""
    p = argparse.ArgumentParser(prog="python -m worker.peer", description="one peer-mode rank (run under torchrun)")
    add_train_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("TESSERA_LOG", "WARNING"))
    try:
        return run_rank(args)
    except Exception as e:
        from worker.peer import PeerConfigError

        if isinstance(e, PeerConfigError):
            print(f"tessera peer: {e}", file=sys.stderr, flush=True)
            return 2
        raise


def _train_argv(args: argparse.Namespace) -> list[str]:
    """The rank flags of ``args`` back as a command line (those that differ from the defaults)."""
    p = argparse.ArgumentParser(add_help=False)
    add_train_args(p)
    out: list[str] = []
    for a in p._actions:
        if not a.option_strings or not hasattr(args, a.dest):
            continue
        v = getattr(args, a.dest)
        flag = a.option_strings[0]
        if isinstance(a, argparse._StoreTrueAction):
            out += [flag] if v else []
        elif isinstance(a, argparse._AppendAction):
            for item in v or []:
                out += [flag, str(item)]
        elif v != a.default:
            out += [flag, str(v)]
    return out


def launcher_argv(args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for ``tessera peer``: the elastic agent, then ``-m worker.peer`` and the rank flags."""
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if args.rdzv_endpoint:
        argv += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.rdzv_id:
            argv += ["--rdzv-id", args.rdzv_id]
        if args.rdzv_conf:
            argv += ["--rdzv-conf", args.rdzv_conf]
    else:
        if str(args.nnodes) not in ("1", "1:1"):
            raise SystemExit("tessera peer: --nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        argv += ["--standalone"]
    return argv + ["-m", "worker.peer", *_train_argv(args)]


def add_peer_commands(sub: Any) -> None:
    p = sub.add_parser(
        "peer", help="peer mode: N ranks per node under torchrun's elastic agent, all-reduce DP or ZeRO",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic run (default 1)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (several nodes); none: standalone")
    p.add_argument("--rdzv-id", default="", help="job id shared by the nodes of one run")
    p.add_argument("--rdzv-conf", default="", help="torchrun's rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts the ranks this many times after a failure")
    add_train_args(p)
    p.set_defaults(func=_peer)


def _peer(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    resolve_mode(args)  # a contradicting --mode/--zero: one line (tessera peer: error: ...), exit 2, no rank started
    argv = launcher_argv(args)
    try:
        torchrun(argv)
    except ChildFailedError as e:
        # the rank that failed first on its own (the agent then stops the others with a signal)
        fails = sorted(e.failures.items(), key=lambda kv: (kv[1].exitcode is None or kv[1].exitcode <= 0, kv[1].timestamp))
        rank, why = fails[0] if fails else (-1, None)
        code = why.exitcode if why is not None and why.exitcode is not None else 1
        print(f"tessera peer: rank {rank} failed first (exit code {code}); its message is above", file=sys.stderr)
        return code if code > 0 else 1
    return 0
