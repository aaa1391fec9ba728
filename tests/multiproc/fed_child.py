"""A federated client process for tests: ``python fed_child.py ADDRESS CLIENT_ID NUM_EXAMPLES [TOKEN]``.

Its fit is deterministic and known to the test: every array moves by
N(0, 1) noise drawn from ``default_rng([index, round])`` (index = the digits of
CLIENT_ID), computed in the weights' dtype. Prints ``exit ok`` after the server's
Shutdown, ``exit error ...`` otherwise.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from federated.client import start_client  # noqa: E402
from federated.runtime import Client  # noqa: E402


def child_update(weights: list[np.ndarray], index: int, rnd: int) -> list[np.ndarray]:
    """What the child returns from fit (the test recomputes it)."""
    rng = np.random.default_rng([index, rnd])
    return [w + rng.normal(size=w.shape).astype(w.dtype) for w in weights]


class DeterministicClient(Client):
    def __init__(self, index: int, n: int) -> None:
        self.index, self.n = index, n

    def fit(self, weights, config):
        return child_update(weights, self.index, int(config["round"])), self.n, {"index": float(self.index)}

    def evaluate(self, weights, config):
        return float(sum(float(np.sum(w)) for w in weights)), self.n, {}


def main() -> int:
    address, cid, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    token = sys.argv[4] if len(sys.argv) > 4 else None
    index = int("".join(ch for ch in cid if ch.isdigit()) or 0)
    print(f"client {cid} starting", flush=True)
    try:
        start_client(address, DeterministicClient(index, n), client_id=cid, token=token, reconnect_timeout=30)
    except Exception as e:  # noqa: BLE001
        print(f"exit error {type(e).__name__}: {e}", flush=True)
        return 1
    print("exit ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
