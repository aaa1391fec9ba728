"""Issue 17 items 3 (CLI side), 5, 8, 12, 14: what a new user hits on the command line.

Every error a user can cause is one line on stderr with what to do next (no traceback), exit 2
for a wrong command line or setup and 1 for a failure while running; ``--debug`` shows the
traceback. These run the real ``tessera`` command (``python -m tessera.cli``, or the installed
console script where it matters: its sys.path lacks the current directory) against real shard
processes on loopback ports chosen at run time.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tessera.cli import build_parser

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

pytestmark = pytest.mark.timeout(120)

def _tessera(*args: str, cwd: str | None = None, console: bool = False, timeout: float = 90) -> subprocess.CompletedProcess:
    exe = shutil.which("tessera", path=os.path.dirname(sys.executable)) if console else None
    cmd = [exe] if exe else [sys.executable, "-m", "tessera.cli"]
    env = {**os.environ, "PYTHONPATH": ""} if console else None
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The process failed with ``code`` and said so in exactly one stderr line holding ``needles``."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]



def test_bad_flags_and_bad_settings_are_one_line(tmp_path) -> None:
    cases = [
        (("worker", "--ps", "127.0.0.1:1", "--worker-index"),
         ("tessera worker: error:", "--worker-index: expected one argument", "tessera worker --help")),
        (("worker", "--ps", "127.0.0.1:1", "--worker-index", "2", "--num-workers", "2"),
         ("--worker-index 2 is out of range for --num-workers 2", "0..1")),
        (("worker", "--ps", "127.0.0.1:1", "--task", "ctr", "--task-opt", "vocab"),
         ("tessera worker: error:", "--task-opt expects KEY=VALUE, got 'vocab'")),
        (("demo", "--workers", "two"), ("tessera demo: error:", "invalid int value: 'two'")),
        (("experiment", "consistency", "--modes", "bogus", "--out", str(tmp_path / "e")),
         ("tessera experiment consistency: error:", "unknown mode 'bogus'")),
        (("tokens", "w0:worker", "--out", str(tmp_path / "no" / "such" / "tokens.txt")),
         ("tessera tokens: error:", "no such file or directory")),
        (("cert", "--out-dir", str(tmp_path / "pki"), "--days", "soon"), ("tessera cert: error:", "--days: invalid int value")),
        (("ps", "serve", "--port", "-3"), ("tessera ps serve: error:",)),
        # issue 31 item 8: a mistyped flag points at its own subcommand's --help; malformed addresses
        # are refused at once in every command that takes one (one parser: tessera.argtypes)
        (("peer", "--stepz", "3"), ("tessera peer: error:", "unrecognized arguments: --stepz 3", "(see: tessera peer --help)")),
        (("fed", "client", "--server", "a:1", "--partition", "0/2", "--zz"),
         ("tessera fed client: error:", "unrecognized arguments: --zz", "(see: tessera fed client --help)")),
        (("worker", "--ps", "localhost5999"), ("tessera worker: error:", "'localhost5999' is not HOST:PORT")),
        (("worker", "--ps", "127.0.0.1:5000,,127.0.0.1:5001"), ("tessera worker: error:", "shard 1 is empty")),
        (("ps", "stats", "--ps", "127.0.0.1:99999"), ("tessera ps stats: error:", "the port must be a number 1..65535")),
        (("ps", "checkpoint", "--ps", "host:"), ("tessera ps checkpoint: error:", "the port must be a number")),
        (("ps", "serve", "--backup-of", "primary"), ("tessera ps serve: error:", "'primary' is not HOST:PORT")),
        (("fed", "client", "--server", "localhost5999", "--partition", "0/2"), ("tessera fed client: error:", "is not HOST:PORT")),
        (("peer", "--mode", "hybrid", "--ps", "localhost5999"), ("tessera peer: error:", "is not HOST:PORT")),
    ]
    with ThreadPoolExecutor(4) as pool:  # independent commands: run them side by side
        results = list(pool.map(lambda c: _tessera(*c[0]), cases))
    for (_, needles), r in zip(cases, results, strict=True):
        _one_line_error(r, 2, *needles)


def test_importing_the_command_loads_no_grpc() -> None:
    """main() turns gRPC core's own log lines off before any gRPC code loads (they would come
    before the one error line); importing tessera.cli must not load grpc."""
    r = subprocess.run([sys.executable, "-c", "import sys, tessera.cli; print('grpc' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


def test_debug_shows_the_traceback() -> None:
    r = _tessera("worker", "--ps", "127.0.0.1:1", "--worker-index", "5", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "UsageError" in r.stderr


def test_bad_task_and_module_in_the_current_directory(tmp_path) -> None:
    _one_line_error(_tessera("worker", "--ps", "127.0.0.1:1", "--task", "nope"), 2, "unknown task 'nope'", "module:function")
    _one_line_error(_tessera("demo", "--task", "nope:make", "--out", str(tmp_path / "demo")), 2,
                    "tessera demo: error:", "no module 'nope'")  # refused before any process starts
    line = _one_line_error(_tessera("worker", "--ps", "127.0.0.1:1", "--task", "myrec:make", cwd=str(tmp_path), console=True), 2,
                           "no module 'myrec' in the current directory", "PYTHONPATH")
    assert str(tmp_path) in line
    (tmp_path / "myrec.py").write_text("def other():\n    pass\n")
    _one_line_error(_tessera("worker", "--ps", "127.0.0.1:1", "--task", "myrec:make", cwd=str(tmp_path), console=True), 2,
                    "has no function 'make'", "other")


def test_unreachable_shard_is_named_with_the_cause() -> None:
    port = free_port()
    r = _tessera("worker", "--ps", f"127.0.0.1:{port}", "--retry-timeout", "2", "--steps", "2")
    _one_line_error(r, 1, f"shard 0 (127.0.0.1:{port}) not reachable within 2 s", "nothing is listening", "connection refused")


def test_shard_count_and_order_mismatch(proc_cluster) -> None:
    a0, a1 = proc_cluster(2)
    _one_line_error(_tessera("worker", "--ps", a0, "--steps", "2"), 2,
                    "--ps lists 1 shard, but position 0", "is shard 0 of 2", "list all 2 shards in shard order")
    _one_line_error(_tessera("ps", "stats", "--ps", f"{a1},{a0}"), 2, f"position 0 ({a1}) is shard 1 of 2")
    # a second shard on a port in use: the start warning, then one error line (no gRPC log lines)
    r = _tessera("ps", "serve", "--port", a0.rpartition(":")[2])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], r.stderr
    assert "cannot listen on" in lines[-1] and "--port 0" in lines[-1]


# a user task without an evaluation, with one PSEmbedding (so worker 1 waits for worker 0's tables)
PLAIN_TASK = """
import torch, torch.nn.functional as F
from worker import PSEmbedding, Task

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = PSEmbedding("plain/emb", 8, mode="mean", optimizer="adagrad", lr=0.05)
        self.out = torch.nn.Linear(8, 2)
    def forward(self, ids):
        return self.out(self.emb(ids))

