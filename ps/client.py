"""PSClient: the Python API workers use to talk to a set of shards.

Dense calls fan out one stream per shard, concurrently, and reassemble the
slices; sparse calls deduplicate ids, group them by owning shard and send one
request per shard (split further when large), concurrently, returning rows in
the caller's order. Every call has a deadline; UNAVAILABLE is retried with
backoff. Arrays may be numpy arrays or torch tensors (CPU or CUDA): results
come back as the same kind, on the same device.

Thread-safety: a PSClient may be shared by threads.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np
import torch

from ps.config import (
    DENSE,
    SPARSE,
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    OptimizerSpec,
    TableSpec,
)
from ps.errors import (
    InternalError,
    InvalidArgumentError,
    NonFiniteError,
    PSError,
    ResourceExhaustedError,
    ShardUnavailableError,
    with_table,
)
from ps.consistency import SyncPolicy
from ps.partition import SlotMap
from ps.shard import MembershipView, ShardStats, TableInfo
from ps.table import PushResult
from ps.wire import ERRORS, info_from_proto, membership_from_proto, policy_to_proto, spec_to_proto, stats_from_proto
from tessera.codec import as_numpy, from_wire, pack, to_wire, unpack
from tessera.rpc import channel_options
from tessera.service import ClientSecurity, client_channel
from tessera.v1 import ps_pb2 as pb

__all__ = ["PSClient", "DenseResult"]

T = TypeVar("T")

_SERVICE = "/tessera.v1.ParameterServer/"


@dataclass(frozen=True)
class DenseResult:
    """Outcome of a dense push: per-shard slice versions after it, and staleness when known."""

    versions: tuple[int, ...]
    staleness: tuple[int, ...]
    late: int = 0  # BSP: shards where the push's clock was already applied (not applied there)
    clock: int = -1  # BSP: the table's clock after the push (min over shards)


@dataclass
class _Dense:
    spec: TableSpec
    ranges: list[tuple[int, int]]  # [start, stop) per shard
    chunk: list[int]  # chunk_elems per shard


@dataclass
class _Sparse:
    spec: TableSpec
    slots: SlotMap
    max_ids: list[int]  # per shard: most ids one request may carry (0: unknown)


class _Replica:
    """One server of a shard: its channel and method stubs (raw bytes in and out)."""

    def __init__(self, address: str, options: list, interceptors: Sequence[Any] = (), security: ClientSecurity | None = None) -> None:
        self.address = address
        self.channel = client_channel(address, security, options)
        if interceptors:
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        u = lambda m: self.channel.unary_unary(_SERVICE + m)  # noqa: E731
        self.create, self.describe, self.stats = u("CreateTable"), u("DescribeTable"), u("Stats")
        self.pull_sparse, self.push_sparse = u("PullSparse"), u("PushSparse")
        self.join, self.heartbeat, self.checkpoint, self.role = u("Join"), u("Heartbeat"), u("Checkpoint"), u("Role")
        self.push_dense = self.channel.stream_stream(_SERVICE + "PushDense")
        self.pull_dense = self.channel.unary_stream(_SERVICE + "PullDense")


class _Shard:
    """One shard: its primary and backups (``"HOST:PORT|HOST:PORT"``); stubs go to the current primary."""

    def __init__(self, index: int, spec: str, options: list, interceptors: Sequence[Any] = (), security: ClientSecurity | None = None) -> None:
        self.index = index
        self.replicas = [_Replica(a, options, interceptors, security) for a in spec.split("|") if a]
        if not self.replicas:
            raise ValueError(f"shard {index}: no address in {spec!r}")
        self.cur = 0
        self.label = f"{index} at {spec}"
        self.failovers = 0

    @property
    def address(self) -> str:
        return self.replicas[self.cur].address

    def failover(self, timeout: float = 1.0) -> bool:
        """Point at the replica that says it is primary with the highest epoch; True if one does."""
        best: tuple[int, int] | None = None
        for j, r in enumerate(self.replicas):
            try:
                reply = pb.RoleReply.FromString(r.role(pb.RoleRequest().SerializeToString(), timeout=timeout))
            except grpc.RpcError:
                continue
            if reply.role == "primary" and (best is None or reply.epoch > best[1]):
                best = (j, reply.epoch)
        if best is None:
            return False
        if best[0] != self.cur:
            self.cur = best[0]
            self.failovers += 1
        return True

    def close(self) -> None:
        for r in self.replicas:
            r.channel.close()


    # the stubs of the current primary
    create = property(lambda self: self.replicas[self.cur].create)
    describe = property(lambda self: self.replicas[self.cur].describe)
    stats = property(lambda self: self.replicas[self.cur].stats)
    pull_sparse = property(lambda self: self.replicas[self.cur].pull_sparse)
    push_sparse = property(lambda self: self.replicas[self.cur].push_sparse)
    join = property(lambda self: self.replicas[self.cur].join)
    heartbeat = property(lambda self: self.replicas[self.cur].heartbeat)
    checkpoint = property(lambda self: self.replicas[self.cur].checkpoint)
    push_dense = property(lambda self: self.replicas[self.cur].push_dense)
    pull_dense = property(lambda self: self.replicas[self.cur].pull_dense)


class PSClient:
    """Connects to the shards at ``addresses`` (shard i at addresses[i]).

    ``addresses``: one entry per shard; ``"A|B"`` names a shard's primary and its backup (the
    client follows whichever is primary, failing over when one is gone).
    ``timeout``: deadline per call attempt in seconds. ``retry_timeout``: how long a call keeps
    retrying a shard that is UNAVAILABLE (backoff 0.1 s doubling up to 2 s, failing over between
    replicas) before it raises ShardUnavailableError naming the shard; ``retries`` bounds the
    number of retries as well (None: only the time bounds them). ``security``: TLS / mutual TLS
    and the token to present (``tessera.service.ClientSecurity``; default plaintext, no token).
    ``wire_dtype``: "float16"/"bfloat16" sends pushes and pulls at that
    precision (tables stay float32), None sends float32. ``interceptors``: gRPC client
    interceptors on every shard channel (e.g. ``tessera.rpc.DelayInterceptor``).
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        timeout: float = 60.0,
        retries: int | None = None,
        wire_dtype: str | None = None,
        worker: str = "",
        max_request_bytes: int = 16 << 20,
        interceptors: Sequence[Any] = (),
        retry_timeout: float = 30.0,
        security: ClientSecurity | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        if not addresses:
            raise ValueError("PSClient needs at least one shard address")
        if wire_dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {wire_dtype!r}")
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.timeout = timeout
        self.retries = retries
        self.retry_timeout = retry_timeout
        self.wire_dtype = wire_dtype or "float32"
        self.worker = worker
        # pushes carry (client, seq): a retry whose first attempt was applied is answered, not applied twice.
        # seq starts at the wall clock in microseconds, so a restarted worker of the same name never reuses one
        self.client_id = worker or f"client-{uuid.uuid4().hex[:12]}"
        self._seq = itertools.count(time.time_ns() // 1000)
        self.duplicates = 0  # retried pushes the shards had already applied
        # acknowledged updates per "table@shard": dense pushes applied (async) and sparse rows applied; a
        # fault test checks them against the shards' versions (acknowledged but lost = acked - applied)
        self.acked: Counter[str] = Counter()
        self.max_request_bytes = max_request_bytes
        opts = channel_options()
        self.security = security
        self._shards = [_Shard(i, a, opts, interceptors, security) for i, a in enumerate(self.addresses)]
        # BSP/SSP pulls block in these threads while the shards wait: leave room for the pushes that unblock them
        self._pool = ThreadPoolExecutor(max_workers=max(16, 8 * self.num_shards), thread_name_prefix="psclient")
        self._dense: dict[str, _Dense] = {}
        self._sparse: dict[str, _Sparse] = {}
        self._meta_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for s in self._shards:
            s.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every shard accepts connections (raises ShardUnavailableError)."""
        for s in self._shards:
            try:
                grpc.channel_ready_future(s.replicas[s.cur].channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                raise ShardUnavailableError(f"shard {s.label} not reachable within {timeout} s") from None

    # ------------------------------------------------------------------ plumbing
    def _call(self, shard: int, method: str, request: bytes, table: str | None = None) -> bytes:
        s = self._shards[shard]
        try:
            return self._retry(s, lambda: getattr(s, method)(request, timeout=self.timeout))
        except grpc.RpcError as e:
            raise _typed(e, s.label, table) from None

    def _retry(self, s: _Shard, attempt: Callable[[], T]) -> T:
        """``attempt()`` until it does not fail UNAVAILABLE, for at most ``retry_timeout`` seconds
        (and ``retries`` retries): jittered exponential backoff, and a failover check between
        attempts where the shard has replicas. Every other error propagates at once."""
        deadline = time.monotonic() + self.retry_timeout
        n = 0
        while True:
            try:
                return attempt()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE or (self.retries is not None and n >= self.retries):
                    raise
                cap = 2.0
                if len(s.replicas) > 1:
                    before = s.cur
                    if s.failover() and s.cur != before:
                        n += 1
                        continue  # a new primary: try it now
                    cap = 0.5  # a backup may take over any moment: look again soon
                delay = min(cap, 0.1 * 2**n) * (0.5 + random.random() / 2)
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                n += 1

    def _count_ack(self, key: str, updates: int, duplicate: bool) -> None:
        with self._meta_lock:
            self.acked[key] += updates
            self.duplicates += int(duplicate)

    def _fan_out(self, jobs: list[Any]) -> list[Any]:
        """Run zero-arg callables concurrently; re-raise the first error after all finish."""
        if len(jobs) == 1:
            return [jobs[0]()]
        futs = [self._pool.submit(j) for j in jobs]
        results, first_error = [], None
        for f in futs:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    # ------------------------------------------------------------------ tables
    def create_table(self, spec: TableSpec) -> bool:
        """Create ``spec`` on every shard. True if any shard created it; identical re-creation is a no-op.

        Raises TableExistsError if a table of that name exists with another spec.
        """
        return any(self._create_table(spec))

    def _create_table(self, spec: TableSpec) -> list[bool]:
        """Create ``spec`` on every shard; per shard, whether it created the table (False: it had it)."""
        check = pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=self.num_shards, validate_only=True)
        check_raw = check.SerializeToString()
        # every shard must accept before any creates: a refusal on one shard must not leave the table on others
        self._fan_out([lambda i=i: self._call(i, "create", check_raw, spec.name) for i in range(self.num_shards)])
        req = pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=self.num_shards).SerializeToString()
        replies = self._fan_out([lambda i=i: self._call(i, "create", req, spec.name) for i in range(self.num_shards)])
        infos, created = [], []
        for raw in replies:
            msg, _ = unpack(pb.CreateTableReply, raw)
            created.append(msg.created)
            infos.append(info_from_proto(msg.info))
        self._remember(infos)
        return created

    def create_dense(
        self,
        name: str,
        shape: Sequence[int] | int,
        optimizer: str | OptimizerSpec = "sgd",
        init: str | InitializerSpec | Any = "zeros",
        seed: int = 0,
        allow_nonfinite: bool = False,
        **hparams: float,
    ) -> bool:
        """Create a dense table. ``init`` is an initializer name/spec, or an array of initial values.

        Initial values are written only to the shards that created their slice now: a slice that
        already existed (trained, or restored from a checkpoint) is never reset."""
        values = None
        if not isinstance(init, (str, InitializerSpec)):
            values, init = init, "zeros"
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        try:
            spec = TableSpec(
                name, DENSE, shape=shape, optimizer=_opt(optimizer, hparams), initializer=_init(init), seed=seed,
                allow_nonfinite=allow_nonfinite,
            )
        except InvalidArgumentError as e:
            raise with_table(name, e) from None
        created = self._create_table(spec)
        fresh = [i for i, c in enumerate(created) if c]
        if values is not None and fresh:
            self._push_dense(name, values, pb.DENSE_OP_ASSIGN, -1, False, None, shards=fresh)
        return bool(fresh)

    def create_sparse(
        self,
        name: str,
        dim: int,
        optimizer: str | OptimizerSpec = "sgd",
        init: str | InitializerSpec = "zeros",
        seed: int = 0,
        admission: AdmissionSpec | None = None,
        eviction: EvictionSpec | None = None,
        num_slots: int = 4096,
        allow_nonfinite: bool = False,
        **hparams: float,
    ) -> bool:
        try:
            spec = TableSpec(
                name, SPARSE, dim=dim, optimizer=_opt(optimizer, hparams), initializer=_init(init), seed=seed,
                admission=admission or AdmissionSpec(), eviction=eviction or EvictionSpec(), num_slots=num_slots,
                allow_nonfinite=allow_nonfinite,
            )
        except InvalidArgumentError as e:
            raise with_table(name, e) from None
        return self.create_table(spec)

    def describe(self, name: str) -> list[TableInfo]:
        req = pb.DescribeTableRequest(table=name).SerializeToString()
        raws = self._fan_out([lambda i=i: self._call(i, "describe", req, name) for i in range(self.num_shards)])
        infos = [info_from_proto(unpack(pb.TableInfo, r)[0]) for r in raws]
        self._remember(infos)
        return infos

    def _remember(self, infos: list[TableInfo]) -> None:
        spec = infos[0].spec
        for i, info in enumerate(infos):
            if info.shard_index != i or info.num_shards != self.num_shards:
                raise InvalidArgumentError(
                    f"shard at {self.addresses[i]} is shard {info.shard_index} of {info.num_shards}; "
                    f"the client expected {i} of {self.num_shards} (check the order of --ps addresses)"
                )
        with self._meta_lock:
            if spec.kind == DENSE:
                self._dense[spec.name] = _Dense(
                    spec, [(i.offset, i.offset + i.length) for i in infos], [i.chunk_elems for i in infos]
                )
            else:
                self._sparse[spec.name] = _Sparse(
                    spec, SlotMap(spec.num_slots, self.num_shards), [i.max_ids_per_request for i in infos]
                )

    def _dense_meta(self, name: str) -> _Dense:
        if name not in self._dense:
            self.describe(name)
            if name not in self._dense:
                raise InvalidArgumentError(f"table {name!r} is sparse; use the sparse calls")
        return self._dense[name]

    def _sparse_meta(self, name: str) -> _Sparse:
        if name not in self._sparse:
            self.describe(name)
            if name not in self._sparse:
                raise InvalidArgumentError(f"table {name!r} is dense; use the dense calls")
        return self._sparse[name]

    # ------------------------------------------------------------------ dense
    def pull_dense(
        self, name: str, out: Any = None, policy: SyncPolicy | None = None, return_clock: bool = False
    ) -> Any:
        """The whole table. Into ``out`` (numpy array or torch tensor of the table's size, filled in
        place and returned) or a new float32 numpy array of the table's shape.

        ``policy``: wait as BSP/SSP require for step ``policy.clock`` (blocks on the shards).
        ``return_clock``: also return ``(clock, versions)``: the table's BSP clock (min over
        shards) and each shard's slice version (pass them back as a push's ``base_version``)."""
        meta = self._dense_meta(name)
        direct = _direct_out(out, meta.spec.numel)  # straight into out: no temporary, no second copy
        flat = direct if direct is not None else np.empty(meta.spec.numel, np.float32)
        head = pb.PullDenseRequest(table=name, dtype=self.wire_dtype, worker=self.worker)
        if policy is not None:
            head.sync.CopyFrom(policy_to_proto(policy))
        req = head.SerializeToString()
        clocks: list[int] = []
        versions = [-1] * self.num_shards

        def one(i: int) -> int:
            start, stop = meta.ranges[i]
            s = self._shards[i]

            def attempt() -> int:
                version = 0
                got = 0
                for raw in s.pull_dense(req, timeout=self.timeout):
                    msg, pl = unpack(pb.DenseChunk, raw, (15,))
                    data = from_wire(pl.get(15, b""), msg.dtype, None, what=f"table {name!r} reply")
                    a = start + msg.offset
                    flat[a : a + data.size] = data
                    got += data.size
                    version = msg.version
                    clocks.append(msg.clock)
                if got != stop - start:
                    raise InternalError(f"table {name!r}: shard {s.address} returned {got} of {stop - start} elements")
                return version

            try:
                versions[i] = self._retry(s, attempt)
                return versions[i]
            except grpc.RpcError as e:
                raise _typed(e, s.label, name) from None

        # shards whose range of a tiny table is empty hold nothing to read (and see no BSP pushes)
        self._fan_out([lambda i=i: one(i) for i in range(self.num_shards) if meta.ranges[i][1] > meta.ranges[i][0]])
        if direct is not None:
            result = out
        else:
            arr = flat.reshape(meta.spec.shape)
            result = arr if out is None else _fill(out, arr, name)
        return (result, (min(clocks, default=0), tuple(versions))) if return_clock else result

    def push_dense(
        self, name: str, grad: Any, base_version: int | Sequence[int] = -1, return_params: bool = False, out: Any = None,
        policy: SyncPolicy | None = None,
    ) -> Any:
        """Push a gradient for the whole table (same numel as the table); the shards apply their optimizer.

        With ``return_params`` the updated values stream back in the same call
        and are returned (into ``out`` if given, else like ``grad``); otherwise
        returns a DenseResult. ``base_version``: the version the gradient was computed
        from (one for all shards, or one per shard as pull_dense returns them). ``policy``: BSP pushes are held until the round
        completes (the call returns as soon as the shard holds it); async/SSP
        pushes advance this worker's clock.
        """
        if policy is not None and policy.sync and return_params:
            raise InvalidArgumentError(f"table {name!r}: return_params is not available for BSP pushes; pull instead")
        return self._push_dense(name, grad, pb.DENSE_OP_GRADIENT, base_version, return_params, out, policy)

    def assign_dense(self, name: str, values: Any) -> DenseResult:
        """Overwrite the table's values (optimizer state and version are kept)."""
        return self._push_dense(name, values, pb.DENSE_OP_ASSIGN, -1, False, None)

    def _push_dense(
        self, name: str, grad: Any, op: int, base_version: int | Sequence[int], return_params: bool, out: Any,
        policy: SyncPolicy | None = None, shards: Sequence[int] | None = None,
    ) -> Any:
        meta = self._dense_meta(name)
        bases = [base_version] * self.num_shards if isinstance(base_version, int) else list(base_version)
        if len(bases) != self.num_shards:
            raise InvalidArgumentError(f"table {name!r}: {len(bases)} base versions for {self.num_shards} shards")
        sync = policy_to_proto(policy) if policy is not None else None
        g = as_numpy(grad).reshape(-1)
        if g.size != meta.spec.numel:
            raise InvalidArgumentError(
                f"table {name!r}: pushed {g.size} elements ({tuple(np.shape(as_numpy(grad)))}), table has {meta.spec.numel} {meta.spec.shape}"
            )
        direct = _direct_out(out, meta.spec.numel) if return_params else None
        flat = (direct if direct is not None else np.empty(meta.spec.numel, np.float32)) if return_params else None
        # values assigned are kept, not accumulated: never round them to a low-precision wire dtype
        wire = self.wire_dtype if op == pb.DENSE_OP_GRADIENT else "float32"
        # all shards or none: check what will be sent, so no shard refuses a part the others apply
        _check_finite(meta.spec, g, wire, "gradient" if op == pb.DENSE_OP_GRADIENT else "assigned values")

        def one(i: int) -> tuple[int, int, bool, int]:
            start, stop = meta.ranges[i]
            chunk = meta.chunk[i]
            s = self._shards[i]
            seq = next(self._seq)

            def requests() -> Iterator[bytes]:
                for off in range(0, stop - start, chunk):
                    part = g[start + off : min(stop, start + off + chunk)]
                    head = pb.DenseChunk(offset=off)
                    if off == 0:
                        head.table, head.op, head.base_version = name, op, bases[i]  # type: ignore[assignment]
                        head.return_params, head.reply_dtype, head.worker = return_params, wire, self.worker
                        head.client, head.seq = self.client_id, seq
                        if sync is not None:
                            head.sync.CopyFrom(sync)
                    dtype, data = to_wire(part, wire)
                    head.dtype = dtype
                    head.last = off + chunk >= stop - start
                    yield pack(head, {15: data})

            def attempt() -> tuple[int, int, bool, int]:
                version = staleness = clock = -1
                late = False
                for raw in s.push_dense(requests(), timeout=self.timeout):
                    msg, pl = unpack(pb.DenseChunk, raw, (15,))
                    if 15 in pl and flat is not None:
                        data = from_wire(pl[15], msg.dtype, None, what=f"table {name!r} reply")
                        a = start + msg.offset
                        flat[a : a + data.size] = data
                    else:
                        version, staleness, late, clock = msg.version, msg.staleness, msg.late, msg.clock
                        dup[0] = msg.duplicate
                return version, staleness, late, clock

            dup = [False]
            try:
                out = self._retry(s, attempt)
            except grpc.RpcError as e:
                raise _typed(e, s.label, name) from None
            # counted once the call succeeded: an attempt that read its reply and then failed is retried
            self._count_ack(f"{name}@{i}", 1 if op == pb.DENSE_OP_GRADIENT and not (sync is not None and sync.sync) else 0, dup[0])
            return out

        # a table smaller than the cluster leaves some shards an empty range: nothing to send them
        res = self._fan_out(
            [
                (lambda i=i: one(i)) if meta.ranges[i][1] > meta.ranges[i][0] and (shards is None or i in shards)
                else (lambda: (-1, -1, False, -1))
                for i in range(self.num_shards)
            ]
        )
        if direct is not None:
            return out
        if flat is not None:
            arr = flat.reshape(meta.spec.shape)
            return _fill(out, arr, name) if out is not None else _like(grad, arr)
        clocks = [r[3] for r in res if r[3] >= 0]
        return DenseResult(tuple(r[0] for r in res), tuple(r[1] for r in res), sum(r[2] for r in res), min(clocks, default=-1))

    # ------------------------------------------------------------------ sparse
    def _group(self, name: str, ids: Any) -> tuple[TableSpec, np.ndarray, np.ndarray, list[list[np.ndarray]]]:
        """(spec, unique ids, inverse, per shard: index arrays into unique ids, split to fit a request)."""
        meta = self._sparse_meta(name)
        spec = meta.spec
        arr = _ids(ids, name)
        uniq, inverse = np.unique(arr, return_inverse=True)
        owner = meta.slots.shard_of(uniq)
        per_req = max(1, self.max_request_bytes // (spec.dim * 4 + 16))
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(self.num_shards + 1))
        for i in range(self.num_shards):  # all shards or none: refuse before sending anything
            n, limit = int(bounds[i + 1] - bounds[i]), meta.max_ids[i]
            if limit and min(n, per_req) > limit:
                raise ResourceExhaustedError(
                    f"table {name!r}: {n} ids for shard {i} exceed its limit of {limit} ids per request; "
                    "split the batch or lower max_request_bytes"
                )
        groups = []
        for i in range(self.num_shards):
            idx = order[bounds[i] : bounds[i + 1]]
            groups.append([idx[j : j + per_req] for j in range(0, len(idx), per_req)])
        return spec, uniq, inverse.reshape(-1), groups

    def pull_sparse(
        self, name: str, ids: Any, return_versions: bool = False, policy: SyncPolicy | None = None,
        return_clock: bool = False,
    ) -> Any:
        """Rows for ``ids`` (any shape of int64 ids; result shape ids.shape + (dim,)), in the caller's order.

        Missing rows are created on the shards with the table's initializer.
        Result: numpy float32 for numpy/list ids; a torch tensor on the ids'
        device for torch ids. With ``return_versions`` also returns int64 row
        versions; with ``return_clock`` also the table's BSP clock (last).
        ``policy``: wait as BSP/SSP require for step ``policy.clock``.
        """
        spec, uniq, inverse, groups = self._group(name, ids)
        rows = np.empty((len(uniq), spec.dim), np.float32)
        versions = np.empty(len(uniq), np.int64)
        head = pb.PullSparseRequest(table=name, dtype=self.wire_dtype, worker=self.worker)
        if policy is not None:
            head.sync.CopyFrom(policy_to_proto(policy))
        clocks: list[int] = []

        def one(i: int, idx: np.ndarray) -> None:
            req = pack(head, {15: np.ascontiguousarray(uniq[idx])})
            msg, pl = unpack(pb.PullSparseReply, self._call(i, "pull_sparse", req, name), (14, 15))
            rows[idx] = from_wire(pl.get(15, b""), msg.dtype, (len(idx), spec.dim), what=f"table {name!r} reply")
            versions[idx] = from_wire(pl.get(14, b""), "int64", (len(idx),), what=f"table {name!r} versions")
            clocks.append(msg.clock)

        self._fan_out([lambda i=i, idx=idx: one(i, idx) for i, g in enumerate(groups) for idx in g])
        shape = tuple(np.shape(ids)) + (spec.dim,)
        out: list[Any] = [_like(ids, rows[inverse].reshape(shape))]
        if return_versions:
            out.append(_like(ids, versions[inverse].reshape(np.shape(ids))))
        if return_clock:
            out.append(min(clocks, default=0))
        return out[0] if len(out) == 1 else tuple(out)

    def push_sparse(
        self, name: str, ids: Any, grads: Any, base_versions: Any = None, policy: SyncPolicy | None = None
    ) -> PushResult:
        """Push row gradients (grads: ids.shape + (dim,)); duplicate ids are summed first.

        ``base_versions`` (same shape as ids): the row versions the gradients
        were computed from, so the shards can measure staleness. ``policy``:
        a BSP push reaches every shard (empty where no id lives there), since
        each shard's round waits for every live worker.
        """
        spec, uniq, inverse, groups = self._group(name, ids)
        sync = policy_to_proto(policy) if policy is not None else None
        if sync is not None and sync.sync:
            groups = [g or [np.zeros(0, np.int64)] for g in groups]
        ga = as_numpy(grads)
        if ga.size and (ga.ndim < 1 or ga.shape[-1] != spec.dim):
            raise InvalidArgumentError(
                f"table {name!r}: gradient shape {tuple(ga.shape)} does not end in the table's dim {spec.dim}"
            )
        g = ga.reshape(-1, spec.dim) if ga.size else np.zeros((0, spec.dim), np.float32)
        if g.shape[0] != len(inverse):
            raise InvalidArgumentError(
                f"table {name!r}: {g.shape[0]} gradient rows for {len(inverse)} ids (dim {spec.dim})"
            )
        summed = np.zeros((len(uniq), spec.dim), np.float32)
        if len(inverse) == len(uniq):
            summed[inverse] = g  # no duplicates: a scatter, not a sum
        else:
            torch.from_numpy(summed).index_add_(0, torch.from_numpy(inverse), torch.from_numpy(np.ascontiguousarray(g, np.float32)))
        _check_finite(spec, summed, self.wire_dtype)  # what is sent: after summing duplicates and the wire cast
        base = None
        if base_versions is not None:
            base = np.full(len(uniq), -1, np.int64)
            np.maximum.at(base, inverse, as_numpy(base_versions).reshape(-1).astype(np.int64))

        def one(i: int, idx: np.ndarray) -> PushResult:
            head = pb.PushSparseRequest(table=name, dim=spec.dim, worker=self.worker, client=self.client_id, seq=next(self._seq))
            if sync is not None:
                head.sync.CopyFrom(sync)
            dtype, data = to_wire(summed[idx], self.wire_dtype)
            head.dtype = dtype
            payloads: dict[int, Any] = {14: np.ascontiguousarray(uniq[idx]), 15: data}
            if base is not None:
                payloads[13] = np.ascontiguousarray(base[idx])
            msg, _ = unpack(pb.PushSparseReply, self._call(i, "push_sparse", pack(head, payloads), name))
            self._count_ack(f"{name}@{i}", 0 if sync is not None and sync.sync else msg.applied, msg.duplicate)
            return PushResult(msg.applied, msg.dropped, msg.mean_staleness, msg.max_staleness, 0, int(msg.late), msg.clock)

        parts = self._fan_out([lambda i=i, idx=idx: one(i, idx) for i, gr in enumerate(groups) for idx in gr])
        measured = [p for p in parts if p.mean_staleness >= 0]
        return PushResult(
            sum(p.applied for p in parts),
            sum(p.dropped for p in parts),
            float(np.mean([p.mean_staleness for p in measured])) if measured else -1.0,
            max((p.max_staleness for p in parts), default=-1),
            0,
            sum(p.late for p in parts),
            min((p.clock for p in parts), default=-1),
        )

    # ------------------------------------------------------------------ membership
    def join(self, lease_s: float = 0.0) -> list[MembershipView]:
        """Register this client's ``worker`` name with every shard (lease_s 0: the shard's default)."""
        self._need_worker("join")
        req = pb.JoinRequest(worker=self.worker, lease_ms=int(lease_s * 1000)).SerializeToString()
        raws = self._fan_out([lambda i=i: self._call(i, "join", req) for i in range(self.num_shards)])
        return [membership_from_proto(unpack(pb.MembershipReply, r)[0]) for r in raws]

    def heartbeat(self, clock: int = 0, leave: bool = False) -> list[MembershipView]:
        """Renew this worker's lease on every shard (``leave``: leave the live set instead)."""
        self._need_worker("heartbeat")
        req = pb.HeartbeatRequest(worker=self.worker, clock=clock, leave=leave).SerializeToString()
        raws = self._fan_out([lambda i=i: self._call(i, "heartbeat", req) for i in range(self.num_shards)])
        return [membership_from_proto(unpack(pb.MembershipReply, r)[0]) for r in raws]

    def leave(self) -> None:
        self.heartbeat(leave=True)

    def _need_worker(self, what: str) -> None:
        if not self.worker:
            raise InvalidArgumentError(f"{what}: create the PSClient with worker='name'")

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, at_clock: int | None = None) -> list[tuple[str, int]]:
        """A checkpoint on every shard, at one BSP clock: (path, clock) per shard.

        Two phases: every shard holds its BSP tables at a clock >= ``at_clock`` (None: 0), then all
        are cut at the highest clock any shard held at, so the checkpoints form one consistent cut.
        ``at_clock`` -1: each shard now, without coordination (async/SSP runs have no common clock)."""
        if at_clock is None or at_clock >= 0:
            hold = pb.CheckpointRequest(at_clock=at_clock or 0, hold=True).SerializeToString()
            held = self._fan_out([lambda i=i: self._call(i, "checkpoint", hold) for i in range(self.num_shards)])
            at_clock = max(unpack(pb.CheckpointReply, r)[0].clock for r in held)
        req = pb.CheckpointRequest(at_clock=at_clock).SerializeToString()
        raws = self._fan_out([lambda i=i: self._call(i, "checkpoint", req) for i in range(self.num_shards)])
        out = []
        for raw in raws:
            msg, _ = unpack(pb.CheckpointReply, raw)
            out.append((msg.path, msg.clock))
        return out

    # ------------------------------------------------------------------ stats
    def stats(self) -> list[ShardStats]:
        req = pb.StatsRequest().SerializeToString()
        raws = self._fan_out([lambda i=i: self._call(i, "stats", req) for i in range(self.num_shards)])
        return [stats_from_proto(unpack(pb.StatsReply, r)[0]) for r in raws]


