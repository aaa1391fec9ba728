"""Run a benchmark's --quick mode as the smoke tests do: in its own session, with a deadline for a
hang, its last stdout line the JSON it also wrote to --json-out, and none of its processes left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every bench smoke test's deadline: for a hang, never a speed check. A --quick run takes 20-60 s on a
# quiet 2-core machine and 4-5x that beside a parallel suite or other work (bench/faults.py --quick
# took over 240 s at load average 13), so the deadline is 10 minutes; TEST_TIMEOUT_S is the
# pytest-timeout mark above it (the bench's own deadline fires first and kills its process group).
DEADLINE_S = 600.0
TEST_TIMEOUT_S = DEADLINE_S + 60


def _in_session(sid: int) -> set[int]:
    """Processes in session ``sid`` (Linux /proc; empty elsewhere)."""
    out = set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    out.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def run_quick(script: str, json_out: str, extra: tuple[str, ...] = (), timeout: float = DEADLINE_S) -> tuple[dict[str, Any], str]:
    """Run ``bench/<script> --quick`` (and ``extra`` arguments): (its final JSON figures, its stdout). Fails the test if it
    hangs (no exit in ``timeout`` s), exits non-zero, prints other JSON than it wrote, or leaves a
    process behind (shards, workers, load clients: every process it started is in its session)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "bench", script), "--quick", "--json-out", json_out, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and everything it started
        stdout, stderr = proc.communicate()
        raise AssertionError(f"bench/{script} --quick did not finish in {timeout:.0f} s:\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    last = json.loads(stdout.strip().splitlines()[-1])  # the last line is the JSON figures
    with open(json_out) as f:
        assert last == json.load(f)
    deadline = time.monotonic() + 5
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _in_session(proc.pid)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
    return last, stdout
