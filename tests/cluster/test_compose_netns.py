"""docker-compose.yml run for real without Docker (issue 14, item 4): each service of a profile in a
network namespace of its own (``compose_netns.ComposeRun``), with the file's commands, ports, host
names, variables, secrets (made by deploy/make-secrets.sh: mutual TLS and tokens), health checks
and depends_on. Short runs: the variables of .env are overridden with few steps and rounds.

* default profile: 2 shards each with a backup, 2 ctr workers, the report one-shot: the workers
  finish, every shard (and backup) answered SERVING, each metrics endpoint shows the documented
  names with non-zero values, the report prints both shards' stats; stopped and started again with
  more steps, the shards restore their checkpoints and training goes on from the restored tables;
* the same with shard0's primary killed mid-run (namespace's processes SIGKILLed, link down): the
  workers finish through the backup (``shard0-backup`` is primary afterwards);
* ``federated``: the server finishes its rounds with all 3 clients;
* ``peer``: 2 ranks (torchrun c10d rendezvous at ``peer0:29400`` across namespaces) train gpt and
  the loss goes down.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from compose_netns import ROOT, ComposeRun, make_secrets

from tessera.metrics import FED_METRICS, RPC_METRICS, SHARD_METRICS, TRAINER_METRICS
from worker.netns import namespaces_available

pytestmark = pytest.mark.skipif(bool(namespaces_available()), reason=f"network namespaces: {namespaces_available()}")

COMPOSE = ROOT / "docker-compose.yml"
SHARDS = ("shard0", "shard0-backup", "shard1", "shard1-backup")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("secrets")
    make_secrets(out)
    return out


def _values(text: str, name: str) -> list[float]:
    """Values of the samples of ``name`` (a histogram: its _count) in a Prometheus text page."""
    pat = re.compile(rf"^{re.escape(name)}(?:_count)?(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return [float(v) for v in pat.findall(text)]


def _assert_metrics(text: str, names: tuple[str, ...], who: str, nonzero: tuple[str, ...]) -> None:
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)), f"{who}: a metric family twice (Prometheus refuses the page)"
    for n in names:
        assert f"# HELP {n.removesuffix('_total')}" in text or f"# HELP {n}" in text, f"{who}: {n} missing"
    for n in nonzero:
        assert any(v > 0 for v in _values(text, n)), f"{who}: {n} has no non-zero sample"


def _scrape_until(run: ComposeRun, name: str, metric: str, at_least: float, timeout: float) -> str:
    """Scrape ``name`` until a sample of ``metric`` reaches ``at_least`` (the endpoint may not be up yet)."""
    deadline = time.monotonic() + timeout
    page = ""
    while time.monotonic() < deadline:
        try:
            page = run.scrape(name)
            if any(v >= at_least for v in _values(page, metric)):
                return page
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{name}: {metric} did not reach {at_least} in {timeout:.0f} s; log:\n{run.tail(name)}\n{page[-2000:]}")


def _env(secrets: Path, **kw: str) -> dict[str, str]:
    return {"SECRETS_DIR": str(secrets), "CHECKPOINT_EVERY": "5", "LEASE": "6", "FAILOVER": "2", "SOLO_AFTER": "3",
            "PS_MODE": "ssp", "BATCH_SIZE": "64", "CTR_TEST_SIZE": "500", "WORKER_DEVICE": "cpu", "RETRY_TIMEOUT": "60",
            **kw}


def _run_default(secrets: Path, tmp_path: Path, steps: int, kill_primary: bool) -> None:
    with ComposeRun(COMPOSE, (), _env(secrets, STEPS=str(steps)), tmp_path) as run:
        run.up(timeout=150, only=(*SHARDS, "worker0", "worker1"))
        for s in SHARDS:
            assert any("SERVING" in h for h in run.services[s].health_checks), (s, run.services[s].health_checks)
        if kill_primary:
            _scrape_until(run, "shard0", "tessera_ps_worker_clock", 5, 150)  # training is under way: kill shard0
            run.kill("shard0")
        else:
            for w in ("worker0", "worker1"):  # a scrape of each worker's endpoint while it trains
                page = _scrape_until(run, w, "tessera_train_steps", 1, 150)
                _assert_metrics(page, TRAINER_METRICS, w, ("tessera_train_steps", "tessera_train_examples_per_second"))
        for w in ("worker0", "worker1"):
            assert run.wait_exit(w, 240) == 0, run.tail(w)
        run.up(timeout=60, only=("report",))
        assert run.wait_exit("report", 60) == 0, run.tail("report")
        report = run.tail("report", 200)
        assert "shard 0/2" in report and "shard 1/2" in report, report
        live = [s for s in SHARDS if not (kill_primary and s == "shard0")]
        for s in live:
            page = run.scrape(s)
            _assert_metrics(page, RPC_METRICS + SHARD_METRICS, s, ("tessera_rpc_requests_total", "tessera_rpc_latency_seconds",
                                                                  "tessera_rpc_received_bytes_total", "tessera_ps_up_seconds"))
        for s in ("shard0", "shard1") if not kill_primary else ("shard1",):
            page = run.scrape(s)
            for n in ("tessera_ps_table_version", "tessera_ps_replicated_total", "tessera_ps_sent_bytes_total",
                      "tessera_ps_worker_clock", "tessera_ps_has_backup"):
                assert any(v > 0 for v in _values(page, n)), (s, n)
        if kill_primary:
            page = run.scrape("shard0-backup")
            assert _values(page, "tessera_ps_is_primary") == [1.0], "the backup did not take over"
            assert any(v >= steps for v in _values(page, "tessera_ps_worker_clock")), "training did not finish on the backup"
        assert list((tmp_path / "volumes" / "shard1-ckpt").iterdir()), "no checkpoint in shard1's volume"


@pytest.mark.timeout(300)
def test_default_profile_trains_with_health_metrics_and_report_then_restores(secrets: Path, tmp_path: Path) -> None:
    _run_default(secrets, tmp_path, steps=40, kill_primary=False)
    # `docker compose down` (SIGTERM: final checkpoints into the volumes), then `up` again with
    # STEPS=60: the primaries restore their tables (40 steps x 2 workers = 80 dense updates) and the
    # workers continue the run from the shards' clock (README, Restarting): steps 40-59, 40 updates more
    with ComposeRun(COMPOSE, (), _env(secrets, STEPS="60"), tmp_path) as run:
        run.up(timeout=150, only=(*SHARDS, "worker0", "worker1"))
        for w in ("worker0", "worker1"):
            assert run.wait_exit(w, 200) == 0, run.tail(w)
        page = run.scrape("shard0")
        dense = re.search(r'^tessera_ps_table_version\{[^}]*table="ctr/dense"[^}]*\} (\S+)$', page, re.MULTILINE)
        assert dense and float(dense.group(1)) == 80 + 2 * 20, page[-3000:]  # not 40: the tables were restored
        assert "restored" in run.tail("shard0", 50), run.tail("shard0")
        assert _values(page, "tessera_ps_has_backup") == [1.0]  # shard0-backup re-attached


@pytest.mark.timeout(300)
def test_default_profile_survives_a_killed_primary_shard(secrets: Path, tmp_path: Path) -> None:
    _run_default(secrets, tmp_path, steps=60, kill_primary=True)


@pytest.mark.timeout(300)
def test_federated_profile_finishes_its_rounds(secrets: Path, tmp_path: Path) -> None:
    fed = ("fed-server", "fed-client0", "fed-client1", "fed-client2")
    with ComposeRun(COMPOSE, ("federated",), _env(secrets, FED_ROUNDS="12", FED_WAIT_TIMEOUT="120"), tmp_path) as run:
        run.up(timeout=120, only=fed)
        assert any("SERVING" in h for h in run.services["fed-server"].health_checks)
        deadline = time.monotonic() + 120
        page = ""
        server = run.services["fed-server"].proc
        while time.monotonic() < deadline:  # the server exits after its last round: scrape while it runs
            try:
                page = run.scrape("fed-server")
            except OSError:
                if server is None or server.poll() is not None:
                    break
                # (a scrape that failed, e.g. slower than its 5 s on a loaded machine, while the server runs: again)
            else:
                if any(v >= 1 for v in _values(page, "tessera_fed_rounds_total")):
                    break
            time.sleep(0.1)
        _assert_metrics(page, RPC_METRICS + FED_METRICS, "fed-server",
                        ("tessera_fed_rounds_total", "tessera_fed_last_round_seconds", "tessera_fed_received_bytes_total",
                         "tessera_rpc_requests_total"))
        assert run.wait_exit("fed-server", 180) == 0, run.tail("fed-server")
        for c in fed[1:]:
            assert run.wait_exit(c, 60) == 0, run.tail(c)
        results = json.loads((tmp_path / "volumes" / "fed-data" / "results.json").read_text())
        assert len(results["history"]) == 12 and results["failed"] is None
        assert all(r["answered"] == 3 for r in results["history"]), results["history"]


@pytest.mark.timeout(300)
def test_peer_profile_loss_goes_down(secrets: Path, tmp_path: Path) -> None:
    env = _env(secrets, PEER_STEPS="30", PEER_GLOBAL_BATCH="16", PEER_LOG_EVERY="5")
    with ComposeRun(COMPOSE, ("peer",), env, tmp_path) as run:
        run.up(timeout=60, only=("peer0", "peer1"))
        for p in ("peer0", "peer1"):  # each rank's endpoint while it trains
            page = _scrape_until(run, p, "tessera_train_steps", 5, 200)
            _assert_metrics(page, TRAINER_METRICS, p, ("tessera_train_steps", "tessera_train_examples_per_second",
                                                       "tessera_train_loss"))
        for p in ("peer0", "peer1"):
            assert run.wait_exit(p, 240) == 0, run.tail(p)
        recs = [json.loads(x) for x in (tmp_path / "volumes" / "peer-metrics" / "rank0.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in recs if r.get("kind") == "step"]
        assert len(losses) >= 4 and losses[-1] < losses[0] * 0.9, losses
        assert (tmp_path / "volumes" / "peer-metrics" / "rank1.jsonl").exists()
        assert '"world": 2' in run.tail("peer0", 100), run.tail("peer0")
