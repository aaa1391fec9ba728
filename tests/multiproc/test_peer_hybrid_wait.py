"""`tessera peer --mode hybrid` started before its shards (issue 31 item 8): rank 0 says every 5 s
which shard it waits for, as the worker does; after --retry-timeout every rank prints one line
naming the shard, and the launcher exits 1 with no traceback. Real ranks under torchrun against a
port nothing listens on. The rank that gives up first is the one that started waiting first; the
launcher then stops the others (SIGTERM), and each of them says so, naming the shards."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(240)
def test_hybrid_without_shards_says_what_it_waits_for_then_one_line_per_rank() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "2", "--mode", "hybrid",
                        "--ps", dead, "--retry-timeout", "23", "--task", "ctr", "--steps", "1", "--no-progress"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)
    err = p.stderr
    assert p.returncode == 1, p.stdout[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    waits = [line for line in err.splitlines() if f"tessera peer: rank 0: waiting for shard 0 at {dead}" in line]
    # every 5 s of the 23: 4 lines on an idle machine; at least 2 however late load makes each (a fresh-clone
    # run under the suite's load printed its first at 6 s of an 11 s wait, and no second)
    assert len(waits) >= 2, err[-3000:]
    assert not any("tessera peer: rank 1: waiting" in line for line in err.splitlines()), err[-3000:]  # rank 0 speaks
    # one line per rank naming the shard: its own give-up, or, for a rank the launcher stopped once another
    # gave up (under load the ranks start waiting seconds apart), "stopped (SIGTERM) while waiting ..."
    for r in range(2):
        lines = [line for line in err.splitlines() if f"tessera peer: rank {r}: " in line and f"rank {r}: waiting for shard" not in line]
        assert len(lines) == 1 and dead in lines[0], f"rank {r}:\n{err[-4000:]}"


@pytest.mark.timeout(180)
def test_hybrid_waits_60_seconds_by_default() -> None:
    """README (Peer mode): "The hybrid waits for its shards as the worker does: rank 0 says every 5 s
    which shard it waits for and why, and after `--retry-timeout` (60 s) every rank prints one line".
    A real `tessera peer --mode hybrid` of one rank, given no --retry-timeout, against a port nothing
    listens on: rank 0's first note (after 5 s) says it waits out of 60 s. Stopped then (its whole
    process group). Reference: the README's figure; the give-up itself is the test above."""
    import signal

    dead = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore::FutureWarning", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "tessera.cli", "peer", "--nproc-per-node", "1", "--mode", "hybrid",
                          "--ps", dead, "--task", "ctr", "--steps", "1", "--no-progress"],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    seen: list[str] = []
    try:
        assert p.stderr is not None
        line = ""
        for line in p.stderr:
            seen.append(line)
            if f"tessera peer: rank 0: waiting for shard 0 at {dead}" in line:
                break
        # the note's first figure is when load let it print (5 s on an idle machine, 6 under the suite): the total is the point
        waited = re.search(rf"waiting for shard 0 at {re.escape(dead)} \((\d+) s of 60\)", line)
        assert waited is not None and int(waited.group(1)) >= 5, "".join(seen)[-3000:]
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
