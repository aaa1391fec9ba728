"""Reads are reads (issue 30, items 2 and 3): what a ``reader`` token (and any pull) can do to a shard.

Each attack is played against a real shard (``build_server`` on 127.0.0.1:0, TLS, bearer tokens
from a token file) with a reader token, and the shard's state read back afterwards must equal
the state before: rows, ids, values, optimizer state, versions, last touch (the LRU/TTL order),
admission counts, residency (resident or on disk), eviction epoch and counters, table steps,
row counts and held bytes, BSP clocks and held contributions, membership (names, liveness,
clocks, lease times) and worker-name bindings (``_state``). Then the behaviour the attack used
to break is checked from outside: the trained rows survive a worker's push of new ids, a worker
can still push new rows under the byte budget, the real worker can join under the name the
reader used, a BSP round is not held by a reader pulling with a dead worker's name. Worker names
pinned in the token file (``workers=``) cannot be taken by another token before their worker
starts.

Reference for the values: the rows a worker trained (read back by the admin before the attack),
and for a new id pulled then pushed, SGD by hand from the initializer (``init_rows``)."""
from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from ps.client import PSClient
from ps.config import EvictionSpec, ShardConfig
from ps.consistency import SyncPolicy
from ps.errors import PermissionDeniedError
from ps.initializers import init_rows, table_key
from ps.server import build_server
from ps.shard import Shard
from ps.table import DenseTable, SparseTable
from ps.wire import frame, unframe
from tessera.service import ClientSecurity, ServerSecurity, client_channel, issue_cert, make_ca, write_token_file
from tessera.v1 import ps_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SVC = "/tessera.v1.ParameterServer/"
TOKENS = {"admin": "a" * 32, "w0": "b" * 32, "w1": "c" * 32, "reader": "d" * 32, "early": "e" * 32, "gpus": "f" * 32}
ROLES = {"admin": ["admin"], "w0": ["worker"], "w1": ["worker"], "reader": ["reader"], "early": ["worker"], "gpus": ["worker"]}
PINS = {"w0": ["w0"], "gpus": ["gpu-*"]}  # w0 may use only "w0"; "gpus" every name starting with "gpu-"
DIM = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("reads")
    ca_cert, ca_key = make_ca()
    (d / "ca.crt").write_bytes(ca_cert)
    cert, key = issue_cert(ca_cert, ca_key, "server", ["127.0.0.1", "localhost"])
    (d / "server.crt").write_bytes(cert)
    (d / "server.key").write_bytes(key)
    write_token_file(str(d / "tokens.txt"), TOKENS, ROLES, workers=PINS)
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key"), "tokens": str(d / "tokens.txt")}


@pytest.fixture
def serve(files):
    """serve(**ShardConfig fields) -> (address, shard): a TLS + token shard built from the token file."""
    made: list[tuple[Any, Shard]] = []

    def make(**cfg: Any) -> tuple[str, Shard]:
        sec = ServerSecurity.from_files(files["cert"], files["key"], token_file=files["tokens"])
        server, port, sh = build_server(ShardConfig(**cfg), security=sec)
        made.append((server, sh))
        return f"127.0.0.1:{port}", sh

    yield make
    for server, sh in made:
        server.stop(0)
        sh.close()


def _client(files, address: str, identity: str, worker: str = "", **kw: Any) -> PSClient:
    kw.setdefault("timeout", 10)
    sec = ClientSecurity(tls_ca=files["ca"], token=TOKENS[identity])
    return PSClient([address], retry_timeout=0.2, security=sec, worker=worker, **kw)


def _raw(files, address: str, identity: str) -> grpc.Channel:
    return client_channel(address, ClientSecurity(tls_ca=files["ca"], token=TOKENS[identity]))


def _pull_sparse(ch: grpc.Channel, table: str, ids: np.ndarray, worker: str = "", **sync: Any) -> tuple[Any, np.ndarray]:
    """A raw PullSparse: (reply head, rows as float32 (n, dim))."""
    head = pb.PullSparseRequest(table=table, dtype="float32", worker=worker)
    if sync:
        head.sync.CopyFrom(pb.SyncSpec(**sync))
    raw = ch.unary_unary(SVC + "PullSparse")(frame(head, ids=np.asarray(ids, np.int64)), timeout=30)
    msg, pl = unframe(pb.PullSparseReply, raw)
    return msg, np.frombuffer(pl["data"], np.float32).reshape(len(ids), msg.dim)


def _pull_dense(ch: grpc.Channel, table: str, worker: str = "") -> list:
    return list(ch.unary_stream(SVC + "PullDense")(pb.PullDenseRequest(table=table, worker=worker).SerializeToString(), timeout=30))


