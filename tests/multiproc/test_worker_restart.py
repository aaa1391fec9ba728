"""Restarting a finished run on the same shards continues it (issue 17 item 2).

Two ``tessera worker`` processes train ``digits`` against 2 real shard processes to ``--steps 4``;
then both are started again with ``--steps 7``: every worker, worker 0 too, continues from the
shards' clock (async: the clock each worker reached, recorded on the shards; BSP: the tables'
rounds) and trains the 3 steps left, as its summary line says (``3 steps (4->7)``). Run a third
time with the same ``--steps`` and there is nothing left to train: 0 steps, and a warning that says
how to continue or start afresh. Reference: the step counts the README states.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def _run(addresses: list[str], mode: str, steps: int) -> list[tuple[int, int, int, str]]:
    """Both workers to ``steps``; per worker (steps trained, start clock, final clock, stderr)."""
    base = [sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", "digits",
            "--steps", str(steps), "--batch-size", "16", "--num-workers", "2", "--no-progress", "--mode", mode,
            "--torch-threads", "1"]
    procs = [subprocess.Popen([*base, "--worker-index", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    out = []
    for p in procs:
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        m = re.search(r": (\d+) steps \((\d+)->(\d+)\)", stderr)  # the summary line
        assert m, stderr[-2000:]
        out.append((int(m[1]), int(m[2]), int(m[3]), stderr))
    return out


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_restart_continues_from_the_shards_clock(proc_cluster, mode: str) -> None:
    addresses = proc_cluster(2)
    first = _run(addresses, mode, 4)
    assert [r[:3] for r in first] == [(4, 0, 4)] * 2
    again = _run(addresses, mode, 7)
    assert [r[:3] for r in again] == [(3, 4, 7)] * 2, [r[3][-500:] for r in again]
    done = _run(addresses, mode, 7)
    assert [r[:3] for r in done] == [(0, 7, 7)] * 2
    for r in done:
        assert "nothing to train" in r[3] and "raise --steps" in r[3], r[3]
