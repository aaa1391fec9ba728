"""PS throughput benchmark: how close does the parameter server get to the bare transport?

Measures, on loopback, with every server in its own process:

(a) raw gRPC echo (python grpc, generic handlers, raw bytes, no protobuf) of
    the dense payload: a bidi stream of 1 MiB chunks (the chunk the PS uses,
    2^18 float32), the same over two echo servers at once (half each, like two
    shards), and sequential unary calls of 16 MiB; the 1-server stream is timed
    again between the PS dense runs of (b) (``grpc_stream_with_Nshard``: the
    baseline sampled in the same minutes, so load from elsewhere that comes and
    goes hits both). ``raw_grpc_gbps`` is the best of them: the baseline is the
    best bare gRPC transport.
(b) PS dense push + pull of a 64 MiB float32 table (16M elements) on 1 and on 2
    shard processes (``ps.cli.start_local_shards``), with Adam and with SGD on
    the shards, three ways each: "separate" = push_dense(grad) then
    pull_dense(); "fused" = push_dense(grad, return_params=True); "step" =
    PSClient.step(push t, pull t+1). ``dense_pushpull_gbps``: the best Adam
    way / shard count, ``dense_ratio`` = that / raw_grpc_gbps;
    ``dense_sgd_ratio`` = the best SGD way / raw_grpc_gbps (same bytes);
    ``adam_limit_ratio`` = (best raw gRPC round trip of the same bytes + torch's
    fused Adam on the same tensor in this process) / the best PS Adam push+pull
    time: 1.0 means the PS adds nothing beyond moving the bytes and the maths.
(c) PS sparse pull_sparse + push_sparse of 4096 unique random ids x 64 dims from
    a 1M-row table (adagrad, rows created before timing), 2 shards, fresh ids
    each repeat, and the same bytes by PSClient.step (push the last batch's
    rows, pull the next's): ``sparse_rows_per_s``, ``sparse_gbps`` (4096*64*4
    bytes / time, the better way), ``sparse_ratio`` = sparse_gbps /
    raw_grpc_gbps, and ``sparse_vs_raw_same_size`` against a raw unary echo of
    the same 1 MiB. Also the CPU per op of both shard processes (every thread) and of this
    client: ``sparse_step_shard_cpu_ms``, ``sparse_step_client_cpu_ms`` (and ``sparse_pullpush_*``),
    with the mean wall time of the window they were measured in (``sparse_step_cpu_window_ms``: no
    process can spend more than the machine's cores times that); each transport's suffixed ``_grpc``
    / ``_bulk``, unsuffixed the default transport's (bulk where measured). With ``--only sparse``,
    then the same against 2 shards whose sparse tables do no work
    (bench/no_table_shard.py: the real servicer, validation and transports, a table that takes no
    time), the same keys prefixed ``no_table_`` (``no_table_sparse_ratio``): the ceiling no table
    code could pass on the machine it runs on.
(d) plain TCP echo of the dense payload (sendall in a thread + recv_into):
    ``raw_tcp_gbps``.

Transports (``--transports``, default both, same shards, same run): every PS figure is measured over
gRPC (names as above) and over the shards' bulk port (``tessera ps serve --bulk-port``; names suffixed
``_bulk``, the dense tables their own). The goal ratios (``dense_sgd_ratio``, ``adam_limit_ratio``,
``sparse_ratio``) take the best of them; ``*_grpc`` / ``*_bulk`` keys give each transport's alone.
The baselines stay raw gRPC and raw TCP.

Throughput is always *payload bytes one way per second of round trip* (the
payload goes out and comes back within the timed interval), in GB/s (1e9 B/s).
Each measurement runs after a warm-up, several times (variants interleaved so
noise hits them alike); "best" is from the minimum time, "median" from the
median time.

Run (about a minute on 2 cores)::

    python bench/ps_throughput.py                 # full run
    python bench/ps_throughput.py --quick         # smoke run (~20 s): 16 MiB table, 2 shards only, 100k rows
    python bench/ps_throughput.py --json-out bench/out/ps.json
    python bench/ps_throughput.py --shard-omp-threads 1   # shards with OMP_NUM_THREADS=1 (A/B)

It prints a table and, as its last line, one line of JSON (keys
raw_grpc_gbps, raw_tcp_gbps, dense_pushpull_gbps, dense_ratio, dense_sgd_ratio,
adam_limit_ratio (with raw_grpc_roundtrip_ms, torch_fused_adam_ms,
dense_adam_ms behind it), sparse_rows_per_s, sparse_gbps, sparse_ratio,
sparse_vs_raw_same_size, dense_vs_tcp, per-variant figures, ...). Every child process is stopped on exit, also on Ctrl-C.

(f) issue 32, from ``bench/ps_kernel.py --served`` (a child process): ``kernel_vs_fbgemm`` (the table's
    in-process pull + push of 4,096 Zipf(1.1) ids x 64 from 1M rows, row-wise Adagrad, against
    FBGEMM's fused CPU kernel on the same ids; goal <= 1) and ``served_vs_fbgemm`` (one shard process on
    the default transport, by PSClient.step; goal <= 3), min of repeats (``*_median`` too); where
    ``fbgemm-gpu-cpu`` does not import, ``fbgemm`` says why and those keys are absent.
(e) issue 18, from bench/ps_memory.py's fresh child processes: ``sparse_bytes_per_row_ratio``
    (RSS growth of 2M fp32 Adagrad rows of dim 64 over their payload; baseline
    ``raw_bytes_per_row_ratio``) and ``populate_rows_per_s`` (rows created per second, best and
    median; baseline ``raw_fill_rows_per_s``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

MiB = 1 << 20
CHUNK_BYTES = (1 << 18) * 4  # the PS dense wire chunk: 2^18 float32 = 1 MiB
UNARY_BYTES = 16 * MiB
ECHO_UNARY = "/bench.Echo/Unary"
ECHO_STREAM = "/bench.Echo/Stream"
SHARD_ARGS = ("--bulk-port", "0")  # every shard also serves its bulk port; a transport="grpc" client ignores it


# =========================================================================== echo servers (child processes)
def _quiet_signals(stop: threading.Event | None = None) -> None:
    """SIGTERM/SIGINT end the child quietly (the parent stops it; Ctrl-C reaches it too)."""
    def handler(*_: object) -> None:
        if stop is not None:
            stop.set()
        else:
            os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def serve_grpc_echo() -> None:
    import grpc

    from tessera.rpc import server_options

    class Echo(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails):  # type: ignore[override]
            if details.method == ECHO_UNARY:
                return grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
            if details.method == ECHO_STREAM:
                return grpc.stream_stream_rpc_method_handler(lambda it, ctx: (r for r in it))
            return None

    stop = threading.Event()
    _quiet_signals(stop)
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=server_options())
    server.add_generic_rpc_handlers((Echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    stop.wait()
    server.stop(0).wait()


def serve_tcp_echo() -> None:
    _quiet_signals()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    print(f"listening on 127.0.0.1:{srv.getsockname()[1]}", flush=True)

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(CHUNK_BYTES)
        mv = memoryview(buf)
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    return
                conn.sendall(mv[:n])

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def spawn_echo(kind: str, procs: list[subprocess.Popen], timeout: float = 30.0) -> str:
    """Start this script as an echo server of ``kind`` ("grpc"/"tcp"); returns its address."""
    from ps.cli import (
        read_first_line,  # imported here: echo children stay free of torch
    )

    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", kind],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    procs.append(p)
    line = read_first_line(p, time.monotonic() + timeout)
    if "listening on" not in line:
        raise RuntimeError(f"{kind} echo server failed to start: {line!r}")
    return line.split("listening on ")[1].split()[0]


# =========================================================================== timing
@dataclass
class Result:
    name: str
    payload: int  # bytes one way per timed call
    times: list[float]
    group: str = ""
    rows: int = 0  # sparse: rows per timed call
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def gbps(self) -> float:
        return self.payload / self.best / 1e9

    @property
    def gbps_median(self) -> float:
        return self.payload / self.median / 1e9


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Time each fn ``repeats`` times after ``warmup`` untimed calls, alternating between fns."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# =========================================================================== (a) raw gRPC
def bench_grpc(addrs: list[str], nbytes: int, repeats: int, warmup: int, small: int = 0) -> list[Result]:
    import grpc
    import numpy as np

    from tessera.rpc import channel_options

    payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    chunks = [payload[i : i + CHUNK_BYTES] for i in range(0, nbytes, CHUNK_BYTES)]
    bigs = [payload[i : i + UNARY_BYTES] for i in range(0, nbytes, UNARY_BYTES)]
    channels = [grpc.insecure_channel(a, options=channel_options()) for a in addrs]
    try:
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=30)
        streams = [ch.stream_stream(ECHO_STREAM) for ch in channels]
        unary = channels[0].unary_unary(ECHO_UNARY)
        pool = ThreadPoolExecutor(max_workers=len(addrs))

        def stream_one(k: int, parts: list[bytes]) -> int:
            return sum(len(r) for r in streams[k](iter(parts), timeout=60))

        def stream1() -> None:
            assert stream_one(0, chunks) == nbytes

        half = (len(chunks) + 1) // 2

        def stream2() -> None:
            futs = [pool.submit(stream_one, 0, chunks[:half]), pool.submit(stream_one, 1, chunks[half:])]
            assert sum(f.result() for f in futs) == nbytes

        def unary16() -> None:
            assert sum(len(unary(b, timeout=60)) for b in bigs) == nbytes

        small_payload = payload[:small]

        def unary_small() -> None:
            assert len(unary(small_payload, timeout=60)) == small

        fns: dict[str, Callable[[], object]] = {"grpc_stream": stream1, "grpc_unary": unary16}
        if small:
            fns["grpc_unary_small"] = unary_small
        if len(addrs) > 1:
            fns["grpc_stream_2srv"] = stream2
        t = interleaved(fns, repeats, warmup)
        pool.shutdown()
    finally:
        for ch in channels:
            ch.close()
    notes = {
        "grpc_stream": "bidi stream, 1 MiB chunks, 1 server",
        "grpc_stream_2srv": "bidi stream, 1 MiB chunks, 2 servers (half each)",
        "grpc_unary": "unary echo, 16 MiB messages, sequential",
        "grpc_unary_small": f"unary echo of {small} bytes (the sparse payload)",
    }
    return [Result(k, small if k == "grpc_unary_small" else nbytes, v, "raw-small" if k == "grpc_unary_small" else "raw", note=notes[k])
            for k, v in t.items()]


class StreamEcho:
    """The raw gRPC bidi-stream echo round trip of ``nbytes`` in 1 MiB chunks (the ``grpc_stream``
    figure), as a callable that bench_dense interleaves with the PS runs: the baseline is sampled in
    the same minutes as what it is compared with, so load that comes and goes hits both alike."""

    def __init__(self, addr: str, nbytes: int) -> None:
        import grpc
        import numpy as np

        from tessera.rpc import channel_options

        payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        self.chunks = [payload[i : i + CHUNK_BYTES] for i in range(0, nbytes, CHUNK_BYTES)]
        self.nbytes = nbytes
        self.channel = grpc.insecure_channel(addr, options=channel_options())
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stream = self.channel.stream_stream(ECHO_STREAM)

    def __call__(self) -> None:
        assert sum(len(r) for r in self.stream(iter(self.chunks), timeout=60)) == self.nbytes

    def close(self) -> None:
        self.channel.close()


# =========================================================================== (d) raw TCP
def bench_tcp(addr: str, nbytes: int, repeats: int, warmup: int) -> Result:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(os.urandom(nbytes))
    back = bytearray(nbytes)
    view = memoryview(back)
    try:
        def roundtrip() -> None:
            sender = threading.Thread(target=sock.sendall, args=(payload,))
            sender.start()
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:])
                if not n:
                    raise RuntimeError("tcp echo closed the connection")
                got += n
            sender.join()

        t = interleaved({"tcp": roundtrip}, repeats, warmup)["tcp"]
        if bytes(view[:64]) != bytes(payload[:64]):
            raise RuntimeError("tcp echo returned different bytes")
    finally:
        sock.close()
    return Result("tcp_echo", nbytes, t, "raw", note="sendall thread + recv_into, 1 server")


# =========================================================================== (b) PS dense
def bench_dense(
    addrs: list[str], numel: int, repeats: int, warmup: int, echo: StreamEcho | None = None, transports: tuple[str, ...] = ("grpc",),
) -> list[Result]:
    """Adam and SGD tables of ``numel`` float32, three ways each: push then pull ("separate"), one
    push that returns the values ("fused"), and ``PSClient.step`` (one Step call per shard when the
    slice fits ``step_inline_bytes``, else, async as here, the fused push), per transport (``grpc``;
    ``bulk``: the shards' bulk port, names suffixed ``_bulk``, its own tables). ``echo``: the raw gRPC
    stream echo of the same bytes, timed between them (a "raw" result, so the baseline is the best of
    every sample)."""
    import numpy as np

    from ps.client import PSClient

    s = len(addrs)
    grad = np.random.default_rng(2).standard_normal(numel, dtype=np.float32) * np.float32(1e-3)
    push_t: dict[str, list[float]] = {t: [] for t in transports}
    pull_t: dict[str, list[float]] = {t: [] for t in transports}
    out = np.empty(numel, np.float32)
    fns: dict[str, Callable[[], object]] = {}
    clients = {
        # the server's message limit is 64 MiB: a step whose slice fits goes as one Step call per shard
        tr: PSClient(addrs, timeout=300, max_request_bytes=60 << 20, transport="grpc" if tr == "grpc" else "auto")
        for tr in transports
    }
    try:
        for tr, c in clients.items():
            c.wait_ready()
            sfx = _suffix(tr)
            for opt, hp in (("adam", {"lr": 1e-3}), ("sgd", {"lr": 1e-3})):
                name = f"bench_{opt}{sfx}"
                c.create_dense(name, (numel,), opt, **hp)

                def separate(name: str = name, c: PSClient = c, timed: bool = opt == "adam", tr: str = tr) -> None:
                    t0 = time.perf_counter()
                    c.push_dense(name, grad)
                    t1 = time.perf_counter()
                    p = c.pull_dense(name, out=out)
                    if timed:
                        push_t[tr].append(t1 - t0)
                        pull_t[tr].append(time.perf_counter() - t1)
                    assert p.size == numel

                def fused(name: str = name, c: PSClient = c) -> None:
                    p = c.push_dense(name, grad, return_params=True, out=out)
                    assert p.size == numel

                def step(name: str = name, c: PSClient = c) -> None:
                    r = c.step(push_dense={name: grad}, pull_dense={name: out})
                    assert r.dense[name].size == numel

                fns[f"{opt}_separate{sfx}"], fns[f"{opt}_fused{sfx}"], fns[f"{opt}_step{sfx}"] = separate, fused, step
            if tr == "bulk":
                c.describe(f"bench_adam{sfx}")
                if not all(st.replicas[st.cur].bulk is not None for st in c._shards):
                    raise RuntimeError("the shards serve no bulk port (start them with --bulk-port)")
        if echo is not None:
            fns["echo"] = echo
        t = interleaved(fns, repeats, warmup)
        expect = (warmup + repeats) * 3
        for tr, c in clients.items():
            versions = {opt: c.describe(f"bench_{opt}{_suffix(tr)}")[0].version for opt in ("adam", "sgd")}
            if versions != {"adam": expect, "sgd": expect}:
                raise RuntimeError(f"dense tables ({tr}) at versions {versions}, expected {expect} each")
    finally:
        for c in clients.values():
            c.close()
    nbytes = numel * 4
    notes = {"separate": "push_dense + pull_dense", "fused": "push_dense(return_params=True)", "step": "PSClient.step (Step RPC)"}
    res = []
    for tr in transports:
        sfx = _suffix(tr)
        for opt in ("adam", "sgd"):
            for way in ("separate", "fused", "step"):
                grp = "dense" if opt == "adam" else "dense-sgd"
                res.append(Result(f"{'dense' if opt == 'adam' else 'sgd'}_{s}shard_{way}{sfx}", nbytes, t[f"{opt}_{way}{sfx}"], grp,
                                  note=f"{opt}: {notes[way]}{' (bulk)' if sfx else ''}"))
        # halves of "separate" (one-way figures: payload / time of that half), for the analysis
        res.append(Result(f"dense_{s}shard_push_only{sfx}", nbytes, push_t[tr][warmup:], "dense-part", note="adam: push half of separate (one way)"))
        res.append(Result(f"dense_{s}shard_pull_only{sfx}", nbytes, pull_t[tr][warmup:], "dense-part", note="adam: pull half of separate (one way)"))
    if echo is not None:
        res.append(Result(f"grpc_stream_with_{s}shard", nbytes, t["echo"], "raw",
                          note=f"grpc_stream again, interleaved with the {s}-shard PS runs above"))
    return res


def _suffix(transport: str) -> str:
    return "" if transport == "grpc" else f"_{transport}"


def bench_adam_math(numel: int, repeats: int, warmup: int) -> Result:
    """torch's fused Adam (torch.optim.Adam(fused=True)) on a ``numel`` float32 tensor, in this process:
    the arithmetic a PS Adam push must do at least."""
    import torch

    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel) * 1e-3
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    # one thread (as a shard runs it) and torch's default: the faster counts (the stricter limit;
    # an OpenMP pool on a loaded machine can be slower than one thread)
    default = torch.get_num_threads()
    best: dict[int, list[float]] = {}
    for n in sorted({1, default}):
        torch.set_num_threads(n)
        best[n] = interleaved({"adam": opt.step}, repeats, warmup)["adam"]
    torch.set_num_threads(default)
    n = min(best, key=lambda k: min(best[k]))
    return Result("torch_fused_adam", numel * 4, best[n], "math", note=f"torch.optim.Adam(fused=True).step, {n} thread(s) (faster of 1 and {default})")


# =========================================================================== (c) PS sparse
def _proc_cpu_s(pids: list[int]) -> float:
    """CPU seconds of every thread of ``pids`` so far (Linux schedstat, ns resolution; 0 elsewhere)."""
    from ps_server_model import cpu_seconds  # a sibling script, as ps_memory below

    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue  # no /proc/PID/task: not Linux, or the process ended
    return total


def bench_sparse(
    addrs: list[str], table_rows: int, batch: int, dim: int, repeats: int, warmup: int, pids: list[int] | None = None,
    cpu: dict[str, dict[str, float]] | None = None, transports: tuple[str, ...] = ("grpc",), populate: bool = True,
) -> tuple[list[Result], float]:
    """Per transport (names suffixed ``_bulk`` for the bulk port; one table for all): pull + push,
    and the same by Step. ``pids``: the shard processes; ``cpu`` (filled if given): per variant, the
    shards' CPU ms per op (every thread, schedstat) and this client's (process CPU around the op only).
    ``populate``: create the table's rows first and check that it holds them (False for shards whose
    tables hold nothing: bench/no_table_shard.py)."""
    import numpy as np

    from ps.client import PSClient

    name = "bench_sparse"
    rng = np.random.default_rng(3)
    clients = {tr: PSClient(addrs, timeout=300, transport="grpc" if tr == "grpc" else "auto") for tr in transports}
    try:
        c0 = next(iter(clients.values()))
        c0.wait_ready()
        c0.create_sparse(name, dim, "adagrad", lr=0.01)
        t0 = time.perf_counter()
        step = 1 << 17
        for lo in range(0, table_rows if populate else 0, step):  # rows are made by pushes (pulls only read)
            fill = np.arange(lo, min(table_rows, lo + step), dtype=np.int64)
            c0.push_sparse(name, fill, np.zeros((len(fill), dim), np.float32))
        populate_s = time.perf_counter() - t0
        rows = sum(t.rows for s in c0.stats() for t in s.tables if t.name == name)
        if populate and rows != table_rows:
            raise RuntimeError(f"sparse table holds {rows} rows, expected {table_rows}")
        n = warmup + repeats
        grads = rng.standard_normal((batch, dim), dtype=np.float32) * np.float32(1e-2)
        fns: dict[str, Callable[[], object]] = {}
        for tr, c in clients.items():
            sfx = _suffix(tr)
            it = iter([rng.choice(table_rows, batch, replace=False).astype(np.int64) for _ in range(2 * n + 1)])

            def pullpush(c: PSClient = c, it: Iterator[np.ndarray] = it) -> None:
                ids = next(it)
                r = c.pull_sparse(name, ids)
                assert r.shape == (batch, dim)
                c.push_sparse(name, ids, grads)

            prev = [next(it)]

            def step_(c: PSClient = c, it: Iterator[np.ndarray] = it, prev: list[np.ndarray] = prev) -> None:
                # push the rows pulled last time, pull the next batch's: one Step call per shard
                ids = next(it)
                r = c.step(push_sparse={name: (prev[0], grads)}, pull_sparse={name: ids})
                assert r.sparse[name][0].shape == (batch, dim)
                prev[0] = ids

            fns[f"sparse{sfx}"], fns[f"step{sfx}"] = pullpush, step_
        if cpu is None:
            t = interleaved(fns, repeats, warmup)
        else:  # the same alternation, with the CPU of the shards and of this client per op
            for _ in range(warmup):
                for fn in fns.values():
                    fn()
            t = {k: [] for k in fns}
            acc = {k: [0.0, 0.0, 0.0] for k in fns}  # shard CPU, client CPU, wall of the measured window
            for _ in range(repeats):
                for k, fn in fns.items():
                    w0 = time.perf_counter()
                    s0 = _proc_cpu_s(pids or [])
                    cc0 = time.process_time()
                    t0 = time.perf_counter()
                    fn()
                    t[k].append(time.perf_counter() - t0)
                    acc[k][1] += time.process_time() - cc0
                    acc[k][0] += _proc_cpu_s(pids or []) - s0
                    acc[k][2] += time.perf_counter() - w0
            for k, (sc, cc, wc) in acc.items():
                cpu[k] = {"shard_cpu_ms": 1e3 * sc / repeats, "client_cpu_ms": 1e3 * cc / repeats, "window_ms": 1e3 * wc / repeats}
    finally:
        for c in clients.values():
            c.close()
    res = []
    for tr in transports:
        sfx = _suffix(tr)
        res += [
            Result(f"sparse_{len(addrs)}shard_pullpush{sfx}", batch * dim * 4, t[f"sparse{sfx}"], "sparse", rows=batch,
                   note=f"{batch} ids x {dim} from {table_rows} rows: pull_sparse + push_sparse{' (bulk)' if sfx else ''}"),
            Result(f"sparse_{len(addrs)}shard_step{sfx}", batch * dim * 4, t[f"step{sfx}"], "sparse-step", rows=batch,
                   note=f"the same bytes by PSClient.step (one Step call per shard){' (bulk)' if sfx else ''}"),
        ]
    return res, populate_s


def sparse_figures(res: list[Result], raw_best: Result, raw_small: Result, cpu: dict[str, dict[str, float]] | None = None) -> dict[str, object]:
    """The sparse keys: the best way over every transport (``sparse_gbps``, ``sparse_ratio``, ...), and
    per transport its pull+push and Step figures (gRPC's unsuffixed, ``_bulk`` for the bulk port) with
    ``sparse_ratio_grpc`` / ``sparse_ratio_bulk``; with ``cpu``, the CPU per op of each."""
    sparse = max(res, key=lambda r: r.gbps)
    out: dict[str, object] = {
        "raw_grpc_sparse_size_gbps": round(raw_small.gbps, 5), "sparse_best": sparse.name,
        "sparse_gbps": round(sparse.gbps, 5), "sparse_gbps_median": round(sparse.gbps_median, 5),
        "sparse_ratio": round(sparse.gbps / raw_best.gbps, 5), "sparse_vs_raw_same_size": round(sparse.gbps / raw_small.gbps, 5),
        "sparse_ms": round(sparse.best * 1e3, 3), "sparse_ms_median": round(sparse.median * 1e3, 3),
        "sparse_rows_per_s": round(sparse.rows / sparse.best, 1), "sparse_rows_per_s_median": round(sparse.rows / sparse.median, 1),
    }
    default = "bulk" if any(r.name.endswith("_bulk") for r in res) else "grpc"
    for tr in ("grpc", "bulk"):
        sfx = _suffix(tr)
        mine = {r.group: r for r in res if r.name.endswith("_bulk") == (tr == "bulk")}
        if not mine:
            continue
        pp, st = mine["sparse"], mine["sparse-step"]
        out.update({
            f"sparse_pullpush_gbps{sfx}": round(pp.gbps, 5), f"sparse_step_gbps{sfx}": round(st.gbps, 5),
            f"sparse_pullpush_ms{sfx}": round(pp.best * 1e3, 3), f"sparse_step_ms{sfx}": round(st.best * 1e3, 3),
            f"sparse_ratio_{tr}": round(max(pp.gbps, st.gbps) / raw_best.gbps, 5),
        })
        if cpu:
            # CPU per op (every thread of both shard processes; this client process around the op only),
            # suffixed _grpc / _bulk; unsuffixed: the default transport's (the bulk port where measured:
            # what `tessera ps serve` and a PSClient do with no transport flags)
            for way, key in (("step", "step"), ("pullpush", "sparse")):
                c = cpu[f"{key}{sfx}"]
                figs = {f"sparse_{way}_shard_cpu_ms": c["shard_cpu_ms"], f"sparse_{way}_client_cpu_ms": c["client_cpu_ms"],
                        f"sparse_{way}_cpu_window_ms": c["window_ms"]}
                out.update({f"{k}_{tr}": round(v, 3) for k, v in figs.items()})
                if tr == default:
                    out.update({k: round(v, 3) for k, v in figs.items()})
    return out


def kernel_figures(quick: bool) -> dict[str, object]:
    """(f): ``bench/ps_kernel.py --served`` in a child process (its own torch threads and shard); its
    FBGEMM comparisons, prefixed where they would clash with this script's keys."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_kernel.py"), "--served",
           *(["--quick"] if quick else ["--repeats", "60"])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"bench/ps_kernel.py failed ({r.returncode}): {r.stderr[-800:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    keys = ("kernel_vs_fbgemm", "kernel_vs_fbgemm_median", "served_vs_fbgemm", "served_vs_fbgemm_median", "served_vs_kernel",
            "kernel_vs_numpy", "fbgemm")
    out: dict[str, object] = {k: got[k] for k in keys if k in got and not isinstance(got[k], dict)}
    for k in ("kernel", "served", "fbgemm"):
        if isinstance(got.get(k), dict):
            out[f"row_{k}_min_ms"], out[f"row_{k}_median_ms"] = got[k]["min_ms"], got[k]["median_ms"]
    return out