def make(seed=0, **_):
    torch.manual_seed(seed)
    def batches(worker_index, num_workers, batch_size, start_step):
        step = start_step
        while True:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)
            ids = torch.randint(0, 1000, (num_workers * batch_size, 4), generator=g)
            lo = worker_index * batch_size
            yield ids[lo:lo + batch_size], (ids % 2).sum(1)[lo:lo + batch_size] % 2
            step += 1
    return Task("plain", Model(), batches, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]), sparse_ids=lambda b: {"emb": b[0]})
"""


def test_healthy_run_stats_show_no_errors_or_internal_tables_and_eval_warning(proc_cluster, tmp_path) -> None:
    """Two workers of a user task (a module in the current directory, run by the console script):
    worker 1 polls for worker 0's tables (NOT_FOUND answers on the shard), yet ``ps stats`` shows no
    errors and no ``*/ready`` table unless ``--all``; --eval-every on a task without an evaluation
    warns once."""
    (address,) = proc_cluster(1)
    (tmp_path / "plaintask.py").write_text(PLAIN_TASK)
    exe = shutil.which("tessera", path=os.path.dirname(sys.executable)) or ""
    base = [exe, "worker", "--ps", address, "--task", "plaintask:make", "--steps", "4", "--batch-size", "16",
            "--num-workers", "2", "--no-progress", "--mode", "async"]
    procs = [
        subprocess.Popen([*base, "--worker-index", str(i), *(["--eval-every", "2"] if i == 0 else [])],
                         cwd=str(tmp_path), stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})
        for i in (1, 0)  # worker 1 first: it waits for worker 0's tables
    ]
    errs = [p.communicate(timeout=100)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert errs[1].count("warning: --eval-every 2: task 'plain' has no evaluation") == 1, errs[1]
    assert "warning" not in errs[0]
    plain = _tessera("ps", "stats", "--ps", address)
    assert plain.returncode == 0, plain.stderr
    assert "errors:   -" in plain.stdout and "NOT_FOUND" not in plain.stdout, plain.stdout
    assert "plain/emb" in plain.stdout and "/ready" not in plain.stdout
    full = _tessera("ps", "stats", "--ps", address, "--all")
    assert "plain/ready" in full.stdout


def test_stats_hide_the_clock_table_unless_all(proc_cluster) -> None:
    """README: ``ps stats`` leaves out the trainer's internal tables, ``PREFIX/ready`` and
    ``PREFIX/clock`` (the steps each worker finished), unless ``--all``. The run above checks
    ``/ready``; here a shard holds a model table and both internal tables, named as the trainer names
    them (worker.paramsync.ParamSync.ready_table / clock_table with prefix "run"). Reference: the
    shard's own Stats (all three tables are there)."""
    (address,) = proc_cluster(1)
    from ps.client import PSClient

    with PSClient([address], timeout=10) as c:
        c.create_sparse("run/emb", 4)
        c.create_sparse("run/clock", 1, optimizer="sgd", lr=1.0)  # as ParamSync.create_tables makes it
        c.create_dense("run/ready", 1)
        assert {t.name for t in c.stats()[0].tables} == {"run/emb", "run/clock", "run/ready"}
    plain = _tessera("ps", "stats", "--ps", address)
    assert plain.returncode == 0, plain.stderr
    assert "run/emb" in plain.stdout and "run/clock" not in plain.stdout and "run/ready" not in plain.stdout, plain.stdout
    full = _tessera("ps", "stats", "--ps", address, "--all")
    assert full.returncode == 0, full.stderr
    assert "run/emb" in full.stdout and "run/clock" in full.stdout and "run/ready" in full.stdout, full.stdout


