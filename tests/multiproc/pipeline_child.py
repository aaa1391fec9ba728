"""One rank of the pipeline equivalence tests (started by test_pipeline_equivalence.py with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set, as torchrun would). World = D x P with P = 2 pipeline stages in
the layout rank = pp*D + dp. Runs the checks named on the command line in one process group and
prints ``OK <check> <detail>`` per passed check; a failed check raises (non-zero exit).

Reference for every check: one process (this one, outside the group) training a deep copy of the
same initial gpt model with ``torch.optim.SGD`` (lr 0.5) on the *global* batch, compared at every step (loss)
and after the last step (this rank's parameters, by name).
Checks: ``<schedule>[-v<V>][-recompute][-fp64]``, e.g. ``1f1b``, ``interleaved-v2``, ``gpipe-recompute``,
``gpipe-fp64`` (SGD lr=1 in float64, rtol 1e-12); ``same`` asserts that the schedules run so far
ended with identical parameters (bit for bit).
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from worker.peer import init_mesh
from worker.peer.mesh import shutdown_group
from worker.peer.pipeline import PipelineEngine, gpt_layers, layout_groups
from worker.tasks import load_task

P, M, STEPS, G = 2, 4, 3, 8  # pipeline ranks, micro-batches, steps, global batch
OPTS = {"vocab": 32, "seq": 8, "dim": 16, "layers": 4, "heads": 2, "lr": 3e-3}


def run(check: str, dp_idx: int, D: int, groups) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pp_ranks, pp_group, _, dp_group = groups
    parts = check.split("-")
    kind, V = parts[0], 1
    for p in parts[1:]:
        if p.startswith("v"):
            V = int(p[1:])
    recompute, fp64 = "recompute" in parts, "fp64" in parts
    dtype = torch.float64 if fp64 else torch.float32
    task = load_task("gpt", seed=0, dtype="float64" if fp64 else "float32", **OPTS)
    names = {id(p): n for n, p in task.model.named_parameters()}
    ref = copy.deepcopy(task.model)

    def make_opt(params):  # type: ignore[no-untyped-def]
        # SGD, not Adam: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift),
        # and Adam would turn the rounding noise there into steps of up to lr in either direction
        return torch.optim.SGD(params, lr=1.0 if fp64 else 0.5)

    ref_opt = make_opt(ref.parameters())
    eng = PipelineEngine(gpt_layers(task.model), pp_ranks=pp_ranks, kind=kind, micro_batches=M, virtual=V,
                         pp_group=pp_group, dp_group=dp_group, dp_size=D, recompute=recompute)
    opt = make_opt(eng.parameters())
    per_rank = G // D
    mine, glob = task.batches(dp_idx, D, per_rank, 0), task.batches(0, 1, G, 0)
    rtol = 1e-12 if fp64 else 1e-5
    before = {names[id(p)]: p.detach().clone() for p in eng.parameters()}
    for step in range(STEPS):
        gb = next(glob)
        ref_opt.zero_grad()
        logits = ref(gb[:, :-1])  # the task's loss in the model's dtype (task.loss casts to fp32)
        ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), gb[:, 1:].reshape(-1))
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        ref_opt.step()
        b = next(mine)
        mbs = list(b.chunk(M))
        eng.zero_grad()
        loss = eng.step([x[:, :-1] for x in mbs], [x[:, 1:] for x in mbs], (per_rank // M, OPTS["seq"], OPTS["dim"]),
                        act_dtype=dtype)
        opt.step()
        assert abs(loss - float(ref_loss)) <= rtol * abs(float(ref_loss)), f"{check} step {step}: loss {loss} vs reference {float(ref_loss)}"
    refp = dict(ref.named_parameters())
    worst = 0.0
    for p in eng.parameters():
        n = names[id(p)]
        torch.testing.assert_close(p.detach(), refp[n].detach(), rtol=rtol, atol=rtol * 1e-1, msg=lambda s, n=n: f"{check}: {n}: {s}")
        assert not torch.equal(p.detach(), before[n]), f"{check}: {n} did not change"
        worst = max(worst, float((p.detach() - refp[n].detach()).abs().max()))
    # the whole model's parameters on every rank (each stage's owner contributes them once)
    full = torch.cat([(p.detach() if id(p) in {id(q) for q in eng.parameters()} else torch.zeros_like(p)).reshape(-1)
                      for p in task.model.parameters()])
    if pp_group is not None:
        dist.all_reduce(full, group=pp_group)
    print(f"OK {check} stages {eng.bounds} params {len(before)} max_abs_err {worst:.2e} loss {loss:.6f}", flush=True)
    return full


def main() -> None:
    mesh = init_mesh("gloo", "cpu", timeout_s=120)
    torch.set_num_threads(1)
    D = mesh.world // P
    groups = layout_groups(P, D)
    dp_idx = mesh.rank % D
    finals: dict[str, torch.Tensor] = {}
    for check in sys.argv[1:]:
        if check == "same":
            items = [(k, v) for k, v in finals.items() if "fp64" not in k]
            k0, v0 = items[0]
            for k, v in items[1:]:
                assert torch.equal(v0, v), f"{k} and {k0} differ: max {float((v - v0).abs().max()):.3e}"
            print(f"OK same {[k for k, _ in items]}", flush=True)
            continue
        finals[check] = run(check, dp_idx, D, groups)
    shutdown_group()


if __name__ == "__main__":
    main()
