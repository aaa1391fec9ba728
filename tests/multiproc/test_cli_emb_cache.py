"""`tessera worker --emb-cache-rows N --emb-cache-staleness K` (README, Training with workers: Devices):
a real worker process against a real shard process trains the ctr task with the hot-row cache and
reports its hit rate; a refresh rule that cannot work is refused naming the flag."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

EXE = shutil.which("tessera", path=os.path.dirname(sys.executable)) or "tessera"


@pytest.mark.timeout(120)
def test_worker_with_emb_cache_trains_and_reports_its_hit_rate(proc_cluster) -> None:
    (address,) = proc_cluster(1)
    p = subprocess.run(
        [EXE, "worker", "--ps", address, "--task", "ctr", "--task-opt", "vocab=1000", "--task-opt", "test_size=200",
         "--mode", "ssp", "--staleness", "2", "--steps", "30", "--batch-size", "32", "--device", "cpu", "--no-progress",
         "--emb-cache-rows", "300", "--emb-cache-staleness", "2"],
        capture_output=True, text=True, timeout=100, check=False,
    )
    assert p.returncode == 0, p.stderr
    m = re.search(r"emb cache emb: hit rate ([\d.]+) of lookups", p.stderr)
    assert m, p.stderr
    assert float(m.group(1)) > 0.1, p.stderr  # ctr ids are Zipf-like: hot rows are served from the cache


@pytest.mark.timeout(60)
def test_async_emb_cache_needs_a_refresh_period() -> None:
    # refused before the worker dials a shard: no shard is needed (nothing listens on port 1)
    p = subprocess.run(
        [EXE, "worker", "--ps", "127.0.0.1:1", "--task", "ctr", "--task-opt", "test_size=10", "--mode", "async", "--steps", "5", "--no-progress",
         "--emb-cache-rows", "100", "--emb-cache-staleness", "0"],
        capture_output=True, text=True, timeout=50, check=False,
    )
    assert p.returncode != 0
    assert "--emb-cache-rows/--emb-cache-staleness" in p.stderr and "refreshed every K steps" in p.stderr, p.stderr