# ------------------------------------------------------------------------------------------ state
def _sparse_state(t: SparseTable) -> dict[str, Any]:
    with t.lock:
        ids, loc = t._index.items()
        order = np.argsort(ids)
        ids, loc = ids[order], loc[order]
        cols = ["values", "version", "touch", "admits", *t._state_names]
        d = {k: v.numpy().tobytes() for k, v in t._gather(loc, cols).items()} if len(ids) else {}
        return {
            "ids": ids.tobytes(), "resident": (loc >= 0).tobytes(), "cols": d, "rows": t.rows, "step": t.step,
            "updates": t.updates, "evicted": t.evicted, "dropped": t.dropped, "epoch": t.eviction_epoch,
            "demoted": t.demoted, "promoted": t.promoted, "held": t.held_bytes(),
            "sketch": t._seen.counters.tobytes() if t._seen is not None else b"",
            "staleness": (t.staleness.count, t.staleness.max),
        }


def _state(sh: Shard) -> dict[str, Any]:
    """Everything a read could change, read straight from the shard (as the admin's Stats, pulls and
    checkpoints see it, and more: last touch, admission counts, residency, bindings)."""
    out: dict[str, Any] = {}
    for name, t in sorted(sh.tables.items()):
        if isinstance(t, DenseTable):
            out[name] = {"values": t.values().tobytes(), "version": t.version, "held": t.held_bytes()}
        else:
            out[name] = _sparse_state(t)
        r = sh.rounds[name]
        out[name]["round"] = (r.clock, sorted(r._pending), r.late)
    out["members"] = sorted((w.name, w.live, w.clock, w.lease_s, w.last_seen, w.left_at) for w in sh.membership.workers())
    out["bindings"] = sh.names.bindings()
    out["held"] = sh.held_bytes()
    return out


# ------------------------------------------------------------------------------------------ attacks
def test_reader_pulls_of_new_ids_evict_no_trained_row_and_touch_no_lru_order(serve, files) -> None:
    """max_rows=64, every row trained: a reader pulls 64 new ids twice, the trained rows again, and
    names worker w0 in its pulls. Nothing in the shard changes; the worker's next push of one new id
    evicts the row the *worker* used least recently (row 0), not the one the reader read last."""
    address, sh = serve()
    with _client(files, address, "admin") as admin, _client(files, address, "w0", worker="w0") as w0:
        admin.create_sparse("emb", DIM, "sgd", lr=0.5, init="uniform", seed=3, eviction=EvictionSpec(max_rows=64))
        w0.join()
        for i in range(64):  # row i last pushed at step i: row 0 is the least recently used
            w0.push_sparse("emb", np.array([i]), np.ones((1, DIM), np.float32))
        trained, vers = admin.pull_sparse("emb", np.arange(64), return_versions=True)
        assert (vers == 1).all()
        before = _state(sh)
        ch = _raw(files, address, "reader")
        try:
            for _ in range(2):
                _pull_sparse(ch, "emb", np.arange(1000, 1064), worker="w0")
            for _ in range(3):
                _pull_sparse(ch, "emb", np.array([0]), worker="w0")  # a pull that refreshed LRU would save row 0
            _, rows = _pull_sparse(ch, "emb", np.arange(64))
            np.testing.assert_array_equal(rows, trained)  # the reader reads what the worker trained
        finally:
            ch.close()
        assert _state(sh) == before
        again, vers = admin.pull_sparse("emb", np.arange(64), return_versions=True)
        np.testing.assert_array_equal(again, trained)
        assert (vers == 1).all() and sh.sparse("emb").evicted == 0
        w0.push_sparse("emb", np.array([5000]), np.ones((1, DIM), np.float32))
        assert 0 not in {i for i, _ in sh.sparse("emb").items()} and sh.sparse("emb").evicted == 1
        _, vers = admin.pull_sparse("emb", np.arange(64), return_versions=True)
        assert vers[0] == 0 and (vers[1:] == 1).all()