# ---------------------------------------------------------------------- helpers
def _typed(e: grpc.RpcError, address: str, table: str | None = None) -> PSError:
    found, code, details = ERRORS.exception_of(e)
    cls: type[PSError] = found if issubclass(found, PSError) else InternalError
    if table is not None and f"table {table!r}" not in (details or ""):
        details = f"table {table!r}: {details}"  # e.g. gRPC's own "Received message larger than max"
    err = cls(f"{details} [shard {address}, {code.name if code else 'unknown'}]")
    err.code = code  # type: ignore[attr-defined]
    return err


def _check_finite(spec: TableSpec, g: np.ndarray, wire: str, what: str = "gradient") -> None:
    """Refuse NaN/Inf in what would be sent: ``g`` at ``wire`` precision (1e6 is Inf in float16)."""
    if spec.allow_nonfinite:
        return
    dtype, data = to_wire(g, wire)
    sent = from_wire(data, dtype, None)
    if not np.isfinite(sent).all():
        bad = int(sent.size - np.count_nonzero(np.isfinite(sent)))
        raise NonFiniteError(
            f"table {spec.name!r}: {what} holds {bad} NaN/Inf value(s) as {wire} on the wire; rejected before sending"
        )


def _opt(optimizer: str | OptimizerSpec, hparams: dict[str, float]) -> OptimizerSpec:
    if isinstance(optimizer, OptimizerSpec):
        if hparams:
            raise ValueError("pass hyperparameters inside the OptimizerSpec or as keywords, not both")
        return optimizer
    return OptimizerSpec(optimizer, hparams)


