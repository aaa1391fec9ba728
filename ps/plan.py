"""The client's planner: what a worker's call sends, decided before anything is sent. Validates
(dtypes, shapes, NaN/Inf as they will be on the wire, id ranges, per-shard id limits), groups ids
by owning shard and slices them to fit a request, and places replies in the caller's order.
Chooses the route of a step's tables (``stream_dense``, ``step_fits``, ``fuse_dense``). Pure
(numpy/torch; no grpc): ``PSClient`` (ps/client.py) runs the plan over the wire and the fan-out."""
from __future__ import annotations

from typing import Any, Container, Iterable, Mapping, Sequence

import numpy as np
import torch

from ps.config import TableSpec
from ps.consistency import ASYNC, SyncPolicy
from ps.errors import DtypeError, InvalidArgumentError, NonFiniteError, ResourceExhaustedError, ShapeMismatchError
from ps.partition import SlotMap
from ps.rowkernel import KERNEL
from ps.rowstore import row_items
from ps.table import all_finite
from tessera.codec import as_numpy, from_wire, to_wire

__all__ = ["dense_input", "wire_checked", "iota", "is_identity", "placement", "placed", "ids_of", "like", "direct_out",
           "fill", "group", "policy_for", "joined", "DenseOut", "SparseOut", "sum_duplicates", "stream_dense", "step_fits",
           "fuse_dense"]


def group(
    name: str, uniq: np.ndarray, slots: SlotMap, num_shards: int, max_ids: Sequence[int], per_req: int
) -> list[list[np.ndarray]]:
    """Per shard, index arrays into the unique ids ``uniq`` of the ids it owns, in slices of at most
    ``per_req``. Refuses (ResourceExhaustedError, before anything is sent) a shard whose slices
    would exceed its ``max_ids`` per request (0: no limit)."""
    owner = slots.shard_of(uniq, KERNEL)
    if num_shards <= 1 << 16:  # a stable sort of small integers is a radix sort (O(n), no comparisons)
        owner = owner.astype(np.uint8 if num_shards <= 1 << 8 else np.uint16)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_shards + 1))
    groups = []
    for i in range(num_shards):  # all shards or none: refused here, before anything is sent
        idx, limit = order[bounds[i] : bounds[i + 1]], max_ids[i]
        if limit and min(len(idx), per_req) > limit:
            raise ResourceExhaustedError(
                f"table {name!r}: {len(idx)} ids for shard {i} exceed its limit of {limit} ids per request; "
                "split the batch or lower max_request_bytes"
            )
        groups.append([idx[j : j + per_req] for j in range(0, len(idx), per_req)])
    return groups


