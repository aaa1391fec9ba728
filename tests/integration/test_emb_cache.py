"""The hot-row embedding cache (worker/emb_cache.py) against real gRPC shards.

- sync: training with the cache on gives exactly the parameters of training with it off (which
  tests/integration/test_worker_sync_exact.py checks against a single-process torch reference), and
  a conditional pull leaves out, on the wire, every row the cache serves: rows nobody pushed since
  the cache pulled them (frozen lookups beside trained ones: hits, fewer rows than cache off);
- ssp: every row a lookup is served is checked against the PS's own history of that row: it is the
  row as the PS held it at most K clocks before (value and version), never older;
- hit rate on Zipf(1.1) ids with a cache of 1% of the rows, reported and above 50%.

Each test runs on the CPU device (CI) and again on CUDA where one is present (skipped otherwise).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import EvictionSpec, SyncPolicy
from worker import TrainConfig, Trainer, load_task
from worker.binding import PSEmbedding
from worker.emb_cache import EmbCache, attach_caches

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cache's pinned/side-stream path)")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]
W, B, STEPS = 2, 16, 6
VOCAB = 100  # ranks per field: rows come back often, some after steps nobody touched them


def _sync_run(train_workers, cluster, cache_rows: int, device: str):
    """W sync workers on the ctr task (small id space); returns (per worker {step: flat params}, final rows, caches)."""
    kw = {"vocab": VOCAB, "test_size": 100}
    tasks = [load_task("ctr", **kw) for _ in range(W)]
    caches = [attach_caches(t.model, cache_rows, 2, "sync", device, admit=1) for t in tasks]
    seen: list[dict[int, torch.Tensor]] = [{} for _ in range(W)]

    def make(i: int) -> Trainer:
        cfg = TrainConfig(mode="sync", steps=STEPS, batch_size=B, worker_index=i, num_workers=W, progress=False,
                          evaluate=False, lease_s=30, device=device)
        return Trainer(tasks[i], cluster.client(timeout=60), cfg,
                       on_step=lambda step, tr: seen[i].__setitem__(step, tr.flat.detach().cpu().clone()))

    train_workers(W, make, timeout=120)
    emb = tasks[0].model.emb
    wire = sum(c.rows_pulled[emb.table] for c in cluster.clients)  # rows whose values the workers' pulls brought
    ids = (np.arange(26, dtype=np.int64)[:, None] << 40 | np.arange(VOCAB)).reshape(-1)  # every (field, rank) row
    return seen, cluster.client().pull_sparse(emb.table, ids, return_versions=True), caches, wire


@pytest.mark.timeout(240)
@pytest.mark.parametrize("device", DEVICES)
def test_sync_with_cache_gives_exactly_the_parameters_without(inproc_cluster, train_workers, device: str) -> None:
    """Reference: the same sync run (2 workers, 2 real shards) with the cache off; dense parameters at
    every step and every row with its version after the run are bitwise equal."""
    off_seen, (off_rows, off_ver), _, off_wire = _sync_run(train_workers, inproc_cluster(2), 0, device)
    on_seen, (on_rows, on_ver), caches, on_wire = _sync_run(train_workers, inproc_cluster(2), 1024, device)
    for i in range(W):
        for t in range(STEPS):
            assert torch.equal(on_seen[i][t], off_seen[i][t]), f"worker {i} step {t}: dense parameters differ"
    np.testing.assert_array_equal(on_ver, off_ver)
    np.testing.assert_array_equal(on_rows, off_rows)
    assert off_ver.max() > 0, "rows never moved"
    # the cache held rows of later batches, and refused every one: each had changed on the PS (in
    # sync mode a worker's own push changes every row it used, so nothing it cached stays current)
    refreshed = sum(c["emb"].stats.refreshed for c in caches)
    assert refreshed > 0, "the cache never held a row a later batch asked for: the test compared nothing"
    hits = sum(c["emb"].stats.row_hits for c in caches)
    print(f"\nsync ctr, cache on: {hits} row hits, rows over the wire {on_wire} (cache off {off_wire})")
    assert on_wire == off_wire - hits  # every row served from the cache is one the PS did not send
    # README: a step that reads only rows it trains gets no sync hits (its own push changed each row it
    # cached); test_sync_cache_serves_rows_nobody_pushed_and_saves_their_transfer shows the hits
    assert hits == 0


def _zipf_ids(rng: np.random.Generator, perm: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    return perm[rng.choice(len(p), n, p=p)]


def _sync_two_tower(cluster, cache_rows: int, device: str, steps: int = 12):
    """One BSP worker driven step by step: each step looks up Zipf(1.1) user ids (trained: their row
    gradients are pushed) and Zipf item ids from the same table under no_grad (frozen features: read,
    never pushed). Returns (per step (user, item) outputs, final rows and versions, rows over the wire,
    the cache, lookups checked against the PS)."""
    V, dim = 2000, 8
    client, truth = cluster.client(), cluster.client()
    client.worker = "w0"
    emb = PSEmbedding("tower/emb", dim, optimizer="adagrad", lr=0.1)
    emb.client = client
    client.create_sparse(emb.table, dim, optimizer=emb.optimizer, init=emb.init, seed=emb.seed)
    emb.cache = EmbCache(cache_rows, dim, "sync", 0, device, admit=1) if cache_rows else None
    client.join(30)
    rng = np.random.default_rng(3)
    p = 1.0 / np.arange(1, V + 1) ** 1.1
    p /= p.sum()
    perm = rng.permutation(V)
    outs, checked = [], 0
    for t in range(steps):
        emb.policy = SyncPolicy(clock=t, sync=True)
        users = torch.from_numpy(_zipf_ids(rng, perm, p, 128)).to(device)
        items = torch.from_numpy(_zipf_ids(rng, perm, p, 128)).to(device)
        ri = emb.fetch(items, emb.policy)
        emb.prefetched(ri)
        with torch.no_grad():
            item = emb(items)  # frozen: read through the cache, no gradient pushed
        if emb.cache is not None:  # every row served (hit or not) is the PS's row now, value and version
            rows, vers = truth.pull_sparse(emb.table, ri.uniq, return_versions=True)
            np.testing.assert_array_equal(item.cpu().numpy(), rows[ri.inverse])
            np.testing.assert_array_equal(ri.versions, vers)
            checked += len(ri.uniq)
        user = emb(users)
        ((user * item).sum(-1) ** 2).sum().backward()
        g = emb.gradients()
        client.push_sparse(g.table, g.ids, g.grads, g.base_versions, policy=emb.policy)
        outs.append((user.detach().cpu().clone(), item.cpu().clone()))
    final = truth.pull_sparse(emb.table, np.arange(V, dtype=np.int64), return_versions=True)
    client.leave()
    return outs, final, client.rows_pulled[emb.table], emb.cache, checked


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", DEVICES)
def test_sync_cache_serves_rows_nobody_pushed_and_saves_their_transfer(inproc_cluster, device: str) -> None:
    """Sync mode, rows read without being trained (frozen item lookups beside trained user lookups on the
    same table, 2 real shards): a resident row nobody pushed since the cache pulled it is a hit, and the
    PS does not send it. Reference: the same run with the cache off; every lookup's values, and every
    row with its version after the run, are bitwise equal; and each served item row equals the PS's row
    read by a second client at that step. The cache-on run pulls fewer rows over the wire."""
    off_outs, (off_rows, off_ver), off_wire, _, _ = _sync_two_tower(inproc_cluster(2), 0, device)
    on_outs, (on_rows, on_ver), on_wire, cache, checked = _sync_two_tower(inproc_cluster(2), 200, device)
    for t, ((u0, i0), (u1, i1)) in enumerate(zip(off_outs, on_outs)):
        assert torch.equal(u0, u1) and torch.equal(i0, i1), f"step {t}: looked-up rows differ"
    np.testing.assert_array_equal(on_ver, off_ver)
    np.testing.assert_array_equal(on_rows, off_rows)
    assert off_ver.max() > 1, "rows never moved"
    s = cache.stats
    print(f"\nsync, frozen item lookups: {s.row_hits} of {s.rows} rows served from the cache "
          f"({s.hit_rate:.3f} of lookups); rows over the wire {on_wire} (cache off {off_wire}); {checked} rows checked")
    assert s.row_hits > 0 and s.refreshed > 0, "no hits, or no resident row changed: the test compared nothing"
    assert s.transferred == s.rows - s.row_hits
    assert on_wire == off_wire - s.row_hits < off_wire


def _evicting_run(cluster, cache_rows: int, device: str):
    """Rows that come back at the same version with other values: a sync-mode reader (the cache's
    conditional pulls, or plain pulls with the cache off) of 24 rows on a table with
    ``eviction.ttl_steps=2`` (2 real shards), and another worker that pushes them, makes the shards
    evict them (pushes of other rows), creates them again and pushes them once more: back at version 1.
    Returns, per read, the rows served and their versions, each checked against the PS's rows read by a
    third client at that moment; and the cache."""
    dim, name = 8, "evict/emb"
    reader, other, truth = cluster.client(), cluster.client(), cluster.client()
    reader.create_sparse(name, dim, optimizer="adagrad", init="normal", eviction=EvictionSpec(ttl_steps=2), lr=0.1)
    cache = EmbCache(cache_rows, dim, "sync", 0, device, admit=1) if cache_rows else None
    rng = np.random.default_rng(5)
    ids = np.sort(rng.permutation(3000)[:24]).astype(np.int64)
    reads = []

    def read(step: int) -> None:
        if cache is not None:
            r = cache.fetch(reader, name, ids, None, step, None)
            rows, vers = r.leaf.cpu().numpy(), r.versions
        else:
            rows, vers = reader.pull_sparse(name, ids, return_versions=True)
        ref_rows, ref_vers = truth.pull_sparse(name, ids, return_versions=True)
        np.testing.assert_array_equal(vers, ref_vers, err_msg=f"read {step}: versions")
        np.testing.assert_array_equal(rows, ref_rows, err_msg=f"read {step}: rows (served stale?)")
        reads.append((rows.copy(), vers.copy()))

    def push(which: np.ndarray) -> None:
        other.push_sparse(name, which, rng.standard_normal((len(which), dim)).astype(np.float32))

    read(0)  # the rows' initial values (version 0; pulls create nothing); the cache admits them
    push(ids)
    read(1)  # version 1: the cache refreshes them
    for k in range(4):  # the other worker trains other rows: ours expire and are dropped
        filler = np.arange(10_000 + 40 * k, 10_040 + 40 * k, dtype=np.int64)
        other.pull_sparse(name, filler)
        push(filler)
    _, v = other.pull_sparse(name, ids, return_versions=True)  # evicted: they read as new rows, version 0
    assert (v == 0).all(), "the rows were not evicted"
    push(ids)  # version 1 again, other values
    read(2)  # the cache holds version 1 from read 1: it must not serve it
    read(3)  # nothing changed since read 2: served from the cache (the epochs hold again)
    return reads, cache


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_sync_cache_stays_exact_when_rows_are_evicted_and_created_again(inproc_cluster, device: str) -> None:
    """Eviction on (``ttl_steps``): a row the cache holds at version 1 is evicted, created again and
    pushed once: version 1, other values. Reference: the same run with the cache off; every read gives
    the same rows and versions, and each equals the PS's rows at that moment (a second client). The
    cache sent nothing it did not have to once the epochs held again (the last read: all hits)."""
    off, _ = _evicting_run(inproc_cluster(2), 0, device)
    on, cache = _evicting_run(inproc_cluster(2), 64, device)
    for t, ((r0, v0), (r1, v1)) in enumerate(zip(off, on)):
        np.testing.assert_array_equal(v1, v0, err_msg=f"read {t}: versions")
        np.testing.assert_array_equal(r1, r0, err_msg=f"read {t}: rows")
    assert not np.array_equal(on[2][0], on[1][0]) and (on[2][1] == on[1][1]).all(), "no row came back at the same version"
    s = cache.stats
    assert s.admitted == 24 and s.row_hits == 24, f"the last read should be all hits: {s}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["ssp", "async"])
@pytest.mark.parametrize("device", DEVICES)
def test_cached_rows_are_never_older_than_the_mode_allows(inproc_cluster, device: str, mode: str) -> None:
    """One worker (a real PSEmbedding with the cache, Adagrad rows on 2 real shards), driven step by
    step: after each step's push the test reads every row from the PS (its history per clock). Per
    lookup: a row served at step t with age a was pulled at step t-a, so it must be, value and version,
    the PS's row after clock t-a-1, with a <= K; a cached row the PS changed since is served at most K
    steps. Async: the same with a <= K-1 (refreshed every K steps). Reference: the PS's own rows, read
    by a second client."""
    K, V, steps = 3, 400, 14
    bound = K if mode == "ssp" else K - 1
    cluster = inproc_cluster(2)
    client, truth_client = cluster.client(), cluster.client()
    client.worker = "w0"
    emb = PSEmbedding("ssp/emb", 8, optimizer="adagrad", lr=0.1)
    emb.client = client
    client.create_sparse(emb.table, emb.dim, optimizer=emb.optimizer, init=emb.init, seed=emb.seed)
    emb.cache = EmbCache(V // 10, emb.dim, mode, K, device, admit=1)
    client.join(30)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, V + 1) ** 1.1
    p /= p.sum()
    perm = rng.permutation(V)
    all_ids = np.arange(V, dtype=np.int64)
    history = [truth_client.pull_sparse(emb.table, all_ids, return_versions=True)]  # history[c + 1]: after clock c
    w = torch.randn(emb.dim, device=device)
    checked = aged = 0
    for t in range(steps):
        ids = torch.from_numpy(_zipf_ids(rng, perm, p, 256)).to(device)
        emb.policy = SyncPolicy(clock=t, staleness=K if mode == "ssp" else -1)
        r = emb.fetch(ids, emb.policy)
        emb.prefetched(r)
        out = emb(ids)
        (out @ w).sum().backward()
        leaf = r.cached.leaf.detach().cpu().numpy()
        for j, rid in enumerate(r.uniq):
            a = int(r.cached.ages[j])
            assert 0 <= a <= bound, f"step {t}: row {rid} served {a} clocks old ({mode}, K={K})"
            rows, vers = history[t - a]  # the PS after clock t-a-1: what the pull at step t-a saw
            assert r.versions[j] == vers[rid], f"step {t}: row {rid} version {r.versions[j]}, the PS had {vers[rid]} at clock {t - a - 1}"
            np.testing.assert_array_equal(leaf[j], rows[rid], err_msg=f"step {t}: row {rid}")
            # never older than K clocks: every update the PS applied up to clock t-K-1 is in it
            assert r.versions[j] >= history[max(0, t - bound)][1][rid]
            checked += 1
            aged += a > 0
        g = emb.gradients()
        client.push_sparse(g.table, g.ids, g.grads, g.base_versions, policy=emb.policy)
        client.heartbeat(t + 1)
        history.append(truth_client.pull_sparse(emb.table, all_ids, return_versions=True))
    assert aged > checked // 10, f"only {aged} of {checked} lookups were served from the cache"
    assert history[-1][1].max() >= K + 2, "rows did not change often enough to be stale"
    client.leave()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", DEVICES)
def test_hit_rate_on_zipf_ids_with_a_one_percent_cache(inproc_cluster, device: str) -> None:
    """Zipf(1.1) ids over 100k rows, 4096 ids a step, a cache of 1000 rows (1%), SSP K=8, rows trained
    on a real shard. Reports the per-lookup hit rate (after 5 warm-up steps) and requires > 50%."""
    R, K = 100_000, 8
    cluster = inproc_cluster(1)
    client = cluster.client()
    emb = PSEmbedding("zipf/emb", 16, optimizer="adagrad", lr=0.05)
    emb.client = client
    client.create_sparse(emb.table, emb.dim, optimizer=emb.optimizer, init=emb.init)
    emb.cache = cache = EmbCache(R // 100, emb.dim, "ssp", K, device)
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, R + 1) ** 1.1
    p /= p.sum()
    perm = rng.permutation(R)
    before = None
    for t in range(30):
        if t == 5:
            before = (cache.stats.lookups, cache.stats.hits, cache.stats.rows, cache.stats.row_hits)
        ids = torch.from_numpy(_zipf_ids(rng, perm, p, 4096)).to(device)
        r = emb.fetch(ids, SyncPolicy(clock=t))
        emb.prefetched(r)
        out = emb(ids)
        out.sum().backward()
        g = emb.gradients()
        client.push_sparse(g.table, g.ids, g.grads, g.base_versions)
    assert before is not None
    s = cache.stats
    hit_rate = (s.hits - before[1]) / (s.lookups - before[0])
    row_hit_rate = (s.row_hits - before[3]) / (s.rows - before[2])
    print(f"\nZipf(1.1), 100k rows, cache 1%: hit rate {hit_rate:.3f} of lookups, {row_hit_rate:.3f} of unique rows per step")
    assert hit_rate > 0.5, f"hit rate {hit_rate:.3f}"


def test_bad_cache_settings_name_what_was_wrong() -> None:
    """Clear errors for sizes and rules that cannot work; nothing is attached."""
    with pytest.raises(ValueError, match="rows must be >= 1"):
        EmbCache(0, 8)
    with pytest.raises(ValueError, match="mode must be one of"):
        EmbCache(8, 8, mode="bsp")
    with pytest.raises(ValueError, match="async: rows are refreshed every K steps"):
        EmbCache(8, 8, mode="async", staleness=0)
    task = load_task("ctr", vocab=100, test_size=10)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        attach_caches(task.model, -1, 2, "sync", "cpu")
    assert task.model.emb.cache is None
