"""Simulation: a real federated server and many clients on one machine, over real gRPC.

The server runs in this process. The clients are virtual: one or a few client
*nodes* (threads here, or ``processes`` child processes) each host a range of client
ids and build a client only when the server sends it a task (one torch model per
worker thread, reused), so 10,000 registered clients cost a registry entry each on
the server and a partition index each on the nodes, and memory does not grow with
rounds. Outputs (``out``): ``results.json``, ``accuracy.png``, ``loss.png`` and
``label_distribution.png``.

When there are more clients than the task's data can give one example each, client
``i`` uses data part ``i % parts`` (parts = training examples / ``min_examples``).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from federated.config import SecAggSettings, ServerConfig
from federated.errors import ConfigError
from federated.partition import label_counts, parse_partition
from federated.privacy import DPConfig

__all__ = ["SimulationConfig", "run_simulation", "rss_mb", "peak_rss_mb", "node_main"]

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident set size now, in MB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):
        return 0.0


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB: /proc's VmHWM, which counts this
    process alone (``getrusage``'s ``ru_maxrss`` of a child started by fork and exec
    starts from the parent's peak, so a server launched by a process that had imported
    torch would report that process's memory); ``ru_maxrss`` where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6  # kB
    except (OSError, ValueError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated training run (see the module doc)."""

    task: str = "digits"
    clients: int = 100
    fraction: float = 0.1
    rounds: int = 30
    strategy: str = "fedavg"
    strategy_params: dict[str, Any] = field(default_factory=dict)
    partition: str = "dirichlet:0.5"
    seed: int = 0
    processes: int = 0  # 0: client nodes are threads of this process
    workers: int = 16  # concurrent tasks per node (more than are sampled at once: no queueing)
    min_clients: int = 2
    round_timeout: float = 60.0
    straggler_factor: float = 1.0  # ServerConfig.straggler_factor (a huge one: every round waits for all it drew)
    eval_fraction: float = 0.0  # federated evaluation on clients (central evaluation always runs)
    eval_every: int = 1
    compress: str = ""
    secagg: bool = False
    dp: DPConfig | None = None
    client_config: dict[str, Any] = field(default_factory=dict)  # overrides the task's epochs / lr / batch_size
    min_examples: int = 1
    out: str | None = None
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ConfigError("need at least one client")
        if self.processes < 0 or self.workers < 1:
            raise ConfigError("processes must be >= 0 and workers >= 1")
        parse_partition(self.partition)