def dense_input(spec: TableSpec, x: Any, flat: bool, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """``x`` as the flat array to send, and the shape the caller gave. Refuses (before anything is
    sent) a dtype other than the table's and a shape other than the table's (or, with ``flat``,
    its flat view (numel,)): a (5, 2) tensor is not silently a (2, 5) table, nor float64 float32."""
    if isinstance(x, (list, tuple)) or np.isscalar(x):
        x = np.asarray(x, dtype=spec.dtype)  # no dtype of its own: the table's
    dtype = str(x.dtype).removeprefix("torch.")
    shape = tuple(int(d) for d in x.shape)
    if dtype != spec.dtype:
        raise DtypeError(
            f"table {spec.name!r}: {what} of dtype {dtype}, the table holds {spec.dtype}; cast it first "
            f"(numpy .astype(np.{spec.dtype}), torch .to(torch.{spec.dtype}))"
        )
    want = (spec.numel,) if flat else tuple(spec.shape)
    if shape != want:
        view = " (the flat view, flat=True)" if flat else ""
        hint = "" if flat or int(np.prod(shape, dtype=np.int64)) != spec.numel else "; to push the flat view on purpose pass flat=True"
        raise ShapeMismatchError(
            f"table {spec.name!r}: {what} of shape {shape} ({int(np.prod(shape, dtype=np.int64))} elements), "
            f"expected {want}{view} ({spec.numel} elements){hint}; nothing sent"
        )
    return as_numpy(x).reshape(-1), shape


def wire_checked(spec: TableSpec, g: np.ndarray, wire: str, what: str = "gradient") -> tuple[str, memoryview]:
    """``g`` cast once to the wire dtype (the bytes to send), after refusing NaN/Inf in what is sent
    (1e6 is Inf in float16): all shards or none, so no shard refuses a part the others apply."""
    dtype, data = to_wire(g, wire)
    if not spec.allow_nonfinite:
        sent = from_wire(data, dtype, None)
        if not all_finite(sent):
            bad = int(sent.size - np.count_nonzero(np.isfinite(sent)))
            raise NonFiniteError(
                f"table {spec.name!r}: {what} holds {bad} NaN/Inf value(s) as {wire} on the wire; rejected before sending"
            )
    return dtype, data


_IOTA = [np.arange(0)]  # one read-only 0, 1, 2, ... that ``iota``'s views share


def iota(n: int) -> np.ndarray:
    """0, 1, ..., n-1 as a read-only view that ``is_identity`` recognises without reading it (the
    inverse of ids that were unique and sorted already)."""
    a = _IOTA[0]
    if len(a) < n:
        a = np.arange(max(n, 2 * len(a)))
        a.flags.writeable = False
        _IOTA[0] = a
    return a[:n]


def is_identity(inverse: np.ndarray, n: int) -> bool:
    """``inverse`` is 0, 1, ..., n-1 (the ids were unique and sorted already)."""
    if inverse.size != n:
        return False
    if inverse.base is _IOTA[0] and inverse.flags.c_contiguous:  # a run of 0, 1, 2, ...: starting at 0?
        return n == 0 or int(inverse.flat[0]) == 0
    return bool(inverse.size == 0 or (inverse[0] == 0 and inverse[-1] == inverse.size - 1 and np.all(np.diff(inverse) == 1)))


def placement(inverse: np.ndarray, n: int) -> tuple[np.ndarray | None, bool]:
    """(place, in_order) for a reply's n unique ids. ``place``: for ids that are all distinct but not
    sorted (``inverse`` a permutation of n), the caller's position of each unique id, so that replies
    are written in the caller's order directly instead of gathered by ``inverse`` afterwards (one copy
    of the rows fewer); else None. ``in_order``: the rows so placed (or the ids already unique and
    sorted) need no gather by ``inverse``."""
    if inverse.size != n:
        return None, False
    if is_identity(inverse, n):
        return None, True
    at = np.empty(n, np.int64)
    at[inverse] = np.arange(n)
    return at, True


def placed(place: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
    return idx if place is None else place[idx]


def ids_of(ids: Any, table: str) -> np.ndarray:
    """Ids as a flat int64 array; values that do not fit int64 are an error, not a wrap-around."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            raise InvalidArgumentError(f"table {table!r}: ids must be integers, got {ids.dtype}")
        if ids.dtype != getattr(torch, "uint64", None):
            return ids.detach().cpu().reshape(-1).to(torch.int64).numpy()
        ids = ids.detach().cpu().numpy()  # uint64: range-checked below, not wrapped by .to(int64)
    try:
        arr = np.asarray(ids)
    except OverflowError:
        raise InvalidArgumentError(f"table {table!r}: an id does not fit in 64 bits") from None
    if arr.dtype == object:
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise InvalidArgumentError(f"table {table!r}: ids must be integers in the int64 range") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind == "u":
        if arr.max() > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"table {table!r}: id {int(arr.max())} is out of range for int64 (ids are signed 64-bit)")
    elif arr.dtype.kind != "i":
        raise InvalidArgumentError(f"table {table!r}: ids must be integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=False)


def like(x: Any, arr: np.ndarray) -> Any:
    """``arr`` as the caller's kind: a torch tensor on x's device if x is a tensor, else numpy."""
    if not isinstance(x, torch.Tensor):
        return arr
    t = torch.from_numpy(arr)
    return t if x.device.type == "cpu" else t.to(x.device)


def direct_out(out: Any, numel: int) -> np.ndarray | None:
    """A flat float32 numpy view of ``out`` that replies can be written into directly, else None.

    Only where a copy would fill it identically: C-contiguous writable float32 numpy arrays and
    contiguous CPU float32 tensors that do not require grad. On a failed call such an ``out`` may
    be partly overwritten.
    """
    if isinstance(out, np.ndarray) and out.dtype == np.float32 and out.size == numel and out.flags.c_contiguous:
        return out.reshape(-1) if out.flags.writeable else None
    if (
        isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.float32 and out.numel() == numel
        and out.is_contiguous() and not out.requires_grad
    ):
        return out.detach().numpy().reshape(-1)
    return None


def fill(out: Any, arr: np.ndarray, table: str) -> Any:
    """Copy ``arr`` into the caller's buffer ``out`` (numpy array or torch tensor, same numel) and return it."""
    n = out.numel() if isinstance(out, torch.Tensor) else np.size(out)
    if n != arr.size:
        raise InvalidArgumentError(f"table {table!r}: out has {n} elements, the table has {arr.size}")
    if isinstance(out, torch.Tensor):
        with torch.no_grad():
            out.copy_(torch.from_numpy(arr).view(out.shape))
    else:
        np.copyto(out, arr.reshape(np.shape(out)))
    return out


def policy_for(policy: Any, name: str) -> SyncPolicy:
    """A call's policy for table ``name``: one for every table, or one per table (absent: async)."""
    p = policy if policy is None or isinstance(policy, SyncPolicy) else policy.get(name)
    return p if p is not None else ASYNC


def stream_dense(largest_slice: Mapping[str, int], itemsize: int, inline_bytes: int) -> set[str]:
    """The dense tables of a step that go by the chunked streams (PushDense/PullDense, beside the Step
    calls), not inside the Step calls: those whose largest slice (``largest_slice``: elements per
    table) is over ``inline_bytes`` at ``itemsize`` bytes per element on the wire (a unary message of
    many MiB costs more than its chunks streamed)."""
    return {n for n, elems in largest_slice.items() if elems * itemsize > inline_bytes}


def step_fits(parts: Sequence[Sequence[Any]], reply_bytes: Sequence[int], max_request_bytes: int) -> bool:
    """Does one Step call per shard carry the step: each shard's request (``parts``: its StepParts'
    arrays) and reply (``reply_bytes``), with 4 KiB for the rest, within ``max_request_bytes``? (If
    not, the step runs as separate calls.)"""
    size = [sum(a.nbytes for p in ps for a in (p.ids, p.values, p.base_versions) if a is not None) for ps in parts]
    return max([*size, *reply_bytes], default=0) + 4096 <= max_request_bytes


def fuse_dense(push_dense: Iterable[str], pull_dense: Container[str], policy: Any, pull_policy: Any) -> list[str]:
    """The dense tables of a step run as separate calls that go as one fused push (the shard streams
    the new values back while the gradient is still arriving): those pushed and pulled where neither
    waits (``policy``, ``pull_policy`` as ``policy_for`` takes them: not BSP, no SSP pull)."""
    return [
        n for n in push_dense
        if n in pull_dense and not any(p.sync or p.ssp for p in (policy_for(policy, n), policy_for(pull_policy, n)))
    ]


def joined(group: list[np.ndarray]) -> np.ndarray:
    """A shard's index slices (``group``) as one index array."""
    return group[0] if len(group) == 1 else np.concatenate(group) if group else np.zeros(0, np.int64)


class DenseOut:
    """A dense table's values as they come back from its shards: written into the caller's ``out``
    directly where that fills it identically (``direct_out``), else into a new float32 array."""

    def __init__(self, spec: TableSpec, out: Any) -> None:
        self.spec, self.out = spec, out
        self.direct = direct_out(out, spec.numel)
        self.flat = self.direct if self.direct is not None else np.empty(spec.numel, np.float32)

    def put(self, offset: int, values: np.ndarray) -> None:
        self.flat[offset : offset + values.size] = values

    def result(self, kind: Any = None) -> Any:
        """``out`` filled, else the values in the table's shape (like ``kind``: see ``like``)."""
        if self.direct is not None:
            return self.out
        arr = self.flat.reshape(self.spec.shape)
        return like(kind, arr) if self.out is None else fill(self.out, arr, self.spec.name)


class SparseOut:
    """A sparse pull's rows and versions as they come back from the shards, for ``ids`` whose unique
    ids have ``inverse`` back to the caller's order: each shard's rows are written in the caller's
    order at once where the ids are distinct (``placement``: no gather after)."""

    def __init__(self, dim: int, uniq: np.ndarray, inverse: np.ndarray, ids: Any) -> None:
        self.dim, self.inverse, self.ids = dim, inverse, ids
        self.rows = np.empty((len(uniq), dim), np.float32)
        self.versions = np.empty(len(uniq), np.int64)
        self.place, self.in_order = placement(inverse, len(uniq))

    def put(self, idx: np.ndarray, rows: np.ndarray, versions: np.ndarray) -> None:
        """The rows and versions of the unique ids at ``idx`` (float32 rows: one copy per row, not per value)."""
        at = placed(self.place, idx)
        if rows.dtype == np.float32 and rows.flags.c_contiguous and self.dim:
            row_items(self.rows)[at] = row_items(rows.reshape(-1, self.dim))
        else:
            self.rows[at] = rows
        self.versions[at] = versions

    def result(self) -> tuple[Any, Any]:
        """(rows ids.shape + (dim,), int64 versions ids.shape) in the caller's order, like the ids."""
        rows, versions = (self.rows, self.versions) if self.in_order else (self.rows[self.inverse], self.versions[self.inverse])
        shape = tuple(np.shape(self.ids))
        return like(self.ids, rows.reshape(shape + (self.dim,))), like(self.ids, versions.reshape(shape))


def sum_duplicates(
    spec: TableSpec, uniq: np.ndarray, inverse: np.ndarray, grads: Any, base_versions: Any
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """A sparse push's gradient rows (one per id; ``inverse`` maps the ids to ``uniq``) checked and
    summed per unique id: (float32 rows, newest base version per row or None, ``place``). The rows
    of the unique ids at ``idx`` are ``rows[placed(place, idx)]``: with duplicates, the sums in the
    order of ``uniq`` (``place`` None); with distinct ids, the caller's rows as they are, ``place``
    each unique id's position among them (no scatter into ``uniq``'s order and gather back out)."""
    name = spec.name
    ga = as_numpy(grads)
    if ga.size and (ga.ndim < 1 or ga.shape[-1] != spec.dim):
        raise InvalidArgumentError(f"table {name!r}: gradient shape {tuple(ga.shape)} does not end in the table's dim {spec.dim}")
    g = ga.reshape(-1, spec.dim) if ga.size else np.zeros((0, spec.dim), np.float32)
    if g.shape[0] != len(inverse):
        raise InvalidArgumentError(f"table {name!r}: {g.shape[0]} gradient rows for {len(inverse)} ids (dim {spec.dim})")
    bv = None if base_versions is None else as_numpy(base_versions).reshape(-1).astype(np.int64, copy=False)
    place, distinct = placement(inverse, len(uniq))
    if distinct:  # one row per unique id already: sent as given, each shard's rows gathered once
        return np.ascontiguousarray(g, np.float32), bv, place
    summed = np.zeros((len(uniq), spec.dim), np.float32)
    torch.from_numpy(summed).index_add_(0, torch.from_numpy(inverse), torch.from_numpy(np.ascontiguousarray(g, np.float32)))
    if bv is None:
        return summed, None, None
    base = np.full(len(uniq), -1, np.int64)
    np.maximum.at(base, inverse, bv)
    return summed, base, None
