"""Pipeline schedules as data, checked without communication (``worker.peer.pipeline.simulate``):
every forward before its backward, sends matched by receives, no deadlock, and the peak in-flight
activations the papers state (GPipe: m per rank; 1F1B: P - r on rank r, so P at most); the
simulated bubble with free communication equals (P-1)/(m+P-1) for GPipe and 1F1B."""
from __future__ import annotations

import pytest

from worker.peer.pipeline import (
    Action,
    ScheduleError,
    bubble_theory,
    partition,
    schedule,
    simulate,
)


@pytest.mark.parametrize("P,m", [(1, 1), (1, 4), (2, 1), (2, 8), (3, 5), (4, 4), (4, 16)])
def test_gpipe_and_1f1b(P: int, m: int) -> None:
    g = simulate(schedule("gpipe", P, m), m)
    assert g["peak_in_flight"] == [m] * P
    f = simulate(schedule("1f1b", P, m), m)
    assert f["peak_in_flight"] == [min(P - r, m) for r in range(P)]
    assert max(f["peak_in_flight"]) == min(P, m)
    for res in (g, f):
        assert res["bubble"] == pytest.approx(bubble_theory(P, m), abs=1e-12)


@pytest.mark.parametrize("P,m,V", [(2, 2, 2), (2, 8, 2), (4, 8, 2), (2, 4, 3), (4, 4, 4)])
def test_interleaved(P: int, m: int, V: int) -> None:
    sched = schedule("interleaved", P, m, V)
    res = simulate(sched, m, V)
    total = m * V
    # Megatron's warm-up: (P - r - 1) * 2 + (V - 1) * P forwards, then one forward one backward
    assert res["peak_in_flight"] == [min((P - r - 1) * 2 + (V - 1) * P + 1, total) for r in range(P)]
    # each rank computes V stages for every micro-batch; virtual stage s on rank s % P
    for r, acts in enumerate(sched):
        assert sorted((a.mb, a.stage) for a in acts if a.op == "F") == [(mb, s) for mb in range(m) for s in range(r, P * V, P)]
    # smaller bubble than 1F1B with the same P, m (stage costs 1/V of a full stage)
    one = simulate(schedule("1f1b", P, m), m)
    assert res["bubble"] < one["bubble"] or P == 1


def test_counts_and_matching() -> None:
    sched = schedule("1f1b", 3, 4)
    sends = sum(a.op.startswith("SEND") for acts in sched for a in acts)
    recvs = sum(a.op.startswith("RECV") for acts in sched for a in acts)
    assert sends == recvs == 2 * 4 * 2  # acts and grads over 2 boundaries for 4 micro-batches
    assert sched[0][0] == Action("F", 0, 0) and sched[0][1] == Action("SEND_ACT", 0, 0, 1)


