"""`tessera experiment consistency` end to end on a tiny config: real shard and worker processes.

One shard per mode: the harness starts and stops a cluster per mode whatever its size, and what
is checked is the harness (modes, series, summaries, files, Ctrl-C leaving no process), so each
mode starts one shard process, not two."""
from __future__ import annotations

import json
import subprocess
import sys


def test_experiment_harness_writes_every_mode(tmp_path) -> None:
    out = tmp_path / "exp"
    cmd = [
        sys.executable, "-m", "tessera.cli", "experiment", "consistency", "--task", "digits", "--workers", "2",
        "--shards", "1", "--modes", "sync,ssp:2", "--staleness-aware-lr", "both", "--steps", "40",
        "--batch-size", "16", "--eval-every", "10", "--straggler", "1x2", "--jitter", "1", "--seed", "3",
        "--out", str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in ("results.json", "summary.md", "metric_vs_time.png", "metric_vs_updates.png", "staleness.png"):
        assert (out / name).stat().st_size > 0, name
    r = json.loads((out / "results.json").read_text())
    assert r["complete"] and r["metric"] == "accuracy"
    assert list(r["modes"]) == ["sync", "ssp:2", "ssp:2+salr"]  # staleness-aware lr is a grid factor
    s = r["settings"]
    assert (s["seed"], s["straggler"], s["jitter_ms"], s["steps"], s["workers"]) == (3, "1x2", 1.0, 40, 2)
    assert r["target"] is not None
    for label, m in r["modes"].items():
        series = m["series"]
        assert len(series) >= 4, label  # evaluations at steps 10, 20, 30, 40 (+ final)
        times = [p["time_s"] for p in series]
        assert times == sorted(times) and times[0] >= 0, label
        assert [p["step"] for p in series] == sorted(p["step"] for p in series)
        sm = m["summary"]
        assert sm["workers_finished"] == 2 and sm["examples_per_s"] > 0
        assert sm["time_to_target_s"] is not None, label  # the default target is reached by every mode
    assert r["modes"]["sync"]["summary"]["max_staleness"] == 0
    assert "| ssp:2+salr |" in (out / "summary.md").read_text()


def test_ctrl_c_stops_every_process_and_keeps_partial_results(tmp_path) -> None:
    import os
    import signal
    import time

    out = tmp_path / "exp"
    cmd = [
        sys.executable, "-m", "tessera.cli", "experiment", "consistency", "--task", "digits", "--workers", "2",
        "--shards", "1", "--modes", "sync,async", "--steps", "30", "--batch-size", "16", "--eval-every", "10",
        "--out", str(out),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not (out / "async-w1.jsonl").exists():  # the first mode is done, the second under way
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else "timeout"
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130
    r = json.loads((out / "results.json").read_text())
    assert not r["complete"]
    assert r["modes"]["sync"]["complete"] and r["modes"]["sync"]["series"]
    assert not r["modes"]["async"]["complete"]
    assert "| async | (interrupted) |" in (out / "summary.md").read_text()
    deadline = time.monotonic() + 15
    while True:  # no process of the experiment is left
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes left behind"
        time.sleep(0.2)
