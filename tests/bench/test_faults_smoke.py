"""bench/faults.py --quick still runs end to end and reports every figure it promises.

Speed is not asserted (benchmarks measure, tests check). What must hold even in a tiny run is
asserted: no acknowledged update is lost when a primary is SIGKILLed (and none is applied twice,
in the fault-free runs either: that is what makes the accounting trustworthy), the backup took
over and training resumed, and the load test saw no errors. Also: the last stdout line is the
JSON also written to --json-out, and the run left none of its processes behind.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ["failover_s", "lost_updates", "metric_delta", "replication_throughput_ratio", "load_errors", "rss_growth_mb"]
FIGURES = ["promote_s", "write_resume_s", "auc_fault_free", "auc_fault", "eps_replicated", "eps_unreplicated",
           "rss_start_mb", "rss_end_mb", "load_pull_sparse_p50_ms", "load_push_sparse_p99_ms", "load_push_dense_p50_ms"]


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


@pytest.mark.timeout(260)  # ~45 s on a quiet 2-core machine; 2-2.5 min at load average 10-15
def test_faults_quick(tmp_path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "bench", "faults.py"), "--quick", "--json-out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own session: every process it starts is found below by session id
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and everything it started
        stdout, stderr = proc.communicate()
        raise AssertionError(f"bench/faults.py --quick did not finish in 240 s:\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    last = json.loads(stdout.strip().splitlines()[-1])  # the last line is the JSON figures
    assert last == json.loads(out.read_text())
    for k in KEYS + FIGURES:
        assert k in last, k
        assert isinstance(last[k], (int, float)) and math.isfinite(last[k]), (k, last[k])
    assert last["quick"] is True
    # the goals that must hold even tiny
    assert last["lost_updates"] == 0, stdout[-3000:]
    assert last["double_applied"] == 0 and last["fault_free_lost"] == 0 and last["fault_free_double"] == 0, stdout[-3000:]
    assert last["acked_updates"] > 0
    assert last["load_errors"] == 0, stdout[-3000:]
    assert 0 < last["promote_s"] <= last["failover_s"]  # the backup took over, then training went on
    assert last["replication_throughput_ratio"] > 0 and last["rss_start_mb"] > 0
    assert set(last["goals"]) == {"lost_updates", "failover_s", "metric_delta", "replication_throughput_ratio", "load_errors"}
    # every process the bench started (shards, backups, workers, load clients) is gone
    deadline = time.monotonic() + 5
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _in_session(proc.pid)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