def test_simulate_catches_bad_schedules() -> None:
    good = schedule("1f1b", 2, 2)
    # backward before forward
    bad = [list(good[0]), list(good[1])]
    i = next(i for i, a in enumerate(bad[1]) if a.op == "B")
    j = next(j for j, a in enumerate(bad[1]) if a.op == "F")
    bad[1][i], bad[1][j] = bad[1][j], bad[1][i]
    with pytest.raises(ScheduleError):
        simulate(bad, 2)
    # a receive with no send: deadlock, named
    bad = [[a for a in good[0] if a.op != "SEND_ACT"], good[1]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad, 2)
    # two ranks each waiting for the other first
    dead = [[Action("RECV_GRAD", 0, 0, 1), Action("F", 0, 0), Action("SEND_ACT", 0, 0, 1), Action("B", 0, 0)],
            [Action("RECV_ACT", 0, 1, 0), Action("F", 0, 1), Action("B", 0, 1), Action("SEND_GRAD", 0, 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dead, 1)
    # a message sent but never received
    extra = [good[0] + [Action("SEND_ACT", 1, 0, 1)], good[1]]
    with pytest.raises(ScheduleError):
        simulate(extra, 2)


def test_bad_parameters() -> None:
    with pytest.raises(ScheduleError, match="schedule must be one of"):
        schedule("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="divisible"):
        schedule("interleaved", 2, 3, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        schedule("1f1b", 2, 4, 2)


def test_partition() -> None:
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition([1, 2, 3, 4, 5], 3) == [(0, 3), (3, 4), (4, 5)]
    assert partition([3], 1) == [(0, 1)]
    with pytest.raises(ScheduleError, match="cannot split"):
        partition([1, 1], 3)


def test_pipeline_config_start_checks() -> None:
    """The checks every rank of `tessera peer --pp` makes before any collective (one message each)."""
    import argparse

    from worker.peer.cli import add_train_args
    from worker.peer.mesh import PeerConfigError
    from worker.peer.pipeline import pipeline_config

    p = argparse.ArgumentParser()
    add_train_args(p)

    def cfg(*argv: str, world: int = 4) -> tuple[int, int, int, int, int]:
        return pipeline_config(p.parse_args(["--pp", "2", *argv]), world)

    assert cfg("--global-batch", "16") == (2, 2, 1, 4, 1)  # (P, D, T, m, V); m defaults to 2 x P
    assert cfg("--schedule", "interleaved", "--micro-batches", "4", "--global-batch", "8") == (2, 2, 1, 4, 2)
    assert cfg("--tp", "2", "--mode", "zero1", "--global-batch", "8", world=8) == (2, 2, 2, 4, 1)
    assert cfg("--mode", "zero3", "--global-batch", "16") == (2, 2, 1, 4, 1)  # ZeRO-2/3 compose with PP
    # --accumulate k is the pipeline's k micro-batches; 16-bit transport and the collective checks compose
    assert cfg("--accumulate", "8", "--global-batch", "16", "--compress", "bf16", "--debug-collectives") == (2, 2, 1, 8, 1)
    assert cfg("--accumulate", "4", "--micro-batches", "4", "--global-batch", "16") == (2, 2, 1, 4, 1)
    for argv, world, msg in [
        (["--mode", "hybrid"], 4, r"run with --mode dp \(any --zero"),
        (["--accumulate", "2", "--micro-batches", "4", "--global-batch", "16"], 4,
         "--accumulate 2 and --micro-batches 4 contradict: a pipeline's micro-batches are its accumulation"),
        (["--task", "digits", "--recompute", "selective"], 4, "--recompute selective is the gpt task's built-in split's"),
        ([], 3, "world size 3 is not divisible by --tp 1 x --pp 2"),
        (["--tp", "2"], 6, "world size 6 is not divisible by --tp 2 x --pp 2"),
        (["--tp", "2", "--dp", "2"], 4, "--dp 2 x --tp 2 x --pp 2 is not the world size 4"),
        (["--sequence-parallel"], 4, "--sequence-parallel needs --tp > 1"),
        (["--global-batch", "12"], 4, "global batch 12 is not divisible by D 2 x micro-batches 4"),
        (["--schedule", "interleaved", "--micro-batches", "3", "--global-batch", "6"], 2, "micro-batches divisible by pipeline ranks"),
    ]:
        with pytest.raises(PeerConfigError, match=msg):
            cfg(*argv, world=world)


def test_simulate_with_unbalanced_stages_and_message_delay() -> None:
    """Per-rank costs and a delivery delay: equal stages and free messages give (P-1)/(m+P-1) as the
    mean over ranks too; a slower last stage, or each message arriving later, only adds to it (the
    corrected theory bench/peer.py compares its measured bubble with); a wrong cost list is refused."""
    P, m = 2, 8
    sched = schedule("1f1b", P, m)
    even = simulate(sched, m, t_fwd=[1.0, 1.0], t_bwd=[2.0, 2.0])
    assert even["bubble_mean"] == pytest.approx(bubble_theory(P, m), abs=1e-12)
    slow_last = simulate(sched, m, t_fwd=[1.0, 1.2], t_bwd=[2.0, 2.4])
    assert slow_last["bubble_mean"] > even["bubble_mean"] and slow_last["makespan"] > even["makespan"]
    delayed = simulate(sched, m, t_comm=0.5)
    assert delayed["bubble_mean"] > even["bubble_mean"]
    with pytest.raises(ScheduleError, match="one >= 0 per rank"):
        simulate(sched, m, t_fwd=[1.0, 1.0, 1.0])
