"""PSClient: the Python API workers use to talk to a set of shards.

One idea: partition, fan out, reassemble. Dense tables are cut at the shards' ranges and sent as
one chunked stream per shard; sparse ids are deduplicated, grouped by owning shard and sent as one
request per shard (split further when large); ``step`` sends one training step (push t, pull t+1)
as one Step call per shard. Calls run concurrently and results come back in the caller's shape and
order. Talking to one shard (replicas, deadlines, retries of UNAVAILABLE and of a CANCELLED that a
server's shutdown caused, typed errors) is ``ps.stub.ShardStub``'s; the framing is ``ps.wire``'s.
Arrays may be numpy arrays or torch tensors (CPU or CUDA): results come back as the same kind, on
the same device.

Thread-safety: a PSClient may be shared by threads.
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from ps.config import DENSE, SPARSE, AdmissionSpec, EvictionSpec, InitializerSpec, OptimizerSpec, TableSpec
from ps.errors import InternalError, InvalidArgumentError, TableNotFoundError, with_table
from ps.consistency import SyncPolicy
from ps.outages import ShardWatch
from ps.plan import (DenseOut, SparseOut, dense_input, fuse_dense, group, ids_of, iota, joined, placed, policy_for, step_fits,
                     stream_dense, sum_duplicates, wire_checked)
from ps.partition import SlotMap
from ps.shard import PULL_DENSE, PULL_SPARSE, PUSH_DENSE, PUSH_SPARSE, MembershipView, ShardStats, StepOutcome, StepPart, TableInfo
from ps.stub import CallPolicy, ShardStub
from ps.table import PushResult
from ps.wire import (frame, frame_pieces, info_from_proto, membership_from_proto, policy_to_proto, spec_to_proto,
                     stats_from_proto, step_parts_to_proto, step_reply_from_proto, unframe)
from tessera.codec import DTYPES, as_numpy, from_wire
from tessera.rpc import channel_options
from tessera.service import ClientSecurity
from tessera.v1 import ps_pb2 as pb

__all__ = ["ChangedRows", "DenseResult", "PSClient", "StepResult"]

T = TypeVar("T")


_GROUPS_KEPT = 4  # groupings of recent id arrays kept per sparse table (PSClient._group)


@dataclass(frozen=True)
class DenseResult:
    """Outcome of a dense push: per-shard slice versions after it, and staleness when known."""

    versions: tuple[int, ...]
    staleness: tuple[int, ...]
    late: int = 0  # BSP: shards where the push's clock was already applied (not applied there)
    clock: int = -1  # BSP: the table's clock after the push (min over shards)


@dataclass
class StepResult:
    """What ``PSClient.step`` brought back.

    ``dense``: per pulled dense table, its values (the caller's ``out`` buffer, filled in place, or a
    new float32 array of the table's shape). ``dense_versions``: per pulled dense table, each shard's
    slice version at the pull (pass it back as the next push's base version). ``sparse``: per pulled
    sparse table, (rows ids.shape + (dim,), int64 row versions ids.shape), in the caller's id order,
    numpy or torch like the ids. ``clock``: per pulled table, its BSP clock (min over shards).
    ``pushed``: per pushed table, a DenseResult or a PushResult as push_dense/push_sparse return."""

    dense: dict[str, Any]
    dense_versions: dict[str, tuple[int, ...]]
    sparse: dict[str, tuple[Any, Any]]
    clock: dict[str, int]
    pushed: dict[str, Any]


@dataclass
class ChangedRows:
    """What ``PSClient.pull_sparse_changed`` brought back, in the caller's id order: ``changed`` bool per
    id (its values came over the wire: the version differs from the known one, or the shard could not
    vouch for the known one, see ``pull_sparse_changed``; a row not changed is the one the caller holds);
    ``rows`` float32 (changed.sum(), dim), the changed rows in id order; ``versions`` int64 per id
    (current, every id); ``epochs`` int64 per id, the eviction epoch of the id's shard at which its
    version was read (what to pass as ``known_epochs`` with these versions next time); ``clock`` the
    table's BSP clock (min over shards)."""

    changed: np.ndarray
    rows: np.ndarray
    versions: np.ndarray
    epochs: np.ndarray
    clock: int


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
    ``max_request_bytes``: the most one request carries (sparse requests are split to fit; a step
    that does not fit one Step call per shard runs as separate calls). ``step_inline_bytes``: in
    ``step``, a dense table whose largest slice is bigger travels by the chunked streams instead
    of inside the Step call (default 1 MiB, one wire chunk). ``transport``: "auto" (default) sends
    the data calls over a shard's bulk port when it serves one (``tessera ps serve --bulk-port``;
    the shard says so in its Role reply), else gRPC; "grpc": always gRPC.
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
        step_inline_bytes: int = 1 << 20,
        transport: str = "auto",
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a]
        if not addresses:
            raise ValueError("PSClient needs at least one shard address")
        if wire_dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {wire_dtype!r}")
        if transport not in ("auto", "grpc"):
            raise ValueError(f"transport must be 'auto' or 'grpc', got {transport!r}")
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
        # per sparse table: rows whose values came back over the wire (pull_sparse, step, pull_sparse_changed)
        self.rows_pulled: Counter[str] = Counter()
        self.max_request_bytes = max_request_bytes
        self.step_inline_bytes = step_inline_bytes
        opts = channel_options()
        self.security = security
        policy = CallPolicy(timeout, retries, retry_timeout)
        # says when a shard becomes unreachable, while it stays so, and when it is back (set its ``say``,
        # ``doing`` and ``on_back`` to take part)
        self.watch = ShardWatch(retry_timeout)
        self._shards = [
            ShardStub(i, a, opts, policy, interceptors, security, transport == "auto", watch=self.watch)
            for i, a in enumerate(self.addresses)
        ]
        # BSP/SSP pulls block in these threads while the shards wait: leave room for the pushes that unblock them
        self._pool = ThreadPoolExecutor(max_workers=max(16, 8 * self.num_shards), thread_name_prefix="psclient")
        self._dense: dict[str, _Dense] = {}
        self._sparse: dict[str, _Sparse] = {}
        self._meta_lock = threading.Lock()
        # per sparse table: its last few _group results (a trainer pushes the rows it pulled 1-2 steps before)
        self._last_group: dict[str, list[tuple[_Sparse, np.ndarray, Any]]] = {}

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every shard channel (idempotent); the client is unusable afterwards."""
        self._pool.shutdown(wait=False)
        self.watch.close()
        for s in self._shards:
            s.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every shard accepts connections (raises ShardUnavailableError)."""
        for s in self._shards:
            s.wait_ready(timeout)

    # ------------------------------------------------------------------ plumbing
    def _call(self, shard: int, method: str, request: Any, table: str | None = None) -> bytes:
        return self._shards[shard].call(method, request, table)

    def _count_rows(self, table: str, n: int) -> None:
        with self._meta_lock:
            self.rows_pulled[table] += n

    def _count_ack(self, key: str, updates: int, duplicate: bool) -> None:
        with self._meta_lock:
            self.acked[key] += updates
            self.duplicates += int(duplicate)

    def _all(self, method: str, request: Any, reply: Any, table: str | None = None, shards: Sequence[int] | None = None) -> list[Any]:
        """Unary ``method`` with one ``request`` message on every shard (``shards``: these), concurrently:
        the replies parsed as ``reply`` (a message class), in shard order."""
        raw = request.SerializeToString()
        which = range(self.num_shards) if shards is None else shards
        return [unframe(reply, r)[0] for r in self._settle([self._shards[i].start(method, raw, table) for i in which])]

    def _fan_out(self, jobs: list[Any]) -> list[Any]:
        """Run zero-arg callables concurrently; re-raise the first error after all finish."""
        if len(jobs) <= 1:
            return [j() for j in jobs]
        # the first job runs here, on the calling thread (which would only wait): one hand-off fewer
        futs = [self._pool.submit(j) for j in jobs[1:]]
        return self._settle([jobs[0], *(f.result for f in futs)])

    @staticmethod
    def _settle(jobs: Iterable[Callable[[], Any]]) -> list[Any]:
        """Each zero-arg callable's result in order (for calls already sent, ``ShardStub.start``: their
        replies); the first error is raised after all finished."""
        results, first_error = [], None
        for job in jobs:
            try:
                results.append(job())
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
        req = pb.CreateTableRequest(spec=spec_to_proto(spec), num_shards=self.num_shards, validate_only=True)
        # every shard must accept before any creates: a refusal on one shard must not leave the table on others
        self._all("CreateTable", req, pb.CreateTableReply, spec.name)
        req.validate_only = False
        replies = self._all("CreateTable", req, pb.CreateTableReply, spec.name)
        self._remember([info_from_proto(m.info) for m in replies])
        return [m.created for m in replies]

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
        spec = _spec(name, DENSE, optimizer, hparams, init, shape=shape, seed=seed, allow_nonfinite=allow_nonfinite)
        created = self._create_table(spec)
        fresh = [i for i, c in enumerate(created) if c]
        if values is not None and fresh:
            # initial values in any float dtype, as the table's shape or its flat view (cast, not refused)
            arr = as_numpy(values)
            if arr.dtype.kind == "f":
                arr = arr.astype(spec.dtype, copy=False)
            self._push_dense(name, arr, pb.DENSE_OP_ASSIGN, -1, False, None, shards=fresh, flat_view=arr.ndim == 1)
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
        row_dtype: str = "float32",
        **hparams: float,
    ) -> bool:
        """Create the sparse table ``name`` on every shard: rows of ``dim`` values, created on
        first touch by ``init`` (deterministic per (table, id, ``seed``)) and updated by ``optimizer``
        (hyperparameters as keyword arguments, see the API reference). ``row_dtype``: how the shards
        store the rows, float32, float16 or bfloat16 (optimizer maths in float32; a low-precision
        table's rows are pulled as stored and widened to float32 here). Returns True if any shard
        created it, False if an identical table existed (a different one raises TableExistsError)."""
        return self.create_table(_spec(
            name, SPARSE, optimizer, hparams, init, dim=dim, dtype=row_dtype, seed=seed, admission=admission or AdmissionSpec(),
            eviction=eviction or EvictionSpec(), num_slots=num_slots, allow_nonfinite=allow_nonfinite,
        ))

    def drop_table(self, name: str, missing_ok: bool = False) -> bool:
        """Drop table ``name`` from every shard (admin only): its values, optimizer state, BSP clock
        and deduplication records are gone, and a later ``create_*`` of the name starts afresh.
        Returns True if any shard held it. TableNotFoundError naming it if no shard did (``missing_ok``:
        False instead). Idempotent per shard, so a call that failed part-way can simply be repeated."""
        return bool(self.drop_tables([name], missing_ok=missing_ok))

    def drop_tables(self, names: Sequence[str], missing_ok: bool = False) -> list[str]:
        """Drop ``names`` from every shard in one call per shard (each shard drops them together and,
        with a checkpoint directory, writes one checkpoint after); returns the names some shard held.
        ``missing_ok`` False: TableNotFoundError for a name no shard held (the others are dropped).
        A shard with a backup forwards the drop to it first."""
        names = list(dict.fromkeys(names))
        if not names:
            return []
        replies = self._all("DropTable", pb.DropTableRequest(tables=names, missing_ok=True), pb.DropTableReply, names[0] if len(names) == 1 else None)
        held = {n for m in replies for n in m.dropped}
        with self._meta_lock:
            for n in names:
                self._dense.pop(n, None)
                self._sparse.pop(n, None)
        missing = [n for n in names if n not in held]
        if missing and not missing_ok:
            raise TableNotFoundError(f"table {missing[0]!r} not found on any of the {self.num_shards} shards")
        return [n for n in names if n in held]

    def describe(self, name: str) -> list[TableInfo]:
        """Each shard's view of table ``name`` (kind, shape, optimizer, clock); TableNotFoundError if absent."""
        infos = [info_from_proto(m) for m in self._all("DescribeTable", pb.DescribeTableRequest(table=name), pb.TableInfo, name)]
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
        return self._meta(name, self._dense, "sparse; use the sparse calls")

    def _sparse_meta(self, name: str) -> _Sparse:
        return self._meta(name, self._sparse, "dense; use the dense calls")

    def _meta(self, name: str, known: Mapping[str, T], other: str) -> T:
        """What the client knows of table ``name`` (asked of the shards the first time)."""
        if name not in known:
            self.describe(name)
            if name not in known:
                raise InvalidArgumentError(f"table {name!r} is {other}")
        return known[name]

    # ------------------------------------------------------------------ dense
    def pull_dense(self, name: str, out: Any = None, policy: SyncPolicy | None = None, return_clock: bool = False) -> Any:
        """The whole table. Into ``out`` (numpy array or torch tensor of the table's size, filled in
        place and returned) or a new float32 numpy array of the table's shape.

        ``policy``: wait as BSP/SSP require for step ``policy.clock`` (blocks on the shards).
        ``return_clock``: also return ``(clock, versions)``: the table's BSP clock (min over
        shards) and each shard's slice version (pass them back as a push's ``base_version``)."""
        meta = self._dense_meta(name)
        got = DenseOut(meta.spec, out)  # straight into out where it can: no temporary, no second copy
        sync = policy_to_proto(policy) if policy is not None else None
        req = pb.PullDenseRequest(table=name, dtype=self.wire_dtype, worker=self.worker, sync=sync).SerializeToString()
        clocks: list[int] = []
        versions = [-1] * self.num_shards

        def one(i: int) -> None:
            start, stop = meta.ranges[i]
            s = self._shards[i]

            def attempt() -> int:
                version = n = 0
                for raw in s.pull_dense(req):
                    msg, pl = unframe(pb.DenseChunk, raw)
                    data = from_wire(pl.get("data", b""), msg.dtype, None, what=f"table {name!r} reply")
                    got.put(start + msg.offset, data)
                    n += data.size
                    version = msg.version
                    clocks.append(msg.clock)
                if n != stop - start:
                    raise InternalError(f"table {name!r}: shard {s.address} returned {n} of {stop - start} elements")
                return version

            versions[i] = s.retry(attempt, name)

        # shards whose range of a tiny table is empty hold nothing to read (and see no BSP pushes)
        self._fan_out([lambda i=i: one(i) for i in range(self.num_shards) if meta.ranges[i][1] > meta.ranges[i][0]])
        result = got.result()
        return (result, (min(clocks, default=0), tuple(versions))) if return_clock else result

    def push_dense(
        self, name: str, grad: Any, base_version: int | Sequence[int] = -1, return_params: bool = False, out: Any = None,
        policy: SyncPolicy | None = None, flat: bool = False,
    ) -> Any:
        """Push a gradient for the whole table; the shards apply their optimizer.

        ``grad``: a numpy array or torch tensor of the table's shape and dtype (float32); another
        shape or dtype is refused (ShapeMismatchError / DtypeError, both InvalidArgumentError,
        naming the table, the expected and the given shape or dtype; nothing is sent). ``flat``:
        push the table's flat view on purpose (a 1-D tensor of the table's numel, C order).
        With ``return_params`` the updated values stream back in the same call and are returned
        (into ``out`` if given, else like ``grad``); otherwise returns a DenseResult. In async/SSP
        mode a shard that computes the push as its chunks arrive sends each new block back at once,
        while the rest is still being sent; after a successful return ``out`` holds the committed
        values. If the call raises, nothing was applied and ``out`` is unspecified (it may hold some
        blocks' provisional new values): pull to read the table. ``base_version``: the version the
        gradient was computed from (one for all shards, or one per shard as pull_dense returns
        them). ``policy``: BSP pushes are held until the round completes (the call returns as soon
        as the shard holds it); async/SSP pushes advance this worker's clock.
        """
        if policy is not None and policy.sync and return_params:
            raise InvalidArgumentError(f"table {name!r}: return_params is not available for BSP pushes; pull instead")
        pushed = self._push_dense(name, grad, pb.DENSE_OP_GRADIENT, base_version, return_params, out, policy, flat_view=flat)
        return pushed[0] if return_params else pushed

    def assign_dense(self, name: str, values: Any, flat: bool = False) -> DenseResult:
        """Overwrite the table's values (optimizer state and version are kept). ``values``: the
        table's shape and dtype, or its flat view with ``flat`` (as for push_dense)."""
        return self._push_dense(name, values, pb.DENSE_OP_ASSIGN, -1, False, None, flat_view=flat)

    def _push_dense(
        self, name: str, grad: Any, op: int, base_version: int | Sequence[int], return_params: bool, out: Any,
        policy: SyncPolicy | None = None, shards: Sequence[int] | None = None, flat_view: bool = False,
    ) -> Any:
        """The DenseResult; with ``return_params``: (values, DenseResult)."""
        meta, bases, given_shape, wire, wdata = self._dense_grad(name, grad, base_version, op, flat_view)
        sync = policy_to_proto(policy) if policy is not None else None
        got = DenseOut(meta.spec, out) if return_params else None

        def one(i: int) -> tuple[int, PushResult]:
            start, stop = meta.ranges[i]
            chunk = meta.chunk[i]
            s = self._shards[i]
            seq = next(self._seq)

            # what the first chunk says of the push (``early``: replies are read while this stream is sent, on
            # gRPC's sender thread)
            first = pb.DenseChunk(
                table=name, op=op, base_version=bases[i], return_params=return_params, reply_dtype=wire,  # type: ignore[arg-type]
                worker=self.worker, early=return_params, client=self.client_id, seq=seq, shape=given_shape, flat_view=flat_view,
                sync=sync,
            )

            def requests() -> Iterator[Any]:
                for off in range(0, stop - start, chunk):
                    head = pb.DenseChunk(offset=off, dtype=wire, last=off + chunk >= stop - start)
                    if off == 0:
                        head.MergeFrom(first)
                    part = wdata[start + off : min(stop, start + off + chunk)]
                    yield frame_pieces(head, data=part)  # (views of wdata: sent as they are over bulk)

            def attempt() -> PushResult:
                version = staleness = clock = -1
                late = False
                # reply chunks land by offset as they come (a later one overwrites an earlier one): the
                # early ones (sent before the commit) count only if the status says they held
                early = final = 0
                for raw in s.push_dense(requests()):
                    msg, pl = unframe(pb.DenseChunk, raw)
                    if "data" in pl and got is not None:
                        data = from_wire(pl["data"], msg.dtype, None, what=f"table {name!r} reply")
                        got.put(start + msg.offset, data)
                        if msg.early:
                            early += data.size
                        else:
                            final += data.size
                    else:
                        version, staleness, late, clock = msg.version, msg.staleness, msg.late, msg.clock
                        dup[0] = msg.duplicate
                        if msg.early:
                            final += early
                if got is not None and final != stop - start:
                    raise InternalError(
                        f"table {name!r}: shard {s.address} returned {final} of {stop - start} updated values"
                        + (f" ({early} sent before the commit, not confirmed)" if early else "")
                    )
                return PushResult(0, 0, -1.0, staleness, version, int(late), clock)

            dup = [False]
            out = s.retry(attempt, name)
            # counted once the call succeeded: an attempt that read its reply and then failed is retried
            self._count_ack(f"{name}@{i}", 1 if op == pb.DENSE_OP_GRADIENT and not (sync is not None and sync.sync) else 0, dup[0])
            return i, out

        # a table smaller than the cluster leaves some shards an empty range: nothing to send them
        sent = [i for i in (shards if shards is not None else range(self.num_shards)) if meta.ranges[i][1] > meta.ranges[i][0]]
        result = _dense_result(self._fan_out([lambda i=i: one(i) for i in sent]), self.num_shards)
        return result if got is None else (got.result(grad), result)

    def _dense_grad(
        self, name: str, grad: Any, base_version: int | Sequence[int], op: int, flat_view: bool = False
    ) -> tuple[_Dense, list[int], tuple[int, ...], str, np.ndarray]:
        """A dense push checked and cast once, before anything is sent (all shards or none: no shard
        refuses a part the others apply; the finiteness check reads what is sent): (meta, base version
        per shard, the shape the caller gave, the wire dtype, the flat values to send in it)."""
        meta = self._dense_meta(name)
        bases = [base_version] * self.num_shards if isinstance(base_version, int) else list(base_version)
        if len(bases) != self.num_shards:
            raise InvalidArgumentError(f"table {name!r}: {len(bases)} base versions for {self.num_shards} shards")
        gradient = op == pb.DENSE_OP_GRADIENT
        g, given_shape = dense_input(meta.spec, grad, flat_view, "gradient" if gradient else "values")
        # values assigned are kept, not accumulated: never round them to a low-precision wire dtype
        wire, data = wire_checked(meta.spec, g, self.wire_dtype if gradient else "float32", "gradient" if gradient else "assigned values")
        return meta, bases, given_shape, wire, np.frombuffer(data, DTYPES[wire])

    # ------------------------------------------------------------------ sparse
    def _group(self, name: str, ids: Any) -> tuple[TableSpec, np.ndarray, np.ndarray, list[list[np.ndarray]]]:
        """(spec, unique ids, inverse, per shard: index arrays into unique ids, split to fit a request)."""
        meta = self._sparse_meta(name)
        spec = meta.spec
        arr = ids_of(ids, name)
        recent = self._last_group.setdefault(name, [])
        for m, kept_ids, grouped in reversed(recent):
            if m is meta and kept_ids.shape == arr.shape and np.array_equal(kept_ids, arr):
                return grouped  # ids grouped lately (a push of rows a recent pull fetched): no hashing again
        if arr.size and bool(np.all(arr[1:] > arr[:-1])):
            uniq, inverse = arr, iota(arr.size)  # unique and sorted already (PSEmbedding's ids): no sort
        else:
            uniq, inverse = np.unique(arr, return_inverse=True)
        per_req = max(1, self.max_request_bytes // (spec.dim * 4 + 16))
        groups = group(name, uniq, meta.slots, self.num_shards, meta.max_ids, per_req)
        out = (spec, uniq, inverse.reshape(-1), groups)
        kept = arr.copy()  # not the caller's array, which may change after this call (uniq may be it)
        recent.append((meta, kept, (spec, kept if uniq is arr else uniq, *out[2:])))  # callers only read it
        del recent[:-_GROUPS_KEPT]
        return out

    def pull_sparse(
        self, name: str, ids: Any, return_versions: bool = False, policy: SyncPolicy | None = None,
        return_clock: bool = False,
    ) -> Any:
        """Rows for ``ids`` (any shape of int64 ids; result shape ids.shape + (dim,)), in the caller's order.

        An id with no row on its shard reads as the table's initializer's values at version 0
        (a pull creates nothing: rows are made by the first push).
        Result: numpy float32 for numpy/list ids; a torch tensor on the ids'
        device for torch ids. With ``return_versions`` also returns int64 row
        versions; with ``return_clock`` also the table's BSP clock (last).
        ``policy``: wait as BSP/SSP require for step ``policy.clock``.
        """
        spec, uniq, inverse, groups = self._group(name, ids)
        got = SparseOut(spec.dim, uniq, inverse, ids)
        clock = self._pull_rows(name, spec.dim, uniq, groups, policy, lambda idx, msg, versions, rows, sent: got.put(idx, rows, versions))
        out = got.result()[: 2 if return_versions else 1] + ((clock,) if return_clock else ())
        return out if len(out) > 1 else out[0]

    def pull_sparse_changed(
        self, name: str, ids: Any, known_versions: Any, known_epochs: Any, policy: SyncPolicy | None = None,
    ) -> ChangedRows:
        """A conditional pull: ``ids`` (unique int64 ids, 1-D) with ``known_versions`` (int64 per id: the
        version of the row the caller holds, -1: none) and ``known_epochs`` (int64 per id: the shard's
        eviction epoch at which that version was read, as ``ChangedRows.epochs`` gave it). The shards send
        versions for every id but row values only where the version differs from the known one; see
        ``ChangedRows`` (caller's order). ``policy``: as for ``pull_sparse``.

        A version names one value only within one eviction epoch (a row dropped and created again
        restarts at version 0), so per shard the request names one epoch, the newest of the held ids'
        epochs; held ids of older epochs are asked as not held (-1), and when that epoch is no longer the
        shard's, the shard sends every row (all ``changed``). A shard that predates conditional pulls
        sends every row too."""
        spec, uniq, inverse, groups = self._group(name, ids)
        if len(uniq) != len(inverse):
            raise InvalidArgumentError(f"table {name!r}: a conditional pull needs unique ids ({len(inverse) - len(uniq)} repeated)")
        known = []
        for what, given in (("known_versions", known_versions), ("known_epochs", known_epochs)):
            a = np.asarray(as_numpy(given)).reshape(-1)
            if a.shape != (len(inverse),):
                raise InvalidArgumentError(f"table {name!r}: {what} has {a.size} entries for {len(inverse)} ids (one per id)")
            u = np.empty(len(uniq), np.int64)
            u[inverse] = a.astype(np.int64, copy=False)
            known.append(u)
        rows = np.empty((len(uniq), spec.dim), np.float32)  # filled where changed
        versions = np.empty(len(uniq), np.int64)
        changed = np.ones(len(uniq), bool)  # the rows whose values came over the wire
        epochs = np.empty(len(uniq), np.int64)

        def put(idx: np.ndarray, msg: pb.PullSparseReply, v: np.ndarray, r: np.ndarray, sent: np.ndarray | None) -> None:
            versions[idx], epochs[idx] = v, msg.epoch
            if sent is not None:
                changed[idx] = sent
            rows[idx[changed[idx]]] = r

        clock = self._pull_rows(name, spec.dim, uniq, groups, policy, put, (known[0], known[1]))
        changed = changed[inverse]
        return ChangedRows(changed, rows[inverse[changed]], versions[inverse], epochs[inverse], clock)

    def _pull_rows(
        self, name: str, dim: int, uniq: np.ndarray, groups: list[list[np.ndarray]], policy: SyncPolicy | None,
        put: Callable[[np.ndarray, pb.PullSparseReply, np.ndarray, np.ndarray, np.ndarray | None], None],
        known: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> int:
        """One PullSparse per slice of ``groups`` (index arrays into ``uniq``), concurrently: per reply
        ``put(idx, reply, versions, rows, sent)``. ``known``: (version, epoch) per unique id, a conditional
        pull (``pull_sparse_changed``): ``sent`` marks the ids of ``idx`` whose rows the reply carries
        (None: all of them). Returns the table's clock (min over the replies)."""
        sync = policy_to_proto(policy) if policy is not None else None
        head = pb.PullSparseRequest(table=name, dtype=self.wire_dtype, worker=self.worker, sync=sync)
        clocks: list[int] = []

        def one(i: int, idx: np.ndarray) -> None:
            req, bulk, kv = head, {}, None
            if known is not None:
                kv, ke = known[0][idx], known[1][idx]
                held = kv >= 0
                epoch = int(ke[held].max()) if held.any() else 0
                bulk["known_versions"] = kv = np.ascontiguousarray(np.where(held & (ke == epoch), kv, -1))  # older epochs: as not held
                req = pb.PullSparseRequest(known_epoch=epoch)
                req.MergeFrom(head)
            msg, pl = unframe(pb.PullSparseReply, self._call(i, "PullSparse", frame(req, **bulk, ids=np.ascontiguousarray(uniq[idx])), name))
            versions = from_wire(pl.get("versions", b""), "int64", (len(idx),), what=f"table {name!r} versions")
            sent = versions != kv if msg.conditional and kv is not None else None  # the rows the reply carries, in request order
            n = len(idx) if sent is None else int(np.count_nonzero(sent))
            put(idx, msg, versions, from_wire(pl.get("data", b""), msg.dtype, (n, dim), what=f"table {name!r} reply"), sent)
            clocks.append(msg.clock)
            self._count_rows(name, n)

        self._fan_out([lambda i=i, idx=idx: one(i, idx) for i, g in enumerate(groups) for idx in g])
        return min(clocks, default=0)

    def push_sparse(
        self, name: str, ids: Any, grads: Any, base_versions: Any = None, policy: SyncPolicy | None = None
    ) -> PushResult:
        """Push row gradients (grads: ids.shape + (dim,)); duplicate ids are summed first.

        ``base_versions`` (same shape as ids): the row versions the gradients
        were computed from, so the shards can measure staleness. ``policy``:
        a BSP push reaches every shard (empty where no id lives there), since
        each shard's round waits for every live worker.
        """
        sync = policy_to_proto(policy) if policy is not None else None
        spec, uniq, groups, wrows, base, place = self._sparse_grads(name, ids, grads, base_versions, sync is not None and sync.sync)

        def one(i: int, idx: np.ndarray) -> PushResult:
            at = placed(place, idx)
            head = pb.PushSparseRequest(
                table=name, dim=spec.dim, worker=self.worker, client=self.client_id, seq=next(self._seq), dtype=self.wire_dtype,
                sync=sync,
            )
            bulk: dict[str, Any] = {"ids": np.ascontiguousarray(uniq[idx]), "data": wrows.take(at, 0)}
            if base is not None:
                bulk["base_versions"] = np.ascontiguousarray(base[at])
            msg, _ = unframe(pb.PushSparseReply, self._call(i, "PushSparse", frame(head, **bulk), name))
            self._count_ack(f"{name}@{i}", 0 if sync is not None and sync.sync else msg.applied, msg.duplicate)
            return PushResult(msg.applied, msg.dropped, msg.mean_staleness, msg.max_staleness, 0, int(msg.late), msg.clock)

        return _merged(self._fan_out([lambda i=i, idx=idx: one(i, idx) for i, gr in enumerate(groups) for idx in gr]))

    # ------------------------------------------------------------------ step
    def step(self, *args: Any, **kwargs: Any) -> StepResult:
        """One training step in one RPC per shard (the arguments and what is checked: ``step_begin``):
        ``step_begin(...)()``, blocking until every shard answered."""
        return self.step_begin(*args, **kwargs)()

    def step_begin(
        self,
        push_dense: Mapping[str, Any] | None = None,
        push_sparse: Mapping[str, Sequence[Any]] | None = None,
        pull_dense: Mapping[str, Any] | Sequence[str] | None = None,
        pull_sparse: Mapping[str, Any] | None = None,
        policy: SyncPolicy | Mapping[str, SyncPolicy] | None = None,
        pull_policy: SyncPolicy | Mapping[str, SyncPolicy] | None = None,
        base_versions: Mapping[str, int | Sequence[int]] | None = None,
    ) -> Callable[[], StepResult]:
        """One training step in one RPC per shard: push step t's gradients, then pull step t+1's values.
        Checks everything and sends every shard its request now (errors in the arguments are raised
        here), and returns the function that reads the replies and answers the step's result (call it
        once; the caller's arrays must not change until it returns; ``step`` calls it at once): a caller
        with other work meanwhile needs no thread for the call.

        ``push_dense``: table -> gradient (the table's shape and dtype, as push_dense);
        ``push_sparse``: table -> (ids, grads) or (ids, grads, base_versions) (as push_sparse: duplicate
        ids are summed); ``pull_dense``: table names, or table -> ``out`` buffer (or None);
        ``pull_sparse``: table -> ids (any shape). ``policy`` / ``pull_policy``: the SyncPolicy of the
        pushes (step t) and of the pulls (step t+1), one for every table or one per table (absent: async).
        ``base_versions``: per pushed dense table, the version(s) its gradient was computed from.

        Each shard gets one Step call holding its parts of every table; it validates them all before
        applying any (a bad part raises naming its table; nothing applied on that shard), applies the
        pushes (each table atomically, retried calls deduplicated), then answers the pulls once their
        policy allows, so in BSP the values returned are those of the round the pushes completed.
        Everything is checked here before anything is sent (shapes, dtypes, NaN/Inf, id ranges). A
        step whose request or reply to one shard would exceed ``max_request_bytes`` runs as the
        separate calls instead (pushes, then pulls; same results).
        """
        push_dense, push_sparse = dict(push_dense or {}), dict(push_sparse or {})
        pull_dense = dict(pull_dense) if isinstance(pull_dense, Mapping) else {n: None for n in (pull_dense or ())}
        pull_sparse, base_versions = dict(pull_sparse or {}), dict(base_versions or {})
        item = DTYPES[self.wire_dtype].itemsize
        largest = {n: max(b - a for a, b in self._dense_meta(n).ranges) for n in (*push_dense, *pull_dense)}
        big = stream_dense(largest, item, self.step_inline_bytes)
        for n in big & set(push_dense):  # checked before anything is sent, as the rest
            self._dense_grad(n, push_dense[n], base_versions.get(n, -1), pb.DENSE_OP_GRADIENT)
        every = (dict(push_dense), push_sparse, dict(pull_dense), pull_sparse)  # for separate calls if it does not fit
        streamed: tuple[dict, dict, dict, dict] = (
            {n: push_dense.pop(n) for n in big & set(push_dense)}, {}, {n: pull_dense.pop(n) for n in big & set(pull_dense)}, {},
        )
        S = self.num_shards
        parts: list[list[StepPart]] = [[] for _ in range(S)]  # per shard, pushes first (validated and cast once, here)
        reply = [0] * S  # reply bytes per shard
        for name, grad in push_dense.items():
            meta, bases, _, _, data = self._dense_grad(name, grad, base_versions.get(name, -1), pb.DENSE_OP_GRADIENT)
            for i, (start, stop) in enumerate(meta.ranges):
                if stop > start:
                    parts[i].append(StepPart(name, PUSH_DENSE, policy_for(policy, name), next(self._seq), bases[i], data[start:stop]))
        for name, args in push_sparse.items():
            p = policy_for(policy, name)
            _, uniq, groups, rows, base, place = self._sparse_grads(name, args[0], args[1], args[2] if len(args) > 2 else None, p.sync)
            for i, idx in enumerate(map(joined, groups)):
                if len(groups[i]):  # a BSP push reaches every shard (its round waits for every live worker)
                    at = placed(place, idx)
                    vers = None if base is None else base[at]
                    parts[i].append(StepPart(name, PUSH_SPARSE, p, next(self._seq), values=rows.take(at, 0), ids=uniq[idx], base_versions=vers))
        for name in pull_dense:
            for i, (start, stop) in enumerate(self._dense_meta(name).ranges):
                if stop > start:
                    parts[i].append(StepPart(name, PULL_DENSE, policy_for(pull_policy, name)))
                    reply[i] += (stop - start) * item
        pulled = {name: self._group(name, ids) for name, ids in pull_sparse.items()}
        for name, (spec, uniq, _, groups) in pulled.items():
            for i, idx in enumerate(map(joined, groups)):
                if len(idx):
                    parts[i].append(StepPart(name, PULL_SPARSE, policy_for(pull_policy, name), ids=uniq[idx]))
                    reply[i] += len(idx) * (spec.dim * item + 8)
        if not step_fits(parts, reply, self.max_request_bytes):
            separately = self._step_separately(*every, policy, pull_policy, base_versions)
            return lambda: separately
        side = self._pool.submit(self._step_separately, *streamed, policy, pull_policy, base_versions) if big else None
        try:  # every shard's request is sent before any reply is read (no thread)
            sent = [self._shards[i].start("Step", step_parts_to_proto(p, self.worker, self.client_id, self.wire_dtype))
                    for i, p in enumerate(parts) if p]
        except BaseException:
            if side is not None:
                futures_wait([side])  # it ends before this raises (this error is the one raised)
            raise

        def one(i: int, raw: bytes) -> list[StepOutcome]:
            msg, pl = unframe(pb.StepReply, raw)
            if len(msg.parts) != len(parts[i]):
                raise InternalError(f"shard {self._shards[i].label}: Step answered {len(msg.parts)} of {len(parts[i])} parts")
            return step_reply_from_proto(msg, pl.get("data", memoryview(b"")), self.wire_dtype)

        def finish() -> StepResult:
            try:
                raws = iter(self._settle(sent))
                replies = [one(i, next(raws)) if p else [] for i, p in enumerate(parts)]
            finally:
                side_result = side.result() if side is not None else None  # its error, if any, after the Step calls ended
            result = self._step_result(replies, pull_dense, pulled, pull_sparse, policy, set(push_dense))
            return result if side_result is None else _merge_steps(result, side_result)

        return finish

    def _step_result(
        self, replies: list[list[StepOutcome]], pull_dense: dict[str, Any], pulled: dict[str, Any], pull_sparse: dict[str, Any],
        policy: Any, dense_pushed: set[str],
    ) -> StepResult:
        """The shards' Step outcomes placed in the caller's shapes and order (``step``)."""
        S = self.num_shards
        flats = {n: DenseOut(self._dense_meta(n).spec, out) for n, out in pull_dense.items()}
        sparse = {n: SparseOut(spec.dim, uniq, inverse, pull_sparse[n]) for n, (spec, uniq, inverse, _) in pulled.items()}
        at = {n: [joined(g) for g in pulled[n][3]] for n in pulled}
        dense_versions = {n: [-1] * S for n in pull_dense}
        clocks: dict[str, list[int]] = {}
        pushes: dict[str, list[tuple[int, StepOutcome]]] = {}
        for i, outcomes in enumerate(replies):
            for o in outcomes:
                name = o.table
                if o.op == PULL_DENSE:
                    assert o.blocks is not None  # (step_reply_from_proto: a pull's values are set)
                    flats[name].put(self._dense_meta(name).ranges[i][0], o.blocks[0])
                    dense_versions[name][i] = o.version
                elif o.op == PULL_SPARSE:
                    assert o.versions is not None
                    sparse[name].put(at[name][i], o.rows, o.versions)
                    self._count_rows(name, len(at[name][i]))
                else:
                    pushes.setdefault(name, []).append((i, o))
                if o.op in (PULL_DENSE, PULL_SPARSE):
                    clocks.setdefault(name, []).append(o.clock)
        pushed: dict[str, Any] = {}
        for name, outs in pushes.items():
            sync = policy_for(policy, name).sync
            for i, o in outs:
                assert o.push is not None
                acked = 0 if sync else 1 if name in dense_pushed else o.push.result.applied
                self._count_ack(f"{name}@{i}", acked, o.push.duplicate)
            results = [(i, o.push.result) for i, o in outs if o.push is not None]
            pushed[name] = _dense_result(results, S) if name in dense_pushed else _merged([r for _, r in results])
        return StepResult(
            {n: d.result() for n, d in flats.items()}, {n: tuple(v) for n, v in dense_versions.items()},
            {n: s.result() for n, s in sparse.items()}, {n: min(c) for n, c in clocks.items()}, pushed,
        )

    def _step_separately(
        self, push_dense: dict, push_sparse: dict, pull_dense: dict, pull_sparse: dict, policy: Any, pull_policy: Any,
        base_versions: dict,
    ) -> StepResult:
        """``step`` as separate calls (a step too big for one message per shard, or its streamed dense
        tables): pushes, then pulls. Takes ``pull_dense``'s fused tables out of it."""
        pol = policy_for
        fused = {n: pull_dense.pop(n) for n in fuse_dense(push_dense, pull_dense, policy, pull_policy)}
        for n, o in fused.items():  # as a pull: into ``out``, else a new float32 numpy array
            fused[n] = o if o is not None else np.empty(self._dense_meta(n).spec.shape, np.float32)
        pushes: list[Any] = [
            lambda n=n, g=g: self._push_dense(
                n, g, pb.DENSE_OP_GRADIENT, base_versions.get(n, -1), n in fused, fused.get(n), pol(policy, n),
            )
            for n, g in push_dense.items()
        ] + [
            lambda n=n, a=a: self.push_sparse(n, a[0], a[1], a[2] if len(a) > 2 else None, policy=pol(policy, n))
            for n, a in push_sparse.items()
        ]
        pushed = dict(zip([*push_dense, *push_sparse], self._fan_out(pushes)))
        dense, versions, sparse, clock = {}, {}, {}, {}
        for n in fused:
            dense[n], res = pushed[n]
            pushed[n], versions[n], clock[n] = res, res.versions, max(res.clock, 0)
        pulls: list[Any] = [
            lambda n=n, o=o: self.pull_dense(n, out=o, policy=pol(pull_policy, n), return_clock=True) for n, o in pull_dense.items()
        ] + [
            lambda n=n, ids=ids: self.pull_sparse(n, ids, return_versions=True, policy=pol(pull_policy, n), return_clock=True)
            for n, ids in pull_sparse.items()
        ]
        for n, r in zip([*pull_dense, *pull_sparse], self._fan_out(pulls)):
            if n in pull_dense:
                dense[n], (clock[n], versions[n]) = r[0], r[1]
            else:
                sparse[n], clock[n] = (r[0], r[1]), r[2]
        return StepResult(dense, versions, sparse, clock, pushed)

    def _sparse_grads(
        self, name: str, ids: Any, grads: Any, base_versions: Any, bsp: bool
    ) -> tuple[TableSpec, np.ndarray, list[list[np.ndarray]], np.ndarray, np.ndarray | None, np.ndarray | None]:
        """A sparse push checked, its duplicate ids summed and cast once to the wire dtype (the
        finiteness check reads what is sent): (spec, unique ids, per-shard index groups (``bsp``:
        every shard at least an empty one, since each shard's round waits for every live worker),
        the rows to send, newest base version per row or None, ``place``: the rows and base versions
        of the unique ids at ``idx`` are at ``placed(place, idx)``; see ``sum_duplicates``)."""
        spec, uniq, inverse, groups = self._group(name, ids)
        summed, base, place = sum_duplicates(spec, uniq, inverse, grads, base_versions)
        if bsp:
            groups = [g or [np.zeros(0, np.int64)] for g in groups]
        dtype, data = wire_checked(spec, summed, self.wire_dtype)
        return spec, uniq, groups, np.frombuffer(data, DTYPES[dtype]).reshape(len(summed), spec.dim), base, place

    # ------------------------------------------------------------------ membership
    def join(self, lease_s: float = 0.0, fresh: bool = False) -> list[MembershipView]:
        """Register this client's ``worker`` name with every shard (lease_s 0: the shard's default).
        ``fresh``: this worker starts a fresh run, its clock on the shards restarts at 0 (by default a
        worker that was there before keeps the clock it had: a restart continues)."""
        self._need_worker("join")
        req = pb.JoinRequest(worker=self.worker, lease_ms=int(lease_s * 1000), fresh=fresh)
        return [membership_from_proto(m) for m in self._all("Join", req, pb.MembershipReply)]

    def heartbeat(self, clock: int = 0, leave: bool = False, shards: Sequence[int] | None = None) -> list[MembershipView]:
        """Renew this worker's lease on every shard (``leave``: leave the live set instead); one view
        per shard. ``shards``: only these (a view each, in that order), so an unreachable shard does
        not hold up the others' leases."""
        self._need_worker("heartbeat")
        req = pb.HeartbeatRequest(worker=self.worker, clock=clock, leave=leave)
        return [membership_from_proto(m) for m in self._all("Heartbeat", req, pb.MembershipReply, shards=shards)]

    def leave(self) -> None:
        """Leave every shard's live set now (BSP rounds stop waiting for this worker)."""
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
            held = self._all("Checkpoint", pb.CheckpointRequest(at_clock=at_clock or 0, hold=True), pb.CheckpointReply)
            at_clock = max(m.clock for m in held)
        return [(m.path, m.clock) for m in self._all("Checkpoint", pb.CheckpointRequest(at_clock=at_clock), pb.CheckpointReply)]

    # ------------------------------------------------------------------ stats
    def stats(self) -> list[ShardStats]:
        """Counters of every shard (tables, requests, errors, staleness, replication), one per shard."""
        return [stats_from_proto(m) for m in self._all("Stats", pb.StatsRequest(), pb.StatsReply)]


# ---------------------------------------------------------------------- helpers


def _merge_steps(a: StepResult, b: StepResult) -> StepResult:
    return StepResult(*({**getattr(a, f.name), **getattr(b, f.name)} for f in fields(StepResult)))


def _dense_result(results: Sequence[tuple[int, PushResult]], num_shards: int) -> DenseResult:
    """One dense push's result from its shards' (shard, result): per shard its slice version and
    staleness (-1: nothing pushed there), how many were late, the lowest clock."""
    versions, staleness = [-1] * num_shards, [-1] * num_shards
    for i, r in results:
        versions[i], staleness[i] = r.version, r.max_staleness
    clocks = [r.clock for _, r in results if r.clock >= 0]
    return DenseResult(tuple(versions), tuple(staleness), sum(r.late for _, r in results), min(clocks, default=-1))


def _merged(parts: Sequence[Any]) -> PushResult:
    """One push's result from its shards' (PushResults or StepPartReplies): counts summed, the mean of
    the measured mean stalenesses (-1: none measured), the worst staleness, the lowest clock."""
    measured = [p.mean_staleness for p in parts if p.mean_staleness >= 0]
    return PushResult(
        sum(p.applied for p in parts), sum(p.dropped for p in parts), sum(measured) / len(measured) if measured else -1.0,
        max((p.max_staleness for p in parts), default=-1), 0, sum(int(p.late) for p in parts), min((p.clock for p in parts), default=-1),
    )


def _spec(
    name: str, kind: str, optimizer: str | OptimizerSpec, hparams: dict[str, float], init: str | InitializerSpec, **fields: Any
) -> TableSpec:
    """The spec create_dense / create_sparse ask for (an invalid one: InvalidArgumentError naming the table)."""
    if isinstance(optimizer, OptimizerSpec) and hparams:
        raise ValueError("pass hyperparameters inside the OptimizerSpec or as keywords, not both")
    try:
        return TableSpec(
            name, kind, optimizer=optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(optimizer, hparams),
            initializer=init if isinstance(init, InitializerSpec) else InitializerSpec(init), **fields,
        )
    except InvalidArgumentError as e:
        raise with_table(name, e) from None


