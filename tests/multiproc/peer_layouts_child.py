"""One rank of several `tessera peer` runs in one process group (started by a test with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would): ``peer_layouts_child.py FLAGS :: FLAGS ...``.

Each ``FLAGS`` (the rank flags of `python -m worker.peer`) goes through the command line's own rank
code, ``worker.peer.cli.run_rank``, one after the other, so one launch pays for the ranks' start
(torch, the group) once however many layouts it checks. The only changes: the process group is kept
between runs (``shutdown_group`` becomes a barrier; the last run's group is torn down at the end), and
after a ``--mode hybrid`` run rank 0 drops every table on its shards, so the next hybrid run starts
on them as on fresh shards (a BSP run refuses shards whose tables already have a clock).
Prints ``RC <i> <exit code>`` per run and, on rank 0, ``REPORT <i> <the run's JSON report>``.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys

import torch.distributed as dist

import worker.peer
from worker.peer.cli import main as rank_main
from worker.peer.mesh import shutdown_group


def _keep_group(barrier: bool = True) -> None:
    if barrier and dist.is_initialized():
        dist.barrier()


def _drop_tables(ps: str) -> None:
    if dist.get_rank() == 0:
        from ps.client import PSClient

        client = PSClient(ps.split(","), timeout=30)
        client.drop_tables([t.name for st in client.stats() for t in st.tables], missing_ok=True)
        client.close()
    dist.barrier()


def main(argv: list[str]) -> None:
    runs: list[list[str]] = [[]]
    for a in argv:
        if a == "::":
            runs.append([])
        else:
            runs[-1].append(a)
    worker.peer.shutdown_group = _keep_group  # type: ignore[assignment]
    try:
        for i, flags in enumerate(runs):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = rank_main(flags)
            print(f"RC {i} {rc}", flush=True)
            if "hybrid" in flags and rc == 0:
                _drop_tables(flags[flags.index("--ps") + 1])
            reports = [line for line in out.getvalue().splitlines() if line.startswith("{")]
            if reports:
                print(f"REPORT {i} {json.dumps(json.loads(reports[-1]))}", flush=True)
    finally:
        worker.peer.shutdown_group = shutdown_group  # type: ignore[assignment]
        shutdown_group(barrier=False)


if __name__ == "__main__":
    main(sys.argv[1:])
