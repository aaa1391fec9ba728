"""The shard's own push protocol (ps/shard.py), without a socket: a streamed dense push
(``Shard.push_dense``, what PushDense decodes into) and ``Shard.step`` share one intake, validate
once and apply nothing they reject. Reference: plain SGD in numpy on the same gradients (fp32)."""
from __future__ import annotations

import pathlib
from typing import Iterator

import numpy as np
import pytest

from ps.config import OptimizerSpec, ShardConfig, TableSpec
from ps.consistency import SyncPolicy
from ps.errors import InvalidArgumentError, ShapeMismatchError
from ps.shard import PUSH_DENSE, PUSH_SPARSE, DenseBlock, DensePush, DensePushOutcome, PushChunk, Shard, StepPart

CHUNK, N, LR = 4, 40, 0.5  # 10 blocks: enough for the push to compute early (ps.table._EARLY_BLOCKS)


@pytest.fixture
def shard() -> Iterator[Shard]:
    sh = Shard(ShardConfig(chunk_elems=CHUNK))
    sh.create_table(TableSpec("w", "dense", shape=(N,), optimizer=OptimizerSpec("sgd", {"lr": LR})))
    sh.create_table(TableSpec("e", "sparse", dim=3, optimizer=OptimizerSpec("sgd", {"lr": LR})))
    yield sh
    sh.close()


def _chunks(head: DensePush, g: np.ndarray, last: bool = True) -> list[PushChunk]:
    out = [PushChunk(k, g[k : k + CHUNK], head=head if k == 0 else None) for k in range(0, len(g), CHUNK)]
    if last:
        out[-1] = PushChunk(out[-1].offset, out[-1].values, True, head=out[-1].head)
    return out


def test_streamed_push_answers_early_blocks_that_are_the_committed_values(shard: Shard) -> None:
    g = np.arange(N, dtype=np.float32) / 7
    head = DensePush("w", return_params=True, early=True, client="c", seq=1)
    out = list(shard.push_dense(iter(_chunks(head, g))))
    blocks, final = out[:-1], out[-1]
    assert isinstance(final, DensePushOutcome) and final.early and final.push.result.version == 1
    assert all(isinstance(b, DenseBlock) and b.early for b in blocks) and len(blocks) == N // CHUNK
    got = np.concatenate([b.block.numpy() for b in sorted(blocks, key=lambda b: b.offset)])
    want = np.zeros(N, np.float32) - np.float32(LR) * g  # SGD from zeros, in numpy
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(shard.dense("w").values(), want, rtol=1e-6)
    again = list(shard.push_dense(iter(_chunks(head, g))))[-1]  # a retried (client, seq): not applied twice
    assert isinstance(again, DensePushOutcome) and again.push.duplicate
    np.testing.assert_allclose(shard.dense("w").values(), want, rtol=1e-6)


def test_stream_without_its_last_chunk_applies_nothing(shard: Shard) -> None:
    head = DensePush("w")
    with pytest.raises(ShapeMismatchError, match="without its last chunk"):
        list(shard.push_dense(iter(_chunks(head, np.ones(N, np.float32), last=False))))
    bad = [PushChunk(0, np.ones(CHUNK, np.float32), head=head), PushChunk(CHUNK, np.ones(CHUNK, np.float32), True, table="x")]
    with pytest.raises(InvalidArgumentError, match="carries a chunk for 'x'"):
        list(shard.push_dense(iter(bad)))
    assert shard.dense("w").version == 0 and not shard.dense("w").values().any()


def test_a_bsp_push_without_a_worker_is_refused_on_every_path_by_one_check(shard: Shard) -> None:
    bsp = SyncPolicy(clock=0, sync=True)
    ids = np.array([1, 2], np.int64)
    rows = np.ones((2, 3), np.float32)
    attempts = [
        lambda: list(shard.push_dense(iter(_chunks(DensePush("w", policy=bsp), np.ones(N, np.float32))))),
        lambda: shard.step([StepPart("w", PUSH_DENSE, bsp, values=np.ones(N, np.float32))]),
        lambda: shard.step([StepPart("e", PUSH_SPARSE, bsp, values=rows, ids=ids)]),
        lambda: shard.push_sparse("e", ids, rows, policy=bsp),
    ]
    for attempt in attempts:
        with pytest.raises(InvalidArgumentError, match="a BSP push must name its worker"):
            attempt()
    assert shard.dense("w").version == 0 and all(r.pending() == 0 for r in shard.rounds.values())
    ps_dir = pathlib.Path(__file__).resolve().parents[2] / "ps"
    sites = sum(p.read_text().count("must name its worker") for p in ps_dir.glob("*.py"))
    assert sites == 1  # raised in one place (Shard._check_writer), whatever the path


def test_a_step_with_one_bad_part_applies_none(shard: Shard) -> None:
    good = StepPart("w", PUSH_DENSE, values=np.ones(N, np.float32), seq=1)
    bad = StepPart("e", PUSH_SPARSE, values=np.full((2, 3), np.nan, np.float32), ids=np.array([1, 2], np.int64), seq=2)
    with pytest.raises(Exception, match="'e'"):
        shard.step([good, bad], client="c")
    assert shard.dense("w").version == 0 and not shard.dense("w").values().any()
    out = shard.step([good], client="c")
    assert out[0].push is not None and out[0].version == 1
    np.testing.assert_allclose(shard.dense("w").values(), np.full(N, -LR, np.float32))