def test_stats_list_the_workers_as_name_at_clock(proc_cluster) -> None:
    """README: ``ps stats`` prints per shard "its workers (``name@clock``)". Two workers join a
    real shard and report the steps they finished (heartbeats with clocks 7 and 3). Reference: the
    clocks they reported, as the shard's own Stats holds them."""
    (address,) = proc_cluster(1)
    from ps.client import PSClient

    with PSClient([address], timeout=10, worker="alice") as a, PSClient([address], timeout=10, worker="bob") as b:
        a.join(lease_s=60)
        b.join(lease_s=60)
        a.heartbeat(7)
        b.heartbeat(3)
    with PSClient([address], timeout=10) as c:
        assert {(w.name, w.clock) for w in c.stats()[0].workers} == {("alice", 7), ("bob", 3)}
    r = _tessera("ps", "stats", "--ps", address)
    assert r.returncode == 0, r.stderr
    line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith("workers:")), "")
    assert "alice@7" in line and "bob@3" in line and "name@clock" in line, r.stdout


def test_worker_retry_timeout_defaults_to_60_seconds() -> None:
    """README: calls that find a shard unavailable are retried for at most ``retry_timeout``
    seconds ("one setting; ``tessera worker --retry-timeout``, default 60"). The parser's default is
    60, and a real `tessera worker` given no --retry-timeout, started against a port nothing listens
    on, says after 5 s that it waits for its shard out of 60 s (the wait at start is that same
    setting; test_unreachable_shard_is_named_with_the_cause gives up after --retry-timeout 2).
    Reference: the README's figure."""
    assert build_parser().parse_args(["worker", "--ps", "127.0.0.1:1"]).retry_timeout == 60.0
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "tessera.cli", "worker", "--ps", f"127.0.0.1:{port}", "--steps", "1",
                          "--task-opt", "test_size=8"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        seen = []
        for line in p.stderr:  # the first note comes after 5 s of waiting
            seen.append(line)
            if "waiting for shard 0" in line:
                break
        # the note's first figure is when load let it print (5 s on an idle machine, 6 under the suite): the total is the point
        waited = re.search(rf"waiting for shard 0 at 127\.0\.0\.1:{port} \((\d+) s of 60\)", line)
        assert waited is not None and int(waited.group(1)) >= 5, seen
    finally:
        p.kill()
        p.wait(20)


