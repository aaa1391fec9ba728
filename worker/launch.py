"""Local clusters for `tessera demo` and `tessera experiment`: shard and worker processes on
loopback, their metrics files tailed as they grow, and every process stopped at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

__all__ = ["LocalRun", "worker_command"]


def worker_command(addresses: Sequence[str], index: int, num_workers: int, metrics: str, **flags: Any) -> list[str]:
    """``python -m tessera.cli worker ...`` for worker ``index``; ``flags`` become ``--name value``
    (``True`` becomes a bare ``--name``; None/False are left out; a list repeats the flag)."""
    cmd = [
        sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--worker-index", str(index),
        "--num-workers", str(num_workers), "--metrics-out", metrics, "--no-progress",
    ]
    for k, v in flags.items():
        for item in v if isinstance(v, list) else [v]:  # a list repeats the flag
            if item is None or item is False:
                continue
            cmd.append("--" + k.replace("_", "-"))
            if item is not True:
                cmd.append(str(item))
    return cmd


class LocalRun:
    """``num_shards`` shard processes + one worker process per entry of ``worker_flags``.

    Use as a context manager: on exit (normal, error or Ctrl-C) every process is stopped.
    ``poll()`` returns the metrics records written since the last call.
    """

    def __init__(self, out_dir: str, num_shards: int, lease_s: float = 5.0, host: str = "127.0.0.1") -> None:
        self.out_dir = out_dir
        self.num_shards = num_shards
        self.lease_s = lease_s
        self.host = host
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.files: list[str] = []
        self.logs: list[str] = []  # each worker's stderr
        self._pos: list[int] = []

    def __enter__(self) -> "LocalRun":
        from ps.cli import start_local_shards
        from tessera.service import is_loopback

        os.makedirs(self.out_dir, exist_ok=True)
        insecure = () if is_loopback(self.host) else ("--insecure",)  # a private namespace link of an experiment
        procs, self.addresses = start_local_shards(self.num_shards, ("--lease", str(self.lease_s), "--host", self.host, *insecure))
        self.procs += procs
        return self

    def __exit__(self, *exc: Any) -> None:
        from ps.cli import stop_processes

        stop_processes(self.procs, grace=10)

    def start_workers(
        self, num_workers: int, prefix: str, per_worker: Sequence[dict[str, Any]],
        wrap: dict[int, list[str]] | None = None,
    ) -> None:
        """Start worker i with ``per_worker[i]`` as its flags; its metrics go to
        ``OUT/PREFIXw<i>.jsonl``, its stderr to ``OUT/PREFIXw<i>.log``. ``wrap[i]``: a command
        prefix for worker i (e.g. ``ip netns exec NS``)."""
        for i in range(num_workers):
            path = os.path.join(self.out_dir, f"{prefix}w{i}.jsonl")
            if os.path.exists(path):
                os.remove(path)
            log = os.path.join(self.out_dir, f"{prefix}w{i}.log")
            cmd = (wrap or {}).get(i, []) + worker_command(self.addresses, i, num_workers, path, lease=self.lease_s, **per_worker[i])
            with open(log, "w") as err:  # a file, not a pipe: a chatty worker never blocks on a full pipe
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            self.procs.append(p)
            self.workers.append(p)
            self.files.append(path)
            self.logs.append(log)
            self._pos.append(0)

    def running(self) -> bool:
        """True while any worker process runs."""
        return any(p.poll() is None for p in self.workers)

    def poll(self) -> list[dict]:
        """The metrics records the workers appended since the last call (complete lines only)."""
        out: list[dict] = []
        for i, path in enumerate(self.files):
            if not os.path.exists(path):
                continue
            with open(path) as f:
                f.seek(self._pos[i])
                chunk = f.read()
            complete, _, rest = chunk.rpartition("\n")
            self._pos[i] += len(chunk) - len(rest)
            out += [json.loads(line) for line in complete.split("\n") if line.strip()]
        return out

    def failures(self) -> list[str]:
        """One line per worker that exited non-zero: its exit code, the last line of its stderr
        (a worker's error is one line) and where its whole log is."""
        bad = []
        for i, p in enumerate(self.workers):
            if p.poll() not in (None, 0):
                try:
                    with open(self.logs[i], errors="replace") as f:
                        lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
                except OSError:
                    lines = []
                last = lines[-1] if lines else "(no output)"
                bad.append(f"worker {i} exited with code {p.returncode}: {last} (log: {self.logs[i]})")
        return bad
