"""The attacker of tests/integration/test_admission.py, in its own process (as an attacker is on
another machine: it must not share the honest worker's interpreter): keeps N calls of one identity
outstanding against a shard (a refused or finished one is sent again a second later) until its
stdin closes. It prints "ready" once its first N calls are sent and have had a second to be
admitted or refused, and at the end one JSON line: the calls' final status codes and one detail per code.

    python admission_attacker.py pull|push ADDRESS CA_FILE TOKEN N
"""
from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ps.wire import frame
from tessera.service import ClientSecurity, client_channel
from tessera.v1 import ps_pb2 as pb

SVC = "/tessera.v1.ParameterServer/"


def main(kind: str, address: str, ca: str, token: str, n: int) -> None:
    channel = client_channel(address, ClientSecurity(tls_ca=ca, token=token))
    stall = threading.Event()
    if kind == "pull":
        # a BSP pull for the next clock of a table nobody pushes: it waits (until the server's cap)
        pull = channel.unary_stream(SVC + "PullDense")
        req = pb.PullDenseRequest(table="idle", dtype="float32", sync=pb.SyncSpec(clock=1, sync=True)).SerializeToString()

        def start() -> Any:
            return pull(req, timeout=120)
    else:
        # the table's first chunk, valid, not the last: the shard reads on, and nothing more comes
        push = channel.stream_stream(SVC + "PushDense")
        first = frame(pb.DenseChunk(table="w", offset=0, worker="w1", dtype="float32"), data=np.zeros(1024, np.float32))

        def stalled() -> Iterator[bytes]:
            yield first
            stall.wait(120)

        def start() -> Any:
            return push(stalled(), timeout=120)

    codes: dict[str, int] = {}
    details: dict[str, str] = {}
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    calls: list[Any] = []
    ready = False
    while not done.is_set():
        live = []
        for c in calls:
            if c.done():
                code = c.code().name
                codes[code] = codes.get(code, 0) + 1
                details.setdefault(code, c.details() or "")
            else:
                live.append(c)
        while len(live) < n:
            live.append(start())
        calls = live
        done.wait(1.0)
        if not ready:  # the first N calls were sent a second ago
            print("ready", flush=True)
            ready = True
    stall.set()
    for c in calls:
        c.cancel()
    print(json.dumps({"codes": codes, "details": details}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
