"""Selective activation recomputation (Korthikanti et al. 2022: only the attention core, q k^T,
softmax, dropout and the product with v, runs again in backward) and full per-layer recomputation
with tensor-parallel dropout, on CPU with Gloo at (D, T, P) = (1, 2, 1).

References: selective recompute against the same TP (and SP) model without recompute, with
attention and residual dropout (Adam, parameters after each of 3 steps, fp32 rtol 1e-5: the
recomputation must draw the same dropout masks from the tp stream); without dropout, selective TP
and SP against one process (SGD on the global batch); full recompute in the pipeline's stages with
TP dropout against no recompute (the mesh's RNG streams replayed); `tessera peer --recompute
selective` (T=2 with sequence parallelism, and T=1) against one process's loss at every step.
"""
from __future__ import annotations

import argparse

import pytest
from test_pipeline_3d import _peer, _reference_losses, _report  # type: ignore[import-not-found]
from test_tensor_parallel import _check, run_mesh  # type: ignore[import-not-found]

from worker.peer.flags import add_pipeline_args, recompute_mode, takes_pipeline_path

CHECKS = ["selective", "selective-sp", "selective-ref", "selective-ref-sp", "full-dropout"]


@pytest.mark.timeout(300)
def test_selective_and_full_recompute_equal_no_recompute() -> None:
    """(1, 2, 1): selective == none with dropout (TP and SP), selective == one process without dropout,
    and it keeps under 0.8 of the activation bytes; full recompute with SP dropout == none."""
    _check(run_mesh(1, 2, 1, CHECKS), CHECKS)


@pytest.mark.timeout(300)
def test_tessera_peer_recompute_selective_equals_one_process() -> None:
    """`tessera peer --tp 2 --sequence-parallel --recompute selective` and `--recompute selective` on one
    rank (the TP model at T=1) equal one process (Adam, every step's loss, rtol 1e-5) and say so."""
    ref = _reference_losses()
    r = _report(_peer(2, ["--tp", "2", "--sequence-parallel", "--recompute", "selective", "--micro-batches", "2"]))
    assert (r["tp"], r["pp"], r["recompute"], r["recompute_mode"]) == (2, 1, True, "selective"), r
    assert r["losses"] == pytest.approx(ref, rel=1e-5), (r["losses"], ref)
    r = _report(_peer(1, ["--recompute", "selective", "--micro-batches", "2"]))
    assert (r["tp"], r["recompute_mode"]) == (1, "selective"), r
    assert r["losses"] == pytest.approx(ref, rel=1e-5), (r["losses"], ref)


def test_recompute_flag_values() -> None:
    """`--recompute` alone is full (as before), `--recompute full|selective` name it, absent is none;
    anything else is refused by the parser."""
    p = argparse.ArgumentParser()
    add_pipeline_args(p)
    for argv, want in (([], "none"), (["--recompute"], "full"), (["--recompute", "full"], "full"),
                       (["--recompute", "selective"], "selective")):
        args = p.parse_args(argv)
        assert recompute_mode(args) == want and takes_pipeline_path(args) == (want != "none"), (argv, args)
    with pytest.raises(SystemExit):
        p.parse_args(["--recompute", "some"])
