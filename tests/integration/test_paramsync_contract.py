"""One contract every ``ParamSync`` passes, subclassed per implementation.

Each implementation trains, as the only worker, a small MLP for a few steps through the sync's
own calls (join, fetch, load, zero_grad, backward, gradients, push) and must give, after every
step, the parameters of a deep copy of the same model trained with ``torch.optim`` in this
process (the reference; fp32, rtol 1e-5). PSSync runs against a real gRPC shard in this process;
the peer syncs against a real Gloo process group of one rank in this process (the multi-rank
equivalence is tests/multiproc/test_peer_equivalence.py).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps import OptimizerSpec
from worker.paramsync import ParamSync, PSSync

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 5, generator=g)
    return x, torch.stack([x.sum(1), x[:, 0]], 1)


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


class ParamSyncContract:
    """Subclasses provide ``make(model, spec) -> ParamSync`` (the sync of the only worker)."""

    def make(self, model: nn.Module, spec: OptimizerSpec) -> ParamSync:
        raise NotImplementedError

    def _step(self, sync: ParamSync, model: nn.Module, step: int, micro: int = 1) -> None:
        f = sync.fetch(step, _batch(step))
        assert f.step == step
        sync.load(f)
        sync.zero_grad()
        x, y = f.batch
        for j, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            ctx = sync.no_sync() if j < micro - 1 else contextlib.nullcontext()
            with ctx:
                (_loss(model, (xs, ys)) / micro).backward()
        sync.push(step, sync.gradients(step))

    def _values(self, sync: ParamSync, step: int) -> torch.Tensor:
        """The parameters every worker computes step ``step`` from (after a fetch + load)."""
        sync.load(sync.fetch(step, _batch(step)))
        return sync.parameters()

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("opt", ["sgd", "adam"])
    def test_steps_equal_torch_optim_on_one_process(self, opt: str) -> None:
        model = _model()
        ref = copy.deepcopy(model)
        spec = OptimizerSpec(opt, {"lr": 0.05})
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05) if opt == "sgd" else torch.optim.Adam(ref.parameters(), lr=0.05)
        sync = self.make(model, spec)
        try:
            assert sync.join() == 0
            torch.testing.assert_close(sync.parameters(), _flat(ref))  # the model's own initial values
            for t in range(STEPS):
                self._step(sync, model, t)
                ref_opt.zero_grad()
                _loss(ref, _batch(t)).backward()
                ref_opt.step()
                torch.testing.assert_close(self._values(sync, t + 1), _flat(ref), rtol=1e-5, atol=1e-6, msg=lambda m: f"step {t}: {m}")
            assert not torch.equal(_flat(ref), _flat(_model())), "parameters never moved"
        finally:
            sync.leave()
            sync.close()

    @pytest.mark.timeout(60)
    def test_accumulated_micro_batches_equal_one_batch(self) -> None:
        model = _model()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        sync = self.make(model, OptimizerSpec("sgd", {"lr": 0.1}))
        try:
            sync.join()
            for t in range(2):
                self._step(sync, model, t, micro=4)
                ref_opt.zero_grad()
                _loss(ref, _batch(t)).backward()
                ref_opt.step()
            torch.testing.assert_close(self._values(sync, 2), _flat(ref), rtol=1e-5, atol=1e-6)
        finally:
            sync.leave()
            sync.close()

    @pytest.mark.timeout(60)
    def test_leave_twice_is_harmless(self) -> None:
        sync = self.make(_model(), OptimizerSpec("sgd", {"lr": 0.1}))
        sync.join()
        sync.leave()
        sync.leave()
        sync.close()


class TestPSSync(ParamSyncContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, inproc_cluster: Any) -> Iterator[None]:
        self.cluster = inproc_cluster(1)
        self.n = 0
        yield

    def make(self, model: nn.Module, spec: OptimizerSpec) -> ParamSync:
        self.n += 1  # a fresh table prefix per sync
        return PSSync(model, self.cluster.client(timeout=30), f"m{self.n}", mode="sync", dense_optimizer=spec, lease_s=30)



class TestDataParallelSync(ParamSyncContract):
    @pytest.fixture(autouse=True)
    def _group(self, gloo_group: None) -> None:
        return None

    def make(self, model: nn.Module, spec: OptimizerSpec) -> ParamSync:
        from worker.peer import DataParallelSync

        return DataParallelSync(model, spec, bucket_mb=1e-4)


class _Zero(ParamSyncContract):
    stage = 1

    @pytest.fixture(autouse=True)
    def _group(self, gloo_group: None) -> None:
        return None

    def make(self, model: nn.Module, spec: OptimizerSpec) -> ParamSync:
        from worker.peer import DataParallelSync

        return DataParallelSync(model, spec, stage=self.stage)


class TestZero1(_Zero):
    stage = 1


class TestZero2(_Zero):
    stage = 2


class TestZero3(_Zero):
    stage = 3


def test_default_buckets_are_25_mib_whole_parameters_last_first_the_first_at_most_1_mib() -> None:
    """README (Peer mode, Buckets): "Gradients are cut into buckets of `--bucket-mb` MiB (default 25;
    whole parameters, last layer first; the first bucket at most 1 MiB, as in DDP, so communication
    starts early)". The rank program's parser (what `tessera peer` passes through) gives 25, and a
    ``GroupReducer`` (the core every peer layout's all-reduce goes through) built at that size over 200
    fp32 parameters of 256 KiB each (50 MiB) has the buckets computed here by hand: the last 4
    parameters (1 MiB), then 100 (25 MiB), then the 96 left; each a contiguous range of whole
    parameters of the flat buffer, the last parameters first."""
    import argparse

    from worker.peer.cli import add_train_args
    from worker.peer.core import ALONE, GroupReducer

    p = argparse.ArgumentParser()
    add_train_args(p)
    bucket_mb = p.parse_args([]).bucket_mb
    assert bucket_mb == 25.0
    n = 2**16  # elements of one parameter: 256 KiB in fp32
    params = [nn.Parameter(torch.zeros(n)) for _ in range(200)]
    r = GroupReducer(params, ALONE, bucket_mb=bucket_mb)
    assert [b.params for b in r.buckets] == [list(range(196, 200)), list(range(96, 196)), list(range(0, 96))]
    assert [(b.start, b.stop) for b in r.buckets] == [(196 * n, 200 * n), (96 * n, 196 * n), (0, 96 * n)]
    assert (r.buckets[0].stop - r.buckets[0].start) * 4 == 2**20
    assert r.bucket_bytes == 25 * 2**20 and GroupReducer(params[:1], ALONE).bucket_bytes == 25 * 2**20
