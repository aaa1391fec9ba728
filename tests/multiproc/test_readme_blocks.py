"""The README's shell blocks run as written (issue 17).

Every ```bash block of README.md is either run here by bash, in a fresh directory with the
installed `tessera` first on PATH, or listed in SKIP with the reason and the test that covers
what it shows. A new block that is in neither fails this test: run it or say why not.

What the run changes, and only this: the fixed ports 5000/5001 become free ports chosen at run
time (two test runs, or a user's own server, may hold 5000), and `--steps 5000` becomes
`--steps 30` (the point is that the commands work, not a long training run). Background jobs
a block leaves (its shards) are killed with its process group at the end.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")

# first line of the block (a prefix) -> why it is not run here, and where what it shows is tested
SKIP = {
    "sudo deploy/make-secrets.sh":
        "needs a Docker engine (none here); tests/cluster/test_compose_netns.py runs docker-compose.yml's services "
        "with these secrets in network namespaces",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && tessera demo":
        "installs into a fresh venv (downloads, minutes); `tessera demo` itself is tests/multiproc/test_demo.py",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]'":
        "runs the whole test suite, this test included (CI's .ci/run)",
    "# 2 ranks on this machine":
        "peer mode: 200 gpt steps on 2 ranks take minutes on 2 CPU cores (and torchrun); the peer-mode tests run "
        "`tessera peer` and the rank program",
    "# pipeline parallelism: the gpt task's layers in 2 stages":
        "200 gpt steps under torchrun take minutes on 2 CPU cores; tests/multiproc/test_pipeline_cli.py runs "
        "`tessera peer --pp 2 --schedule 1f1b --recompute` (and the start check), tests/unit/test_planner.py this "
        "`tessera plan` line",
    "# in the directory holding my_lm.py":
        "needs the README's my_lm.py beside it; tests/multiproc/test_readme_peer_user_model.py saves that block "
        "and runs these commands as written (3 steps), and compares the TP=2 x PP=2 one with one process",
    "tessera experiment consistency":
        "takes minutes even with --quick; the command runs in tests/multiproc/test_experiment.py",
    "# checkpoints: on request":
        "names hosts 10.0.0.1-10.0.0.4 and a placeholder ([--restore]); checkpoints, resharding and replication "
        "are tests/multiproc/test_ps_faults.py and tests/integration/test_ps_replication.py",
    "# everything goes into fed-demo/":
        "the federated quick start: run as written (30 rounds cut to 3) by the federated tests "
        "(tests/multiproc/test_readme_fed_*.py)",
    "tessera fed server --task my_task:make":
        "run as written by tests/multiproc/test_readme_fed_user_model.py",
    "sudo .venv/bin/python -m pytest -q --timeout 600 -p no:cacheprovider tests/cluster/test_compose_netns.py":
        "the no-Docker cluster check: that test file is part of the suite (as root, with iproute2), so running it "
        "again from here would run it twice",
    "tessera cert --out-dir pki --hosts ps0,ps1":
        "binds 10.0.0.1 (another machine) and ends in '...' placeholders; TLS, tokens and roles are "
        "tests/integration/test_ps_security.py, the CLI's TLS mistakes tests/multiproc/test_cli_tls.py",
}


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", open(README).read(), re.S)


def _skip_reason(block: str) -> str | None:
    first = block.strip().splitlines()[0]
    for prefix, why in SKIP.items():
        if first.startswith(prefix):
            return why
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _as_run(block: str) -> str:
    block = block.replace("--steps 5000", "--steps 30")
    p0, p1 = _free_ports(2)
    block = re.sub(r"\b5000\b", str(p0), block)
    return re.sub(r"\b5001\b", str(p1), block)


def _run(block: str, cwd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    p = subprocess.Popen(["bash", "-e", "-c", block], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever the block left running
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    blocks = _blocks()
    assert len(blocks) >= 5
    run = [b for b in blocks if _skip_reason(b) is None]
    assert run, "no README block is run"
    for b in run:
        assert any(k in b for k in ("tessera ps serve", "tessera ps stats", "tessera worker")), (
            f"a README block that is neither run by a test here nor in SKIP: add it to one\n{b}"
        )
    used = {prefix for prefix in SKIP for b in blocks if b.strip().splitlines()[0].startswith(prefix)}
    assert used == set(SKIP), f"SKIP names blocks the README no longer has: {set(SKIP) - used}"


@pytest.mark.timeout(300)
def test_training_with_workers_block(tmp_path) -> None:
    """Two shards in the background, worker 1 in the background, worker 0 in the foreground, then the shards stopped."""
    block = next(b for b in _blocks() if "tessera worker" in b and _skip_reason(b) is None)
    assert "$i" not in block  # a block pasted as is must not need a shell variable set first
    r = _run(_as_run(block), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    for w in (0, 1):
        records = [json.loads(line) for line in (tmp_path / f"metrics-w{w}.jsonl").read_text().splitlines()]
        summary = [x for x in records if x["kind"] == "summary"]
        assert summary and summary[-1]["final_clock"] >= 30, records[-1]
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_parameter_server_block(tmp_path) -> None:
    """Two shards in the background, `tessera ps stats` (it waits for them to come up), shards stopped."""
    block = next(b for b in _blocks() if "tessera ps stats" in b and _skip_reason(b) is None)
    r = _run(_as_run(block), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "shard 0/2" in r.stdout and "shard 1/2" in r.stdout, r.stdout
