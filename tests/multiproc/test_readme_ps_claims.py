"""README promises about the parameter server that had no test (helper Y's README audit,
/work/notes/Y-audit.md), each checked against a real shard process on a loopback port:

* "Servers bind 127.0.0.1 unless --host says otherwise; --port 0 picks a free port and prints it"
  (the shard process's listening sockets, read from /proc).
* "tessera ps stats waits up to --wait seconds for the shards".
* "gRPC keepalive pings every second, so a dead host or cut link fails the calls on it within
  about 6 s instead of at their deadline" (a SIGSTOPped shard: the kernel still holds its socket,
  only the process answers nothing, as a hung host or a black-holed link).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from ps.cli import start_local_shards, stop_processes
from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import ShardUnavailableError
from ps.server import build_server

pytestmark = pytest.mark.timeout(60)


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(IPv4 address, port) of every TCP socket process ``pid`` listens on, from /proc (Linux)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                addr, port = cols[1].split(":")
                if len(addr) == 8:
                    ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                else:  # IPv6, kernel order: four little-endian 32-bit words
                    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                    ip = socket.inet_ntop(socket.AF_INET6, raw).removeprefix("::ffff:")  # v4-mapped: the IPv4 address
                out.add((ip, int(port, 16)))
    return out


def _serve(*extra: str, stderr: Any = subprocess.DEVNULL) -> tuple[subprocess.Popen, str, int]:
    """`tessera ps serve --port 0 ...` as a process; (the process, the HOST:PORT it printed, the bulk
    port it printed or 0)."""
    p = subprocess.Popen([sys.executable, "-m", "tessera.cli", "ps", "serve", "--port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert p.stdout is not None
    seen = []
    for line in p.stdout:  # other notes may come first; the address line when the shard is ready
        seen.append(line)
        m = re.search(r"tessera-ps listening on (\S+):(\d+)", line)
        if m:
            bulk = re.search(r" bulk (\d+)", line)
            return p, f"{m.group(1)}:{m.group(2)}", int(bulk.group(1)) if bulk else 0
    p.wait(20)
    raise AssertionError(f"no 'listening on' line (exit {p.returncode}): {seen}")


def _stop(p: subprocess.Popen, err: Any) -> None:
    """SIGTERM and wait for the exit (a shard drains in ~4 s); one that is still there after 20 s is
    asked for its threads' stacks (SIGUSR1), which the failure shows, then killed."""
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        p.kill()
        p.wait()
        err.seek(0)
        raise AssertionError(f"the shard did not exit within 20 s of SIGTERM; its stderr:\n{err.read()[-6000:]}") from None


def test_a_shard_binds_loopback_unless_host_says_otherwise(tmp_path) -> None:
    """Also the README's "`kill -USR1 PID` prints every thread's stack to stderr, and the process runs on"."""
    err = open(tmp_path / "stderr", "w+")
    p, address, bulk = _serve(stderr=err)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0 and bulk > 0, address  # --port 0 and the default bulk port: free ones, printed
        for each in (int(port), bulk):
            with socket.create_connection(("127.0.0.1", each), timeout=5):
                pass
        if sys.platform.startswith("linux"):  # it listens on loopback only: no wildcard, no other address
            assert _listening_addresses(p.pid) == {("127.0.0.1", int(port)), ("127.0.0.1", bulk)}, _listening_addresses(p.pid)
        p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "ps/server.py" not in (text := (tmp_path / "stderr").read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "(most recent call first)" in text and "ps/server.py" in text, text  # the main thread waits in serve()
        with socket.create_connection(("127.0.0.1", int(port)), timeout=5):  # and it serves on
            pass
        assert p.poll() is None
    finally:
        _stop(p, err)
        err.close()


def test_stats_waits_up_to_wait_seconds_then_fails_naming_the_shard() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "tessera.cli", "ps", "stats", "--ps", f"127.0.0.1:{port}", "--wait", "1"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    # gave up after --wait, not a default: the line names the 1 s it waited
    assert f"shard 0 (127.0.0.1:{port}) not reachable within 1 s" in r.stderr, r.stderr

    # a shard that comes up while stats waits is found: stats started first, the shard (here, in
    # this process: it starts in milliseconds) 1.5 s later
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stats = subprocess.Popen([sys.executable, "-m", "tessera.cli", "ps", "stats", "--ps", f"127.0.0.1:{port}", "--wait", "40"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    server, _, shard = build_server(ShardConfig(port=port))
    try:
        out, err = stats.communicate(timeout=45)
        assert stats.returncode == 0, err
        assert "shard 0" in out, out
    finally:
        if stats.poll() is None:
            stats.kill()
        server.stop(0)
        shard.close()


def _wait_all_threads_stopped(pid: int, timeout: float = 30.0) -> None:
    """Until every thread of ``pid`` is in state T (a SIGSTOP is taken by each thread when it next runs:
    on a loaded machine a gRPC thread answered a call 4 ms after kill() had returned)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(st == "T" for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: thread states {states}"
        time.sleep(0.01)


def test_a_stopped_shard_fails_calls_within_seconds_not_at_their_deadline() -> None:
    """Keepalive: the call's deadline is 60 s; a shard that stops answering (SIGSTOP) makes it fail
    as UNAVAILABLE (ShardUnavailableError after retry_timeout) in a few seconds. Before the
    ping timeout was set in tessera/rpc.py this call waited its whole 60 s deadline and failed as
    DEADLINE_EXCEEDED (DeadlineExceededError, not a ShardUnavailableError): the error's class is
    the check, however slow a loaded machine makes the few seconds."""
    procs, addresses = start_local_shards(1, ())
    try:
        with PSClient(addresses, timeout=60, retry_timeout=1.0) as c:
            c.create_dense("w", 10, lr=0.1)
            c.pull_dense("w")
            os.kill(procs[0].pid, signal.SIGSTOP)
            _wait_all_threads_stopped(procs[0].pid)  # kill() returns before a busy thread stops (a call answered)
            with pytest.raises(ShardUnavailableError, match="shard 0"):
                c.pull_dense("w")
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
        stop_processes(procs, grace=3.0)
