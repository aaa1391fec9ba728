"""Primary-backup replication: the backup holds exactly what the primary acknowledged; when the
primary is gone the backup takes over and clients given both addresses carry on; a restarted node
rejoins as the backup of the new primary and catches up.

Reference: the primary's own state (values, optimizer state, versions, clocks) read from its
Shard object, and a single-shard cluster that received the same pushes without any failure."""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.consistency import SyncPolicy
from ps.errors import ShardUnavailableError
from ps.server import build_server
from ps.shard import BACKUP, PRIMARY, Shard

pytestmark = pytest.mark.timeout(120)


class Group:
    """One shard: a primary and its backup, both servers in this process."""

    def __init__(self, **cfg: object) -> None:
        self.cfg = dict(failover_s=1.0, **cfg)
        self.primary, self.pport, self.pshard = build_server(ShardConfig(**self.cfg))  # type: ignore[arg-type]
        self.paddr = f"127.0.0.1:{self.pport}"
        self.backup, self.bport, self.bshard = build_server(ShardConfig(backup_of=self.paddr, **self.cfg))  # type: ignore[arg-type]
        self.baddr = f"127.0.0.1:{self.bport}"
        self.extra: list[tuple[grpc.Server, Shard]] = []
        wait_for(lambda: self.pshard.backup == self.baddr and self.bshard.installed.is_set(), "backup attached")

    @property
    def spec(self) -> str:
        return f"{self.paddr}|{self.baddr}"

    def stop(self) -> None:
        for server, shard in [(self.primary, self.pshard), (self.backup, self.bshard), *self.extra]:
            server.stop(0)
            shard.close()


def wait_for(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.05)


@pytest.fixture
def group():
    made: list[Group] = []

    def make(**cfg: object) -> Group:
        g = Group(**cfg)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()


def _same_state(a: Shard, b: Shard) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.clocks == sb.clocks
    ta = {t["spec"]["name"]: t for t in sa.tables}
    tb = {t["spec"]["name"]: t for t in sb.tables}
    assert ta.keys() == tb.keys()
    for name in ta:
        x, y = ta[name], tb[name]
        for k in ("values", "ids", "versions"):
            if k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"{name}.{k}")
        for k in x["state"]:
            np.testing.assert_array_equal(x["state"][k], y["state"][k], err_msg=f"{name}.state.{k}")
        assert x.get("version") == y.get("version") and x.get("step") == y.get("step")


def _pushes(c: PSClient, steps: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 40, size=16)
        c.pull_sparse("emb", ids)
        c.push_sparse("emb", ids, rng.normal(size=(16, 4)).astype(np.float32))
        c.push_dense("w", rng.normal(size=12).astype(np.float32))


def _tables(c: PSClient) -> None:
    c.create_dense("w", 12, optimizer="adam", init="uniform", seed=1, lr=0.01)
    c.create_sparse("emb", 4, optimizer="adagrad", init="normal", seed=2, lr=0.1)


def test_backup_mirrors_every_acknowledged_update(group) -> None:
    g = group()
    with PSClient([g.spec], timeout=10, worker="w0") as c:
        _tables(c)
        _pushes(c, 10)
        # BSP rounds too (two workers; held contributions mirrored, the applied mean replicated)
        c2 = PSClient([g.spec], timeout=10, worker="w1")
        c.join(), c2.join()
        for step in range(3):
            for cl in (c, c2):
                cl.pull_dense("w", policy=SyncPolicy(clock=step, sync=True))
            c.push_dense("w", np.ones(12, np.float32), policy=SyncPolicy(clock=step, sync=True))
            assert g.bshard.rounds["w"].pending() == 1  # the held contribution is on the backup too
            c2.push_dense("w", np.zeros(12, np.float32), policy=SyncPolicy(clock=step, sync=True))
        c.pull_dense("w", policy=SyncPolicy(clock=3, sync=True))
        c2.close()
    _same_state(g.pshard, g.bshard)
    assert g.pshard.replicated > 0 and g.bshard.rounds["w"].clock == 3
    assert {"w0", "w1"} <= g.bshard.membership.live()


