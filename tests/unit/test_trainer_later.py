"""The trainer's ``_Later``: a push_fetch completed on the thread that first asks for it. Reference: a
``concurrent.futures.Future`` (the pool's), whose ``result()`` gives every caller the same value or error."""
from __future__ import annotations

import threading

import pytest

from worker.trainer import _Later


def test_the_work_runs_once_on_the_asking_thread_and_every_caller_gets_its_value() -> None:
    calls: list[str] = []

    def finish() -> tuple[int, str]:
        calls.append(threading.current_thread().name)
        return 7, "fetched"

    later = _Later(finish)
    assert calls == []  # nothing runs until asked
    assert later.result() == later.result() == (7, "fetched")
    assert calls == [threading.current_thread().name]


def test_an_error_is_raised_to_every_caller() -> None:
    def finish() -> None:
        raise ConnectionError("shard 1 gone")

    later = _Later(finish)
    for _ in range(2):
        with pytest.raises(ConnectionError, match="shard 1 gone"):
            later.result()
