"""Gate: a shared/exclusive lock. Every mutation of a shard passes it shared; attaching a backup
takes it exclusive, so the snapshot the backup starts from misses no mutation and sees none half
done. Shared holds are re-entrant per thread (a push that completes a BSP round applies it on the
same thread), and pass inside the same thread's exclusive hold; an exclusive waiter blocks new
shared holders (no starvation).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["Gate"]


class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._mine = threading.local()  # depth: this thread's shared holds; counted: the outermost one counts in _shared
        self._owner: int | None = None

    def shared(self) -> Gate:
        """A shared hold: ``with gate.shared():`` (the gate is its own context, no generator: every mutation takes one)."""
        return self

    def __enter__(self) -> None:
        mine = self._mine
        depth = getattr(mine, "depth", 0)
        if depth == 0:
            mine.counted = self._owner != threading.get_ident()  # inside this thread's own exclusive hold: not counted
            if mine.counted:
                with self._cond:
                    while self._exclusive or self._waiting:
                        self._cond.wait()
                    self._shared += 1
        mine.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        mine = self._mine
        mine.depth -= 1
        if mine.depth == 0 and mine.counted:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
            self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._owner = None
                self._cond.notify_all()
