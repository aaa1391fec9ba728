"""`tessera ps stats` over a real replicated pair of shard processes (issue 31 item 6): each
server's role and epoch, and whether the backup is attached (hence in sync: replication is
synchronous); after the primary is SIGKILLed the backup reports itself primary at epoch 1 and
the dead member as unreachable. Text and --json both."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from ps.cli import start_local_shards, stop_processes

pytestmark = pytest.mark.timeout(180)


def _stats(ps: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli", "ps", "stats", "--ps", ps, "--wait", "10", *extra],
                          capture_output=True, text=True, timeout=90)


def _until(ps: str, needle: str, deadline_s: float = 60.0) -> str:
    """`ps stats` output once it holds ``needle`` (attaching and failover take their time)."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = _stats(ps)
        if r.returncode == 0 and needle in r.stdout:
            return r.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"no {needle!r} within {deadline_s} s: rc {r.returncode}\n{r.stdout}\n{r.stderr}")
        time.sleep(0.5)


def test_stats_show_role_epoch_and_the_attached_backup() -> None:
    procs: list[subprocess.Popen] = []
    try:
        p, (primary,) = start_local_shards(1)
        procs += p
        b, (backup,) = start_local_shards(1, ("--backup-of", primary, "--failover", "1"))
        procs += b
        ps = f"{primary}|{backup}"
        out = _until(ps, f"backup {backup} attached, in sync")
        assert "  replication: primary, epoch 0; " in out, out
        assert f"  member {primary}: primary, epoch 0" in out, out
        assert f"  member {backup}: backup of {primary}, epoch 0, attached, in sync" in out, out
        j = json.loads(_stats(ps, "--json").stdout)[0]
        assert (j["role"], j["epoch"], j["backup"]) == ("primary", 0, backup)
        assert (j["members"][backup]["role"], j["members"][backup]["backup_of"]) == ("backup", primary)
        # the primary dies: the backup takes over at a new epoch; the dead member is named
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)
        out = _until(ps, "replication: primary, epoch 1")
        assert "no backup attached" in out and f"  member {primary}: not reachable" in out, out
        assert f"  member {backup}: primary, epoch 1" in out, out
    finally:
        stop_processes(procs)