def test_a_backup_refuses_client_calls_and_names_its_primary(group) -> None:
    g = group()
    with PSClient([g.baddr], timeout=5, retry_timeout=0.5) as c:
        with pytest.raises(ShardUnavailableError) as e:
            c.create_dense("w", 4)
    assert "backup of" in str(e.value) and g.paddr in str(e.value)


def test_failover_loses_no_acknowledged_update(group) -> None:
    """Train against P|B; kill P; keep training against the same client: the result equals a
    single shard that received the same pushes (every acknowledged push applied exactly once)."""
    g = group()
    ref_server, ref_port, ref_shard = build_server(ShardConfig())
    try:
        with PSClient([g.spec], timeout=5, worker="w0") as c, PSClient([f"127.0.0.1:{ref_port}"], worker="w0") as ref:
            for cl in (c, ref):
                _tables(cl)
                _pushes(cl, 5, seed=1)
            g.primary.stop(0)  # the primary is gone (its port refuses connections)
            t0 = time.monotonic()
            _pushes(c, 5, seed=2)
            failover_s = time.monotonic() - t0
            _pushes(ref, 5, seed=2)
            assert g.bshard.role == PRIMARY and g.bshard.epoch == 1
            assert failover_s < 60  # within the client's retries: a deadline, not a speed check (bench/faults.py measures it)
            np.testing.assert_array_equal(c.pull_dense("w"), ref.pull_dense("w"))
            np.testing.assert_array_equal(c.pull_sparse("emb", np.arange(40)), ref.pull_sparse("emb", np.arange(40)))
            assert c._shards[0].failovers == 1
    finally:
        ref_server.stop(0)
        ref_shard.close()


def test_a_restarted_node_rejoins_as_backup_and_catches_up(group) -> None:
    g = group()
    with PSClient([g.spec], timeout=5, worker="w0") as c:
        _tables(c)
        _pushes(c, 3)
        g.primary.stop(0)
        g.pshard.close()
        _pushes(c, 3, seed=5)  # fails over to the backup
        assert g.bshard.role == PRIMARY
        # the old primary's host comes back, as the backup of the new primary
        server, port, shard = build_server(ShardConfig(backup_of=g.baddr, failover_s=1.0))
        g.extra.append((server, shard))
        wait_for(lambda: shard.installed.is_set() and g.bshard.backup == f"127.0.0.1:{port}", "rejoined as backup")
        assert shard.role == BACKUP
        _pushes(c, 3, seed=6)  # replicated to the new backup
        _same_state(g.bshard, shard)


def test_primary_that_lost_its_backup_waits_then_goes_on_alone(group) -> None:
    g = group(solo_after_s=1.5)
    with PSClient([g.paddr], timeout=5, retry_timeout=0.3) as c:
        _tables(c)
        g.backup.stop(0)
        g.bshard.close()
        with pytest.raises(ShardUnavailableError, match="did not take the update|backup was lost"):
            c.push_dense("w", np.ones(12, np.float32))
        before = c.pull_dense("w")  # reads go on
        with pytest.raises(ShardUnavailableError, match="backup was lost"):
            c.push_dense("w", np.ones(12, np.float32))
        np.testing.assert_array_equal(c.pull_dense("w"), before)  # nothing applied
        time.sleep(1.6)
        c.push_dense("w", np.ones(12, np.float32))  # alone now
        assert not np.array_equal(c.pull_dense("w"), before)
        assert c.stats()[0].backups_lost == 1


def test_concurrent_pushes_during_attach_are_all_on_the_backup(group) -> None:
    """A backup attaching while workers push: the snapshot and the forwarded stream together miss nothing."""
    g = group()
    g.backup.stop(0)
    g.bshard.close()
    errors: list[BaseException] = []
    stop = threading.Event()
    with PSClient([g.paddr], timeout=10, retry_timeout=20) as c:
        _tables(c)

        def pusher(seed: int) -> None:
            try:
                with PSClient([g.paddr], timeout=10, retry_timeout=30, worker=f"p{seed}") as cc:
                    while not stop.is_set():
                        _pushes(cc, 1, seed)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=pusher, args=(s,)) for s in range(2)]
        # the primary refuses writes until the backup is back (solo_after_s 10 s): attach a new one now
        server, port, shard = build_server(ShardConfig(backup_of=g.paddr, failover_s=1.0))
        g.extra.append((server, shard))
        for t in threads:
            t.start()
        wait_for(lambda: shard.installed.is_set(), "new backup attached")
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[0]
    _same_state(g.pshard, shard)


