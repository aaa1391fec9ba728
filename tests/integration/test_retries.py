"""Deadlines and retries against a real server that is briefly unavailable."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import ShardUnavailableError
from ps.server import build_server

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)



def test_call_retries_until_the_shard_comes_up() -> None:
    port = free_port()
    servers = []

    def start_later() -> None:
        time.sleep(0.8)
        servers.append(build_server(ShardConfig(port=port))[0])

    t = threading.Thread(target=start_later)
    t.start()
    client = PSClient([f"127.0.0.1:{port}"], timeout=20, retries=8)
    try:
        t0 = time.monotonic()
        assert client.create_dense("w", (4,), "sgd")  # first attempts find nothing listening
        assert time.monotonic() - t0 >= 0.5
        np.testing.assert_array_equal(client.pull_dense("w"), np.zeros(4, np.float32))
    finally:
        t.join()
        client.close()
        for s in servers:
            s.stop(0)


def test_gives_up_with_a_typed_error() -> None:
    client = PSClient([f"127.0.0.1:{free_port()}"], timeout=2, retries=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError, match="UNAVAILABLE"):
            client.create_dense("w", (4,), "sgd")
        assert time.monotonic() - t0 < 60  # it gives up (2 retries of 2 s calls): a deadline, not a speed check
    finally:
        client.close()
