"""Issue 10, the memory test: a shard *process* under a 30 s exhaustion attack stays within its
``--max-bytes`` budget plus a fixed overhead, answers every bad request with a clean status, and
a well-behaved worker sharing it never fails and keeps making progress.

The shard runs as ``tessera ps serve --max-bytes BUDGET`` (a child process on 127.0.0.1); this
process hosts
- the attacker: one thread cycling through every path the bounds cover (tables until refused,
  huge shapes / num_slots / dims, sparse rows with fresh ids until the budget refuses, admission
  sightings of never-seen ids, Joins under fresh names and with huge leases, oversized pulls and
  messages, pushes whose sizes do not match, malformed bytes), each as often as it can, plus
  STALLERS threads opening dense push streams that send one chunk and stop (aborted by the shard's
  ``--push-idle-timeout``). Requests go as raw bytes, so nothing client-side filters them;
- a well-behaved worker (its own PSClient, in a thread) that pulls and pushes a dense and a sparse
  table created before the attack, counting its steps per PROGRESS_WINDOW_S window;
- a sampler reading the shard's VmRSS from /proc every RSS_SAMPLE_S.

Every refusal must be a status from CLEAN_CODES (never INTERNAL / UNKNOWN, nor a timeout);
counts per path and code, RSS start / max / end and the worker's steps are printed (``-s``).
"""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from ps.cli import start_local_shards, stop_processes
from ps.client import PSClient
from ps.config import (
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    OptimizerSpec,
    TableSpec,
)
from ps.wire import spec_to_proto
from tessera.codec import pack
from tessera.v1 import ps_pb2 as pb

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc"),
]

MIB = 1 << 20
BUDGET = 128 * MIB  # the shard's --max-bytes
ATTACK_S = 30.0  # how long the attack runs (the whole test takes ~40-50 s)
# What the shard's RSS may grow beyond its start (after the worker's tables exist) + BUDGET.
# Measured on 2 busy cores, default glibc malloc, 3 runs: max RSS - start = 647, 663, 701 MiB, i.e.
# 519-573 MiB over the budget. It rises for ~15 s, then swings between ~430 and ~700 MiB over start
# without climbing further. Most of it is the allocator, not the shard's data: in the same attack
# with MALLOC_MMAP_THRESHOLD_=1048576 (large buffers always mmapped and returned on free) the peak
# over the budget fell from ~400 to 95 MiB (measured with 4096 tables), so glibc keeps freed buffers
# of up to 32 MiB (its dynamic mmap threshold) in its per-thread arenas: the 8 MiB id lists and the
# 65 MiB messages the shard refused, pull replies, the old arrays a growing sparse table copied
# from. The rest: sparse rows' versions / last touch / ids (24 bytes per allocated row, which the
# budget does not count: ~48 MiB for the dim-1 table's 2M rows), tables' and members' Python
# objects, requests in flight (id lists, the 1 MiB chunks of stalled pushes). 768 MiB leaves
# ~195 MiB above the highest run.
OVERHEAD = 768 * MIB
RSS_SAMPLE_S = 0.5
PROGRESS_WINDOW_S = 5.0
PUSH_IDLE_TIMEOUT_S = 1.0  # --push-idle-timeout: a stalled stream is aborted after this long
# --max-tables / --max-workers: below the defaults (4096 each) so that both are reached early in the
# 30 s on 2 busy cores (Joins run at ~100/s here: every membership change rechecks every table's
# BSP round, and dead members are forgotten to make room, so 4096 *live* ones never pile up in time)
MAX_TABLES = 1024
MAX_WORKERS = 512
STALLERS = 4  # dense push streams stalled at once
CALL_TIMEOUT_S = 20.0  # deadline of every attacker call (a DEADLINE_EXCEEDED is a failure: the shard did not answer)
WORKER_TIMEOUT_S = 20.0

SVC = "/tessera.v1.ParameterServer/"
# what a shard may answer bad input with. CANCELLED: only a stalled push stream, aborted by the
# shard's idle timeout (counted per path below)
CLEAN_CODES = frozenset({"OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS"})
STALL_CODES = frozenset({"CANCELLED"})

