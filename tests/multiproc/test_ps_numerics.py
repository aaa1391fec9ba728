"""A 3-shard PS (three server processes on loopback) against torch.optim in this process.

Reference: the same gradient sequence fed to ``torch.optim.<X>`` on one full
tensor (dense) or, for sparse tables, to one torch optimizer *per row* that
sees only the steps in which that row was pushed (with duplicate ids summed).
That per-row optimizer is the definition of the lazy variants the PS
implements: a row's moments, accumulators and bias-correction step advance
only when the row is updated. Parameters must agree to 1e-6 relative.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.client import PSClient

CASES = [
    ("sgd", {"lr": 0.1}, lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01}, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
    ("momentum", {"lr": 0.05, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ("nesterov", {"lr": 0.05, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    ("adagrad", {"lr": 0.1}, lambda p: torch.optim.Adagrad(p, lr=0.1)),
    (
        "adagrad",
        {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator": 0.1, "weight_decay": 0.001},
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.001),
    ),
    ("adam", {"lr": 0.01}, lambda p: torch.optim.Adam(p, lr=0.01)),
    ("adam", {"lr": 0.01, "weight_decay": 0.01}, lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
]
IDS = [f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)]


@pytest.fixture(scope="module")
def client() -> PSClient:
    from ps.cli import start_local_shards, stop_processes

    # small chunks so every shard's slice spans several wire chunks
    procs, addresses = start_local_shards(3, ("--chunk-elems", "64"))
    c = PSClient(addresses, timeout=30)
    yield c
    c.close()
    stop_processes(procs)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_dense_matches_torch_optim(client: PSClient, case: int) -> None:
    name, hparams, make = CASES[case]
    rng = np.random.default_rng(case)
    init = rng.normal(size=(37, 11)).astype(np.float32)  # 407 elements: 136/136/135 per shard
    table = f"dense-{case}"
    client.create_dense(table, init.shape, name, init=init, **hparams)
    ref = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = make([ref])
    for _ in range(12):
        g = rng.normal(size=init.shape).astype(np.float32)
        ref.grad = torch.from_numpy(g.copy())
        opt.step()
        client.push_dense(table, g)
        torch.testing.assert_close(torch.from_numpy(client.pull_dense(table)), ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_sparse_matches_per_row_torch_optim(client: PSClient, case: int) -> None:
    name, hparams, make = CASES[case]
    rng = np.random.default_rng(100 + case)
    dim = 5
    table = f"sparse-{case}"
    client.create_sparse(table, dim, name, init="normal", seed=7, **hparams)
    universe = np.array([3, -8, 2**40 + 1, 17, 99, 123456789, -(2**62)], dtype=np.int64)
    first = client.pull_sparse(table, universe)
    refs = {int(i): torch.nn.Parameter(torch.from_numpy(first[k].copy())) for k, i in enumerate(universe)}
    opts = {i: make([p]) for i, p in refs.items()}
    for _ in range(10):
        ids = rng.choice(universe, size=6)  # subsets with duplicates: untouched rows must not move
        grads = rng.normal(size=(6, dim)).astype(np.float32)
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads):
            summed[i] = summed.get(i, 0) + g
        for i, g in summed.items():
            refs[i].grad = torch.from_numpy(np.asarray(g, np.float32))
            opts[i].step()
        client.push_sparse(table, ids, grads)
        got = client.pull_sparse(table, universe)
        want = torch.stack([refs[int(i)].detach() for i in universe])
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-7)


def test_torch_tensors_in_same_kind_out(client: PSClient) -> None:
    """torch in -> torch out (same device), with values equal to the numpy path."""
    client.create_dense("kinds", (6,), "sgd", lr=1.0)
    out = client.push_dense("kinds", torch.ones(6), return_params=True)
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    torch.testing.assert_close(out, torch.full((6,), -1.0))
    buf = torch.empty(2, 3)
    assert client.pull_dense("kinds", out=buf) is buf
    torch.testing.assert_close(buf.view(-1), out)
    client.create_sparse("kinds-s", 3, "sgd", lr=1.0)
    rows = client.pull_sparse("kinds-s", torch.tensor([[1, 2], [2, 5]]))
    assert isinstance(rows, torch.Tensor) and rows.shape == (2, 2, 3)
    assert torch.equal(rows[0, 1], rows[1, 0])  # the same id gives the same row


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_low_precision_wire(client: PSClient, wire: str) -> None:
    """fp16/bf16 on the wire: values round-trip to the wire precision; tables stay float32."""
    lp = PSClient(client.addresses, wire_dtype=wire)
    try:
        rng = np.random.default_rng(0)
        init = rng.normal(size=1000).astype(np.float32)
        lp.create_dense(f"wire-{wire}", (1000,), "sgd", lr=1.0, init=init)
        g = rng.normal(size=1000).astype(np.float32)
        lp.push_dense(f"wire-{wire}", g)
        exact = client.pull_dense(f"wire-{wire}")  # float32 pull of the float32 table
        g_wire = torch.from_numpy(g).to(getattr(torch, wire)).float().numpy()
        np.testing.assert_allclose(exact, init - g_wire, rtol=1e-6, atol=1e-7)
        got = lp.pull_dense(f"wire-{wire}")
        tol = 1e-3 if wire == "float16" else 8e-3
        np.testing.assert_allclose(got, exact, rtol=tol, atol=tol)
        lp.create_sparse(f"wire-s-{wire}", 4, "sgd", lr=1.0, init="uniform")
        np.testing.assert_allclose(
            lp.pull_sparse(f"wire-s-{wire}", [5, 6]), client.pull_sparse(f"wire-s-{wire}", [5, 6]), rtol=tol, atol=tol
        )
    finally:
        lp.close()


def test_table_smaller_than_the_cluster(client: PSClient) -> None:
    """2 elements on 3 shards: one shard holds nothing and is simply not asked."""
    client.create_dense("tiny", (2,), "sgd", lr=1.0, init=np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(client.push_dense("tiny", np.ones(2, np.float32), return_params=True), [0.0, 1.0])
    np.testing.assert_array_equal(client.pull_dense("tiny"), [0.0, 1.0])
