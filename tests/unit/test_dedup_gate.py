"""The dedup record's bounds (README: last 16 per client and table, 8192 records, LRU) and the gate's
rules (shared re-entrant, exclusive excludes, a waiting exclusive holds new shared holders back)."""
from __future__ import annotations

import threading
import time

from ps.dedup import Dedup
from ps.gate import Gate

OLD = "too old"


def test_dedup_answers_a_seen_seq_and_nothing_else() -> None:
    d: Dedup[str] = Dedup(window=4, max_keys=8)
    assert d.seen("c", "t", 5, OLD) is None
    d.record("c", "t", 5, "r5")
    assert d.seen("c", "t", 5, OLD) == "r5"
    assert d.seen("c", "u", 5, OLD) is None  # per table
    assert d.seen("other", "t", 5, OLD) is None  # per client
    assert d.seen("", "t", 5, OLD) is None and d.seen("c", "t", 0, OLD) is None  # no id: no dedup
    assert d.duplicates == 1


def test_dedup_window_keeps_the_newest_and_refuses_older_than_a_full_window() -> None:
    d: Dedup[str] = Dedup(window=4, max_keys=8)
    for s in (3, 1, 2, 5, 4, 6):  # out of order
        d.record("c", "t", s, f"r{s}")
    assert [d.seen("c", "t", s, OLD) for s in (3, 4, 5, 6)] == ["r3", "r4", "r5", "r6"]
    assert d.seen("c", "t", 1, OLD) == OLD  # dropped from the window: treated as applied (at most once)
    assert d.seen("c", "t", 7, OLD) is None


def test_dedup_drops_the_least_recently_used_records_beyond_max_keys() -> None:
    d: Dedup[str] = Dedup(window=2, max_keys=3)
    for c in ("a", "b", "c"):
        d.record(c, "t", 1, c)
    d.seen("a", "t", 1, OLD)  # a is used again
    d.record("d", "t", 1, "d")  # b, the least recently used, goes
    assert d.seen("b", "t", 1, OLD) is None
    assert d.seen("a", "t", 1, OLD) == "a" and d.seen("d", "t", 1, OLD) == "d"
    exported = d.export()
    assert len(exported) == 3
    e: Dedup[str] = Dedup(window=2, max_keys=3)
    e.load(exported)
    assert e.seen("d", "t", 1, OLD) == "d"


def test_gate_shared_is_reentrant_and_exclusive_waits_for_shared() -> None:
    g = Gate()
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def reader() -> None:
        with g.shared():
            with g.shared():  # re-entrant
                inside.set()
                release.wait(5)
                order.append("reader done")

    def writer() -> None:
        with g.exclusive():
            order.append("writer in")
            with g.shared():  # inside its own exclusive hold: passes
                order.append("writer shared")

    r = threading.Thread(target=reader)
    r.start()
    inside.wait(5)
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.1)
    assert order == []  # the writer waits for the reader
    late_reader_in = threading.Event()

    def late_reader() -> None:
        with g.shared():
            late_reader_in.set()

    lr = threading.Thread(target=late_reader)
    lr.start()
    time.sleep(0.1)
    assert not late_reader_in.is_set()  # a waiting writer holds new readers back
    release.set()
    for t in (r, w, lr):
        t.join(5)
    assert order == ["reader done", "writer in", "writer shared"]
    assert late_reader_in.is_set()


def test_a_shard_keeps_the_last_16_pushes_per_client_and_table_and_8192_records() -> None:
    """README: a shard records the last 16 pushes per client and table (8192 client-table records at
    most, least recently used dropped), so a retry whose first attempt was applied is answered with
    the original result and not applied again. The tests above use their own bounds; this checks
    the shard's: its Dedup is built with 16 and 8192; a real in-process Shard given pushes 1..17 by
    one client answers a retry of the 16th-newest (seq 2) from the record (its original result,
    version 2) and one 17 back (seq 1) as too old (a placeholder, not its original result), applying
    neither again; after 8192 other clients pushed, that client's record is the one dropped (its
    seq 17 applies anew) and the others' stay. Reference: SGD with lr 1 on ones, in numpy fp32."""
    import numpy as np

    from ps.config import OptimizerSpec, ShardConfig, TableSpec
    from ps.shard import Shard

    shard = Shard(ShardConfig())
    try:
        assert (shard.dedup.window, shard.dedup.max_keys) == (16, 8192)
        shard.create_table(TableSpec("e", "sparse", dim=1, optimizer=OptimizerSpec("sgd", {"lr": 1.0})))
        ids, ones = np.array([5], np.int64), np.ones((1, 1), np.float32)

        def row() -> np.float32:
            return np.float32(shard.pull_sparse("e", ids)[0].float()[0, 0])

        want = row()  # the row's initial value (a pull only reads it)
        first = [shard.push_sparse("e", ids, ones, client="c", seq=s) for s in range(1, 18)]
        for _ in range(17):
            want = want - np.float32(1.0)
        assert [p.result.version for p in first] == list(range(1, 18)) and not any(p.duplicate for p in first)
        assert row() == want

        newest16 = shard.push_sparse("e", ids, ones, client="c", seq=2)  # the 16th newest of 1..17: in the record
        assert newest16.duplicate and newest16.result == first[1].result and newest16.result.version == 2
        back17 = shard.push_sparse("e", ids, ones, client="c", seq=1)  # 17 back: out of the record, too old
        assert back17.duplicate and back17.result != first[0].result and back17.result.version != 1
        assert row() == want and shard.stats().duplicates == 2  # neither applied again

        for k in range(8192):  # 8192 more (client, table) records: "c"'s, the least recently used, goes
            shard.push_sparse("e", ids, ones, client=f"k{k}", seq=1)
        assert not shard.push_sparse("e", ids, ones, client="c", seq=17).duplicate
        assert shard.push_sparse("e", ids, ones, client="k1", seq=1).duplicate
        for _ in range(8192 + 1):
            want = want - np.float32(1.0)
        assert row() == want
    finally:
        shard.close()
