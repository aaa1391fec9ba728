"""Echo round trips over gRPC (``tessera.service.build_server``) and over the bulk data plane
(``tessera.bulk.serve_bulk``), the same handler, the same server process, the same run.

A child process serves one unary echo handler both ways (loopback, plaintext, open); this process
times round trips of 16 B, 1 MiB and 64 MiB (``--sizes``), alternating gRPC and bulk call by call
(both under the same load from elsewhere). Per size and transport: wall ms (min and median of the
repeats) and the server process's CPU ms per call (utime + stime from /proc, Linux; over all the
repeats). Also the cost of ``bytes(bytearray)`` at each size (what a handler that needed ``bytes``
would pay over the bulk plane's ``bytearray`` bodies).

Run: ``python bench/bulk_echo.py`` (well under a minute). It prints a table and, as its last
line, one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {"16B": 16, "1MiB": 1 << 20, "64MiB": 64 << 20}
REPEATS = {"16B": 300, "1MiB": 60, "64MiB": 8}


def serve() -> None:
    import grpc

    from tessera.bulk import serve_bulk
    from tessera.service import Access, ServerSecurity, build_server

    def echo(request: bytes, context: object) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("b.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    sec = ServerSecurity()
    server, port, _ = build_server((handler,), "127.0.0.1", 0, sec)
    bulk = serve_bulk((handler,), "127.0.0.1", 0, sec, Access(sec, {}, ()).caller)
    print(f"{port} {bulk.port}", flush=True)
    sys.stdin.read()  # until the parent closes it
    bulk.stop()
    server.stop(0)


def cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"which of {list(SIZES)}")
    ap.add_argument("--repeats", type=float, default=1.0, help="scale the default repeats (300 / 60 / 8)")
    args = ap.parse_args()
    if os.environ.get("BULK_ECHO_SERVE"):
        serve()
        return
    from tessera.bulk import BulkChannel
    from tessera.service import client_channel

    proc = subprocess.Popen(
        [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "BULK_ECHO_SERVE": "1"},
    )
    try:
        assert proc.stdout is not None
        gport, bport = proc.stdout.readline().split()
        g = client_channel(f"127.0.0.1:{gport}").unary_unary("/b.Echo/Echo")
        bchan = BulkChannel(f"127.0.0.1:{bport}")
        b = bchan.unary_unary("/b.Echo/Echo")
        ways = {"grpc": g, "bulk": b}
        summary: dict[str, float | int | str] = {}
        rows = []
        for label in args.sizes.split(","):
            n = SIZES[label]
            reps = max(2, int(REPEATS[label] * args.repeats))
            data = os.urandom(n)
            for fn in ways.values():  # warm up (connections, first allocations)
                assert bytes(fn(data, timeout=60)) == data
            times: dict[str, list[float]] = {w: [] for w in ways}
            cpu: dict[str, float] = {w: 0.0 for w in ways}
            for i in range(reps):
                order = list(ways) if i % 2 == 0 else list(ways)[::-1]
                for w in order:
                    c0 = cpu_ms(proc.pid)
                    t0 = time.perf_counter()
                    out = ways[w](data, timeout=60)
                    times[w].append((time.perf_counter() - t0) * 1e3)
                    cpu[w] += cpu_ms(proc.pid) - c0
                    assert len(out) == n
            buf = bytearray(data)
            t0 = time.perf_counter()
            for _ in range(3):
                bytes(buf)
            copy_ms = (time.perf_counter() - t0) * 1e3 / 3
            for w in ways:
                mn, md, c = min(times[w]), statistics.median(times[w]), cpu[w] / reps
                rows.append((label, w, mn, md, c, reps))
                summary[f"{w}_{label}_ms_min"] = round(mn, 4)
                summary[f"{w}_{label}_ms_median"] = round(md, 4)
                summary[f"{w}_{label}_server_cpu_ms"] = round(c, 4)
            summary[f"speedup_{label}_median"] = round(statistics.median(times["grpc"]) / statistics.median(times["bulk"]), 3)
            summary[f"bytes_copy_{label}_ms"] = round(copy_ms, 4)
            summary[f"repeats_{label}"] = reps
        bchan.close()
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(30)
    print(f"\necho round trips, loopback plaintext, one server process; {os.cpu_count()} CPUs")
    print(f"{'size':6} {'way':5} {'ms min':>9} {'ms median':>10} {'server cpu ms/call':>19} {'repeats':>8}")
    for label, w, mn, md, c, reps in rows:
        print(f"{label:6} {w:5} {mn:9.3f} {md:10.3f} {c:19.3f} {reps:8d}")
    for label in args.sizes.split(","):
        print(f"{label}: gRPC / bulk median time {summary[f'speedup_{label}_median']:.2f}x; "
              f"bytes(bytearray) copy {summary[f'bytes_copy_{label}_ms']:.3f} ms")
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
