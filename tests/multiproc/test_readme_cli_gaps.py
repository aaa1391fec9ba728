"""README claims about command-line flags that no other test covered, each checked through the real
CLI (``python -m tessera.cli ...``) with real shard and worker processes:

- ``tessera experiment consistency --net-delay MS`` adds MS to every RPC of the last worker (only);
  ``--target`` is the target metric reported (results.json, summary.md, time/updates to target);
  ``--netem`` where the kernel has no netem qdisc is refused with a message;
- ``tessera worker --backup-workers b`` (sync): each step applies the first W-b gradients, the
  straggler's are dropped as late and it skips to the current step;
- ``tessera ps serve --forget-after S`` forgets a dead member S seconds after it died (default
  10 x ``--lease``); ``--max-lease`` caps the lease a Join asks for;
- ``tessera ps serve --metrics-port PORT`` serves Prometheus text at ``/metrics``.

The relations checked are ones the flag creates (a delay per step, versions per step, a member
forgotten sooner than the default would), so each fails if its flag stops doing what the README says.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ps.client import PSClient

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
CLI = [sys.executable, "-m", "tessera.cli"]


def _readme() -> str:
    with open(README) as f:
        return " ".join(f.read().split())  # one line: claims wrap across lines


def _summary(path) -> dict:
    return [json.loads(line) for line in path.read_text().splitlines() if '"summary"' in line][-1]


# ---------------------------------------------------------------------- experiment --net-delay / --target
@pytest.mark.timeout(150)
def test_net_delay_slows_the_last_workers_rpcs_and_target_is_the_reported_one(tmp_path) -> None:
    """2 async workers, 1 shard, digits, 20 steps, --net-delay 150: every Step call of the last worker
    (w1) waits 150 ms before it leaves, one call in flight at a time, so each of w1's steps takes at
    least ~150 ms and about 150 ms more than w0's (which has no delay and, async, never waits for
    w1). Reference: w0 of the same run. --target 0.3 is the target reported."""
    text = _readme()
    assert "`--net-delay MS` (added to the last worker's RPCs, in software" in text
    assert "The target is `--target`, or 99% of the worst mode's best metric" in text
    out = tmp_path / "exp"
    steps, delay_ms = 20, 150.0
    cmd = [*CLI, "experiment", "consistency", "--task", "digits", "--workers", "2", "--shards", "1", "--modes", "async",
           "--steps", str(steps), "--batch-size", "16", "--eval-every", "5", "--net-delay", str(delay_ms),
           "--target", "0.3", "--out", str(out)]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["complete"] and r["settings"]["net_delay_ms"] == delay_ms
    w0, w1 = _summary(out / "async-w0.jsonl"), _summary(out / "async-w1.jsonl")
    # w0 trains every step; w1 too unless w0 finished first (async: on a loaded machine w0's 20 steps can
    # end before w1's first delayed call, and w1 then joins a finished run: it may train fewer steps)
    assert w0["steps"] == steps and 1 <= w1["steps"] <= steps, (w0, w1)
    d = delay_ms / 1000
    t0, t1 = w0["seconds"] / w0["steps"], w1["seconds"] / w1["steps"]
    assert t1 >= 0.8 * d, (w0, w1)  # the delay is really added: every step of w1 has a delayed call
    assert t0 < t1 / 3, (w0, w1)  # ... only to the last worker's calls
    assert 0.8 * d <= t1 - t0 <= 3 * d, (t0, t1)  # about the delay per step, not a multiple of it
    summary_md = (out / "summary.md").read_text()
    assert "net delay 150.0 ms" in summary_md
    # --target: the given value, not the default (99% of the worst mode's best), is the one reported
    assert r["target"] == 0.3
    assert "target accuracy: 0.3000" in summary_md
    series, sm = r["modes"]["async"]["series"], r["modes"]["async"]["summary"]
    first = next((pt for pt in series if pt["metric"] >= 0.3), None)
    assert (sm["time_to_target_s"], sm["updates_to_target"]) == ((first["time_s"], first["updates"]) if first else (None, None))


def test_netem_is_refused_with_a_message_where_the_kernel_lacks_it(tmp_path) -> None:
    """README: --netem needs the netem qdisc; where the kernel lacks it, it is refused with a message
    (exit 2, nothing started). Skipped where netem works (tests/multiproc/test_netem.py covers it)."""
    from worker.netem import netem_available

    why = netem_available()
    if why is None:
        pytest.skip("this kernel has netem: the refusal cannot be seen here")
    assert "there it is refused with a message" in _readme()
    p = subprocess.run([*CLI, "experiment", "consistency", "--task", "digits", "--net-delay", "5", "--netem",
                        "--out", str(tmp_path / "exp")], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "--netem" in p.stderr and "use --net-delay alone" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "exp" / "results.json").exists()


# ---------------------------------------------------------------------- worker --backup-workers
@pytest.mark.timeout(120)
def test_backup_workers_apply_the_first_w_minus_b_and_the_straggler_skips(proc_cluster, tmp_path) -> None:
    """3 `tessera worker` processes in sync mode with --backup-workers 1 against a shard process;
    worker 2 sleeps 50 ms per step on average (--jitter-ms). Each step applies once (the dense table's
    version equals the steps, `tessera ps stats --json`), the straggler's gradients arrive late and are
    dropped, and it skips ahead: it pushes for fewer steps than the run has (the staleness histogram has
    one entry per push on one shard), yet ends at the same clock. Without the flag every round
    would wait for it: none of its pushes late, one push per step."""
    assert "`--backup-workers b` (sync): each step applies the first W-b gradients" in _readme()
    (address,) = proc_cluster(1)
    steps, W = 30, 3
    base = [*CLI, "worker", "--ps", address, "--task", "digits", "--mode", "sync", "--backup-workers", "1",
            "--steps", str(steps), "--batch-size", "16", "--num-workers", str(W), "--no-progress", "--torch-threads", "1"]
    procs = [
        subprocess.Popen([*base, "--worker-index", str(i), "--metrics-out", str(tmp_path / f"m{i}.jsonl"),
                          *(["--jitter-ms", "50"] if i == 2 else [])], stderr=subprocess.PIPE, text=True)
        for i in range(W)
    ]
    try:
        errs = [p.communicate(timeout=100)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * W, [e[-1500:] for e in errs]
    s = [_summary(tmp_path / f"m{i}.jsonl") for i in range(W)]
    assert all(x["final_clock"] == steps for x in s), s
    assert s[2]["late_pushes"] > 0, s[2]  # the straggler's gradients were dropped ...
    pushes = sum(s[2]["staleness_hist"].values())  # one entry per push (one shard), late ones included
    assert pushes < steps, s[2]  # ... and it skipped to the current step (steps counts clocks, skips too)
    st = subprocess.run([*CLI, "ps", "stats", "--ps", address, "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    (dense,) = [t for t in json.loads(st.stdout)[0]["tables"] if t["name"] == "digits/dense"]
    assert dense["version"] == steps, dense  # one mean applied per step, never one per gradient


# ---------------------------------------------------------------------- ps serve --forget-after / --max-lease
def _members(client: PSClient) -> dict[str, bool]:
    return {w.name: w.live for w in client.stats()[0].workers}


@pytest.mark.timeout(60)
def test_forget_after_forgets_a_dead_member_and_max_lease_caps_the_lease(proc_cluster) -> None:
    """Two shard processes. A: --lease 0.5 --max-lease 1 --forget-after 1; B: --lease 0.5 (forgets
    after the default 10 x 0.5 = 5 s). A worker joins A asking for a 30 s lease: it gets 1 s (it dies
    after 1 s, not 30), and is forgotten 1 s after that (before the default's 5 s could). Another
    joins B and leaves at once: listed as gone, then forgotten no sooner than 5 s later."""
    text = _readme()
    assert "`tessera ps serve --max-bytes --max-tables --max-workers --max-lease --forget-after` set them" in text
    assert "| `forget_after_s`: a dead member is forgotten after this long" in text and "| 10 x `lease_s` |" in text
    (a,) = proc_cluster(1, "--lease", "0.5", "--max-lease", "1", "--forget-after", "1")
    (b,) = proc_cluster(1, "--lease", "0.5")
    with PSClient([a], timeout=10, worker="wa") as ca, PSClient([b], timeout=10, worker="wb") as cb, \
            PSClient([a], timeout=10) as sa, PSClient([b], timeout=10) as sb:
        t0 = time.monotonic()
        ca.join(lease_s=30.0)
        cb.join()
        cb.leave()
        t_left_b = time.monotonic()
        assert _members(sb) == {"wb": False}  # gone, still remembered
        dead_a = forgot_a = forgot_b = None
        while forgot_b is None and time.monotonic() - t0 < 30:
            now, ma, mb = time.monotonic(), _members(sa), _members(sb)
            if dead_a is None and ma.get("wa") is False:
                dead_a = now
            if forgot_a is None and "wa" not in ma:
                forgot_a = now
            if "wb" not in mb:
                forgot_b = now
            time.sleep(0.05)
    assert dead_a is not None and forgot_a is not None and forgot_b is not None, (dead_a, forgot_a, forgot_b)
    assert 1.0 <= dead_a - t0 < 10, dead_a - t0  # the 30 s lease asked for was capped at --max-lease 1
    assert forgot_a - t0 >= 1.0 + 1.0  # dead after its 1 s lease, forgotten --forget-after 1 s later
    assert forgot_a - t0 < 1.0 + 5.0, forgot_a - t0  # sooner than the default (10 x --lease) would
    assert forgot_b - t_left_b >= 5.0 - 0.05, forgot_b - t_left_b  # the default: 10 x --lease 0.5


# ---------------------------------------------------------------------- ps serve --metrics-port
@pytest.mark.timeout(60)
def test_ps_serve_metrics_port_serves_prometheus_text(procs) -> None:
    """README (Watch metrics): `--metrics-port PORT` on `ps serve` serves Prometheus text at /metrics:
    the runtime's `tessera_rpc_requests_total{server,method,code}` and the shard's `tessera_ps_*`
    figures (`tessera_ps_table_version`, `tessera_ps_sync_clock`). Checked by scraping a shard process
    after a table was created and pushed to twice: the pushes counted and the version are the calls made."""
    import socket
    import urllib.request

    import numpy as np

    text = _readme()
    assert "`--metrics-port PORT` (0: off) on `ps serve`, `worker`, `peer` (port + local rank) and `fed server` serves Prometheus text at `/metrics`" in text
    with socket.socket() as s:  # a free port (the shard binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from ps.cli import read_first_line

    shard = subprocess.Popen([*CLI, "ps", "serve", "--port", "0", "--metrics-port", str(port)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    procs.append(shard)
    said = [read_first_line(shard, time.monotonic() + 30) for _ in range(2)]  # the metrics line, the listening line
    assert any(f"tessera-ps metrics on 127.0.0.1:{port}" in ln for ln in said), said
    address = next(ln.split("listening on ")[1].split()[0] for ln in said if "listening on" in ln)
    with PSClient([address], timeout=10) as c:
        c.create_dense("m", 8, "sgd", lr=0.1)
        c.push_dense("m", np.ones(8, np.float32))
        c.push_dense("m", np.ones(8, np.float32))
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
            break
        except OSError:
            assert time.monotonic() < deadline, f"no metrics endpoint on port {port}"
            time.sleep(0.2)
    lines = body.splitlines()

    def value(name: str, *labels: str) -> float:
        hits = [ln for ln in lines if ln.startswith(name + "{") and all(lb in ln for lb in labels)]
        assert hits, (name, labels, body[:2000])
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in hits)

    assert value("tessera_rpc_requests_total", 'method="PushDense"', 'code="OK"') == 2
    assert value("tessera_rpc_requests_total", 'method="CreateTable"', 'code="OK"') >= 1
    assert value("tessera_ps_table_version", 'table="m"') == 2
    assert any(ln.startswith("tessera_ps_sync_clock") for ln in lines), body[:2000]


def test_start_local_shards_finds_the_listening_line_after_the_metrics_line() -> None:
    """``ps.cli.start_local_shards`` (the quickstart's and the tests' helper) starts shards that print
    their metrics line first (``--metrics-port``) and still returns their addresses."""
    import socket

    from ps.cli import start_local_shards, stop_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started, addresses = start_local_shards(1, ("--metrics-port", str(port)))
    try:
        with PSClient(addresses, timeout=10) as c:
            c.create_dense("m", 4)
    finally:
        stop_processes(started)


# ---------------------------------------------------------------------- worker --ps-transport grpc
def _requests(server: str) -> float:
    """Calls this process's servers counted under ``server`` (tessera.metrics, Prometheus), every method and code."""
    from prometheus_client import REGISTRY

    return sum(
        s.value for m in REGISTRY.collect() if m.name == "tessera_rpc_requests"
        for s in m.samples if s.name == "tessera_rpc_requests_total" and s.labels.get("server") == server
    )


def test_worker_ps_transport_grpc_keeps_every_call_on_grpc(inproc_cluster) -> None:
    """README: `tessera worker --ps-transport grpc` keeps every call on gRPC. A `tessera worker` process
    (digits, 3 steps) against a shard in this process that serves both planes: with the flag, its calls
    are counted on the shard's gRPC server ("ps0") and none on its bulk port ("ps0-bulk"); the same run
    without the flag (auto, the control) sends its data calls to the bulk port."""
    cl = inproc_cluster(1, bulk_port=0)
    for transport, over_bulk in (("grpc", False), ("auto", True)):
        bulk0, grpc0 = _requests("ps0-bulk"), _requests("ps0")
        r = subprocess.run(
            [*CLI, "worker", "--ps", cl.addresses[0], "--task", "digits", "--steps", "3", "--batch-size", "16",
             "--no-progress", "--torch-threads", "1", "--ps-transport", transport, "--name", f"w-{transport}"],
            capture_output=True, text=True, timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        over = _requests("ps0-bulk") - bulk0, _requests("ps0") - grpc0
        assert over[1] > 0 and (over[0] > 0) == over_bulk, (transport, over)