def test_worker_lease_defaults_to_10_seconds(proc_cluster, tmp_path) -> None:
    """README (Membership): "A worker silent longer than its lease (`--lease`, default 10 s; `tessera ps
    serve --lease` sets the shard default) leaves the live set". A real shard process whose own default
    lease is 1 s, and a real `tessera worker` given no --lease, training; the worker is SIGKILLed, and
    once the shard has not heard from it for 3 s (3 x the shard's default, well under 10) it still
    counts it live: the worker asked for its own 10 s. Reference: the shard's 1 s default, which a
    worker without its own lease would get (the parser's default is checked too)."""
    import time

    from ps import PSClient

    assert build_parser().parse_args(["worker", "--ps", "127.0.0.1:1"]).lease == 10.0
    (address,) = proc_cluster(1, "--lease", "1")
    err = (tmp_path / "worker.err").open("w")
    p = subprocess.Popen([sys.executable, "-m", "tessera.cli", "worker", "--ps", address, "--steps", "1000000",
                          "--task-opt", "test_size=8", "--no-progress"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        with PSClient([address], timeout=10) as c:
            deadline = time.monotonic() + 90
            while not [w for w in c.stats()[0].workers if w.clock >= 2]:  # joined and training
                assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.err").read_text()[-2000:]
                time.sleep(0.2)
            p.kill()
            p.wait(20)
            while True:
                (w,) = c.stats()[0].workers
                if w.idle_s >= 3.0:
                    break
                time.sleep(0.2)
            assert w.idle_s < 9.0, w  # else this check came too late to tell 10 s from 1 s
            assert w.live, w
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(20)
        err.close()


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


@pytest.mark.parametrize("command", ["ps", "worker", "peer", "plan", "demo", "experiment", "fed", "cert", "tokens", "health"])
def test_help_has_a_line_for_every_option_shows_defaults_and_no_markup(command) -> None:
    parser = build_parser()
    seen = 0
    for path, p in _walk(parser):
        if not path or path[0] != command:
            continue
        seen += 1
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"tessera {' '.join(path)} {'/'.join(action.option_strings) or action.dest}: no help"
        text = p.format_help()
        assert "``" not in text and ":func:" not in text and ":class:" not in text, text
        for action in p._actions:
            d = action.default
            nothing = d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (str, list)) and not d)
            if action.option_strings and not nothing and action.help:
                assert "default" in (p._get_formatter()._expand_help(action) if action.help else ""), (path, action.dest)
    assert seen


def test_default_torch_threads_divide_the_cores_among_local_workers() -> None:
    from worker.cli import default_torch_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    assert default_torch_threads("127.0.0.1:5000,localhost:5001", 2) == max(1, cores // 2)  # the whole run is here
    assert default_torch_threads("127.0.0.1:5000|127.0.0.1:5002", 64) == 1  # never below one
    assert default_torch_threads("10.0.0.1:5000", 4) == cores  # shards elsewhere: one worker per machine assumed
    assert default_torch_threads("10.0.0.1:5000", 4, local_workers=2) == max(1, cores // 2)
