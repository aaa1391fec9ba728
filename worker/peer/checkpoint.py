"""Sharded checkpoints of peer mode: each rank writes the pieces it owns, rank 0 a manifest; a
checkpoint loads at any world size and into any peer mode.

Layout of ``DIR/step-<N>/``: ``rank<r>.bin`` (raw little-endian bytes of that rank's pieces) and
``manifest.json`` (written last, by rank 0, after every rank's file is complete and fsynced):
for every piece its tensor name, element offset and length in that tensor's flat layout, dtype,
file and byte offset; plus the scalars (the step, the optimizer's step counter). The directory
is written as ``step-<N>.tmp`` and renamed when complete (atomic: a crash leaves no half
checkpoint that looks whole). No pickle: JSON and raw bytes.

Tensor names are the model's parameter names (``param/<name>``) and the optimizer's per-element
state for them (``state/<key>/<name>``, e.g. Adam's ``exp_avg``), flat: whatever the mode's own
layout (whole parameters in DP, chunks of per-layer buffers in ZeRO), so a checkpoint saved by
ZeRO-2 at D=4 loads into ZeRO-2 at D=2, or into plain DP.

Why not ``torch.distributed.checkpoint``: our ZeRO chunks cut parameters at arbitrary offsets,
which its resharding expresses only through the deprecated ``ShardedTensor`` (DTensor's Shard(0)
is an even split of each parameter), and its metadata file is a pickle.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["CheckpointReader", "Checkpointing", "Piece", "latest_checkpoint", "save_checkpoint"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Piece:
    """Elements ``[offset, offset + len(data))`` of the flat tensor ``name``."""

    name: str
    offset: int
    data: torch.Tensor  # 1-D


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str, step: int, pieces: list[Piece], scalars: dict[str, float], keep: int = 2) -> str:
    """Collective: every rank writes its ``pieces``; returns the checkpoint's directory. Keeps the
    newest ``keep`` checkpoints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    entries = []
    path = os.path.join(tmp, f"rank{rank}.bin")
    with open(path, "wb") as f:
        for p in pieces:
            t = p.data.detach().to("cpu").contiguous()
            raw = t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy()
            entries.append({
                "name": p.name, "offset": int(p.offset), "length": int(t.numel()), "dtype": str(t.dtype).removeprefix("torch."),
                "file": f"rank{rank}.bin", "byte": f.tell(),
            })
            f.write(raw.tobytes())
        f.flush()
        os.fsync(f.fileno())
    # the manifest: every rank's entries, gathered as JSON bytes in a uint8 tensor (no pickle)
    blob = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([blob.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded)
    if rank == 0:
        allentries = [e for g, s in zip(gathered, sizes) for e in json.loads(bytes(g[: int(s.item())].tolist()).decode())]
        manifest = {"format": "tessera-peer-checkpoint/1", "step": step, "world": world, "scalars": scalars, "pieces": allentries}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in sorted(_complete(root))[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, f"step-{old}"), ignore_errors=True)
    dist.barrier()
    return final