def _init(init: str | InitializerSpec) -> InitializerSpec:
    return init if isinstance(init, InitializerSpec) else InitializerSpec(init)


def _ids(ids: Any, table: str) -> np.ndarray:
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
            raise InvalidArgumentError(
                f"table {table!r}: id {int(arr.max())} is out of range for int64 (ids are signed 64-bit)"
            )
    elif arr.dtype.kind != "i":
        raise InvalidArgumentError(f"table {table!r}: ids must be integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=False)


def _like(x: Any, arr: np.ndarray) -> Any:
    """``arr`` as the caller's kind: a torch tensor on x's device if x is a tensor, else numpy."""
    if not isinstance(x, torch.Tensor):
        return arr
    t = torch.from_numpy(arr)
    return t if x.device.type == "cpu" else t.to(x.device)


def _direct_out(out: Any, numel: int) -> np.ndarray | None:
    """A flat float32 numpy view of ``out`` that replies can be written into directly, else None.

    Only where a copy would fill it identically: C-contiguous writable float32 numpy arrays and
    contiguous CPU float32 tensors that do not require grad. On a failed call such an ``out`` may
    be partly overwritten.
    """
    if isinstance(out, np.ndarray):
        if out.dtype == np.float32 and out.size == numel and out.flags.c_contiguous and out.flags.writeable:
            return out.reshape(-1)
    elif isinstance(out, torch.Tensor):
        if (
            out.device.type == "cpu" and out.dtype == torch.float32 and out.numel() == numel
            and out.is_contiguous() and not out.requires_grad
        ):
            return out.detach().numpy().reshape(-1)
    return None


def _fill(out: Any, arr: np.ndarray, table: str) -> Any:
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
