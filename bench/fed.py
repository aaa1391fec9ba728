"""Federated benchmark: rounds over real gRPC on loopback, server and clients in separate processes.

Setup (the issue's): ``digits`` (MLP 64-64-10, 4810 parameters), 100 registered
clients with a Dirichlet(0.5) label split, 10 % sampled per round, FedAvg.
Every run starts a fresh server process (``tessera fed server``) and, at the same
moment, one client process hosting the 100 virtual clients
(``python -m federated.simulate``), so ``startup_s`` counts both interpreters
starting, importing torch and connecting.

Figures (last line, JSON):

* ``s_per_round``: median wall time of rounds 2..R of the FedAvg run (fit on 10
  clients + aggregation + central evaluation; no federated evaluation);
  ``s_per_round_mean`` the mean.
* ``startup_s``: from launching the server process to the end of round 1.
* ``agg_mbps``: MB of client updates per second of ``strategy.aggregate``.
* ``fedavg_acc``, ``fedprox_acc``: central test accuracy after R rounds (FedProx mu=0.01).
* ``secagg_overhead``: s/round with secure aggregation / without (best of two
  interleaved pairs of runs);
  ``secagg_bytes_ratio``: bytes per round (up + down) with / without;
  ``secagg_up_ratio``: uplink only.
* ``int8_bytes_ratio``: uplink bytes per round with int8 / fp32; ``int8_acc_delta``:
  final accuracy int8 - fp32, the mean over seeds 0, 1, 2 (``int8_acc_deltas`` each;
  the same seed for both runs of a pair).
* ``server_rss_mb_10k``: peak RSS (VmHWM) of the server process alone with 10,000
  registered clients (100 sampled per round); quick mode measures 1,000 clients and
  names the figure ``server_rss_mb_1k``. ``server_rss_mb_100``: the same for the
  100-client FedAvg run (always a server process of its own); ``rss_growth_mb`` the
  RSS change between the big run's second and last round.
* ``client_import_s`` / ``client_import_mb``: a fresh interpreter importing what a
  numpy client needs (``import federated``, ``Client``, ``start_client``): seconds of
  the import inside the interpreter (min of 7; 3 quick) and the interpreter's peak RSS;
  ``torch_client_import_s``/``_mb`` the same for ``TorchClient`` (the baseline).
* ``round_overhead_ratio``: ``s_per_round`` over ``inproc_s_per_round``, the median
  seconds per round of the same FedAvg (same task, partition, sampling rule, local
  training on as many threads, aggregation and central evaluation) run in this
  process with no server, wire or client runtime.
* ``fedbuff_speedup``: wall time for FedAvg to reach ``--target`` accuracy / the
  same for FedBuff (K=4), 5 clients one of which is 5x slower (local training
  padded to 0.1 s, 0.5 s for the slow one, so compute dominates as on devices);
  time counted from the first task sent to the first evaluation at or above target,
  best of 2 runs each.

Run (2-3 minutes on 2 cores)::

    python bench/fed.py               # full run
    python bench/fed.py --quick       # smoke run (under a minute): 3 rounds; the 100-client FedAvg
                                      # and the 1,000-client RSS run as processes, the rest in this one
    python bench/fed.py --json-out bench/out/fed.json
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One server process + one client-node process; every wait has a deadline."""

    def __init__(self, rounds: int, clients: int, fraction: float, server_args: list[str], partition: str = "dirichlet:0.5",
                 task: str = "digits", workers: int = 16, seed: int = 0, timeout: float = 240.0, nodes: int = 1) -> None:
        self.rounds, self.clients, self.timeout = rounds, clients, timeout
        self.dir = tempfile.mkdtemp(prefix="fedbench")
        self.results = os.path.join(self.dir, "results.json")
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.t0 = time.monotonic()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tessera.cli", "fed", "server", "--task", task, "--port", str(port),
             "--rounds", str(rounds), "--fraction", str(fraction), "--min-available", str(clients), "--min-clients", "2",
             "--eval-fraction", "0", "--seed", str(seed), "--results", self.results, *server_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        cuts = [clients * k // nodes for k in range(nodes + 1)]
        self.nodes = [subprocess.Popen(
            [sys.executable, "-m", "federated.simulate", f"127.0.0.1:{port}", task, str(clients), partition, str(seed),
             str(cuts[k]), str(cuts[k + 1]), str(workers), "1", "{}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
        ) for k in range(nodes)]

    def run(self) -> dict[str, Any]:
        assert self.server.stdout is not None
        deadline = self.t0 + self.timeout
        first_round = None
        lines = []
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.server.stdout, selectors.EVENT_READ)
                while time.monotonic() < deadline:
                    if sel.select(timeout=0.2):
                        line = self.server.stdout.readline()
                        if not line:
                            break
                        lines.append(line)
                        if first_round is None and line.startswith("round 1:"):
                            first_round = time.monotonic() - self.t0
                    elif self.server.poll() is not None:
                        break
            self.server.wait(timeout=max(1.0, deadline - time.monotonic()))
            for node in self.nodes:
                node.wait(timeout=30)
        finally:
            for p in (self.server, *self.nodes):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if self.server.returncode != 0 or not os.path.exists(self.results):
            err = self.server.stderr.read() if self.server.stderr else ""
            raise RuntimeError(f"server failed ({self.server.returncode}): {''.join(lines)[-2000:]} {err[-3000:]}")
        with open(self.results) as f:
            res = json.load(f)
        res["startup_s"] = first_round
        return res


def run_inproc(rounds: int, clients: int, fraction: float, server_args: list[str]) -> dict[str, Any]:
    """The same job with server and clients in this process (``--quick``: no interpreter
    start-ups; startup and RSS figures then describe this process, not a server alone)."""
    from tessera.cli import parse_key_values
    from federated.simulate import SimulationConfig, peak_rss_mb, run_simulation

    opts: dict[str, Any] = {}
    it = iter(server_args)
    params: list[str] = []
    for a in it:
        if a == "--strategy":
            opts["strategy"] = next(it)
        elif a == "--strategy-param":
            params.append(next(it))
        elif a == "--compress":
            opts["compress"] = next(it)
        elif a == "--secagg":
            opts["secagg"] = True
        elif a == "--seed":
            opts["seed"] = int(next(it))
        else:
            raise ValueError(f"run_inproc does not know {a}")
    res = run_simulation(SimulationConfig(rounds=rounds, clients=clients, fraction=fraction, progress=False, plots=False,
                                          strategy_params=parse_key_values(params, "--strategy-param"), **opts))
    return {"history": res["history"], "peak_rss_mb": peak_rss_mb(), "startup_s": res["summary"]["startup_s"]}


def summarize(res: dict[str, Any]) -> dict[str, float]:
    h = res["history"]
    later = h[1:] if len(h) > 1 else h
    agg_s = sum(r.get("agg_s", 0.0) for r in h)
    return {
        # median: robust to the shared machine's hiccups (the mean is reported beside it)
        "s_per_round": statistics.median(r["round_s"] for r in later),
        "s_per_round_mean": sum(r["round_s"] for r in later) / len(later),
        "round_s": [r["round_s"] for r in h],
        "acc": h[-1].get("central_metrics", {}).get("accuracy", float("nan")),
        "up": sum(r["bytes_up"] for r in h) / len(h),
        "down": sum(r["bytes_down"] for r in h) / len(h),
        "agg_mbps": (sum(r.get("agg_bytes", 0) for r in h) / 1e6 / agg_s) if agg_s > 0 else float("nan"),
        "startup_s": res["startup_s"],
        "peak_rss_mb": res["peak_rss_mb"],
        "rss_growth_mb": (h[-1]["rss_mb"] - h[1]["rss_mb"]) if len(h) > 2 else 0.0,
    }


def fedbuff_experiment(rounds_avg: int, rounds_buff: int, target: float, pad: float = 0.1,
                       repeats: int = 2) -> dict[str, float]:
    """In this process: 5 clients (IID digits), one 5x slower. Time to ``target`` accuracy
    (best of ``repeats`` runs each, interleaved)."""
    import numpy as np
    import torch

    from federated.client import start_node
    from federated.config import ServerConfig
    from federated.runtime import Client
    from federated.server import FedServer
    from federated.strategy import make_strategy
    from federated.tasks import get_task

    torch.set_num_threads(1)
    task = get_task("digits")
    n = 5
    parts = task.partitions(n, "iid", seed=0)

    class Padded(Client):
        """Local training padded to ``pad * factor`` seconds (compute-bound devices)."""

        def __init__(self, inner: Client, factor: float) -> None:
            self.inner, self.factor = inner, factor

        def fit(self, weights: Any, config: Any) -> Any:
            t = time.perf_counter()
            out = self.inner.fit(weights, config)
            time.sleep(max(0.0, pad * self.factor - (time.perf_counter() - t)))
            return out

    def run(strategy: str, params: dict[str, Any], rounds: int) -> tuple[float | None, list[dict[str, Any]]]:
        cfg = ServerConfig(rounds=rounds, fraction=1.0, min_clients=n, min_available=n, round_timeout=30, eval_fraction=0,
                           client_config=dict(task.client_config, epochs=1), wait_timeout=60)
        srv = FedServer(cfg, make_strategy(strategy, **params), task.initial_weights(), task.evaluator())
        port = srv.start()
        # kept clients run on whichever worker thread is free: each needs a model of its own (the
        # per-thread shared model raced between two threads training it: a CI run's heap corruption)
        node = start_node(f"127.0.0.1:{port}", lambda cid: Padded(task.client(parts[int(cid[-1])], shared_model=False),
                                                                  5.0 if cid.endswith("/0") else 1.0),
                          [f"sim/{i}" for i in range(n)], workers=n, keep_clients=True, backoff_max=0.5)
        th = threading.Thread(target=node.run, daemon=True)
        th.start()
        try:
            h = srv.run()
        finally:
            srv.stop(grace=0.5)
            node.stop()
            th.join(10)
        # from the first task sent (all clients connected) to the first evaluation at or above target
        hit = next((r["train_elapsed_s"] for r in h if r.get("central_metrics", {}).get("accuracy", 0) >= target), None)
        return hit, h

    # the machine is shared and noisy: repeat, interleaved, and take each one's best time
    avgs, buffs = [], []
    for _ in range(repeats):
        avgs.append(run("fedavg", {}, rounds_avg))
        buffs.append(run("fedbuff", {"buffer_size": 4}, rounds_buff))
    t_avg, h_avg = min(avgs, key=lambda x: x[0] if x[0] is not None else float("inf"))
    t_buff, h_buff = min(buffs, key=lambda x: x[0] if x[0] is not None else float("inf"))
    return {
        "fedavg_time_to_target_s": float("nan") if t_avg is None else t_avg,
        "fedbuff_time_to_target_s": float("nan") if t_buff is None else t_buff,
        "fedbuff_speedup": (t_avg / t_buff) if (t_avg and t_buff) else float("nan"),
        "fedavg_round_s": float(np.mean([r["round_s"] for r in h_avg])),
        "fedbuff_step_s": float(np.mean([r["round_s"] for r in h_buff])),
        "fedbuff_mean_staleness": float(np.mean([s for r in h_buff for s in r.get("staleness", [])] or [0])),
    }


CLIENT_IMPORT = """
import json, sys, time
t0 = time.perf_counter()
{imports}
took = time.perf_counter() - t0
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))  # this process alone
print(json.dumps({{"s": took, "mb": hwm * 1024 / 1e6, "torch": "torch" in sys.modules, "sklearn": "sklearn" in sys.modules}}))
"""
NUMPY_CLIENT = "import federated\nfrom federated import Client, start_client"
TORCH_CLIENT = "import federated\nfrom federated import TorchClient, start_client"


def client_import(repeats: int) -> dict[str, Any]:
    """Fresh interpreters importing what a numpy client needs (``federated``, ``Client``,
    ``start_client``), and, as the baseline, what a torch client needs (``TorchClient``):
    import seconds (inside the interpreter) and its peak RSS, min and median of ``repeats``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}

    def one(imports: str) -> dict[str, Any]:
        p = subprocess.run([sys.executable, "-c", CLIENT_IMPORT.format(imports=imports)], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        return json.loads(p.stdout.strip().splitlines()[-1])

    runs = [one(NUMPY_CLIENT) for _ in range(repeats)]
    torch_runs = [one(TORCH_CLIENT) for _ in range(max(1, repeats // 2))]
    return {
        "client_import_s": min(r["s"] for r in runs),
        "client_import_s_median": statistics.median(r["s"] for r in runs),
        "client_import_mb": min(r["mb"] for r in runs),
        "client_import_samples_s": [round(r["s"], 4) for r in runs],
        "client_imports_torch": any(r["torch"] or r["sklearn"] for r in runs),
        "torch_client_import_s": min(r["s"] for r in torch_runs),
        "torch_client_import_mb": min(r["mb"] for r in torch_runs),
    }


def inproc_fedavg(rounds: int, clients: int = 100, fraction: float = 0.1, seed: int = 0, workers: int = 16,
                  partition: str = "dirichlet:0.5") -> dict[str, Any]:
    """The baseline of ``round_overhead_ratio``: the same FedAvg rounds with no server, no
    wire and no client runtime, in this process: the same clients (task, partition, seed),
    the same sampling rule, local training on ``workers`` threads (as the client node
    runs them, one torch thread each), FedAvg, then the same central evaluation."""
    import math

    import numpy as np
    import torch

    from federated.simulate import _client_fn
    from federated.strategy import ClientUpdate, make_strategy
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    make, task, _ = _client_fn("digits", clients, partition, seed, 1, {})
    ids = sorted(f"sim/{i}" for i in range(clients))  # the registry's order
    weights = task.initial_weights(seed)
    evaluate = task.evaluator()
    strategy = make_strategy("fedavg")
    strategy.setup(weights)
    k = min(clients, max(2, math.ceil(fraction * clients)))
    warm = make(ids[0])  # torch's one-off set-up, as the client node does first
    warm.fit(warm.get_weights(), {"epochs": 1})
    round_s: list[float] = []
    acc = float("nan")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            pick = np.random.default_rng([seed, rnd, 0, 0]).choice(len(ids), size=k, replace=False)
            sample = [ids[i] for i in sorted(pick.tolist())]
            config = dict(task.client_config, round=rnd)
            base = weights

            def fit(cid: str, base: Any = base, config: Any = config, rnd: int = rnd) -> ClientUpdate:
                w, n, m = make(cid).fit([x.copy() for x in base], dict(config))[:3]
                return ClientUpdate(cid, [np.asarray(x) for x in w], int(n), m, base_round=rnd - 1)

            weights = strategy.aggregate(rnd, weights, list(pool.map(fit, sample)))
            acc = evaluate(weights)[1]["accuracy"]
            round_s.append(time.perf_counter() - t0)
    later = round_s[1:] if len(round_s) > 1 else round_s
    return {"s_per_round": statistics.median(later), "acc": acc, "round_s": round_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (under a minute)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the accuracy runs (default 30; quick 3)")
    ap.add_argument("--target", type=float, default=0.95, help="FedBuff experiment's target accuracy")
    ap.add_argument("--json-out", default=None, help="also write the final JSON here")
    args = ap.parse_args()
    quick = args.quick
    rounds = args.rounds or (3 if quick else 30)
    big = 1000 if quick else 10_000
    seeds = (0, 1, 2)
    t_all = time.monotonic()
    rows: list[tuple[str, dict[str, float]]] = []

    def job(name: str, *server_args: str, rounds: int = rounds, clients: int = 100, fraction: float = 0.1,
            process: bool | None = None) -> dict[str, float]:
        """One run: a server process and a client-node process (in quick mode: in this process
        unless ``process``)."""
        t = time.monotonic()
        if process or (process is None and not quick):
            s = summarize(Job(rounds, clients, fraction, list(server_args)).run())
        else:
            s = summarize(run_inproc(rounds, clients, fraction, list(server_args)))
        s["wall_s"] = time.monotonic() - t
        rows.append((name, s))
        print(f"  {name:<26} {s['s_per_round']:.4f} s/round  acc {s['acc']:.4f}  up {s['up'] / 1e3:.1f} kB/round  "
              f"startup {s['startup_s']:.2f} s  peak RSS {s['peak_rss_mb']:.0f} MB  ({s['wall_s']:.1f} s)", flush=True)
        return s

    print(f"federated benchmark: digits, 100 clients, Dirichlet(0.5), fraction 0.1, {rounds} rounds", flush=True)
    t = time.monotonic()
    imp = client_import(3 if quick else 7)
    print(f"  {'numpy client import':<26} {imp['client_import_s']:.3f} s (median {imp['client_import_s_median']:.3f}), "
          f"{imp['client_import_mb']:.0f} MB; torch client {imp['torch_client_import_s']:.3f} s, "
          f"{imp['torch_client_import_mb']:.0f} MB  ({time.monotonic() - t:.1f} s)", flush=True)
    # the server and its clients as separate processes, always: its RSS is the server's alone
    fedavg = job("fedavg (processes)", process=True)
    t = time.monotonic()
    base = inproc_fedavg(rounds)
    print(f"  {'fedavg in-process, no wire':<26} {base['s_per_round']:.4f} s/round  acc {base['acc']:.4f}  "
          f"({time.monotonic() - t:.1f} s)", flush=True)
    sec = job("fedavg + secagg", "--secagg")  # right after its baseline: the machine's load drifts
    fedprox = job("fedprox mu=0.01", "--strategy", "fedprox", "--strategy-param", "proximal_mu=0.01")
    # int8 against fp32 over 3 seeds (one seed's accuracy difference is mostly the seed's noise)
    plain_by_seed = [fedavg if (not quick and sd == 0) else job(f"fedavg seed {sd}", "--seed", str(sd))
                     for sd in seeds]
    int8_by_seed = [job(f"fedavg int8 uplink seed {sd}", "--compress", "int8", "--seed", str(sd)) for sd in seeds]
    int8, plain0 = int8_by_seed[0], plain_by_seed[0]
    # the secure-aggregation overhead is a ratio of two noisy timings: best of two interleaved pairs
    if quick:
        plain_best, sec_best = plain0["s_per_round"], sec["s_per_round"]
    else:
        plain2 = job("fedavg (repeat)", rounds=15)
        sec2 = job("fedavg + secagg (repeat)", "--secagg", rounds=15)
        plain_best = min(fedavg["s_per_round"], plain2["s_per_round"])
        sec_best = min(sec["s_per_round"], sec2["s_per_round"])
    big_run = job(f"{big} clients, {10 if quick else 100}/round", rounds=3 if quick else 5, clients=big,
                  fraction=(10 if quick else 100) / big, process=True)
    t = time.monotonic()
    if quick:
        fb = fedbuff_experiment(3, 6, 0.8, pad=0.03, repeats=1)
    else:
        fb = fedbuff_experiment(20, 40, args.target)
    print(f"  {'fedbuff vs fedavg':<26} time to target: fedavg {fb['fedavg_time_to_target_s']:.2f} s, "
          f"fedbuff {fb['fedbuff_time_to_target_s']:.2f} s -> {fb['fedbuff_speedup']:.2f}x  ({time.monotonic() - t:.1f} s)",
          flush=True)

    deltas = [i["acc"] - p["acc"] for i, p in zip(int8_by_seed, plain_by_seed)]
    big_key = "server_rss_mb_10k" if big == 10_000 else "server_rss_mb_1k"  # named for what was measured
    out = {
        "s_per_round": round(fedavg["s_per_round"], 4),
        "s_per_round_mean": round(fedavg["s_per_round_mean"], 4),
        "fedavg_rounds_s": [round(x, 4) for x in fedavg["round_s"]],  # each round, for checking s_per_round
        "inproc_s_per_round": round(base["s_per_round"], 4),
        "round_overhead_ratio": round(fedavg["s_per_round"] / base["s_per_round"], 3),
        "startup_s": round(fedavg["startup_s"], 3),
        "agg_mbps": round(fedavg["agg_mbps"], 1),
        "fedavg_acc": round(fedavg["acc"], 4),
        "inproc_acc": round(base["acc"], 4),
        "fedprox_acc": round(fedprox["acc"], 4),
        "secagg_overhead": round(sec_best / plain_best, 3),
        "secagg_bytes_ratio": round((sec["up"] + sec["down"]) / (plain0["up"] + plain0["down"]), 3),
        "secagg_up_ratio": round(sec["up"] / plain0["up"], 3),
        "int8_bytes_ratio": round(int8["up"] / plain0["up"], 3),
        "int8_acc_delta": round(statistics.mean(deltas), 4),
        "int8_acc_deltas": [round(d, 4) for d in deltas],
        "int8_accs": [round(i["acc"], 4) for i in int8_by_seed],
        "fp32_accs": [round(p["acc"], 4) for p in plain_by_seed],
        big_key: round(big_run["peak_rss_mb"], 1),
        "big_clients": big,
        "server_rss_mb_100": round(fedavg["peak_rss_mb"], 1),
        "inproc_peak_rss_mb": round(max(s["peak_rss_mb"] for n, s in rows if "processes" not in n and "clients," not in n),
                                    1) if quick else None,
        "rss_growth_mb": round(big_run["rss_growth_mb"], 2),
        "secagg_s_per_round": round(sec["s_per_round"], 4),
        "secagg_acc": round(sec["acc"], 4),
        **{k: round(v, 4) for k, v in imp.items() if isinstance(v, float)},
        "client_import_samples_s": imp["client_import_samples_s"],
        "client_imports_torch": imp["client_imports_torch"],
        **{k: round(v, 3) for k, v in fb.items()},
        "rounds": rounds,
        "quick": quick,
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    goals = [("fedavg_acc", ">=", 0.90), ("secagg_overhead", "<=", 2.0), ("secagg_bytes_ratio", "<=", 2.0),
             ("int8_bytes_ratio", "<=", 0.3), ("int8_acc_delta", ">=", -0.01), ("s_per_round", "<=", 0.1),
             ("startup_s", "<=", 5.0), ("fedbuff_speedup", ">=", 1.7), ("client_import_s", "<=", 0.3),
             ("client_import_mb", "<=", 80), ("round_overhead_ratio", "<=", 1.5)]
    print()
    print(f"{'figure':<24} {'value':>10}  goal")
    for k, op, g in goals:
        v = out[k]
        ok = (v >= g) if op == ">=" else (v <= g)
        print(f"{k:<24} {v:>10}  {op} {g}  {'ok' if ok else 'MISSED'}")
    for k in ("inproc_s_per_round", "agg_mbps", "fedprox_acc", big_key, "server_rss_mb_100", "rss_growth_mb",
              "secagg_up_ratio", "torch_client_import_s", "torch_client_import_mb"):
        print(f"{k:<24} {out[k]:>10}")
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(out, f)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
