"""A Chrome-trace timeline per rank (open in chrome://tracing or https://ui.perfetto.dev).

Spans: the trainer's fetch / compute (forward + backward) / push of each step on the ``main``
track; each bucket's all-reduce (DP, from its launch in a backward hook to its completion) and
each ZeRO reduce-scatter on the ``comm`` track; each ZeRO all-gather where it runs. Times are
microseconds since the tracer started; ``pid`` is the rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """Collects complete ("X") events; thread-safe appends (completion callbacks run on the
    communication thread). ``save(path)`` writes the Chrome trace JSON."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def complete(self, name: str, cat: str, start: float, end: float, tid: str = "main", **args: Any) -> None:
        ev = {
            "name": name, "cat": cat, "ph": "X", "ts": (start - self.t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
            "pid": self.rank, "tid": tid, "args": args,
        }
        with self._lock:
            self.events.append(ev)

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", tid: str = "main", **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, cat, start, time.perf_counter(), tid, **args)

    def work(self, name: str, work: Any, cat: str = "comm", **args: Any) -> None:
        """An asynchronous collective: a span from now until ``work`` completes."""
        start = time.perf_counter()
        try:
            fut = work.get_future()
        except (AttributeError, RuntimeError):
            return
        fut.add_done_callback(lambda _f: self.complete(name, cat, start, time.perf_counter(), "comm", **args))

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with self._lock:
            events = list(self.events)
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": "main", "args": {"name": "main"}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": "comm", "args": {"name": "collectives"}},
        ]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
