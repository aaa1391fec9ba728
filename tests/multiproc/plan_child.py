"""One rank of the planner's memory test (started by test_planner_memory.py with torchrun's
environment): trains the gpt task with ``PipelineEngine`` in the layout given on the command line
(``P SCHEDULE M [recompute]``; D = world / P; interleaved: V = 2) and prints ``MEM {json}`` with this rank's measured
peak bytes and the planner's estimate (``worker.peer.planner.rank_memory``, fp32).

Measured: the bytes of this rank's parameters (allocated before the measurement) plus the peak
of torch's CPU allocator count (``Total Allocated`` of the profiler's memory events) while the
optimizer is made and two steps run: gradients, optimizer state, activations, buffers.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from worker.peer import init_mesh
from worker.peer.mesh import shutdown_group
from worker.peer.pipeline import PipelineEngine, gpt_layers, layout_groups
from worker.peer.planner import Layout, ModelSpec, rank_memory
from worker.tasks import load_task

OPTS = {"vocab": 256, "seq": 64, "dim": 64, "layers": 4, "heads": 4}
BATCH = 16


def main() -> None:
    P, kind, m = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    recompute = "recompute" in sys.argv[4:]
    V = 2 if kind == "interleaved" else 1
    mesh = init_mesh("gloo", "cpu", timeout_s=120)
    torch.set_num_threads(1)
    D = mesh.world // P
    pp_ranks, pp_group, _, dp_group = layout_groups(P, D)
    pp_rank, dp_idx = mesh.rank // D, mesh.rank % D
    task = load_task("gpt", seed=0, **OPTS)
    eng = PipelineEngine(gpt_layers(task.model), pp_ranks=pp_ranks, kind=kind, micro_batches=m, virtual=V, pp_group=pp_group,
                         dp_group=dp_group, dp_size=D, recompute=recompute)
    param_bytes = sum(p.numel() * p.element_size() for p in eng.parameters())
    per_rank = BATCH // D
    batches = task.batches(dp_idx, D, per_rank, 0)
    data = [next(batches) for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = torch.optim.Adam(eng.parameters(), lr=1e-3)
        for b in data:
            mbs = list(b.chunk(m))
            eng.zero_grad()
            eng.step([x[:, :-1] for x in mbs], [x[:, 1:] for x in mbs], (per_rank // m, OPTS["seq"], OPTS["dim"]))
            opt.step()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: e["ts"])
    base = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    peak = max(e["args"]["Total Allocated"] for e in events) - base
    spec = ModelSpec(OPTS["layers"], OPTS["dim"], OPTS["heads"], OPTS["seq"], BATCH, OPTS["vocab"])
    est = rank_memory(spec, Layout(D=D, P=P, m=m, recompute=recompute, schedule=kind, V=V), pp_rank, precision="fp32")
    out = {"rank": mesh.rank, "pp_rank": pp_rank, "measured": param_bytes + peak, "param_bytes": param_bytes,
           "estimate": sum(est.values()), "parts": est}
    print("MEM " + json.dumps(out), flush=True)
    shutdown_group()


if __name__ == "__main__":
    main()