def sparse_only(
    args: argparse.Namespace, nbytes: int, batch: int, dim: int, sparse_rows: int, repeats: int, warmup: int,
    sparse_repeats: int, sparse_warmup: int, procs: list, t_start: float, transports: tuple[str, ...],
) -> int:
    """``--only sparse``: the raw gRPC baselines (the same echo servers) and the sparse rows; a table
    and one line of JSON with the sparse keys of a full run. Then the same ops against shards whose
    sparse tables do no work (bench/no_table_shard.py): the same keys prefixed ``no_table_``, the
    ceiling that no table code could pass on this machine."""
    from ps.cli import start_local_shards, stop_processes

    log("starting echo servers")
    grpc_addrs = [spawn_echo("grpc", procs), spawn_echo("grpc", procs)]
    raw = bench_grpc(grpc_addrs, nbytes, repeats, warmup + 1, small=batch * dim * 4)
    stop_processes(procs)
    procs.clear()
    shard_procs, addrs = start_local_shards(2, SHARD_ARGS)
    procs += shard_procs
    log(f"PS sparse: populating {sparse_rows} rows, then {batch} ids x {dim}")
    cpu: dict[str, dict[str, float]] = {}
    res, populate_s = bench_sparse(
        addrs, sparse_rows, batch, dim, sparse_repeats, sparse_warmup, [p.pid for p in shard_procs], cpu, transports,
    )
    stop_processes(procs)
    procs.clear()
    log("the same against shards whose sparse tables do no work (bench/no_table_shard.py)")
    no_table = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_table_shard.py")]
    shard_procs, addrs = start_local_shards(2, SHARD_ARGS, command=no_table)
    procs += shard_procs
    nt_cpu: dict[str, dict[str, float]] = {}
    nt_res, _ = bench_sparse(
        addrs, sparse_rows, batch, dim, sparse_repeats, sparse_warmup, [p.pid for p in shard_procs], nt_cpu, transports,
        populate=False,
    )
    stop_processes(procs)
    procs.clear()
    for r in nt_res:
        r.name, r.note = f"no_table_{r.name}", f"{r.note}; tables that do no work"
    raw_best = max(raw, key=lambda r: r.gbps)
    raw_small = next(r for r in raw if r.name == "grpc_unary_small")
    for r in raw + res + nt_res:
        print(f"{r.name:<40} {r.gbps:>9.3f} {r.gbps_median:>9.3f} {r.gbps / raw_best.gbps:>10.3f} {r.best * 1e3:>9.1f} {r.median * 1e3:>9.1f}  {r.note}")
    out = {
        "raw_grpc_gbps": round(raw_best.gbps, 4), "raw_grpc_best": raw_best.name, "raw_grpc_gbps_median": round(raw_best.gbps_median, 4),
        **sparse_figures(res, raw_best, raw_small, cpu),
        **{f"no_table_{k}": v for k, v in sparse_figures(nt_res, raw_best, raw_small, nt_cpu).items() if not k.startswith("raw_")},
        "sparse_table_rows": sparse_rows, "sparse_populate_s": round(populate_s, 3),
        **kernel_figures(args.quick),
        "sparse_only": True, "quick": args.quick, "cpus": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t_start, 1), "loadavg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


