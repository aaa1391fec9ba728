"""Workers ride out a shard SIGKILLed and restarted with ``--restore`` (issue 31 item 1).

Real processes: 2 ``tessera ps serve`` shards with checkpoints and no backup, 2 ``tessera worker``
processes (task ``digits``). One shard is SIGKILLed mid-run and started again on its port with
``--restore``; both workers finish (exit 0) without being restarted.

Sync: the run is paused at known clocks with a cluster checkpoint's holds (phase 1 of
``tessera ps checkpoint``), so what each shard holds at the kill is exact: shard 1 is killed while
it holds both workers' pushes for clock K = 9 and comes back at its checkpoint's clock R = 7; shard
0 is at K + 1 = 10. The workers go back to the shards' common clock R (shard 0 drops their pushes
for clocks 7..9 as late, and each worker says so once) and train on. **Reference**: a run that
restarted every worker at that clock: two fresh shard processes restored from copies of the same
state (shard 0's checkpoint at clock 10, written while the workers waited for shard 1; shard 1's
checkpoint at clock 7), and two fresh worker processes with the same arguments, which start at the
common clock 7. The final dense parameters are equal bit for bit.

Async and SSP: the same outage, with the progress lines each worker prints on stderr asserted (one
worker with its progress bar, one without): one when shard 1 becomes unreachable, one while it
waits (every 5 s: since when, the step training waits at), one when it is back; no traceback. The
workers' lease (4 s) is shorter than the outage: shard 0 never drops them (leases are renewed per
shard).
"""
from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ps.cli import read_first_line
from ps.client import PSClient
from ps.wire import unframe
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(240)

DEADLINE = 120.0  # seconds any one wait may take (generous: the machine may be loaded)
# restored members stay in the sync set for one lease: long enough for the reference's workers to start
LEASE = ("--lease", "30")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """Shard and worker processes of one test; every one still running is killed at the end."""

    def __init__(self, procs: list[subprocess.Popen], tmp: Path) -> None:
        self.procs, self.tmp = procs, tmp
        self.ports = [_port(), _port()]
        self.shards: list[subprocess.Popen | None] = [None, None]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def shard(self, i: int, ckpt: Path, restore: bool = False) -> None:
        cmd = [sys.executable, "-m", "tessera.cli", "ps", "serve", "--port", str(self.ports[i]), "--shard-index", str(i),
               "--num-shards", "2", "--checkpoint-dir", str(ckpt), *(["--restore"] if restore else [])]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        line = read_first_line(p, time.monotonic() + DEADLINE)
        assert "listening on" in line, f"shard {i} did not start: {line}"
        self.shards[i] = p

    def kill(self, i: int) -> None:
        p = self.shards[i]
        assert p is not None
        p.send_signal(signal.SIGKILL)
        p.wait(DEADLINE)

    def workers(self, mode: str, steps: int, *extra: str, progress: tuple[bool, bool] = (False, False)) -> list["Worker"]:
        return [Worker(self, i, mode, steps, *extra, progress=progress[i]) for i in range(2)]

    def one(self, i: int) -> PSClient:
        """A client of shard ``i`` alone (its Stats and Checkpoint calls)."""
        return PSClient([self.addresses[i]], timeout=30, retry_timeout=30)

    def stats(self, i: int):  # noqa: ANN201 - a ps.shard.ShardStats
        with self.one(i) as c:
            return c.stats()[0]

    def checkpoint(self, i: int, at_clock: int, hold: bool = False) -> int:
        """Shard ``i``'s Checkpoint call (``hold``: phase 1 of a cluster checkpoint); returns its clock."""
        with self.one(i) as c:
            raw = c._call(0, "Checkpoint", pb.CheckpointRequest(at_clock=at_clock, hold=hold).SerializeToString())
            return unframe(pb.CheckpointReply, raw)[0].clock

    def dense(self) -> np.ndarray:
        with PSClient(self.addresses, timeout=30) as c:
            return c.pull_dense("digits/dense")


