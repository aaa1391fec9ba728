"""At-most-once pushes: the sequence numbers a shard has applied, per (client, table).

A client numbers every push request it sends (``seq`` > 0, increasing; a retry
reuses its number). The shard records each applied ``seq`` with its result
under the table's write lock, in the same critical section as the apply, so a
retry that arrives after the apply (its reply was lost) is answered with the
original result and not applied again.

Bounded: per (client, table) the last ``window`` sequence numbers are kept
(a client has a handful of pushes in flight per table, never ``window``); a
number below the window of a full record is treated as already applied
(at most once beats at least once for gradients). At most ``max_keys``
(client, table) records are kept, least recently used dropped first.

Pure Python; thread-safe.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

__all__ = ["Dedup"]

R = TypeVar("R")


class Dedup(Generic[R]):
    def __init__(self, window: int = 16, max_keys: int = 8192) -> None:
        if window < 1 or max_keys < 1:
            raise ValueError("window and max_keys must be >= 1")
        self.window = window
        self.max_keys = max_keys
        self._records: OrderedDict[tuple[str, str], OrderedDict[int, R]] = OrderedDict()
        self._lock = threading.Lock()
        self.duplicates = 0

    def seen(self, client: str, table: str, seq: int, too_old: R) -> R | None:
        """The recorded result if ``seq`` was applied (``too_old`` if it fell below a full window); None if new."""
        if not client or seq <= 0:
            return None
        with self._lock:
            rec = self._records.get((client, table))
            if rec is None:
                return None
            self._records.move_to_end((client, table))
            if seq in rec:
                self.duplicates += 1
                return rec[seq]
            if len(rec) >= self.window and seq < next(iter(rec)):
                self.duplicates += 1
                return too_old
            return None

    def record(self, client: str, table: str, seq: int, result: R) -> None:
        if not client or seq <= 0:
            return
        with self._lock:
            key = (client, table)
            rec = self._records.get(key)
            if rec is None:
                rec = self._records[key] = OrderedDict()
                while len(self._records) > self.max_keys:
                    self._records.popitem(last=False)
            else:
                self._records.move_to_end(key)
            in_order = not rec or seq > next(reversed(rec))
            rec[seq] = result
            if not in_order:  # keep the record sorted by seq (the oldest first)
                for k in sorted(rec):
                    rec.move_to_end(k)
            while len(rec) > self.window:
                rec.popitem(last=False)

    def forget(self, table: str) -> None:
        """Drop every record of ``table`` (the table was dropped)."""
        with self._lock:
            for key in [k for k in self._records if k[1] == table]:
                del self._records[key]

    def export(self, table: str | None = None) -> list[tuple[str, str, list[tuple[int, Any]]]]:
        """The records (of ``table``, or all) as (client, table, [(seq, result)]) (checkpoints, a joining backup)."""
        with self._lock:
            return [(c, t, list(rec.items())) for (c, t), rec in self._records.items() if table is None or t == table]

    def load(self, records: list[tuple[str, str, list[tuple[int, Any]]]]) -> None:
        """Add ``records`` (as export() gives them), replacing those of the same (client, table)."""
        with self._lock:
            for c, t, items in records:
                self._records[(str(c), str(t))] = OrderedDict(sorted((int(s), r) for s, r in items))
            while len(self._records) > self.max_keys:
                self._records.popitem(last=False)
