"""Low-precision rows over real gRPC (issue 18): a table created with ``row_dtype`` stores its rows
so, and a pull (PullSparse or a Step part) answers them as stored, whatever the client's wire dtype:
bf16 rows arrive as 2-byte values and widen exactly to fp32 (low 16 bits zero); a float16 wire does
not round them again. Reference: the table's own export (its stored rows), widened to fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.client import PSClient
from ps.config import ShardConfig
from ps.errors import InvalidArgumentError, ResourceExhaustedError
from ps.rowdtype import from_storage_array
from ps.server import build_server

DIM = 16


@pytest.fixture
def shard():
    server, port, sh = build_server(ShardConfig())
    yield f"127.0.0.1:{port}", sh
    server.stop(0)
    sh.close()


def _stored(sh, name: str, ids: np.ndarray) -> np.ndarray:
    """The table's stored rows of ``ids`` (its export), widened to fp32."""
    snap = sh.tables[name].export_state()
    rows = from_storage_array(np.asarray(snap["values"]), sh.tables[name].row_dtype).float().numpy()
    pos = {int(i): k for k, i in enumerate(snap["ids"])}
    return rows[[pos[int(i)] for i in ids]]


@pytest.mark.parametrize("row_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_rows_travel_as_stored(shard, row_dtype: str, wire: str) -> None:
    address, sh = shard
    ids = np.arange(0, 3000, 3, dtype=np.int64)
    with PSClient([address], worker="w0", wire_dtype=wire) as c:
        assert c.create_sparse("e", DIM, optimizer="adagrad", init="normal", seed=1, row_dtype=row_dtype, lr=0.1)
        assert c.describe("e")[0].spec.dtype == row_dtype
        first = c.pull_sparse("e", ids)
        c.push_sparse("e", ids, np.full((len(ids), DIM), 0.3, np.float32))
        rows = c.pull_sparse("e", ids[::-1])[::-1]
        step_rows, _ = c.step(pull_sparse={"e": ids}).sparse["e"]
    want = _stored(sh, "e", ids)
    assert rows.dtype == np.float32 and step_rows.dtype == np.float32
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(step_rows, want)
    assert not np.array_equal(first, rows)  # the push changed them
    if row_dtype == "bfloat16":
        assert not np.any(rows.view(np.uint32) & 0xFFFF)
    else:
        np.testing.assert_array_equal(rows, rows.astype(np.float16).astype(np.float32))


def test_low_precision_reply_size_is_checked_in_its_own_dtype() -> None:
    """A bf16 table's reply is 2 bytes a value: a pull whose fp32 reply would exceed the shard's
    message limit (1 MiB here) is served from a bf16 table, and refused only where the bf16 reply
    itself is over the limit."""
    server, port, sh = build_server(ShardConfig(max_message_bytes=1 << 20, chunk_elems=1 << 16))
    try:
        from ps.config import TableSpec

        sh.create_table(TableSpec("b", "sparse", dim=64, dtype="bfloat16"))
        sh.create_table(TableSpec("f", "sparse", dim=64))
        n = 5000  # fp32: 5000 x (256 + 8) > 1 MiB; bf16: 5000 x (128 + 8) < 1 MiB
        ids = np.arange(n, dtype=np.int64)
        with pytest.raises(ResourceExhaustedError, match="message limit"):
            sh.pull_sparse("f", ids)
        rows, _ = sh.pull_sparse("b", ids)
        assert rows.dtype == torch.bfloat16 and tuple(rows.shape) == (n, 64)
        with pytest.raises(ResourceExhaustedError, match="message limit"):
            sh.pull_sparse("b", np.arange(9000, dtype=np.int64))  # 9000 x 136 > 1 MiB
    finally:
        server.stop(0)
        sh.close()


def test_an_unknown_row_dtype_is_refused_naming_it(shard) -> None:
    address, sh = shard
    with PSClient([address]) as c:
        with pytest.raises(InvalidArgumentError, match=r"'e'.*int8"):
            c.create_sparse("e", DIM, row_dtype="int8")
    assert "e" not in sh.tables


def test_the_ctr_task_option_and_psembedding_choose_the_row_dtype(shard) -> None:
    """README: the worker chooses the row dtype, among others through the ``ctr`` task's ``--task-opt
    row_dtype=bfloat16`` and ``PSEmbedding(..., row_dtype=)``. The worker's own path: the option as
    `tessera worker` parses it (tessera.cli.parse_key_values) into load_task, then the tables
    created as worker 0 creates them (PSSync.create_tables, the trainer's) on a real shard; a
    PSEmbedding given float16 makes a float16 table the same way; an unknown row dtype is refused by
    PSEmbedding itself (ValueError naming it and the choices). Reference: the dtype each table was
    asked for, as the shard's DescribeTable and its own table report it; ctr's default stays float32."""
    import torch.nn as nn

    from tessera.cli import build_parser, parse_key_values
    from worker.binding import PSEmbedding
    from worker.paramsync import PSSync
    from worker.tasks import load_task

    address, sh = shard
    args = build_parser().parse_args(["worker", "--ps", address, "--task", "ctr", "--task-opt", "row_dtype=bfloat16",
                                      "--task-opt", "test_size=8"])
    task = load_task(args.task, seed=args.seed, **parse_key_values(args.task_opt))
    assert [m.row_dtype for m in task.model.modules() if isinstance(m, PSEmbedding)] == ["bfloat16"]
    assert [m.row_dtype for m in load_task("ctr", test_size=8).model.modules() if isinstance(m, PSEmbedding)] == ["float32"]

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = PSEmbedding("two/emb", 4, row_dtype="float16")

    with PSClient([address], timeout=10) as c:
        PSSync(task.model, c, task.name, dense_optimizer=task.dense_optimizer).create_tables(creator=True)
        PSSync(Two(), c, "two").create_tables(creator=True)
        assert c.describe("ctr/emb")[0].spec.dtype == "bfloat16" and c.describe("two/emb")[0].spec.dtype == "float16"
    assert sh.tables["ctr/emb"].row_dtype == torch.bfloat16 and sh.tables["two/emb"].row_dtype == torch.float16
    with pytest.raises(ValueError, match=r"PSEmbedding 'bad': row_dtype must be one of .*'bfloat16'.*got 'int8'"):
        PSEmbedding("bad", 4, row_dtype="int8")
