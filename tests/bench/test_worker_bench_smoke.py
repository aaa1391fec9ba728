"""bench/worker_step.py still runs end to end (--quick) and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check): only that the run succeeds, that the
last stdout line is the JSON also written to --json-out, that every promised figure is there
and positive, and that the run left none of its processes behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = [
    "sync_eps", "ssp_eps", "async_eps", "local_eps", "sync_noov_eps", "ssp_noov_eps", "async_noov_eps",
    "overlap_speedup", "async_wait_fraction", "sync_step_ms", "ddp_step_ms", "sync_vs_ddp", "gloo_allreduce_gbps",
]


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


def test_worker_step_quick(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "bench", "worker_step.py"), "--quick", "--json-out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own session: every process it starts is found below by session id
    )
    try:
        stdout, stderr = proc.communicate(timeout=110)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and everything it started
        stdout, stderr = proc.communicate()
        raise AssertionError(f"bench/worker_step.py --quick did not finish in 110 s:\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-3000:]
    last = json.loads(stdout.strip().splitlines()[-1])  # the last line is the JSON figures
    assert last == json.loads(out.read_text())
    for k in KEYS:
        assert k in last, k
        assert last[k] > 0, (k, last[k])
    assert last["quick"] is True
    # the split of async step time is a share: in [0, 1], and the parts sum to the whole
    parts = [last[f"async_{p}_frac"] for p in ("compute", "pull", "push", "other")]
    assert all(0 <= p <= 1 for p in parts) and abs(sum(parts) - 1) < 0.02, parts
    assert 0 < last["async_wait_fraction"] <= 1
    # every process the bench started (worker children, shard sets) is gone
    deadline = time.monotonic() + 5
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _in_session(proc.pid)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
