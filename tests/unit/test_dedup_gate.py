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
