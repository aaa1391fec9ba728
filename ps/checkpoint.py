"""Shard checkpoints on disk: written so that a crash at any byte never leaves one that loads wrong.

A checkpoint is a directory ``ckpt-<20-digit number>`` under the shard's checkpoint
directory holding:

- ``data.bin``: every array (values, optimizer state, versions, ids) as raw
  little-endian bytes, one after the other;
- ``meta.msgpack``: the shard's state as plain data (table specs, versions,
  clocks, dedup records, membership), arrays given as (dtype, shape, offset,
  nbytes) into ``data.bin``;
- ``manifest.json``, written last: format version, shard, clock, and the size
  and SHA-256 of both files.

Writing: everything goes to ``ckpt-N.tmp``; each file is fsynced, the
directory fsynced, renamed to ``ckpt-N``, and the parent fsynced. A reader
takes the newest directory whose manifest parses and whose files match their
sizes and checksums; others are reported and skipped. No pickle: msgpack and
raw bytes only, so a checkpoint from elsewhere cannot run code.

Sparse rows are stored sorted by virtual slot, with their ids, so a set of
shard checkpoints can be re-spread over a different number of shards
(:func:`reshard`). Pure Python + numpy; no gRPC.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import numpy as np

from ps.errors import FailedPreconditionError
from ps.partition import SlotMap, dense_range

__all__ = ["ShardSnapshot", "CheckpointError", "write_checkpoint", "load_latest", "list_checkpoints", "reshard", "FORMAT",
           "read_checkpoint", "pack_plain", "unpack_plain", "snapshot_to_plain", "snapshot_from_plain"]

FORMAT = 1
_PREFIX = "ckpt-"


class CheckpointError(FailedPreconditionError):
    """A checkpoint that cannot be used (corrupt, truncated, for another shard)."""


@dataclass
class ShardSnapshot:
    """One shard's durable state as plain data (numpy arrays and builtins).

    ``tables``: per table a dict with ``spec`` (plain dict, see ps.wire/spec_to_dict) and
    ``kind``; dense: ``version``, ``start``, ``stop``, ``values``, ``state`` ({name: array});
    sparse: ``step``, ``ids``, ``values``, ``state``, ``versions``. ``clocks``: BSP clock per
    table. ``dedup``: Dedup.export() records with plain-data results. ``workers``: (name, clock,
    lease_s) of the members.
    """

    shard_index: int
    num_shards: int
    tables: list[dict[str, Any]] = field(default_factory=list)
    clocks: dict[str, int] = field(default_factory=dict)
    dedup: list[Any] = field(default_factory=list)
    workers: list[tuple[str, int, float]] = field(default_factory=list)
    created: float = 0.0
    pending: dict[str, list[Any]] = field(default_factory=dict)  # held BSP contributions (backup snapshots only)

    @property
    def sync_clock(self) -> int:
        return min((c for c in self.clocks.values() if c > 0), default=0)


# ---------------------------------------------------------------------- encoding
class _ArrayWriter:
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.offset, self.sha = f, 0, hashlib.sha256()

    def put(self, a: Any) -> dict[str, Any]:
        """Write ``a`` (an array, or a streamed one, ps.table.TieredRows, block by block) little-endian."""
        start, dtype = self.offset, np.dtype(a.dtype).newbyteorder("<")
        for block in a.blocks() if hasattr(a, "blocks") else [a]:
            block = np.ascontiguousarray(block, dtype)
            data = block.data.cast("B") if block.size else b""
            self.f.write(data)
            self.sha.update(data)
            self.offset += len(data)
        return {"__nd__": True, "dtype": dtype.str, "shape": list(np.shape(a)), "offset": start, "nbytes": self.offset - start}


def _encode(x: Any, w: _ArrayWriter) -> Any:
    if isinstance(x, np.ndarray) or hasattr(x, "blocks"):
        return w.put(x)
    if isinstance(x, dict):
        return {k: _encode(v, w) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v, w) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


_DTYPES = {"<f4", "<f8", "<i8", "<i4", "|u1", "<u8", "|b1", "<f2", "<u2"}  # <u2: bfloat16 rows as bits


def _decode(x: Any, data: memoryview) -> Any:
    if isinstance(x, dict):
        if x.get("__nd__"):
            if x["dtype"] not in _DTYPES:
                raise CheckpointError(f"array dtype {x['dtype']!r} not allowed in a checkpoint")
            dt = np.dtype(x["dtype"])
            shape = tuple(int(s) for s in x["shape"])
            off, n = int(x["offset"]), int(x["nbytes"])
            if off < 0 or off + n > len(data) or n != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise CheckpointError(f"array ref {x} does not fit data.bin ({len(data)} bytes)")
            return np.frombuffer(data[off : off + n], dtype=dt).reshape(shape).copy()
        return {k: _decode(v, data) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v, data) for v in x]
    return x


def pack_plain(obj: Any) -> bytes:
    """Plain data with numpy arrays (as checkpoints hold it) as one buffer: u64 meta length,
    msgpack meta, raw array bytes. No pickle."""
    buf = io.BytesIO()
    meta = msgpack.packb(_encode(obj, _ArrayWriter(buf)), use_bin_type=True)
    return struct.pack("<Q", len(meta)) + meta + buf.getvalue()


def unpack_plain(buf: bytes | memoryview) -> Any:
    """The inverse of pack_plain; CheckpointError on malformed input."""
    mv = memoryview(buf)
    if len(mv) < 8:
        raise CheckpointError("plain buffer shorter than its header")
    (n,) = struct.unpack("<Q", mv[:8])
    if 8 + n > len(mv):
        raise CheckpointError(f"plain buffer: meta of {n} bytes does not fit in {len(mv)}")
    try:
        meta = msgpack.unpackb(mv[8 : 8 + n], raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any decoding failure is malformed input
        raise CheckpointError(f"plain buffer: meta does not decode ({e})") from None
    return _decode(meta, mv[8 + n :])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- write / read
def write_checkpoint(root: str, snap: ShardSnapshot, keep: int = 3) -> str:
    """Write ``snap`` durably under ``root`` as a new ``ckpt-N``; keep the newest ``keep``. Returns its path."""
    os.makedirs(root, exist_ok=True)
    number = max([time.time_ns()] + [n + 1 for n, _ in _numbered(root)])
    final = os.path.join(root, f"{_PREFIX}{number:020d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = snapshot_to_plain(snap)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        w = _ArrayWriter(f)
        body = msgpack.packb(_encode(meta, w), use_bin_type=True)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(tmp, "meta.msgpack"), "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    manifest = {
        "format": FORMAT, "shard_index": snap.shard_index, "num_shards": snap.num_shards, "sync_clock": snap.sync_clock,
        "files": {
            "data.bin": {"bytes": w.offset, "sha256": w.sha.hexdigest()},
            "meta.msgpack": {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()},
        },
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(root)
    for _, path in _numbered(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    return final


def _numbered(root: str) -> list[tuple[int, str]]:
    """(number, path) of the finished checkpoint directories under ``root``, oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(n[len(_PREFIX):]), os.path.join(root, n)) for n in names
                  if n.startswith(_PREFIX) and not n.endswith(".tmp") and n[len(_PREFIX):].isdigit())


