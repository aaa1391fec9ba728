"""A real slow link (network namespace + veth + tc netem) for experiments: RPCs from inside the namespace
reach a shard on the host across the link and, where the kernel has netem, take the delay; RPCs from the
host do not. Needs root and iproute2 (skipped elsewhere)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ps.client import PSClient
from ps.config import ShardConfig
from ps.server import build_server
from tessera.service import ServerSecurity
from worker.netem import NetemLink, namespaces_available, netem_available

pytestmark = pytest.mark.skipif(namespaces_available() is not None, reason=str(namespaces_available()))

PROBE = """
import sys, time
from ps.client import PSClient
c = PSClient([sys.argv[1]], timeout=10)
c.stats()
t = time.perf_counter(); c.stats(); print(time.perf_counter() - t)
"""


@pytest.mark.parametrize("delay_ms", [0, 40])
def test_rpcs_from_the_namespace_cross_the_link(delay_ms: int) -> None:
    if delay_ms and netem_available():
        pytest.skip(str(netem_available()))
    with NetemLink(delay_ms, name=f"tt{time.monotonic_ns() % 10000}") as link:
        # an open server on a private namespace link: allowed only when asked for (--insecure)
        server, port, shard = build_server(ShardConfig(host=link.host_address), security=ServerSecurity(insecure=True))
        try:
            address = f"{link.host_address}:{port}"
            with PSClient([address], timeout=10) as c:  # from the host: no delay
                c.stats()
                direct = []  # the best of 5: one call can meet a busy CPU, not five
                for _ in range(5):
                    t = time.perf_counter()
                    c.stats()
                    direct.append(time.perf_counter() - t)
            out = subprocess.run(link.prefix() + [sys.executable, "-c", PROBE, address], capture_output=True, text=True, timeout=240)
            assert out.returncode == 0, out.stderr[-2000:]
            delayed = float(out.stdout.split()[-1])
        finally:
            server.stop(0)
            shard.close()
    assert delayed >= delay_ms / 1000, delayed  # one round trip: the request leaves through the link
    if delay_ms:  # the host's own calls do not cross the link: faster than its delay
        assert min(direct) < delay_ms / 1000, direct
