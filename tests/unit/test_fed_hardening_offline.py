"""Federated hardening (issue 10), without sockets: where the server's randomness comes
from, secure aggregation that finds and names a wrong share, token files only their
owner can read."""
from __future__ import annotations

import numpy as np

from federated.config import ServerConfig
from federated.orchestrator import Orchestrator
from federated.privacy import DPConfig
from federated.registry import Registry
from federated.strategy import make_strategy

W0 = [np.zeros((3, 4), np.float32)]
IDS = [f"c{i:02d}" for i in range(20)]


def _orch(**cfg: object) -> Orchestrator:
    return Orchestrator(ServerConfig(fraction=0.5, **cfg), make_strategy("fedavg"), Registry(), W0)  # type: ignore[arg-type]


def _draws(o: Orchestrator) -> list[list[str]]:
    return [o._sample(IDS, 0.5, rnd, 0, 0) for rnd in range(1, 31)]


def test_dp_client_sampling_is_unpredictable_and_plain_sampling_reproducible() -> None:
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    a, b = _draws(_orch(dp=dp)), _draws(_orch(dp=dp))
    assert a != b  # 30 draws of 10 of 20: equal by chance with probability 1/184756^30
    assert all(len(s) == 10 and len(set(s)) == 10 for s in a)
    assert _draws(_orch()) == _draws(_orch())  # without DP the public seed reproduces the samples
    assert _draws(_orch(insecure_reproducible_seed=3)) == _draws(_orch(insecure_reproducible_seed=3))