def list_checkpoints(root: str) -> list[str]:
    return [p for _, p in _numbered(root)]


def snapshot_to_plain(snap: ShardSnapshot) -> dict[str, Any]:
    return {
        "format": FORMAT, "shard_index": snap.shard_index, "num_shards": snap.num_shards, "tables": snap.tables,
        "clocks": snap.clocks, "dedup": snap.dedup, "workers": [list(w) for w in snap.workers], "created": time.time(),
        "pending": {n: [list(x) for x in p] for n, p in snap.pending.items()},
    }


def snapshot_from_plain(meta: dict[str, Any]) -> ShardSnapshot:
    try:
        return ShardSnapshot(
            int(meta["shard_index"]), int(meta["num_shards"]), meta["tables"], dict(meta["clocks"]), meta["dedup"],
            [(str(n), int(c), float(ls)) for n, c, ls in meta["workers"]], float(meta.get("created", 0.0)),
            {str(n): [(str(w), v) for w, v in p] for n, p in meta.get("pending", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"snapshot does not decode: {type(e).__name__}: {e}") from None


def read_checkpoint(path: str) -> ShardSnapshot:
    """Load one checkpoint directory, verifying sizes and checksums (CheckpointError if anything is off)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: manifest format {manifest.get('format') if isinstance(manifest, dict) else '?'} is not {FORMAT}")
    for name in ("data.bin", "meta.msgpack"):
        want = manifest.get("files", {}).get(name)
        p = os.path.join(path, name)
        if not want or not os.path.exists(p):
            raise CheckpointError(f"{path}: {name} missing")
        size = os.path.getsize(p)
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != want["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its SHA-256 check (corrupt)")
    with open(os.path.join(path, "meta.msgpack"), "rb") as f:
        try:
            meta = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
        except Exception as e:  # noqa: BLE001 - any decoding failure means a bad checkpoint
            raise CheckpointError(f"{path}: meta.msgpack does not decode ({e})") from None
    with open(os.path.join(path, "data.bin"), "rb") as f:
        data = memoryview(f.read())
    return snapshot_from_plain(_decode(meta, data))


def load_latest(root: str) -> tuple[ShardSnapshot | None, str | None, list[tuple[str, str]]]:
    """The newest valid checkpoint under ``root``: (snapshot, path, [(skipped path, why)]); (None, None, ...) if none."""
    skipped: list[tuple[str, str]] = []
    for _, path in reversed(_numbered(root)):
        try:
            return read_checkpoint(path), path, skipped
        except CheckpointError as e:
            skipped.append((path, str(e)))
    return None, None, skipped


# ---------------------------------------------------------------------- resharding
def reshard(snaps: list[ShardSnapshot], num_shards: int) -> list[ShardSnapshot]:
    """Re-spread the snapshots of every shard of a cluster over ``num_shards`` shards.

    Dense tables: the slices are joined in order and cut at the new ranges (each new slice takes
    the highest version of the old ones). Sparse tables: each row goes to the shard its virtual
    slot maps to. BSP clocks, dedup records and members are kept on every new shard.
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    snaps = sorted(snaps, key=lambda s: s.shard_index)
    old = snaps[0].num_shards if snaps else 0
    if [s.shard_index for s in snaps] != list(range(old)) or any(s.num_shards != old for s in snaps):
        raise CheckpointError(
            f"resharding needs one checkpoint of every shard 0..{old - 1}; got shards {[s.shard_index for s in snaps]}"
        )
    out = [
        ShardSnapshot(i, num_shards, [], dict(snaps[0].clocks), list(snaps[0].dedup), list(snaps[0].workers))
        for i in range(num_shards)
    ]
    names = [t["spec"]["name"] for t in snaps[0].tables]
    for name in names:
        parts = [next(t for t in s.tables if t["spec"]["name"] == name) for s in snaps]
        spec = parts[0]["spec"]
        parts.sort(key=lambda t: t.get("start", 0))  # dense slices in order (sparse parts keep theirs)
        values = np.concatenate([t["values"] for t in parts])
        state = {k: np.concatenate([t["state"][k] for t in parts]) for k in parts[0]["state"]}
        if parts[0]["kind"] == "dense":
            version = max(int(t["version"]) for t in parts)
            for i in range(num_shards):
                a, b = dense_range(values.size, i, num_shards)
                out[i].tables.append({
                    "kind": "dense", "spec": spec, "version": version, "start": a, "stop": b,
                    "values": values[a:b].copy(), "state": {k: v[a:b].copy() for k, v in state.items()},
                })
        else:
            ids = np.concatenate([t["ids"] for t in parts])
            versions = np.concatenate([t["versions"] for t in parts])
            owner = SlotMap(int(spec["num_slots"]), num_shards).shard_of(ids)
            step = max(int(t["step"]) for t in parts)
            updates = sum(int(t.get("updates", 0)) for t in parts)  # rows updated: kept in total (on shard 0)
            for i in range(num_shards):
                m = owner == i
                out[i].tables.append({
                    "kind": "sparse", "spec": spec, "step": step, "updates": updates if i == 0 else 0, "ids": ids[m], "values": values[m],
                    "versions": versions[m], "state": {k: v[m] for k, v in state.items()},
                })
    return out