class Worker:
    """A ``tessera worker`` process; its stderr lines are collected as they come."""

    def __init__(self, run: Run, index: int, mode: str, steps: int, *extra: str, progress: bool = False) -> None:
        cmd = [sys.executable, "-m", "tessera.cli", "worker", "--ps", ",".join(run.addresses), "--task", "digits",
               "--mode", mode, "--steps", str(steps), "--batch-size", "16", "--num-workers", "2", "--worker-index",
               str(index), "--torch-threads", "1", "--seed", "3", "--retry-timeout", "120", *extra,
               *([] if progress else ["--no-progress"])]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        run.procs.append(self.p)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.lines.append(line.rstrip("\n"))

    def has(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in list(self.lines))

    def finish(self) -> str:
        try:
            rc = self.p.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError("worker did not finish:\n" + "\n".join(self.lines[-30:])) from None
        self._reader.join(DEADLINE)
        text = "\n".join(self.lines)
        assert rc == 0, f"worker exited {rc}:\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        return text


def _wait(pred, what: str, state=None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + DEADLINE
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (f" ({state()})" if state else "")
        time.sleep(0.05)


def _summary(text: str) -> tuple[int, int, int]:
    m = re.search(r": (\d+) steps \((\d+)->(\d+)\)", text)
    assert m, text[-2000:]
    return int(m[1]), int(m[2]), int(m[3])


FIRST, HOLD0, R, K, STEPS = 4, 6, 7, 9, 16  # see the sync test


def test_sync_workers_go_back_to_the_common_clock_and_match_a_restarted_run(procs, tmp_path) -> None:
    run = Run(procs, tmp_path)
    ck = [tmp_path / "ck0", tmp_path / "ck1"]
    for i in range(2):
        run.shard(i, ck[i])
    for w in run.workers("sync", FIRST, *LEASE):  # the first 4 steps (a round a shard can hold needs a clock > 0)
        w.finish()
    # the run to STEPS is paused with holds (a cluster checkpoint's phase 1), so the state at the
    # kill is exact: shard 0 holds its round for clock 6, so shard 1 stops at clock 7 with nobody
    # computing, and its checkpoint there (clock R, with both workers as members) is what it restarts from
    assert run.checkpoint(0, HOLD0, hold=True) == HOLD0
    workers = run.workers("sync", STEPS, *LEASE)
    # a hold lapses 30 s after it was placed (ShardConfig.cut_hold_s): renew it while the workers start
    # (until both are live on shard 0 the run cannot have reached clock 6, so renewing releases nothing)
    renewed = time.monotonic()
    while sum(w.live for w in run.stats(0).workers) < 2:
        if time.monotonic() - renewed > 10:
            assert run.checkpoint(0, HOLD0, hold=True) == HOLD0
            renewed = time.monotonic()
        assert all(w.p.poll() is None for w in workers), "a worker exited: " + "\n".join(l for w in workers for l in w.lines)
        time.sleep(0.05)

    def at(i: int, clock: int, pushed: int) -> bool:
        """Shard ``i`` is at ``clock`` and both workers pushed every clock below ``pushed`` to it."""
        st = run.stats(i)
        return st.sync_clock == clock and sorted((w.name, w.clock) for w in st.workers if w.live) == [("w0", pushed), ("w1", pushed)]

    def state() -> str:
        return "; ".join(f"shard {i} at {st.sync_clock}, members {[(w.name, w.clock, w.live) for w in st.workers]}"
                         for i, st in ((i, run.stats(i)) for i in range(2))) + "\n" + "\n".join(l for w in workers for l in w.lines[-10:])

    _wait(lambda: at(0, HOLD0, HOLD0 + 1) and at(1, R, R), "the run held at shard 0's clock 6", state)
    assert run.checkpoint(1, -1) == R
    # then shard 1 holds its round for clock K: released, shard 0 applies rounds up to K (clock K + 1),
    # and both workers' pushes for K are held on shard 1, which no worker got further than
    assert run.checkpoint(1, K, hold=True) == K
    run.checkpoint(0, HOLD0)  # phase 2 on shard 0: a checkpoint at 6, and its hold released
    _wait(lambda: at(0, K + 1, K + 1) and at(1, K, K + 1), "the run held at shard 1's clock K", state)
    run.kill(1)
    # shard 0's state while the workers wait for shard 1 (no worker can push there without it)
    assert run.checkpoint(0, -1) == K + 1
    shutil.copytree(ck[0], tmp_path / "ref0")
    shutil.copytree(ck[1], tmp_path / "ref1")  # shard 1 restarts from its newest checkpoint: clock R
    _wait(lambda: all(w.has(r"shard 1 \(127\.0\.0\.1:\d+\) unreachable since") for w in workers), "the unreachable lines")
    run.shard(1, ck[1], restore=True)
    texts = [w.finish() for w in workers]
    live = run.dense()
    for text in texts:
        assert re.search(r"shard 1 \(127\.0\.0\.1:\d+\) is back after [\d.]+ s", text), text[-3000:]
        assert f"shard 1 came back at clock {R}" in text and f"going back to the shards' common clock {R}" in text, text[-3000:]
        # reported once: shard 0 dropped this worker's pushes for clocks R..K as late
        assert len(re.findall(rf"caught up at clock {K + 1} .*: shard 0 dropped {K + 1 - R} of this worker's pushes as late", text)) == 1, text[-3000:]
        assert _summary(text) == (STEPS - FIRST, FIRST, STEPS)
    for p in run.shards:
        assert p is not None
        p.kill()

    # the reference: every worker restarted at the common clock, on shards holding the same state
    ref = Run(procs, tmp_path)
    for i in range(2):
        ref.shard(i, tmp_path / f"ref{i}", restore=True)
    assert [ref.stats(i).sync_clock for i in range(2)] == [K + 1, R]
    for w in ref.workers("sync", STEPS, *LEASE):
        assert _summary(w.finish()) == (STEPS - R, R, STEPS)  # started at the common clock
    np.testing.assert_array_equal(live, ref.dense())


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_workers_say_when_a_shard_is_unreachable_while_they_wait_and_when_it_is_back(procs, tmp_path, mode: str) -> None:
    run = Run(procs, tmp_path)
    ck = [tmp_path / "ck0", tmp_path / "ck1"]
    for i in range(2):
        run.shard(i, ck[i])
    steps = 200
    # a lease shorter than the outage: leases are renewed per shard, so shard 0 never drops the workers.
    # Worker 1 draws its progress bar: the lines come with or without one
    workers = run.workers(mode, steps, "--jitter-ms", "10", "--lease", "4", progress=(False, True))

    def version(i: int) -> int:
        return max((t.version for t in run.stats(i).tables if t.name == "digits/dense"), default=0)

    _wait(lambda: version(1) >= 20, "training under way")
    run.checkpoint(1, -1)  # shard 1 now (async: no common clock)
    at = version(1)
    _wait(lambda: version(1) >= at + 20, "training past the checkpoint")
    run.kill(1)
    since = r"shard 1 \(127\.0\.0\.1:\d+\) unreachable since \d\d:\d\d:\d\d"
    _wait(lambda: all(w.has(since) for w in workers), "the unreachable lines")
    waiting = r"shard 1 \(127\.0\.0\.1:\d+\) still unreachable, since \d\d:\d\d:\d\d \(\d+ s; .*\); training waits at step \d+"
    _wait(lambda: all(w.has(waiting) for w in workers), "a line while the workers wait")
    run.shard(1, ck[1], restore=True)
    for w in workers:
        text = w.finish()
        lines = w.lines
        first = next(i for i, line in enumerate(lines) if re.search(since, line))
        wait_at = next(i for i, line in enumerate(lines) if re.search(waiting, line))
        back = next(i for i, line in enumerate(lines) if re.search(r"shard 1 \(127\.0\.0\.1:\d+\) is back after [\d.]+ s", line))
        assert first < wait_at < back, text[-3000:]
        assert sum(bool(re.search(since, line)) for line in lines) == 1, text[-3000:]  # one line when it goes
        assert _summary(text) == (steps, 0, steps)
    assert run.stats(0).leases_expired == 0
