"""Issue 15 item 7: a numpy federated client needs neither torch nor scikit-learn. In a fresh
interpreter, ``import federated`` plus ``start_client`` (and a whole training run of a numpy
``Client`` against a real server) leave ``torch`` and ``sklearn`` out of ``sys.modules``; the import
stays within the goal's memory (80 MB RSS; its time is measured by ``bench/fed.py``)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from federated.config import ServerConfig
from federated.server import FedServer
from federated.strategy import make_strategy

IMPORT_ONLY = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import federated
    from federated import Client, start_client
    took = time.perf_counter() - t0
    # peak RSS of this interpreter (VmHWM: ru_maxrss would count the forking parent's memory)
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"torch": "torch" in sys.modules, "sklearn": "sklearn" in sys.modules, "seconds": took,
                      "rss_mb": hwm / 1024}))
""")

CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from federated import Client, start_client

    class AddOne(Client):
        def fit(self, weights, config):
            return [w + 1 for w in weights], 5, {"mean": float(np.mean(weights[0]))}

        def evaluate(self, weights, config):
            return float(sum(np.sum(w) for w in weights)), 5, {}

    stats = start_client(sys.argv[1], AddOne(), client_id="np0", reconnect_timeout=30)
    print(json.dumps({"torch": "torch" in sys.modules, "sklearn": "sklearn" in sys.modules,
                      "contributed": stats.contributed, "tasks": stats.tasks}))
""")


def run_python(code: str, *args: str, timeout: float = 60) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(90)
def test_importing_the_client_sdk_pulls_in_no_torch_or_sklearn() -> None:
    got = run_python(IMPORT_ONLY)
    assert got["torch"] is False and got["sklearn"] is False, got
    assert got["rss_mb"] <= 80, got  # the goal; torch alone is ~200 MB


@pytest.mark.timeout(90)
def test_numpy_client_trains_against_a_real_server_without_torch() -> None:
    w0 = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(3, np.float64)]
    server = FedServer(ServerConfig(rounds=2, min_clients=1, eval_every=1, eval_fraction=1.0, round_timeout=30,
                                    wait_timeout=60), make_strategy("fedavg"), w0)
    port = server.start()
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("history", server.run()), daemon=True)
    t.start()
    try:
        got = run_python(CLIENT, f"127.0.0.1:{port}")
        t.join(30)
    finally:
        server.stop(grace=0.5)
    assert got == {"torch": False, "sklearn": False, "contributed": 2, "tasks": 4}, got  # 2 fits + 2 evaluations
    # reference: FedAvg of one client that adds 1, twice, computed here in the weights' own dtypes
    for w, ref in zip(server.weights, w0):
        assert w.dtype == ref.dtype
        np.testing.assert_array_equal(w, ref + 2)
    assert [r["answered"] for r in out["history"]] == [1, 1]
