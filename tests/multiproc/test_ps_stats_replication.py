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
from ps.client import PSClient

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

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


def test_stats_say_a_backup_the_primary_does_not_hold_is_not_attached() -> None:
    """README: for ``--ps PRIMARY|BACKUP`` one ``member`` line per server, asked on its own:
    ``attached, in sync``, ``not attached``, or ``not reachable (why)``; the test above sees the first
    and the last. Here the backup named with the primary is one its primary never held: it was
    started as the backup of a server that is not there (a port nothing listens on), so it cannot
    attach and never takes over. Reference: each server's own Stats (PSClient): the primary holds no
    backup, the other server is a backup of that absent address."""
    procs: list[subprocess.Popen] = []
    try:
        absent = f"127.0.0.1:{free_port()}"
        p, (primary,) = start_local_shards(1)
        procs += p
        b, (backup,) = start_local_shards(1, ("--backup-of", absent))
        procs += b
        ps = f"{primary}|{backup}"
        r = _stats(ps)
        assert r.returncode == 0, r.stderr
        assert "  replication: primary, epoch 0; no backup attached" in r.stdout, r.stdout
        assert f"  member {primary}: primary, epoch 0" in r.stdout, r.stdout
        assert f"  member {backup}: backup of {absent}, epoch 0, not attached" in r.stdout, r.stdout
        assert "attached, in sync" not in r.stdout and "not reachable" not in r.stdout, r.stdout
        with PSClient([primary], timeout=10) as cp, PSClient([backup], timeout=10) as cb:
            assert (cp.stats()[0].role, cp.stats()[0].backup) == ("primary", "")
            assert (cb.stats()[0].role, cb.stats()[0].backup_of) == ("backup", absent)
    finally:
        stop_processes(procs)
