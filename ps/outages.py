"""``ShardWatch``: which shards a client's calls find unreachable, since when, and when they are back.

Each ``ShardStub`` of a ``PSClient`` tells the client's watch of every retried UNAVAILABLE
(``unreachable``) and of every answer (``reached``: a reply, or an error the server sent). The
watch turns that into plain lines, never a traceback: one when a shard becomes unreachable, one
every ``every`` seconds while it stays so (which shard, since when, what the client's user is
waiting for, how long the calls keep retrying), and one when it answers again. ``on_back``
listeners then run (a worker re-checks the shard's clock, renews its lease there at once).

Thread-safety: safe to call from many threads; ``reached`` on a shard that was never down is a
dict lookup (it runs after every call).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ShardWatch"]

log = logging.getLogger(__name__)


@dataclass
class _Outage:
    address: str
    since_wall: float  # time.time() when the first call failed
    since: float  # time.monotonic() of the same moment
    error: str
    said: float  # time.monotonic() of the last line about it


def _one_line(e: BaseException) -> str:
    """A gRPC error as ``CODE: first line of its details`` (at most 160 characters)."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    text = f"{code().name}: {details() or ''}" if callable(code) and callable(details) else f"{type(e).__name__}: {e}"
    text = text.splitlines()[0] if text else text
    return text if len(text) <= 160 else text[:157] + "..."


class ShardWatch:
    """Outages of the shards one client talks to, said as they happen.

    ``retry_timeout``: how long a call retries an unreachable shard (said in the lines). ``say(line)``:
    where the lines go (None: this module's logger at WARNING). ``doing()``: what the client's user is
    waiting for (a worker: ``"training waits at step 17 (push of step 17, pull for step 18)"``), or
    None. ``every``: seconds between "still unreachable" lines."""

    def __init__(self, retry_timeout: float, every: float = 5.0) -> None:
        self.retry_timeout = retry_timeout
        self.every = every
        self.say: Callable[[str], None] | None = None
        self.doing: Callable[[], str] | None = None
        self.on_back: list[Callable[[int, float], None]] = []  # (shard, seconds it was unreachable)
        self._down: dict[int, _Outage] = {}
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._closed = threading.Event()

    def close(self) -> None:
        self._closed.set()

    # ------------------------------------------------------------------ from the stubs
    def unreachable(self, stub: Any, error: BaseException) -> None:
        """A call to shard ``stub.index`` failed UNAVAILABLE and will be retried."""
        now = time.monotonic()
        with self._lock:
            o = self._down.get(stub.index)
            if o is not None:
                o.error, o.address = _one_line(error), stub.address
                return
            o = self._down[stub.index] = _Outage(stub.address, time.time(), now, _one_line(error), now)
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="ps-shard-watch", daemon=True)
                self._ticker.start()
        self._say(f"shard {stub.index} ({o.address}) unreachable since {_clock(o.since_wall)} ({o.error}); "
                  f"{self._doing()}retrying for up to {self.retry_timeout:.0f} s")

    def reached(self, stub: Any) -> None:
        """Shard ``stub.index`` answered a call (a reply or an error of its own)."""
        if stub.index not in self._down:  # the common case, without the lock
            return
        with self._lock:
            o = self._down.pop(stub.index, None)
        if o is None:
            return
        down_s = time.monotonic() - o.since
        moved = f", now at {stub.address}" if stub.address != o.address else ""
        self._say(f"shard {stub.index} ({o.address}) is back after {down_s:.1f} s (unreachable since "
                  f"{_clock(o.since_wall)}{moved})")
        for fn in list(self.on_back):
            try:
                fn(stub.index, down_s)
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the call that got through
                log.exception("shard %d back: a listener failed", stub.index)

    # ------------------------------------------------------------------ lines
    def _tick(self) -> None:
        """While a shard is unreachable: a line about it every ``every`` seconds."""
        while not self._closed.wait(0.25):
            now = time.monotonic()
            lines = []
            with self._lock:
                if not self._down:
                    self._ticker = None
                    return
                for i, o in sorted(self._down.items()):
                    if now - o.said >= self.every:
                        o.said = now
                        left = max(0.0, self.retry_timeout - (now - o.since))
                        lines.append(
                            f"shard {i} ({o.address}) still unreachable, since {_clock(o.since_wall)} "
                            f"({now - o.since:.0f} s; {o.error}); {self._doing()}the calls give up in {left:.0f} s"
                        )
            for line in lines:
                self._say(line)

    def _doing(self) -> str:
        if self.doing is None:
            return ""
        try:
            what = self.doing()
        except Exception:  # noqa: BLE001 - a description must never fail a line
            return ""
        return f"{what}; " if what else ""

    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed stderr must not fail a call: the line goes to the log
            if self.say is not None:
                return self.say(line)
        log.warning("%s", line)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