MAX_SEND = 200 * MIB  # the attacker's channel may send more than the shard accepts (64 MiB)
CHUNK = 1 << 18  # the shard's default --chunk-elems


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            except (OSError, AssertionError):
                return  # the process is gone: the test notices
            self.stop.wait(RSS_SAMPLE_S)


class Worker(threading.Thread):
    """A well-behaved worker: pull dense + sparse, push gradients, forever; records every step's time."""

    def __init__(self, address: str, ids: np.ndarray) -> None:
        super().__init__(name="good-worker", daemon=True)
        self.client = PSClient([address], timeout=WORKER_TIMEOUT_S, retries=0)
        self.ids = ids
        self.steps: list[float] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        rng = np.random.default_rng(1)
        try:
            while not self.stop.is_set():
                w = self.client.pull_dense("good_w")
                rows = self.client.pull_sparse("good_e", self.ids)
                assert np.isfinite(w).all() and np.isfinite(rows).all()
                self.client.push_dense("good_w", rng.normal(size=w.shape).astype(np.float32) * 1e-3)
                self.client.push_sparse("good_e", self.ids, rng.normal(size=rows.shape).astype(np.float32) * 1e-3)
                self.steps.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.client.close()


class Attacker:
    """Raw-bytes requests for every exhaustion path; ``counts[(path, code)]``."""

    def __init__(self, address: str) -> None:
        opts = [("grpc.max_send_message_length", MAX_SEND), ("grpc.max_receive_message_length", 64 * MIB)]
        self.channel = grpc.insecure_channel(address, options=opts)
        self._unary: dict[str, Any] = {}
        self.push_dense_stub = self.channel.stream_stream(SVC + "PushDense")
        self.pull_dense_stub = self.channel.unary_stream(SVC + "PullDense")
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bad: list[str] = []  # unexpected outcomes, with details
        self.lock = threading.Lock()
        self.rng = np.random.default_rng(7)
        self.n = 0  # fresh names and ids
        self.stopping = threading.Event()
        self.stats: dict[str, int] = Counter()

    def close(self) -> None:
        self.channel.close()

    def fresh(self) -> int:
        self.n += 1
        return self.n

    def fresh_ids(self, k: int) -> np.ndarray:
        # never seen before: a counter in the low bits, random high bits
        base = self.fresh() << 24
        return (np.arange(k, dtype=np.int64) + base) ^ (int(self.rng.integers(1, 1 << 20)) << 40)

    def record(self, path: str, code: str, details: str = "", allowed: frozenset[str] = CLEAN_CODES) -> str:
        with self.lock:
            self.counts[(path, code)] += 1
            if code not in allowed:
                self.bad.append(f"{path}: {code}: {details[:300]}")
        return code

    def call(self, path: str, method: str, raw: bytes, allowed: frozenset[str] = CLEAN_CODES) -> str:
        stub = self._unary.get(method)
        if stub is None:
            stub = self._unary[method] = self.channel.unary_unary(SVC + method)
        try:
            stub(raw, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            return self.record(path, e.code().name, e.details() or "", allowed)
        return self.record(path, "OK")

    def create(self, path: str, spec: TableSpec | pb.TableSpec) -> str:
        msg = spec if isinstance(spec, pb.TableSpec) else spec_to_proto(spec)
        return self.call(path, "CreateTable", pb.CreateTableRequest(spec=msg, num_shards=1).SerializeToString())

    def pull(self, path: str, table: str, ids: np.ndarray) -> str:
        return self.call(path, "PullSparse", pack(pb.PullSparseRequest(table=table), {15: np.ascontiguousarray(ids, np.int64)}))

    def push(self, path: str, table: str, ids: np.ndarray, dim: int) -> str:
        """Rows are made by pushes (pulls only read): zero gradients for fresh ``ids``."""
        head = pb.PushSparseRequest(table=table, dim=dim)
        return self.call(path, "PushSparse", pack(head, {14: np.ascontiguousarray(ids, np.int64), 15: np.zeros((len(ids), dim), np.float32)}))

    def push_stream(self, path: str, chunks: list[bytes], allowed: frozenset[str] = CLEAN_CODES) -> str:
        try:
            for _ in self.push_dense_stub(iter(chunks), timeout=CALL_TIMEOUT_S):
                pass
        except grpc.RpcError as e:
            return self.record(path, e.code().name, e.details() or "", allowed)
        return self.record(path, "OK")

    # ------------------------------------------------------------------ setup (part of the attack)
    def setup(self) -> None:
        """The attacker's own tables, made before the table count and the budget run out."""
        adam = OptimizerSpec("adam")
        for spec in (
            TableSpec("a-rows", "sparse", dim=64, optimizer=adam, initializer=InitializerSpec("normal")),
            TableSpec("a-rows-sgd", "sparse", dim=16),
            TableSpec("a-rows-d1", "sparse", dim=1),  # the most rows (ids) per budgeted byte
            TableSpec("a-evict", "sparse", dim=32, optimizer=OptimizerSpec("adagrad"), eviction=EvictionSpec(max_rows=20_000)),
            TableSpec("a-adm", "sparse", dim=32, admission=AdmissionSpec(min_count=3)),
            TableSpec("a-admp", "sparse", dim=32, admission=AdmissionSpec(probability=0.01)),
            TableSpec("a-wide", "sparse", dim=1 << 40),  # creating it holds nothing; pulling a row would
            TableSpec("a-stall", "dense", shape=(4 * CHUNK,)),
        ):
            assert self.create("setup", spec) == "OK", self.bad

    # ------------------------------------------------------------------ paths
    def tables(self) -> None:
        """Small tables under fresh names until refused (max_tables, or the budget), dense and sparse."""
        for _ in range(2 * MAX_TABLES if not self.counts["tables", "RESOURCE_EXHAUSTED"] else 32):  # the first call fills
            n = self.fresh()
            spec = TableSpec(f"t{n}", "dense", shape=(64,)) if n % 2 else TableSpec(f"t{n}", "sparse", dim=4)
            if self.create("tables", spec) != "OK":
                break

    def huge_tables(self) -> None:
        """Shapes / num_slots no budget allows: refused before anything is allocated."""
        n = self.fresh()
        self.create("huge_tables", TableSpec(f"h{n}", "dense", shape=(1 << 40,)))
        self.create("huge_tables", TableSpec(f"h{n}", "dense", shape=(1 << 31, 1 << 31, 1 << 31), optimizer=OptimizerSpec("adam")))
        self.create("huge_tables", TableSpec(f"h{n}", "dense", shape=(BUDGET // 4 + 1,)))
        spec = spec_to_proto(TableSpec(f"h{n}", "sparse", dim=8))
        spec.num_slots = 2**31 - 1
        self.create("huge_tables", spec)
        spec = spec_to_proto(TableSpec(f"h{n}", "sparse", dim=8))
        spec.dim = -1
        self.create("huge_tables", spec)

    def rows(self) -> None:
        """Sparse rows under fresh ids until the budget refuses (then every such push is refused; pulls
        of fresh ids hold nothing). The first call fills, however few cycles a loaded machine allows."""
        for _ in range(64 if not self.counts["rows", "RESOURCE_EXHAUSTED"] else 1):  # the first call fills
            if self.push("rows", "a-rows", self.fresh_ids(20_000), 64) != "OK":  # 15 MiB of rows + Adam state
                break
        self.push("rows", "a-rows-sgd", self.fresh_ids(50_000), 16)
        self.push("rows", "a-rows-d1", self.fresh_ids(250_000), 1)
        self.push("rows", "a-evict", self.fresh_ids(20_000), 32)  # recycled by LRU: bounded by max_rows
        self.pull("rows", "a-rows", self.fresh_ids(20_000))

    def sightings(self) -> None:
        """Never-seen ids on admission tables: counted in the fixed sketch, few (or no) rows made."""
        self.push("sightings", "a-adm", self.fresh_ids(100_000), 32)
        self.push("sightings", "a-admp", self.fresh_ids(50_000), 32)

    def joins(self) -> None:
        """Members under fresh names until refused (max_workers; dead ones make room), and bad names."""
        for _ in range(2 * MAX_WORKERS if not self.counts["joins", "RESOURCE_EXHAUSTED"] else 32):  # the first call fills
            if self.call("joins", "Join", pb.JoinRequest(worker=f"w{self.fresh()}").SerializeToString()) != "OK":
                break
        self.call("joins", "Join", pb.JoinRequest(worker="x" * 300).SerializeToString())
        self.call("joins", "Join", pb.JoinRequest(worker="").SerializeToString())

    def leases(self) -> None:
        """Joins asking for leases of years (capped at --max-lease) or negative ones."""
        for _ in range(8):
            self.call("leases", "Join", pb.JoinRequest(worker=f"L{self.fresh()}", lease_ms=1 << 62).SerializeToString())
        self.call("leases", "Join", pb.JoinRequest(worker=f"L{self.fresh()}", lease_ms=-1).SerializeToString())

    def big_pulls(self) -> None:
        """Pulls over max_ids_per_request, replies over the message limit, rows over max_rows."""
        self.pull("big_pulls", "a-rows", self.fresh_ids((1 << 20) + 1))  # 8 MiB of ids
        self.pull("big_pulls", "a-rows", self.fresh_ids(300_000))  # a 79 MB reply
        self.pull("big_pulls", "a-wide", self.fresh_ids(1))  # one row of 4 TiB
        self.push("big_pulls", "a-evict", self.fresh_ids(20_001), 32)  # a push beyond eviction.max_rows

    def big_messages(self) -> None:
        """A request over the shard's 64 MiB message limit (gRPC refuses it)."""
        self.pull("big_messages", "a-rows-sgd", np.zeros((65 * MIB) // 8, np.int64))

    def mismatched(self) -> None:
        """Pushes whose sizes do not match the table or themselves."""
        ids = self.rng.integers(0, 1 << 40, size=1000, dtype=np.int64)
        head = lambda dim: pb.PushSparseRequest(table="a-rows", dim=dim)
        self.call("mismatched", "PushSparse", pack(head(64), {14: ids, 15: np.zeros((999, 64), np.float32)}))
        self.call("mismatched", "PushSparse", pack(head(63), {14: ids, 15: np.zeros((1000, 63), np.float32)}))
        self.call("mismatched", "PushSparse", pack(head(1 << 40), {14: ids, 15: np.zeros(64, np.float32)}))
        self.call("mismatched", "PushSparse", pack(head(64), {14: b"\x01" * 7, 15: b""}))
        self.call("mismatched", "PushSparse", pack(head(64), {13: ids[:3], 14: ids, 15: np.zeros((1000, 64), np.float32)}))
        first = pb.DenseChunk(table="a-stall", offset=0, last=False)
        short = pack(first, {15: np.zeros(CHUNK - 1, np.float32)})
        self.push_stream("mismatched", [short])
        odd = pack(pb.DenseChunk(table="a-stall", offset=CHUNK + 1, last=True), {15: np.zeros(CHUNK, np.float32)})
        self.push_stream("mismatched", [odd])
        ok = pack(first, {15: np.zeros(CHUNK, np.float32)})
        self.push_stream("mismatched", [ok, pack(pb.DenseChunk(offset=0, last=True), {15: np.zeros(CHUNK, np.float32)})])
        self.push_stream("mismatched", [ok])  # ends without its last chunk
        self.push_stream("mismatched", [pack(pb.DenseChunk(table="a-rows", last=True), {15: np.zeros(4, np.float32)})])

    def malformed(self) -> None:
        """Random bytes to every method (and a truncated valid request)."""
        for method in ("CreateTable", "DescribeTable", "PullSparse", "PushSparse", "Join", "Heartbeat", "Stats", "Role"):
            raw = self.rng.bytes(int(self.rng.integers(1, 4096)))
            self.call("malformed", method, raw)
        good = pack(pb.PullSparseRequest(table="a-rows"), {15: np.arange(100, dtype=np.int64)})
        self.call("malformed", "PullSparse", good[:-17])
        self.push_stream("malformed", [self.rng.bytes(512), self.rng.bytes(512)])
        try:
            for _ in self.pull_dense_stub(self.rng.bytes(300), timeout=CALL_TIMEOUT_S):
                pass
            self.record("malformed", "OK")
        except grpc.RpcError as e:
            self.record("malformed", e.code().name, e.details() or "")

    def stall_forever(self) -> None:
        """(a staller thread) Dense push streams that send one chunk and stop, until the attack ends."""
        chunk = pack(pb.DenseChunk(table="a-stall", offset=0, last=False), {15: np.zeros(CHUNK, np.float32)})
        while not self.stopping.is_set():
            ended = threading.Event()

            def requests(ended: threading.Event = ended) -> Iterator[bytes]:
                yield chunk
                ended.wait(CALL_TIMEOUT_S)  # then stop sending: the shard's idle timeout must end the call

            try:
                for _ in self.push_dense_stub(requests(), timeout=CALL_TIMEOUT_S):
                    pass
                self.record("stalled_push", "OK", allowed=STALL_CODES)
            except grpc.RpcError as e:
                self.record("stalled_push", e.code().name, e.details() or "", allowed=STALL_CODES)
            finally:
                ended.set()


PATHS: list[Callable[[Attacker], None]] = [
    Attacker.joins, Attacker.leases, Attacker.tables, Attacker.huge_tables, Attacker.rows, Attacker.sightings,
    Attacker.big_pulls, Attacker.big_messages, Attacker.mismatched, Attacker.malformed,
]


def _windows(steps: list[float], t0: float, t1: float) -> list[int]:
    n = max(1, int((t1 - t0) // PROGRESS_WINDOW_S))
    out = [0] * n
    for t in steps:
        k = int((t - t0) // PROGRESS_WINDOW_S)
        if 0 <= k < n:
            out[k] += 1
    return out


def test_shard_memory_stays_within_budget_under_attack() -> None:
    procs, addresses = start_local_shards(
        1, (
            "--max-bytes", str(BUDGET), "--push-idle-timeout", str(PUSH_IDLE_TIMEOUT_S),
            "--max-tables", str(MAX_TABLES), "--max-workers", str(MAX_WORKERS),
        ), timeout=60
    )
    proc, address = procs[0], addresses[0]
    attacker: Attacker | None = None
    sampler = RssSampler(proc.pid)
    worker: Worker | None = None
    stallers: list[threading.Thread] = []
    try:
        # the well-behaved worker's tables, and its rows, exist before the attack
        with PSClient([address], timeout=30) as admin:
            admin.create_dense("good_w", (CHUNK + 1000,), "adam", lr=1e-3)
            admin.create_sparse("good_e", 16, "adagrad", lr=0.1)
            good_ids = np.arange(0, 2560, 10, dtype=np.int64)
            admin.push_sparse("good_e", good_ids, np.zeros((len(good_ids), 16), np.float32))
        worker = Worker(address, good_ids)
        worker.start()
        deadline = time.monotonic() + 10
        while len(worker.steps) < 5 and worker.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.error is None and len(worker.steps) >= 5, f"the worker did not start: {worker.error!r}"
        rss_start = rss_bytes(proc.pid)
        sampler.start()

        attacker = Attacker(address)
        t0 = time.monotonic()
        attacker.setup()
        stallers = [threading.Thread(target=attacker.stall_forever, name=f"staller-{i}", daemon=True) for i in range(STALLERS)]
        for t in stallers:
            t.start()
        cycles = 0
        end = t0 + ATTACK_S
        while time.monotonic() < end and worker.error is None and proc.poll() is None:
            for path in PATHS:
                path(attacker)
            cycles += 1
        attacker.stopping.set()
        for t in stallers:
            t.join(CALL_TIMEOUT_S + 5)
        t1 = time.monotonic()
        worker.stop.set()
        worker.join(WORKER_TIMEOUT_S + 5)
        sampler.stop.set()
        sampler.join(5)
        alive = proc.poll() is None
        rss_end = rss_bytes(proc.pid) if alive else 0
        # the shard still answers, and counted no internal error
        with PSClient([address], timeout=30) as admin:
            stats = admin.stats()[0]
        rss = [r for _, r in sampler.samples]
        rss_max = max(rss + [rss_start])
        windows = _windows(worker.steps, t0, t1)

        by_path: dict[str, Counter[str]] = {}
        for (path, code), n in sorted(attacker.counts.items()):
            by_path.setdefault(path, Counter())[code] = n
        print(f"\nattack: {t1 - t0:.1f} s, {cycles} cycles of {len(PATHS)} paths + {STALLERS} stalling streams at a time")
        for path, codes in by_path.items():
            print(f"  {path:<14} " + ", ".join(f"{c}={n}" for c, n in sorted(codes.items())))
        print(
            f"shard RSS (MiB): start {rss_start / MIB:.0f}, max {rss_max / MIB:.0f} (+{(rss_max - rss_start) / MIB:.0f}), "
            f"end {rss_end / MIB:.0f}; budget {BUDGET / MIB:.0f} + overhead {OVERHEAD / MIB:.0f} "
            f"=> limit {(rss_start + BUDGET + OVERHEAD) / MIB:.0f}; {len(rss)} samples"
        )
        print(
            f"shard: {len(stats.tables)} tables, {len(stats.workers)} members, pushes aborted idle "
            f"{stats.pushes_aborted_idle}, errors {dict(stats.errors)}"
        )
        trace = [round((r - rss_start) / MIB) for _, r in sampler.samples[:: max(1, int(2 / RSS_SAMPLE_S))]]
        print(f"shard RSS over start every 2 s (MiB): {trace}")
        print(f"worker: {len(worker.steps)} steps, per {PROGRESS_WINDOW_S:.0f} s window {windows}")

        assert alive, f"the shard process died (exit code {proc.returncode})"
        assert worker.error is None, f"the well-behaved worker failed: {worker.error!r}"
        assert all(w > 0 for w in windows), f"the worker made no progress in some {PROGRESS_WINDOW_S:.0f} s window: {windows}"
        assert not attacker.bad, "unclean answers:\n" + "\n".join(attacker.bad[:20])
        assert "INTERNAL" not in stats.errors and "UNKNOWN" not in stats.errors, stats.errors
        # every path was taken, and the bounds were reached (not just bad input refused)
        assert set(by_path) >= {p.__name__ for p in PATHS} | {"stalled_push"}, sorted(by_path)
        for path in ("tables", "rows", "joins", "big_pulls", "big_messages"):
            assert by_path[path]["RESOURCE_EXHAUSTED"] > 0, (path, by_path[path])
        assert by_path["stalled_push"]["CANCELLED"] > 0 and stats.pushes_aborted_idle > 0
        assert rss_max <= rss_start + BUDGET + OVERHEAD, (
            f"shard RSS reached {rss_max / MIB:.0f} MiB: over start {rss_start / MIB:.0f} + budget {BUDGET / MIB:.0f} "
            f"+ overhead {OVERHEAD / MIB:.0f} MiB"
        )
    finally:
        if attacker is not None:
            attacker.stopping.set()
        if worker is not None:
            worker.stop.set()
        sampler.stop.set()
        stop_processes(procs, grace=3.0)
        if attacker is not None:
            attacker.close()


# ====================================================================== issue 18: bytes per sparse row
ROWS_2M = 2_000_000
ROW_DIM = 64
POPULATE_BATCH = 1 << 15  # ids per push while filling (an 8 MiB fp32 request: its temporaries stay well under 10% of the table)
FAST_RSS_SAMPLE_S = 0.02  # spikes are short: sample often while the table fills
# what a row of the fp32 reference is: 64 fp32 values + 64 fp32 Adagrad accumulators
PAYLOAD_FP32_ADAGRAD = ROWS_2M * ROW_DIM * 4 * 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "row_dtype, optimizer, limit",
    [
        # 2M x 64 fp32 rows with elementwise Adagrad: RSS growth <= 1.25x their bytes
        ("float32", "adagrad", 1.25 * PAYLOAD_FP32_ADAGRAD),
        # the same rows in bf16 with row-wise Adagrad: <= 0.7x the fp32 payload
        ("bfloat16", "rowwise_adagrad", 0.7 * PAYLOAD_FP32_ADAGRAD),
    ],
    ids=["fp32-adagrad", "bf16-rowwise-adagrad"],
)
def test_sparse_rows_grow_a_shard_process_by_their_bytes(row_dtype: str, optimizer: str, limit: float) -> None:
    """Issue 18: 2,000,000 rows of dim 64 created in a ``tessera ps serve`` process through
    PSClient. Reference for the bytes: the fp32 rows plus fp32 Adagrad state (977 MiB). The shard's
    RSS growth (VmRSS after - before, measured from /proc) must stay within ``limit``, and no
    sample taken while the table filled (every 20 ms) may exceed the final growth by more than 10%
    (no transient 2x while storage grows). Measured: ~1.14x and ~0.40x, peak/final 1.00-1.01."""
    procs, addresses = start_local_shards(1, ("--max-bytes", "0"))
    client = PSClient(addresses, timeout=60.0, retries=0)
    try:
        spec = TableSpec("rows", "sparse", dim=ROW_DIM, dtype=row_dtype, optimizer=OptimizerSpec(optimizer, {}),
                         initializer=InitializerSpec("zeros"))
        client.create_table(spec)
        ids = np.random.default_rng(0).permutation(np.arange(ROWS_2M, dtype=np.int64)) * 7919 + 13
        zeros = np.zeros((POPULATE_BATCH, ROW_DIM), np.float32)  # rows are made by pushes (pulls only read)
        client.push_sparse("rows", ids[:4096], zeros[:4096])  # warm: server threads, channel buffers, the first chunk
        pid = procs[0].pid
        time.sleep(0.2)
        start = rss_bytes(pid)
        sampler = RssSampler(pid)
        sampler.samples.clear()
        global RSS_SAMPLE_S
        saved, RSS_SAMPLE_S = RSS_SAMPLE_S, FAST_RSS_SAMPLE_S
        try:
            sampler.start()
            t0 = time.monotonic()
            for a in range(4096, ROWS_2M, POPULATE_BATCH):
                b = ids[a : a + POPULATE_BATCH]
                client.push_sparse("rows", b, zeros[: len(b)])
            fill_s = time.monotonic() - t0
            time.sleep(0.3)
        finally:
            sampler.stop.set()
            sampler.join(5)
            RSS_SAMPLE_S = saved
        end = rss_bytes(pid)
        growth = end - start
        peak = max(r for _, r in sampler.samples) - start
        stats = next(t for t in client.stats()[0].tables if t.name == "rows")
        print(
            f"\n{row_dtype}/{optimizer}: {stats.rows} rows in {fill_s:.1f} s ({ROWS_2M / fill_s:,.0f} rows/s over the wire), "
            f"RSS growth {growth / MIB:.0f} MiB = {growth / PAYLOAD_FP32_ADAGRAD:.3f}x the fp32 payload "
            f"({PAYLOAD_FP32_ADAGRAD / MIB:.0f} MiB), limit {limit / PAYLOAD_FP32_ADAGRAD:.2f}x; peak {peak / MIB:.0f} MiB "
            f"({peak / growth:.3f}x the final growth, {len(sampler.samples)} samples)"
        )
        assert stats.rows == ROWS_2M
        assert growth <= limit, f"RSS grew {growth / MIB:.0f} MiB for 2M rows, over {limit / MIB:.0f} MiB"
        assert peak <= 1.10 * growth, f"RSS spiked to {peak / MIB:.0f} MiB over start, final {growth / MIB:.0f} MiB"
    finally:
        client.close()
        stop_processes(procs)


# ====================================================================== issue 18: the disk tier's RAM
TIER_CHILD = r'''
import json, sys, tempfile, time
import numpy as np
import torch
from ps.config import InitializerSpec, OptimizerSpec, TableSpec
from ps.table import SparseTable
from ps.tier import ResidentBudget

torch.set_num_threads(1)  # on a busy 2-core box two OpenMP threads make every gather 5-10x slower

def rss():  # the process's own memory: anonymous pages (file-backed ones are the libraries it maps, and the page cache)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

rows, dim = int(sys.argv[1]), int(sys.argv[2])
spec = TableSpec("e", "sparse", dim=dim, optimizer=OptimizerSpec("adagrad", {}), initializer=InitializerSpec("uniform"))
row_nbytes = SparseTable(spec, 0, 1)._store.row_nbytes
budget = ResidentBudget(rows // 4 * row_nbytes)
with tempfile.TemporaryDirectory() as d:
    t = SparseTable(spec, 0, 1, resident_budget=budget, spill_dir=d)
    t.push(np.arange(16, dtype=np.int64), np.zeros((16, dim), np.float32))
    # the test's own inputs (11 MiB) before the start: they are not the table's
    ids = np.random.default_rng(0).permutation(np.arange(rows, dtype=np.int64)) * 7919 + 13
    fill = np.full((1 << 15, dim), 0.0, np.float32)  # (written, so resident now: np.zeros' pages would come later)
    start = peak = rss()
    for a in range(0, rows, 1 << 15):  # pushes create rows (a pull is a read): a zero gradient leaves Adagrad's rows at init
        b = ids[a : a + (1 << 15)]
        t.push(b, fill[: len(b)])
        peak = max(peak, rss())
    rng = np.random.default_rng(1)
    for _ in range(30):  # training-like traffic over the whole table: most pulls hit the disk tier
        b = rng.choice(ids, 4096, replace=False)
        t.push(b, np.full((4096, dim), 0.01, np.float32), base_versions=t.pull(b)[1])
        peak = max(peak, rss())
    m = t.memory_stats()
    print(json.dumps({"start": start, "peak": peak, "end": rss(), "budget": budget.limit, "index": m.index_bytes,
                      "metadata": m.metadata_bytes, "chunk": m.chunk_rows * row_nbytes, "resident_rows": m.resident_rows,
                      "cold_rows": m.cold_rows, "disk": m.disk_bytes, "payload": rows * row_nbytes}))
'''


@pytest.mark.timeout(120)
def test_a_table_4x_its_resident_budget_keeps_rss_within_the_budget_plus_its_bookkeeping() -> None:
    """Issue 18, disk tier: 400k rows of dim 64 (fp32, Adagrad: ~230 MB with metadata) in a table
    whose resident budget is a quarter of that, filled and then trained on with random batches,
    in a fresh process. RSS growth (peak, of anonymous pages from after the test's own inputs were made:
    a library mapped meanwhile, ~4 MiB, is not the table's; 118-125 MiB today, of 132 allowed) must stay
    within the budget plus the stated overhead:
    the id index and the metadata of every row (both tiers: they stay in RAM), one chunk of
    rounding, and 48 MiB for a request's temporaries (a 32k-row pull, its reply, the allocator)."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", TIER_CHILD, "400000", "64"], capture_output=True, text=True, timeout=100,
                       check=False, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    overhead = r["index"] + r["metadata"] + r["chunk"] + 48 * MIB
    growth = r["peak"] - r["start"]
    print(f"\ntier: {r['resident_rows']:,} resident / {r['cold_rows']:,} cold rows, payload {r['payload'] / MIB:.0f} MiB, "
          f"budget {r['budget'] / MIB:.0f} MiB, RSS growth peak {growth / MIB:.0f} MiB (end {(r['end'] - r['start']) / MIB:.0f}), "
          f"allowed {(r['budget'] + overhead) / MIB:.0f} MiB (index {r['index'] / MIB:.0f}, metadata {r['metadata'] / MIB:.0f}, "
          f"chunk {r['chunk'] / MIB:.1f}); disk {r['disk'] / MIB:.0f} MiB")
    assert r["cold_rows"] >= 3 * r["resident_rows"] * 0.9
    assert growth <= r["budget"] + overhead, "the disk tier's process held more than its budget plus bookkeeping"
    # the id index (every row's id, both tiers: in RAM by design, allowed above) aside, most rows are on disk
    assert growth - r["index"] < 0.6 * r["payload"], "most of the table must not be resident"
