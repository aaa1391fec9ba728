"""Restarting a finished run on the same shards continues it, or with ``--reset`` starts afresh (issue 17 item 2).

Two ``tessera worker`` processes train ``digits`` against 2 real shard processes to ``--steps 4``;
then both are started again with ``--steps 7``: every worker, worker 0 too, continues from the
shards' clock (async: the clock each worker reached, recorded on the shards; BSP: the tables'
rounds) and trains the 3 steps left, as its summary line says (``3 steps (4->7)``). Run a third
time with the same ``--steps`` and there is nothing left to train: 0 steps, and a warning that says
how to continue or start afresh. Reference: the step counts the README states.

With ``--reset`` on every worker, the same shards then start a fresh run: after the run that reached
step 7, ``--steps 4`` trains 4 steps from step 0 (``4 steps (0->4)``; without it: nothing to
train), and in sync mode the final dense parameters equal, bit for bit, those of the first run from
the same seed (reference: that first run's parameters, read from the shards after it). Worker 1 is
started first and is joined before worker 0 starts, so it has seen the old run's tables: it must
wait for worker 0's fresh ones rather than take the old.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from ps.client import PSClient

pytestmark = pytest.mark.timeout(300)


def _run(addresses: list[str], mode: str, steps: int, *extra: str, one_first: bool = False) -> list[tuple[int, int, int, str]]:
    """Both workers to ``steps``; per worker (steps trained, start clock, final clock, stderr).
    ``one_first``: start worker 1 and wait until the shards count it live before starting worker 0."""
    base = [sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(addresses), "--task", "digits",
            "--steps", str(steps), "--batch-size", "16", "--num-workers", "2", "--no-progress", "--mode", mode,
            "--torch-threads", "1", *extra]

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([*base, "--worker-index", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    if one_first:
        procs = {1: start(1)}
        with PSClient(addresses, timeout=10) as c:
            deadline = time.monotonic() + 120
            while not all(any(w.name == "w1" and w.live for w in st.workers) for st in c.stats()):
                assert time.monotonic() < deadline and procs[1].poll() is None, "worker 1 never joined"
                time.sleep(0.2)
        procs[0] = start(0)
    else:
        procs = {i: start(i) for i in (0, 1)}
    out = []
    for _, p in sorted(procs.items()):
        _, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        m = re.search(r": (\d+) steps \((\d+)->(\d+)\)", stderr)  # the summary line
        assert m, stderr[-2000:]
        out.append((int(m[1]), int(m[2]), int(m[3]), stderr))
    return out


def _dense(addresses: list[str]) -> np.ndarray:
    with PSClient(addresses, timeout=10) as c:
        return c.pull_dense("digits/dense")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_restart_continues_from_the_shards_clock_and_reset_starts_afresh(proc_cluster, mode: str) -> None:
    """One pair of shards for the whole story (each run starts where the shards are; nothing needs
    fresh shards): a run to 4, a restart to 7 that continues, a third that has nothing left, then
    ``--reset`` to 4 that starts afresh."""
    addresses = proc_cluster(2)
    first = _run(addresses, mode, 4)
    assert [r[:3] for r in first] == [(4, 0, 4)] * 2
    trained = _dense(addresses)
    again = _run(addresses, mode, 7)
    assert [r[:3] for r in again] == [(3, 4, 7)] * 2, [r[3][-500:] for r in again]
    done = _run(addresses, mode, 7)
    assert [r[:3] for r in done] == [(0, 7, 7)] * 2
    for r in done:
        assert "nothing to train" in r[3] and "raise --steps" in r[3], r[3]
    # the shards hold a run at step 7: without --reset, --steps 4 would have nothing to train (as `done`
    # shows at 7); with it, every worker trains 4 steps from step 0, worker 1 joined before worker 0
    fresh = _run(addresses, mode, 4, "--reset", one_first=True)
    assert [r[:3] for r in fresh] == [(4, 0, 4)] * 2, [r[3][-800:] for r in fresh]
    assert "dropped" in fresh[0][3] and "generation 1" in fresh[0][3], fresh[0][3][-1500:]
    if mode == "sync":
        np.testing.assert_array_equal(_dense(addresses), trained)  # the same 4 steps from the same initial values
