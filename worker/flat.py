"""The flat parameter buffer: a model's trainable parameters as views into one flat tensor.

Pure torch, no transport. After ``FlatParams(params)`` every parameter's ``.data`` is a view into
``flat.data`` and its ``.grad`` a view into ``flat.grad``, in parameter order, so a whole model's
values or gradients move as one tensor: one PS table, one all-reduce, or (cut into contiguous
ranges) the buckets of data parallelism and the shards of ZeRO.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlatParams", "Segment", "even_split"]


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in the flat buffer: ``flat[offset : offset + numel]``."""

    index: int
    offset: int
    numel: int
    shape: tuple[int, ...]


class FlatParams:
    """``params`` (trainable, on one device) re-homed into one flat buffer and one flat gradient.

    - ``data``: 1-D tensor (the parameters' dtype), ``numel`` elements; ``params[i].data`` is
      ``data[seg.offset : seg.offset + seg.numel].view(seg.shape)``.
    - ``grad``: same shape, zeros at first; ``params[i].grad`` is the matching view. Autograd
      accumulates into the views in place (they keep their identity as long as nobody assigns
      ``p.grad = None``: use ``zero_grad()``, not ``optimizer.zero_grad(set_to_none=True)``).

    Not thread-safe: one writer at a time (the trainer's main thread).
    """

    def __init__(self, params: Sequence[nn.Parameter], device: torch.device | str | None = None) -> None:
        self.params = list(params)
        devices = {p.device for p in self.params}
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"FlatParams: parameters of one buffer must share a dtype, got {sorted(map(str, dtypes))}")
        self.device = torch.device(device) if device is not None else (devices.pop() if len(devices) == 1 else torch.device("cpu"))
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.segments: list[Segment] = []
        off = 0
        for i, p in enumerate(self.params):
            self.segments.append(Segment(i, off, p.numel(), tuple(p.shape)))
            off += p.numel()
        self.numel = off
        self.data = torch.empty(self.numel, device=self.device, dtype=self.dtype)
        self.grad = torch.zeros(self.numel, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            for p, s in zip(self.params, self.segments):
                self.data[s.offset : s.offset + s.numel].copy_(p.detach().reshape(-1))
                p.data = self.data[s.offset : s.offset + s.numel].view(s.shape)
                p.grad = self.grad[s.offset : s.offset + s.numel].view(s.shape)

    @classmethod
    def of(cls, model: nn.Module, device: torch.device | str | None = None, skip: Sequence[nn.Module] = ()) -> FlatParams:
        """The trainable parameters of ``model`` outside the modules in ``skip``, moved to ``device``."""
        if device is not None:
            model.to(device)
        skipped = {id(p) for m in skip for p in m.parameters()}
        return cls([p for p in model.parameters() if p.requires_grad and id(p) not in skipped], device)

    def zero_grad(self) -> None:
        """Zero the flat gradient in place (the parameters' ``.grad`` views stay attached)."""
        self.grad.zero_()

    def load_(self, values: torch.Tensor) -> None:
        """Copy ``values`` (``numel`` elements, any device; non-blocking from pinned host memory) into the parameters."""
        with torch.no_grad():
            self.data.copy_(values.reshape(-1), non_blocking=True)

    def grads_attached(self) -> bool:
        """True while every parameter's ``.grad`` is still the view into ``grad`` (nobody replaced it)."""
        return all(
            p.grad is not None and p.grad.data_ptr() == self.grad[s.offset :].data_ptr()
            for p, s in zip(self.params, self.segments)
        ) if self.numel else True

    def nbytes(self) -> int:
        """Bytes of the parameter buffer (the gradient buffer has as many)."""
        return self.numel * self.data.element_size()


def even_split(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``numel`` elements cut into ``parts`` contiguous ranges ``(start, stop)`` of equal length
    ``ceil(numel / parts)`` rounded up to ``align`` (the last ones end at ``numel``, possibly empty):
    the shards of ZeRO, identical on every rank."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    size = -(-numel // parts)
    size = -(-size // align) * align if align > 1 else size
    return [(min(i * size, numel), min((i + 1) * size, numel)) for i in range(parts)]