def _complete(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    out = []
    for d in os.listdir(root):
        m = re.fullmatch(r"step-(\d+)", d)
        if m and os.path.exists(os.path.join(root, d, "manifest.json")):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    steps = _complete(root)
    return os.path.join(root, f"step-{steps[-1]}") if steps else None


class CheckpointReader:
    """Reads element ranges of the flat tensors of one checkpoint, whatever world size wrote it."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(os.path.join(path, "manifest.json")) as f:
            self.manifest: dict[str, Any] = json.load(f)
        if self.manifest.get("format") != "tessera-peer-checkpoint/1":
            raise ValueError(f"{path}: not a tessera peer checkpoint (format {self.manifest.get('format')!r})")
        self.step = int(self.manifest["step"])
        self.scalars: dict[str, float] = self.manifest["scalars"]
        self.by_name: dict[str, list[dict[str, Any]]] = {}
        for e in self.manifest["pieces"]:
            self.by_name.setdefault(e["name"], []).append(e)

    def has(self, name: str) -> bool:
        return name in self.by_name

    def read(self, name: str, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of ``name`` (into ``out`` if given); every element
        must be covered by the saved pieces."""
        if name not in self.by_name:
            raise KeyError(f"checkpoint {self.path} has no tensor {name!r}")
        entries = self.by_name[name]
        dtype = _DTYPES[entries[0]["dtype"]]
        res = out if out is not None else torch.empty(length, dtype=dtype)
        covered = 0
        for e in entries:
            lo, hi = max(offset, e["offset"]), min(offset + length, e["offset"] + e["length"])
            if lo >= hi:
                continue
            esize = torch.empty(0, dtype=_DTYPES[e["dtype"]]).element_size()
            raw = np.fromfile(
                os.path.join(self.path, e["file"]), dtype=np.uint8, count=(hi - lo) * esize,
                offset=e["byte"] + (lo - e["offset"]) * esize,
            )
            src = torch.from_numpy(raw.copy()).view(_DTYPES[e["dtype"]])
            res[lo - offset : hi - offset].copy_(src)
            covered += hi - lo
        if covered != length:
            raise ValueError(f"checkpoint {self.path}: {name}[{offset}:{offset + length}] is not covered by its pieces")
        return res


class Checkpointing:
    """What a peer ``ParamSync`` adds to save and resume: ``set_checkpointing(dir, every)``; ``join``
    calls ``_resume()`` (the newest complete checkpoint, as rank 0 sees it, loaded on every rank;
    returns its step or 0) and ``push`` calls ``_maybe_save(steps_done)``."""

    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resumed_from: str | None = None

    def set_checkpointing(self, directory: str | None, every: int) -> None:
        if every < 0:
            raise ValueError(f"checkpoint interval must be >= 0, got {every}")
        self.checkpoint_dir, self.checkpoint_every = directory, every

    def checkpoint_pieces(self) -> tuple[list[Piece], dict[str, float]]:
        raise NotImplementedError

    def load_checkpoint(self, reader: CheckpointReader) -> None:
        raise NotImplementedError

    def _resume(self) -> int:
        if not self.checkpoint_dir:
            return 0
        path = latest_checkpoint(self.checkpoint_dir) if dist.get_rank() == 0 else None
        step = torch.tensor([int(path.rsplit("-", 1)[1]) if path else -1], dtype=torch.int64)
        dist.broadcast(step, 0)  # every rank loads the one rank 0 chose
        if int(step) < 0:
            return 0
        path = os.path.join(self.checkpoint_dir, f"step-{int(step)}")
        self.load_checkpoint(CheckpointReader(path))
        self.resumed_from = path
        return int(step)

    def _maybe_save(self, steps_done: int) -> None:
        if self.checkpoint_dir and self.checkpoint_every and steps_done % self.checkpoint_every == 0:
            pieces, scalars = self.checkpoint_pieces()
            save_checkpoint(self.checkpoint_dir, steps_done, pieces, scalars)


def whole_tensor_pieces(
    named: Any, states: dict[int, dict[str, Any]], gather: Any, writer: bool,
) -> tuple[list[Piece], dict[str, float]]:
    """Every parameter of ``named`` (``(spec, local shard)`` pairs, ``spec.name`` its plain name) and
    its optimizer state (``states[id(param)]``) gathered whole by ``gather(spec, local)`` (a
    collective: every rank calls it), saved under the plain names, so the checkpoint loads into any
    other layout; only the ``writer`` rank returns them."""
    pieces: list[Piece] = []
    scalars: dict[str, float] = {}
    for spec, p in named:
        full = gather(spec, p)
        whole = {k: gather(spec, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in sorted(states[id(p)].items())}
        if writer:  # per-element state as state/<key>/<name>; scalar entries (step counters) as scalars
            pieces.append(Piece(f"param/{spec.name}", 0, full.reshape(-1)))
            for k, v in whole.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    pieces.append(Piece(f"state/{k}/{spec.name}", 0, v.reshape(-1)))
                elif isinstance(v, (torch.Tensor, int, float)):
                    scalars[k] = float(v)
    return pieces, scalars


def read_whole_tensors(reader: CheckpointReader, named: Any, tp_rank: int, tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """The reverse of ``whole_tensor_pieces``: copy this rank's TP shard (``spec.shard``) of every
    parameter of ``named`` from the checkpoint into it; returns the shards of each parameter's saved
    optimizer state, by ``id(param)``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for spec, p in named:
            n = math.prod(spec.full_shape)

            def part(name: str, spec: Any = spec, p: torch.Tensor = p, n: int = n) -> torch.Tensor:
                return spec.shard(reader.read(name, 0, n).view(spec.full_shape), tp_rank, tp).to(p)

            p.copy_(part(f"param/{spec.name}"))
            keys = state_keys(reader, spec.name)
            if keys:
                state[id(p)] = {k: part(f"state/{k}/{spec.name}") for k in keys}
    return state


def state_keys(reader: CheckpointReader, name: str) -> list[str]:
    """The per-element optimizer state keys saved for tensor ``name``."""
    return sorted(n.split("/")[1] for n in reader.by_name if n.startswith("state/") and n.split("/", 2)[2] == name)
