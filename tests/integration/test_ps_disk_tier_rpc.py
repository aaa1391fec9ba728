"""A shard with a resident budget (`tessera ps serve --max-resident-bytes`) over real gRPC: rows beyond
the budget go to the disk tier, and every pull and push answers bit-identically to a shard that keeps all
rows in RAM (the reference: the same requests against a shard without a budget)."""
from __future__ import annotations

import numpy as np

from ps.client import PSClient
from ps.config import ShardConfig
from ps.server import build_server


def _run(tmp_path, budget: int) -> tuple[np.ndarray, int, int]:
    server, port, shard = build_server(ShardConfig(max_resident_bytes=budget, spill_dir=str(tmp_path)))
    client = PSClient([f"127.0.0.1:{port}"], worker="w0")
    try:
        client.create_sparse("emb", 16, optimizer="adagrad", init="normal", seed=3, lr=0.1)
        rng = np.random.default_rng(0)
        for _ in range(6):  # touch 6 x 4000 distinct rows, pushing gradients to each batch
            ids = np.unique(rng.integers(0, 60_000, 4000)).astype(np.int64)
            rows = client.pull_sparse("emb", ids)
            client.push_sparse("emb", ids, (rows * 0.5 + 0.01).astype(np.float32))
        probe = np.arange(0, 60_000, 7, dtype=np.int64)
        final = client.pull_sparse("emb", probe)
        table = shard.tables["emb"]
        return final, table.resident_rows, table.cold_rows
    finally:
        client.close()
        server.stop(0)
        shard.close()


def test_disk_tier_answers_like_all_in_ram(tmp_path) -> None:
    ram, _, cold0 = _run(tmp_path / "a", 0)
    tiered, resident, cold = _run(tmp_path / "b", 256 << 10)  # 256 KiB of rows: most of them spill
    assert cold0 == 0
    assert cold > resident > 0, (resident, cold)
    np.testing.assert_array_equal(tiered, ram)
