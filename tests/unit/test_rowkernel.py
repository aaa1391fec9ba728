"""The compiled row kernel (ps/_rowkernel.c via ps.rowkernel) against the numpy/torch path it replaces.

Reference: the same ``SparseTable`` built with ``row_kernel=False`` (ps.optim's torch ops, the path
every table took before the kernel), given the same requests. Every optimizer of ``ps.optim`` (lazy
Adam/AdamW and Adagrad's lr_decay with per-row steps included) on fp32, fp16 and bf16 rows. Rows, optimizer state, versions, the
table step, every pull's reply and every push's result must be bit-identical, over random request
sequences (hypothesis; fp32, fp16 and bf16 rows) with duplicate ids, rows created, refused by
admission, evicted (LRU) and created again, base versions with staleness-aware lr, and pushes whose ``before_swap`` (replication) sees the delta or raises; and
concurrent pushes from threads against the same pushes applied one after another.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps import rowkernel
from ps.config import AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.table import PushResult, RowDelta, SparseTable

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(rowkernel.KERNEL is None, reason=f"row kernel unavailable: {rowkernel.UNAVAILABLE}"),
]

DIM = 19  # a tail past every vector width

OPTIMIZERS = {
    "sgd": {"lr": 0.1, "weight_decay": 0.0},
    "sgd_wd": {"lr": 0.1, "weight_decay": 0.01},
    "momentum": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "nesterov": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
    "adagrad": {"lr": 0.1, "lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0, "initial_accumulator": 0.1},
    "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.0},
    "rowwise_adagrad_wd": {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.02},
    "adagrad_decay": {"lr": 0.1, "lr_decay": 0.05, "eps": 1e-10, "weight_decay": 0.01, "initial_accumulator": 0.1},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "adam_wd": {"lr": 0.01, "beta1": 0.4, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01},  # L2 decay; lerp weight 0.6: its other form
    "adamw": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05},
    "ftrl": {"lr": 0.05, "beta": 1.0, "l1": 0.5, "l2": 0.01, "initial_accumulator": 0.1},  # l1: some weights exactly 0
}
_NAMES = {"sgd_wd": "sgd", "rowwise_adagrad_wd": "rowwise_adagrad", "adagrad_decay": "adagrad", "adam_wd": "adam"}


def _spec(opt: str, dim: int = DIM, max_rows: int = 0, dtype: str = "float32", admit: int = 0) -> TableSpec:
    name = _NAMES.get(opt, opt)
    return TableSpec(
        "emb", "sparse", dim=dim, dtype=dtype, optimizer=OptimizerSpec(name, OPTIMIZERS[opt]), initializer=InitializerSpec("uniform"),
        seed=5, num_slots=64, eviction=EvictionSpec(max_rows=max_rows), admission=AdmissionSpec(min_count=admit),
    )


def _pair(opt: str, dim: int = DIM, max_rows: int = 0, dtype: str = "float32", admit: int = 0) -> tuple[SparseTable, SparseTable]:
    fast = SparseTable(_spec(opt, dim, max_rows, dtype, admit), 0, 1)
    ref = SparseTable(_spec(opt, dim, max_rows, dtype, admit), 0, 1, row_kernel=False)
    assert fast.row_path == "kernel" and fast.memory_stats().row_path == "kernel"
    assert ref.row_path.startswith("numpy")
    return fast, ref


def _same_state(a: SparseTable, b: SparseTable) -> None:
    x, y = a.export_state(), b.export_state()
    for k in ("ids", "values", "versions"):
        np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]), err_msg=k, strict=True)
    assert x["state"].keys() == y["state"].keys()
    for k in x["state"]:
        np.testing.assert_array_equal(np.asarray(x["state"][k]), np.asarray(y["state"][k]), err_msg=k, strict=True)
    assert (x["step"], a.updates, a.dropped, a.evicted) == (y["step"], b.updates, b.dropped, b.evicted)
    assert (a.staleness.count, a.staleness.total, a.staleness.max) == (b.staleness.count, b.staleness.total, b.staleness.max)


def _by_id(d: RowDelta) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray]:
    o = np.argsort(d.ids)
    return d.ids[o], d.values[o], {k: np.asarray(v)[o] for k, v in d.state.items()}, d.versions[o]


_request = st.tuples(
    st.sampled_from(["push", "push", "pull", "push_base", "push_replicated", "push_refused"]),
    st.lists(st.integers(0, 40), min_size=0, max_size=24),  # duplicates likely: 41 ids
    st.integers(0, 2**31 - 1),
)


# every optimizer on fp32 rows; on fp16 and bf16 (stochastic rounding) rows the ones that differ in state
CASES = [(o, "float32") for o in sorted(OPTIMIZERS)] + [
    (o, d) for d in ("float16", "bfloat16")
    for o in ("sgd_wd", "momentum", "adagrad", "rowwise_adagrad_wd", "adagrad_decay", "adam", "adamw", "ftrl")
]


@pytest.mark.parametrize(("opt", "dtype"), CASES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_request, min_size=1, max_size=12), max_rows=st.sampled_from([0, 12]), admit=st.sampled_from([0, 2]))
def test_kernel_matches_the_torch_path_bitwise(opt: str, dtype: str, requests, max_rows: int, admit: int) -> None:
    """``admit`` 2: a row is created at its second sighting (pushes with rows dropped: a gradient subset)."""
    fast, ref = _pair(opt, max_rows=max_rows, dtype=dtype, admit=admit)
    for kind, ids_list, seed in requests:
        ids = np.array(ids_list, np.int64)
        rng = np.random.default_rng(seed)
        if kind == "pull":
            (va, ve), (vb, vf) = fast.pull_rows(ids), ref.pull_rows(ids)
            assert torch.equal(va, vb) and np.array_equal(ve, vf)
            continue
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        if max_rows and len(np.unique(ids)) > max_rows:
            ids, grads = ids[:max_rows], grads[:max_rows]  # a push of more distinct rows than the cap is refused
        base = rng.integers(-1, 4, len(ids)) if kind == "push_base" else None
        pa, pb = fast.prepare_push(ids, grads, base), ref.prepare_push(ids, grads, base)
        if kind in ("push", "push_base"):
            ra, rb = fast.apply_push(pa, staleness_aware_lr=True), ref.apply_push(pb, staleness_aware_lr=True)
            assert ra == rb
        elif kind == "push_replicated":
            seen: list[tuple[PushResult, RowDelta]] = []
            ra = fast.apply_push(pa, before_swap=lambda r, d: seen.append((r, d)))
            rb = ref.apply_push(pb, before_swap=lambda r, d: seen.append((r, d)))
            assert ra == rb == seen[0][0] == seen[1][0]
            da, db = _by_id(seen[0][1]), _by_id(seen[1][1])
            for x, y in zip((da[0], da[1], da[3]), (db[0], db[1], db[3]), strict=True):
                np.testing.assert_array_equal(x, y, strict=True)
            assert da[2].keys() == db[2].keys()
            for k in da[2]:
                np.testing.assert_array_equal(da[2][k], db[2][k], strict=True)
        else:  # before_swap refuses: no row changes on either path (rows LRU eviction dropped stay dropped)
            before = fast.export_state()

            def refuse(r: PushResult, d: RowDelta) -> None:
                raise RuntimeError("backup gone")

            for t, p in ((fast, pa), (ref, pb)):
                with pytest.raises(RuntimeError, match="backup gone"):
                    t.apply_push(p, before_swap=refuse)
            after = fast.export_state()
            kept = np.isin(before["ids"], after["ids"])
            assert np.isin(after["ids"], before["ids"]).all()
            np.testing.assert_array_equal(before["values"][kept], after["values"], strict=True)
            np.testing.assert_array_equal(before["versions"][kept], after["versions"], strict=True)
        _same_state(fast, ref)


@pytest.mark.parametrize(("opt", "dtype"), [("rowwise_adagrad", "float32"), ("adagrad", "float32"), ("sgd", "float32"),
                                           ("rowwise_adagrad", "bfloat16"), ("adagrad", "float16"), ("adam", "float32"),
                                           ("adamw", "bfloat16"), ("ftrl", "float32")])
def test_kernel_matches_on_the_benchmark_shape(opt: str, dtype: str) -> None:
    """dim 64 (whole vectors, no tail), Zipf ids with repeats, rows created as they come."""
    fast, ref = _pair(opt, dim=64, dtype=dtype)
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = np.minimum(rng.zipf(1.1, 512), 5000).astype(np.int64)
        g = rng.standard_normal((len(ids), 64)).astype(np.float32)
        assert fast.push(ids, g) == ref.push(ids, g)
        u = np.unique(ids)
        (va, ve), (vb, vf) = fast.pull_rows(u), ref.pull_rows(u)
        assert torch.equal(va, vb) and np.array_equal(ve, vf)
    _same_state(fast, ref)


def test_concurrent_pushes_match_the_same_pushes_in_turn() -> None:
    """Four threads push to one kernel table at once (disjoint ids per thread, duplicates within a push,
    so each row's update order is its thread's order) while a fifth pulls; the reference applies the
    same pushes one thread after another. Every row and version equal; every pull saw whole rows."""
    fast, ref = _pair("rowwise_adagrad", dim=64)
    pushes = []
    for w in range(4):
        rng = np.random.default_rng(100 + w)
        mine = np.arange(w, 4000, 4, dtype=np.int64)
        pushes.append([(ids := rng.choice(mine, 300), rng.standard_normal((300, 64)).astype(np.float32)) for _ in range(30)])
    errors: list[BaseException] = []
    stop = threading.Event()

    def run(w: int) -> None:
        try:
            for ids, g in pushes[w]:
                fast.push(ids, g)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def read() -> None:
        try:
            while not stop.is_set():
                vals, vers = fast.pull_rows(np.arange(0, 4000, 7, dtype=np.int64))
                assert torch.isfinite(vals).all() and (vers >= 0).all()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    reader.join(timeout=120)
    assert not errors, errors
    for w in range(4):
        for ids, g in pushes[w]:
            ref.push(ids, g)
    _same_state(fast, ref)


def test_every_optimizer_takes_the_kernel_and_what_it_lacks_says_why(monkeypatch) -> None:
    for opt in ("sgd", "momentum", "nesterov", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl"):
        for dtype in rowkernel.KERNEL.row_dtypes:
            assert rowkernel.path_of(opt, {"lr": 0.1}, dtype) == "kernel", (opt, dtype)
    assert rowkernel.path_of("adagrad", {"lr": 0.1, "lr_decay": 0.01}, "float32") == "kernel"
    assert rowkernel.path_of("lamb", {"lr": 0.1}, "float32") == "numpy (lamb: not in the kernel)"
    t = SparseTable(TableSpec("e", "sparse", dim=4, optimizer=OptimizerSpec("adam", {"lr": 0.1})), 0, 1)
    assert t.memory_stats().row_path == "kernel"
    monkeypatch.setattr(rowkernel.KERNEL, "row_dtypes", ("float32", "bfloat16"))  # a build whose compiler lacks _Float16
    assert rowkernel.path_of("adam", {"lr": 0.1}, "float16") == "numpy (float16 rows: this build of the kernel has no float16)"


def test_hash_index_answers_as_the_sorted_index() -> None:
    """ps.index.HashIndex (the kernel's C hash table) against SortedIndex (numpy's searchsorted): the same
    inserts and deletes (revived ids, rebuilds), then lookups of present, deleted and absent ids,
    unsorted and with duplicates, including the extreme int64 ids; the same items."""
    from ps.index import HashIndex, SortedIndex

    rng = np.random.default_rng(9)
    fast, ref = HashIndex(), SortedIndex()
    pool = rng.choice(1 << 40, 30_000, replace=False).astype(np.int64)
    pool[:2] = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    live: set[int] = set()
    for step in range(12):
        new = np.array([i for i in rng.choice(pool, 4000) if int(i) not in live], np.int64)
        new = rng.permutation(np.unique(new))
        rows = rng.integers(-1000, 1 << 30, len(new))
        rows[rows == -1] = 5
        for t in (fast, ref):
            t.insert(new, rows)
        live.update(new.tolist())
        gone = rng.choice(np.array(sorted(live), np.int64), 500, replace=False)
        for t in (fast, ref):
            t.delete(gone)
        live.difference_update(gone.tolist())
        q = np.concatenate([rng.choice(pool, 3000), rng.integers(-5, 1 << 41, 500), pool[:2]])
        np.testing.assert_array_equal(fast.lookup(q), ref.lookup(q), strict=True)
        np.testing.assert_array_equal(fast.lookup(np.sort(q)), ref.lookup(np.sort(q)), strict=True)
    assert len(fast) == len(ref) == len(live)
    (fi, fv), (ri, rv) = fast.items(), ref.items()
    assert dict(zip(fi.tolist(), fv.tolist())) == dict(zip(ri.tolist(), rv.tolist()))
    assert fast.lookup(np.zeros(0, np.int64)).shape == (0,)
    assert (HashIndex().lookup(np.array([1, 2], np.int64)) == -1).all()


def test_without_the_kernel_a_process_says_so_once_and_runs_the_numpy_path() -> None:
    """TESSERA_ROW_KERNEL=0 (as where no compiler built it): tables report the numpy path and why, the
    first sparse table prints one line on stderr, and pushes and pulls give the kernel's results."""
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from ps.config import OptimizerSpec, TableSpec\n"
        "from ps.table import SparseTable\n"
        "ts = [SparseTable(TableSpec(n, 'sparse', dim=8, optimizer=OptimizerSpec('rowwise_adagrad', {'lr': 0.1})), 0, 1) for n in 'ab']\n"
        "ids = np.array([3, 1, 3, 7], np.int64)\n"
        "ts[0].push(ids, np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))\n"
        "print(ts[0].memory_stats().row_path)\n"
        "print(ts[0].pull_rows(np.array([1, 3, 7], np.int64))[0].numpy().tobytes().hex())\n"
    )
    env = {**os.environ, "TESSERA_ROW_KERNEL": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    path, rows = r.stdout.splitlines()
    assert path == "numpy (TESSERA_ROW_KERNEL=0)"
    assert r.stderr.count("tessera ps: row kernel not in use (TESSERA_ROW_KERNEL=0)") == 1
    t = SparseTable(TableSpec("a", "sparse", dim=8, optimizer=OptimizerSpec("rowwise_adagrad", {"lr": 0.1})), 0, 1)
    assert t.row_path == "kernel"
    t.push(np.array([3, 1, 3, 7], np.int64), np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))
    assert t.pull_rows(np.array([1, 3, 7], np.int64))[0].numpy().tobytes().hex() == rows


