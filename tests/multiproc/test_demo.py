"""`tessera demo` (the README's main command): trains, reports AUC against the best achievable, writes
its files, and leaves no process behind, also when interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _group_gone(pgid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _demo(out, seconds: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "demo", "--seconds", seconds, "--out", str(out), "--device", "cpu",
         "--batch-size", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def test_demo_trains_reports_and_cleans_up(tmp_path) -> None:
    out = tmp_path / "demo"
    p = _demo(out, "8")
    try:
        stdout, stderr = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, stderr[-3000:]
    assert "final test auc:" in stdout and "best achievable" in stdout, stdout
    for name in ("results.json", "training.png", "metrics-w0.jsonl", "metrics-w1.jsonl"):
        assert (out / name).stat().st_size > 0, name
    r = json.loads((out / "results.json").read_text())
    assert 0.5 < r["final"]["auc"] <= r["best_achievable"] < 1
    assert _group_gone(p.pid), "processes left behind"


def test_demo_ctrl_c_stops_every_process(tmp_path) -> None:
    p = _demo(tmp_path / "demo", "120")
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "demo" / "metrics-w1.jsonl").exists():  # workers are up and training
            assert time.monotonic() < deadline and p.poll() is None, "demo did not start"
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130
    assert _group_gone(p.pid), "processes left behind after Ctrl-C"