# --------------------------------------------------------------------------- client side
def _client_fn(task_name: str, clients: int, partition: str, seed: int, min_examples: int,
               client_config: dict[str, Any]) -> tuple[Callable[[str], Any], Any, list[np.ndarray]]:
    from federated.tasks import get_task

    task = get_task(task_name)
    task.client_config.update(client_config)
    n_train = len(task.split[1])
    parts_n = max(1, min(clients, n_train // max(1, min_examples)))
    parts = task.partitions(parts_n, partition, seed)

    def make(cid: str) -> Any:
        i = int(cid.rsplit("/", 1)[-1])
        return task.client(parts[i % parts_n], seed=seed * 1_000_003 + i)

    return make, task, parts


def _ids(lo: int, hi: int) -> list[str]:
    return [f"sim/{i}" for i in range(lo, hi)]


def node_main(argv: list[str] | None = None) -> int:
    """Child process: ``python -m federated.simulate ADDRESS TASK CLIENTS PARTITION SEED LO HI WORKERS MIN_EX CONFIG_JSON``."""
    import torch

    from federated.client import start_node

    torch.set_num_threads(1)
    a = argv if argv is not None else sys.argv[1:]
    address, task_name, clients, partition, seed, lo, hi, workers, min_ex, cc = a
    make, _, _ = _client_fn(task_name, int(clients), partition, int(seed), int(min_ex), json.loads(cc))
    # one throw-away local step first: torch's first backward pays one-off set-up costs that
    # would otherwise land in round 1 (a long-running device client is warm too)
    warm = make(f"sim/{lo}")
    warm.fit(warm.get_weights(), {"epochs": 1})
    node = start_node(address, make, _ids(int(lo), int(hi)), workers=int(workers), reconnect_timeout=60,
                      backoff_max=0.5, name=f"sim-node {lo}:{hi}")
    threading.Thread(target=lambda: (node.connected.wait(), print("node connected", flush=True)), daemon=True).start()
    node.run()
    print("node exit ok", flush=True)
    return 0


# --------------------------------------------------------------------------- server side
def _plots(out: str, history: list[dict[str, Any]], counts: np.ndarray, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in history]
    for key, name in (("accuracy", "accuracy"), ("loss", "loss")):
        fig, ax = plt.subplots(figsize=(6, 4))
        if key == "accuracy":
            ax.plot(rounds, [r.get("central_metrics", {}).get("accuracy", np.nan) for r in history], label="central test")
            fed = [r.get("metrics", {}).get("accuracy", np.nan) for r in history]
        else:
            ax.plot(rounds, [r.get("central_loss", np.nan) for r in history], label="central test")
            fed = [r.get("loss", np.nan) for r in history]
        if not all(np.isnan(fed)):
            ax.plot(rounds, fed, label="federated (clients' data)")
        train = [r.get("train_metrics", {}).get(key, np.nan) for r in history]
        if not all(np.isnan(train)):
            ax.plot(rounds, train, label="training (clients)", alpha=0.6)
        ax.set_xlabel("round")
        ax.set_ylabel(name)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
        plt.close(fig)
    shown = counts[: min(len(counts), 40)]
    fig, ax = plt.subplots(figsize=(8, 4))
    left = np.zeros(len(shown))
    cmap = plt.get_cmap("tab10")
    for k in range(shown.shape[1]):
        ax.bar(np.arange(len(shown)), shown[:, k], bottom=left, color=cmap(k % 10), label=str(k))
        left += shown[:, k]
    ax.set_xlabel(f"client (first {len(shown)} of {len(counts)})")
    ax.set_ylabel("examples")
    ax.set_title("label distribution of the partition")
    ax.legend(title="label", fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "label_distribution.png"), dpi=100)
    plt.close(fig)


def _summary(history: list[dict[str, Any]], startup_s: float) -> dict[str, Any]:
    last = history[-1] if history else {}
    later = [r["round_s"] for r in history[1:]] or [r["round_s"] for r in history]
    return {
        "rounds": len(history),
        "final_accuracy": last.get("central_metrics", {}).get("accuracy"),
        "final_loss": last.get("central_loss"),
        "s_per_round": float(np.mean(later)) if later else None,
        "startup_s": startup_s,
        "bytes_up_per_round": float(np.mean([r["bytes_up"] for r in history])) if history else 0.0,
        "bytes_down_per_round": float(np.mean([r["bytes_down"] for r in history])) if history else 0.0,
        "rss_mb_first_round": history[0].get("rss_mb") if history else None,
        "rss_mb_last_round": last.get("rss_mb"),
        "epsilon": last.get("epsilon"),
    }


def run_simulation(cfg: SimulationConfig, on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run one simulation; returns (and writes to ``cfg.out``) the results dict."""
    import torch

    from federated.client import start_node
    from federated.server import FedServer
    from federated.strategy import make_strategy
    from federated.tasks import get_task

    t_start = time.monotonic()
    torch.set_num_threads(1)
    task = get_task(cfg.task)
    task.client_config.update(cfg.client_config)
    params = dict(cfg.strategy_params)
    if cfg.strategy == "scaffold":
        params.setdefault("num_clients", cfg.clients)
    strategy = make_strategy(cfg.strategy, **params)
    server_cfg = ServerConfig(
        rounds=cfg.rounds, fraction=cfg.fraction, min_clients=cfg.min_clients, min_available=max(cfg.min_clients, cfg.clients),
        round_timeout=cfg.round_timeout, straggler_factor=cfg.straggler_factor, eval_fraction=cfg.eval_fraction, eval_every=cfg.eval_every, seed=cfg.seed,
        wait_timeout=300.0, compress=cfg.compress, client_config=dict(task.client_config), dp=cfg.dp,
        secagg=SecAggSettings(enabled=cfg.secagg, max_examples=64.0), max_clients=max(1_000_000, cfg.clients),
    )
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.rounds, desc=f"{cfg.strategy} {cfg.clients} clients", unit="round", mininterval=0.5)

    first_round_end: list[float] = []

    def round_done(rec: dict[str, Any]) -> None:
        rec["rss_mb"] = rss_mb()
        if not first_round_end:
            first_round_end.append(time.monotonic())
        if bar is not None:
            acc = rec.get("central_metrics", {}).get("accuracy")
            bar.set_postfix(acc=f"{acc:.3f}" if acc is not None else "-", loss=f"{rec.get('central_loss', float('nan')):.3f}",
                            s=f"{rec['round_s']:.3f}")
            bar.update(1)
        if on_round is not None:
            on_round(rec)

    server = FedServer(server_cfg, strategy, task.initial_weights(cfg.seed), task.evaluator(), round_done)
    port = server.start()
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    nodes: list[Any] = []
    threads: list[threading.Thread] = []
    n_nodes = max(1, cfg.processes)
    bounds = np.linspace(0, cfg.clients, n_nodes + 1).astype(int)
    try:
        if cfg.processes == 0:
            make, _, _ = _client_fn(cfg.task, cfg.clients, cfg.partition, cfg.seed, cfg.min_examples, cfg.client_config)
            node = start_node(address, make, _ids(0, cfg.clients), workers=cfg.workers, reconnect_timeout=60, name="sim")
            t = threading.Thread(target=node.run, daemon=True, name="sim-node")
            t.start()
            nodes.append(node)
            threads.append(t)
        else:
            for k in range(n_nodes):
                args = [address, cfg.task, str(cfg.clients), cfg.partition, str(cfg.seed), str(bounds[k]), str(bounds[k + 1]),
                        str(cfg.workers), str(cfg.min_examples), json.dumps(cfg.client_config)]
                procs.append(subprocess.Popen([sys.executable, "-m", "federated.simulate", *args],
                                              stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        history = server.run()
    finally:
        if bar is not None:
            bar.close()
        server.stop(grace=1.0)
        for node in nodes:
            node.stop()
        for t in threads:
            t.join(10)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    # from the call (server and clients both starting) to the end of round 1
    startup = first_round_end[0] - t_start if first_round_end else float("nan")
    y_train = task.split[1]
    parts = task.partitions(max(1, min(cfg.clients, len(y_train) // max(1, cfg.min_examples))), cfg.partition, cfg.seed)
    counts = label_counts(y_train, parts, 10)
    results = {
        "config": {**asdict(cfg), "dp": asdict(cfg.dp) if cfg.dp else None},
        "task": task.describe(),
        "strategy": {"name": strategy.name, "params": strategy.params()},
        "summary": {**_summary(history, startup), "wall_s": time.monotonic() - t_start,
                    # this process: the server alone only when the clients ran in child processes
                    "peak_rss_mb": peak_rss_mb(),
                    "server_peak_rss_mb": peak_rss_mb() if cfg.processes > 0 else None},
        "history": history,
        "partition_label_counts": counts.tolist() if len(counts) <= 1000 else None,
    }
    if cfg.out:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=float)
        if cfg.plots:
            _plots(cfg.out, history, counts, f"{cfg.task}: {cfg.strategy}, {cfg.clients} clients, {cfg.partition}")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("TESSERA_LOG", "WARNING"))
    sys.exit(node_main())