# =========================================================================== main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 MiB table, 100k rows, fewer repeats")
    ap.add_argument("--json-out", default=None, help="also write the JSON result to this path")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 10, quick 3; sparse: 6x / 4x that)")
    ap.add_argument("--dense-mib", type=int, default=None, help="dense table / echo payload in MiB (default 64, quick 16)")
    ap.add_argument("--sparse-rows", type=int, default=None, help="sparse table rows (default 1M, quick 100k)")
    ap.add_argument("--shards", default=None, help="shard counts for the dense benchmark (default 1,2; quick 2)")
    ap.add_argument(
        "--shard-omp-threads", type=int, default=None,
        help="set OMP_NUM_THREADS for the shard processes (default: inherit, i.e. the system as shipped)",
    )
    ap.add_argument(
        "--only", choices=("dense", "sparse"), default=None,
        help="dense: only the raw transports, torch's Adam and the dense push+pull (~1/3 the time); "
        "sparse: only the raw gRPC echo baselines and the sparse rows (~1 min); neither reports memory figures",
    )
    ap.add_argument(
        "--transports", default="grpc,bulk",
        help="the PS's transports to measure, same run, same shards (default grpc,bulk: gRPC, and the shards' "
        "--bulk-port; the goal ratios take the best, *_grpc keys gRPC's alone)",
    )
    ap.add_argument("--serve", choices=("grpc", "tcp"), help=argparse.SUPPRESS)  # internal: run an echo server
    args = ap.parse_args(argv)

    if args.serve == "grpc":
        serve_grpc_echo()
        return 0
    if args.serve == "tcp":
        serve_tcp_echo()
        return 0

    quick = args.quick
    dense_only = args.only == "dense"
    repeats = args.repeats or (3 if quick else 10)
    warmup = 1
    sparse_repeats = repeats * (4 if quick else 6)
    sparse_warmup = 3
    dense_mib = args.dense_mib or (16 if quick else 64)
    sparse_rows = args.sparse_rows or (100_000 if quick else 1_000_000)
    shard_counts = [int(x) for x in (args.shards or ("2" if quick else "1,2")).split(",") if x]
    transports = tuple(t for t in args.transports.split(",") if t)
    if not transports or not set(transports) <= {"grpc", "bulk"}:
        ap.error(f"--transports: grpc and/or bulk, got {args.transports!r}")
    if not shard_counts or min(shard_counts) < 1:
        ap.error("--shards needs at least one shard count >= 1")
    nbytes = dense_mib * MiB
    numel = nbytes // 4
    batch, dim = 4096, 64

    from ps.cli import start_local_shards, stop_processes

    if args.shard_omp_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.shard_omp_threads)  # inherited by start_local_shards' children
    # Ctrl-C / SIGTERM: stop every child (finally below) and exit quietly. Ctrl-C also reaches the
    # children (same process group), so a call in flight may fail with UNAVAILABLE before the
    # KeyboardInterrupt surfaces: remember that we were interrupted.
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    t_start = time.perf_counter()
    procs: list[subprocess.Popen] = []
    echo_procs: list[subprocess.Popen] = []
    results: list[Result] = []
    extra: dict[str, object] = {}
    sparse_cpu: dict[str, dict[str, float]] = {}  # the shards' and this client's CPU per sparse op (bench_sparse fills it)
    try:
        if args.only == "sparse":
            return sparse_only(args, nbytes, batch, dim, sparse_rows, repeats, warmup, sparse_repeats, sparse_warmup, procs, t_start, transports)
        # (a) + (d): bare transports
        log("starting echo servers")
        grpc_addrs = [spawn_echo("grpc", procs), spawn_echo("grpc", procs)]
        tcp_addr = spawn_echo("tcp", procs)
        log(f"raw gRPC echo, {dense_mib} MiB")
        results += bench_grpc(grpc_addrs, nbytes, repeats, warmup + 1, small=batch * dim * 4)
        log(f"raw TCP echo, {dense_mib} MiB")
        results.append(bench_tcp(tcp_addr, nbytes, repeats, warmup + 1))
        echo = StreamEcho(grpc_addrs[0], nbytes)  # sampled again between the PS dense runs
        echo_procs = list(procs)
        procs.clear()
        log(f"torch fused Adam on {numel:,} float32 in this process (the arithmetic of a PS Adam push)")
        results.append(bench_adam_math(numel, repeats, warmup + 1))

        # (b) + (c): the PS
        for s in shard_counts:
            log(f"starting {s} shard process(es)")
            shard_procs, addrs = start_local_shards(s, SHARD_ARGS)
            procs += shard_procs
            log(f"PS dense {dense_mib} MiB adam, {s} shard(s)")
            results += bench_dense(addrs, numel, repeats, warmup, echo, transports)
            if s == 2 and not dense_only:
                log(f"PS sparse: populating {sparse_rows} rows, then {batch} ids x {dim}")
                res, populate_s = bench_sparse(
                    addrs, sparse_rows, batch, dim, sparse_repeats, sparse_warmup, [p.pid for p in shard_procs], sparse_cpu, transports,
                )
                results += res
                extra["sparse_populate_s"] = round(populate_s, 3)
            stop_processes(procs)
            procs.clear()
        echo.close()
        stop_processes(echo_procs)
        if 2 not in shard_counts and not dense_only:
            log("starting 2 shard processes for the sparse benchmark")
            shard_procs, addrs = start_local_shards(2, SHARD_ARGS)
            procs += shard_procs
            res, populate_s = bench_sparse(
                addrs, sparse_rows, batch, dim, sparse_repeats, sparse_warmup, [p.pid for p in shard_procs], sparse_cpu, transports,
            )
            results += res
            extra["sparse_populate_s"] = round(populate_s, 3)
        if not dense_only:
            # (e) issue 18: bytes per sparse row and row creation rate (bench/ps_memory.py's children)
            import ps_memory

            mem_rows = 100_000 if quick else 2_000_000
            log(f"PS memory: RSS of {mem_rows:,} fp32 Adagrad rows, populate rate (fresh processes)")
            # quick: one populate run per side (each is a fresh process that starts torch; the median of one is that run)
            extra.update(ps_memory.memory_figures(mem_rows, 1 if quick else 3, threads=1))
            log("row kernel, one served shard and FBGEMM on one workload (bench/ps_kernel.py --served)")
            extra.update(kernel_figures(quick))
    except BaseException as e:
        if not interrupted and not isinstance(e, KeyboardInterrupt):
            raise
        log(f"interrupted ({type(e).__name__}); stopping child processes")
        return 130 if not interrupted or interrupted[0] == signal.SIGINT else 143
    finally:
        stop_processes(procs + echo_procs)

    by = {r.name: r for r in results}
    raw = [r for r in results if r.group == "raw" and r.name.startswith("grpc_")]
    raw_best = max(raw, key=lambda r: r.gbps)
    raw_grpc = raw_best.gbps
    dense = [r for r in results if r.group == "dense"]
    dense_best = max(dense, key=lambda r: r.gbps)
    sgd_best = max((r for r in results if r.group == "dense-sgd"), key=lambda r: r.gbps)
    adam_math = by["torch_fused_adam"]
    raw_small = by["grpc_unary_small"]
    tcp = by["tcp_echo"]
    # 1.0: the PS's Adam push+pull costs no more than moving its bytes (best raw gRPC round trip of
    # the same bytes) plus torch's fused Adam on the same tensor
    adam_limit = (raw_best.best + adam_math.best) / dense_best.best
    per_transport: dict[str, float] = {}  # the two dense goal ratios of each transport alone
    for tr in transports:
        mine = [r for r in results if r.name.endswith("_bulk") == (tr == "bulk")]
        per_transport[f"dense_sgd_ratio_{tr}"] = round(max(r.gbps for r in mine if r.group == "dense-sgd") / raw_grpc, 4)
        per_transport[f"adam_limit_ratio_{tr}"] = round(
            (raw_best.best + adam_math.best) / min(r.best for r in mine if r.group == "dense"), 4)
    if not dense_only:
        sparse = max((r for r in results if r.group in ("sparse", "sparse-step")), key=lambda r: r.gbps)

    # ------------------------------------------------------------------ table
    hdr = f"{'measurement':<26} {'GB/s best':>9} {'GB/s med':>9} {'x raw gRPC':>10} {'ms min':>9} {'ms med':>9}  notes"
    lines = [hdr, "-" * len(hdr)]
    last_group = None
    for r in results:
        if last_group is not None and r.group != last_group:
            lines.append("")
        last_group = r.group
        note = r.note + (f"; {r.rows / r.best:,.0f} rows/s best, {r.rows / r.median:,.0f} median" if r.rows else "")
        lines.append(
            f"{r.name:<26} {r.gbps:>9.3f} {r.gbps_median:>9.3f} {r.gbps / raw_grpc:>10.3f} {r.best * 1e3:>9.1f} {r.median * 1e3:>9.1f}  {note}"
        )
    wall = time.perf_counter() - t_start
    print(
        f"\nPS throughput on loopback: payload bytes one way per second of round trip (GB = 1e9 B); "
        f"dense {dense_mib} MiB, {repeats} repeats after warm-up; "
        f"{'no sparse' if dense_only else f'sparse {sparse_repeats} repeats'}; {os.cpu_count()} CPUs\n"
    )
    print("\n".join(lines))
    print(
        f"\nraw gRPC baseline = {raw_best.name} ({raw_grpc:.3f} GB/s); best PS dense = {dense_best.name} "
        f"({dense_best.gbps:.3f} GB/s, {dense_best.gbps / raw_grpc:.1%} of raw gRPC, {dense_best.gbps / tcp.gbps:.1%} of raw TCP); "
        f"wall {wall:.1f} s\n"
        f"dense_sgd_ratio {sgd_best.gbps / raw_grpc:.3f} (goal >= 0.8; {sgd_best.name}); adam_limit_ratio {adam_limit:.3f} "
        f"(goal >= 0.85: (raw round trip {raw_best.best * 1e3:.1f} ms + fused Adam {adam_math.best * 1e3:.1f} ms) / PS Adam "
        f"{dense_best.best * 1e3:.1f} ms)\n"
        + "".join(f"{k} {v:.3f}; " for k, v in per_transport.items()) + "\n"
    )
    if not dense_only:
        print(
            f"sparse {sparse.gbps:.3f} GB/s = {sparse.gbps / raw_grpc:.2f} x raw_grpc_gbps (goal >= 0.5; "
            f"{sparse.name}), {sparse.gbps / raw_small.gbps:.2f} x raw gRPC at the sparse size\n"
            f"sparse_bytes_per_row_ratio {extra['sparse_bytes_per_row_ratio']:.3f} (goal <= 1.25; raw numpy arrays "
            f"{extra['raw_bytes_per_row_ratio']:.3f}); populate_rows_per_s {extra['populate_rows_per_s']:,} best, "
            f"{extra['populate_rows_per_s_median']:,} median (goal >= 1M; raw fill {extra['raw_fill_rows_per_s']:,})\n"
        )

    # ------------------------------------------------------------------ JSON
    out: dict[str, object] = {
        "raw_grpc_gbps": round(raw_grpc, 4),
        "raw_grpc_best": raw_best.name,
        "raw_tcp_gbps": round(tcp.gbps, 4),
        "dense_pushpull_gbps": round(dense_best.gbps, 4),
        "dense_best": dense_best.name,
        "dense_ratio": round(dense_best.gbps / raw_grpc, 4),
        "dense_vs_tcp": round(dense_best.gbps / tcp.gbps, 4),
        "dense_sgd_gbps": round(sgd_best.gbps, 4),
        "dense_sgd_best": sgd_best.name,
        "dense_sgd_ratio": round(sgd_best.gbps / raw_grpc, 4),
        "adam_limit_ratio": round(adam_limit, 4),
        "raw_grpc_roundtrip_ms": round(raw_best.best * 1e3, 3),
        "torch_fused_adam_ms": round(adam_math.best * 1e3, 3),
        "dense_adam_ms": round(dense_best.best * 1e3, 3),
        "raw_grpc_gbps_median": round(raw_best.gbps_median, 4),
        "raw_tcp_gbps_median": round(tcp.gbps_median, 4),
        "dense_pushpull_gbps_median": round(dense_best.gbps_median, 4),
        "dense_mib": dense_mib,
        "sparse_table_rows": sparse_rows,
        "repeats": repeats,
        "quick": quick,
        "cpus": os.cpu_count(),
        "shard_omp_threads": args.shard_omp_threads,
        "wall_s": round(wall, 1),
        "only": args.only,
        "transports": list(transports),
        **per_transport,
        **extra,
    }
    if not dense_only:
        out.update(sparse_figures([r for r in results if r.group in ("sparse", "sparse-step")], raw_best, raw_small, sparse_cpu))
    for r in results:
        if r.group not in ("sparse", "sparse-step"):
            out[f"{r.name}_gbps"] = round(r.gbps, 4)
            out[f"{r.name}_gbps_median"] = round(r.gbps_median, 4)
    line = json.dumps(out, sort_keys=True)
    if args.json_out:
        d = os.path.dirname(os.path.abspath(args.json_out))
        os.makedirs(d, exist_ok=True)
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