def test_backup_health_serving_only_once_attached(group) -> None:
    """README (cluster): a backup's gRPC health answers SERVING only once its primary has installed its
    state there, so compose's `service_healthy` on a backup waits for a usable replica. A backup whose
    primary is not there stays NOT_SERVING."""
    from tessera.health import check

    orphan, oport, oshard = build_server(ShardConfig(backup_of="127.0.0.1:1", failover_s=60.0))
    try:
        time.sleep(1.0)
        assert check(f"127.0.0.1:{oport}") == "NOT_SERVING"
        assert check(f"127.0.0.1:{oport}", "tessera.v1.ParameterServer") == "NOT_SERVING"
    finally:
        orphan.stop(0)
        oshard.close()
    g = group()  # waits until the backup is attached and installed
    wait_for(lambda: check(g.baddr) == "SERVING", "attached backup SERVING")
    assert check(g.paddr) == "SERVING"


def _serve_configs(monkeypatch, *flag_sets: tuple[str, ...]) -> list[ShardConfig]:
    """The ShardConfig `tessera ps serve FLAGS` runs its shard with, for each set of flags: the
    command's own parser and handler (ps.cli._serve), with ps.server.serve (which would run the
    shard until SIGTERM) replaced by one that keeps the config it is given."""
    from tessera.cli import build_parser

    got: list[ShardConfig] = []
    monkeypatch.setattr("ps.server.serve", lambda cfg, **kw: got.append(cfg))
    for flags in flag_sets:
        args = build_parser().parse_args(["ps", "serve", "--torch-threads", "0", *flags])
        assert args.func(args) == 0
    assert len(got) == len(flag_sets)
    return got


def test_ps_serve_solo_after_flag_reaches_the_shard_config_default_10(monkeypatch) -> None:
    """README (replication): a primary whose backup fails an update refuses writes for
    ``--solo-after`` seconds (default 10), then goes on alone. The going-on-alone is
    test_primary_that_lost_its_backup_waits_then_goes_on_alone (solo_after_s 1.5); this checks the
    flag: its default and ShardConfig's are 10, and what `tessera ps serve` is given (or not) is the
    ``solo_after_s`` the shard is built with. Reference: the README's figure and the value passed."""
    from tessera.cli import build_parser

    assert build_parser().parse_args(["ps", "serve"]).solo_after == 10.0
    assert ShardConfig().solo_after_s == 10.0
    default, given = _serve_configs(monkeypatch, (), ("--solo-after", "3.5"))
    assert default.solo_after_s == 10.0 and given.solo_after_s == 3.5


def test_ps_serve_failover_flag_reaches_the_shard_config_default_2(monkeypatch) -> None:
    """README (replication): when the primary has been unreachable for ``--failover`` seconds
    (default 2) an in-sync backup takes over. The takeover is test_failover_loses_no_acknowledged_update
    (failover_s 1); this checks the flag: its default and ShardConfig's are 2, and what `tessera ps
    serve --backup-of P` is given (or not) is the ``failover_s`` the backup is built with."""
    from tessera.cli import build_parser

    assert build_parser().parse_args(["ps", "serve"]).failover == 2.0
    assert ShardConfig().failover_s == 2.0
    default, given = _serve_configs(monkeypatch, ("--backup-of", "127.0.0.1:1"), ("--backup-of", "127.0.0.1:1", "--failover", "0.7"))
    assert default.failover_s == 2.0 and given.failover_s == 0.7
    assert default.backup_of == given.backup_of == "127.0.0.1:1"