def test_reader_pulls_of_200k_new_ids_leave_the_budget_to_the_workers(serve, files) -> None:
    """A 4 MiB byte budget, about 45,000 rows of dim 4: a reader pulls 200,000 new ids (every pull
    answered with the initializer's values, nothing stored), then a worker's pull and push of 100 new
    ids succeed and create exactly those rows. Reference: SGD from init_rows by hand."""
    address, sh = serve(max_bytes=4 << 20)
    with _client(files, address, "admin") as admin, _client(files, address, "w1", worker="w1") as w1:
        admin.create_sparse("emb", DIM, "sgd", lr=0.25, init="uniform", seed=9)
        before = _state(sh)
        ch = _raw(files, address, "reader")
        try:
            key = table_key("emb", 9)
            for a in range(0, 200_000, 50_000):
                ids = np.arange(a, a + 50_000, dtype=np.int64) * 7 + 1
                _, rows = _pull_sparse(ch, "emb", ids)
                np.testing.assert_array_equal(rows[:50], init_rows(sh.sparse("emb").spec.initializer, key, ids[:50], DIM))
        finally:
            ch.close()
        assert _state(sh) == before and sh.sparse("emb").rows == 0
        rows = admin.pull_sparse("emb", np.arange(10, dtype=np.int64) * 7 + 1)
        np.testing.assert_array_equal(rows, init_rows(sh.sparse("emb").spec.initializer, key, np.arange(10) * 7 + 1, DIM))
        new = np.arange(10**9, 10**9 + 100, dtype=np.int64)
        start = w1.pull_sparse("emb", new)
        g = np.random.default_rng(0).standard_normal((100, DIM)).astype(np.float32)
        w1.push_sparse("emb", new, g)
        assert sh.sparse("emb").rows == 100
        np.testing.assert_allclose(admin.pull_sparse("emb", new), start - 0.25 * g, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(start, init_rows(sh.sparse("emb").spec.initializer, key, new, DIM))


def test_a_reader_naming_a_worker_binds_nothing_and_the_real_worker_joins(serve, files) -> None:
    """Reader pulls (sparse, dense, conditional, BSP-waiting) naming w9: w9 is neither a member nor
    bound; then the real worker (identity w1, no pins) joins as w9."""
    address, sh = serve()
    with _client(files, address, "admin") as admin:
        admin.create_sparse("emb", DIM, "sgd")
        admin.create_dense("w", 8, lr=1.0)
        before = _state(sh)
        ch = _raw(files, address, "reader")
        try:
            _pull_sparse(ch, "emb", np.arange(8), worker="w9")
            _pull_sparse(ch, "emb", np.arange(8), worker="w9", clock=0, sync=True)
            _pull_dense(ch, "w", worker="w9")
            head = pb.PullSparseRequest(table="emb", dtype="float32", worker="w9", known_epoch=1)
            ch.unary_unary(SVC + "PullSparse")(frame(head, known_versions=np.zeros(3, np.int64), ids=np.arange(3, dtype=np.int64)), timeout=10)
        finally:
            ch.close()
        assert _state(sh) == before
        assert "w9" not in {w.name for w in sh.membership.workers()} and sh.names.bindings() == {}
    with _client(files, address, "w1", worker="w9") as real:
        real.join()
        assert "w9" in sh.membership.live() and sh.names.bindings() == {"w9": "w1"}


def test_a_workers_pull_of_an_unknown_name_joins_nothing(serve, files) -> None:
    """Pulls are reads for workers too: a worker token's pull naming a name nobody joined adds no
    member and binds nothing; its Join does both; afterwards its pulls renew that live name's lease."""
    address, sh = serve()
    with _client(files, address, "admin") as admin:
        admin.create_sparse("emb", DIM, "sgd")
    with _client(files, address, "w1", worker="w5") as w:
        before = _state(sh)
        w.pull_sparse("emb", np.arange(4))
        assert _state(sh) == before
        w.join()
        assert "w5" in sh.membership.live() and sh.names.bindings() == {"w5": "w1"}
        seen = next(m.last_seen for m in sh.membership.workers() if m.name == "w5")
        time.sleep(0.05)
        w.pull_sparse("emb", np.arange(4))  # its own live name: the pull renews its lease
        assert next(m.last_seen for m in sh.membership.workers() if m.name == "w5") > seen


def test_bsp_rounds_are_not_held_by_a_reader_pulling_with_a_dead_workers_name(serve, files) -> None:
    """lease 1 s, two workers in a BSP run; w1 stops after joining. A reader pulls every 0.25 s (a
    quarter of the lease) naming ``ghost`` (a name nobody joined) and w1: no ghost member appears,
    w1's lease still runs out, and w0's round completes without it (before this fix the reader's
    first pull made ``ghost`` a live member bound to the reader, and each later one renewed its
    lease: the round waited forever). Reference: w0's gradient alone applied (SGD, lr 1: w = -g)."""
    address, sh = serve(lease_s=1.0, max_lease_s=1.0)
    stop = threading.Event()
    with _client(files, address, "admin") as admin, _client(files, address, "w0", worker="w0") as w0, \
            _client(files, address, "w1", worker="w1") as w1:
        admin.create_dense("w", 8, lr=1.0)
        w0.join(lease_s=1.0)
        w1.join(lease_s=1.0)  # ... and never pushes, pulls nor heartbeats again
        ch = _raw(files, address, "reader")
        pulls = [0]
        refused: list = []

        def reader() -> None:
            while not stop.wait(0.25):
                for name in ("ghost", "w1"):
                    try:
                        _pull_dense(ch, "w", worker=name)
                        pulls[0] += 1
                    except grpc.RpcError as e:  # (the code before this fix refused "w1": another's name)
                        refused.append(e.code())

        def heartbeats() -> None:  # w0 stays alive while it waits (as ParamSync's heartbeat thread does)
            while not stop.wait(0.2):
                w0.heartbeat()

        th = threading.Thread(target=reader, daemon=True)
        beat = threading.Thread(target=heartbeats, daemon=True)
        th.start()
        beat.start()
        try:
            g = np.arange(8, dtype=np.float32)
            w0.push_dense("w", g, policy=SyncPolicy(clock=0, sync=True))
            t0 = time.monotonic()
            vals = w0.pull_dense("w", policy=SyncPolicy(clock=1, sync=True))
            np.testing.assert_array_equal(vals, -g)
            assert time.monotonic() - t0 < 30  # (a deadline, not a speed check: the pull had 30 s)
            assert pulls[0] >= 4 and not refused, "the reader did not pull while the round waited"
            assert sh.membership.live() == {"w0"} and sh.rounds["w"].clock == 1
            assert {w.name for w in sh.membership.workers()} == {"w0", "w1"} and sh.names.bindings() == {"w1": "w1"}
        finally:
            stop.set()
            th.join(5)
            beat.join(5)
            ch.close()


def test_pinned_names_cannot_be_claimed_before_their_worker_starts(serve, files) -> None:
    """The token file pins w0 to identity w0 and gpu-* to identity gpus: another worker token ("early",
    no pins) is refused every write and join under those names before their workers start (state
    unchanged), unpinned names stay first come, and the pinned identities join as their names."""
    address, sh = serve()
    with _client(files, address, "admin") as admin:
        admin.create_sparse("emb", DIM, "sgd")
    before = _state(sh)
    for name in ("w0", "gpu-0", "gpu-17"):
        with _client(files, address, "early", worker=name) as early:
            with pytest.raises(PermissionDeniedError, match=f"'{name}' is pinned to identity"):
                early.join()
            with pytest.raises(PermissionDeniedError, match="pinned"):
                early.push_sparse("emb", np.arange(2), np.ones((2, DIM), np.float32))
            with pytest.raises(PermissionDeniedError, match="pinned"):
                early.heartbeat()
    assert _state(sh) == before
    with _client(files, address, "w0", worker="w0") as w0, _client(files, address, "gpus", worker="gpu-17") as g17:
        w0.join()
        g17.join()
    with _client(files, address, "w0", worker="w3") as wrong, pytest.raises(PermissionDeniedError, match="may use only"):
        wrong.join()  # an identity with pins may use only its pinned names
    with _client(files, address, "early", worker="w3") as e3:
        e3.join()  # unpinned name, identity without pins: first come
    assert sh.membership.live() == {"w0", "gpu-17", "w3"} and sh.names.bindings() == {"w3": "early"}


def test_reader_pulls_of_cold_rows_bring_nothing_back(serve, files, tmp_path) -> None:
    """A disk tier (resident budget of ~200 rows, 1000 rows trained): a reader pulling cold rows reads
    them where they lie (same values as the admin reads) and moves nothing between the tiers."""
    address, sh = serve(max_resident_bytes=200 * 90, spill_dir=str(tmp_path))
    with _client(files, address, "admin") as admin, _client(files, address, "w0", worker="w0") as w0:
        admin.create_sparse("emb", DIM, "sgd", lr=0.5, init="uniform")
        for a in range(0, 1000, 100):
            w0.push_sparse("emb", np.arange(a, a + 100), np.ones((100, DIM), np.float32))
        assert sh.sparse("emb").cold_rows > 500
        want = admin.pull_sparse("emb", np.arange(1000))
        before = _state(sh)
        ch = _raw(files, address, "reader")
        try:
            for a in range(0, 1000, 250):
                _, rows = _pull_sparse(ch, "emb", np.arange(a, a + 250))
                np.testing.assert_array_equal(rows, want[a : a + 250])
        finally:
            ch.close()
        assert _state(sh) == before
        np.testing.assert_array_equal(admin.pull_sparse("emb", np.arange(1000)), want)