def test_a_kernel_that_fails_its_self_check_is_not_used() -> None:
    """README: where the kernel's self-check at load finds it would not give the torch path's floats bit
    for bit, tables run the numpy path and say why. In a fresh process whose torch Adam (ps.optim, the
    self-check's reference) is made to differ in the last bits, as on a machine where torch sums in
    another order, the loaded kernel is refused and a sparse table of any optimizer says so."""
    import subprocess
    import sys

    code = (
        "import ps.optim as o\n"
        "update = o.Adam.update\n"
        "def skewed(self, param, grad, state, step):\n"
        "    update(self, param, grad, state, step)\n"
        "    param.mul_(1 + 2 ** -20)\n"
        "o.Adam.update = skewed\n"
        "import ps.rowkernel as k\n"
        "from ps.config import OptimizerSpec, TableSpec\n"
        "from ps.table import SparseTable\n"
        "t = SparseTable(TableSpec('a', 'sparse', dim=8, optimizer=OptimizerSpec('sgd', {'lr': 0.1})), 0, 1)\n"
        "print(k.KERNEL is None)\n"
        "print(t.memory_stats().row_path)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    why = "adam on float32 rows differs from ps.optim's torch path on this machine"
    assert r.stdout.splitlines() == ["True", f"numpy ({why})"]
    assert r.stderr.count(f"tessera ps: row kernel not in use ({why})") == 1
    assert rowkernel.KERNEL is not None  # (this process: the same kernel, the self-check passed)


def test_ps_stats_says_which_path_each_table_takes(monkeypatch) -> None:
    """Shard.stats() carries each sparse table's row_path through the StatsReply message, and
    `tessera ps stats` prints it (ps.cli.format_stats, the command's formatter). The "slow" table is
    made while ps.rowkernel is as TESSERA_ROW_KERNEL=0 leaves it at import (every optimizer has the
    kernel where it loads)."""
    from ps.cli import format_stats
    from ps.config import ShardConfig
    from ps.shard import Shard
    from ps.wire import stats_from_proto, stats_to_proto

    sh = Shard(ShardConfig())
    sh.create_table(TableSpec("fast", "sparse", dim=8, optimizer=OptimizerSpec("adam", {"lr": 0.1})))
    monkeypatch.setattr(rowkernel, "KERNEL", None)
    monkeypatch.setattr(rowkernel, "UNAVAILABLE", "TESSERA_ROW_KERNEL=0")
    monkeypatch.setattr(rowkernel, "_said", False)  # its one line, restored after
    sh.create_table(TableSpec("slow", "sparse", dim=8, optimizer=OptimizerSpec("adam", {"lr": 0.1})))
    got = stats_from_proto(stats_to_proto(sh.stats()))
    paths = {t.name: t.row_path for t in got.tables}
    assert paths["fast"] == "kernel"
    assert paths["slow"] == "numpy (TESSERA_ROW_KERNEL=0)"
    text = format_stats([got], ["127.0.0.1:1"])
    assert "    pushes: kernel" in text and f"    pushes: {paths['slow']}" in text
