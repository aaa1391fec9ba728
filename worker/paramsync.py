"""``PSSync``: the parameter server as a worker's ``ParamSync`` (through ``PSClient``, over gRPC).

The seam itself (``ParamSync``, ``Fetched``, ``Grads``, ``PushResult``, ``PS_MODES``,
``check_ps_mode``) lives in ``worker.sync_api``, which imports no grpc, so peer ranks can use it
without loading the PS client; it is re-exported here, so ``from worker.paramsync import
ParamSync`` keeps working. ``tests/integration/test_paramsync_contract.py`` is the one contract
suite all implementations pass.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ps import PSClient, SyncPolicy
from ps.errors import FailedPreconditionError, ShardUnavailableError, TableNotFoundError
from worker.binding import PSEmbedding, _Rows
from worker.flat import FlatParams
from worker.sync_api import (
    PS_MODES,
    Fetched,
    Grads,
    ParamSync,
    PushResult,
    check_ps_mode,
)

__all__ = ["PS_MODES", "Fetched", "Grads", "PSSync", "ParamSync", "PushResult", "check_ps_mode"]

log = logging.getLogger(__name__)

WAIT_NOTE_S = 5.0  # seconds between 'still waiting' messages at the start of a run

_SYNC_DENSE = ("sync", "dense-sync")


def say_line(line: str) -> None:
    """A plain line on stderr (through ``tqdm.write``, so a progress bar on stderr stays whole)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


@dataclass
class _Rewind:
    """A shard came back at an older clock: this worker went back to ``clock``, the shards' common
    clock, from step ``left``; the shards in ``ahead`` (index -> their clock) drop its pushes as late
    until it reaches their clock. ``late``: the pushes dropped so far."""

    clock: int
    left: int
    ahead: dict[int, int]
    behind: list[int]
    late: int = 0

    @property
    def until(self) -> int:
        return max(self.ahead.values(), default=self.clock)


class PSSync(ParamSync):
    """The parameter server through ``PSClient``: BSP (``sync``), ASP (``async``), SSP, or
    ``dense-sync`` (dense tables BSP, sparse tables async).

    The model's dense parameters are one flat dense table ``{task}/dense``; its ``PSEmbedding``
    layers are sparse tables. In steady state the trainer calls ``push_fetch``: step t's dense and
    sparse gradients and step t + ``lookahead``'s dense values and rows in one ``PSClient.step``, so
    one Step call per shard per step. ``fetch`` (the first steps) pulls the dense values and the
    batch's rows (concurrently, one thread per table), ``push`` sends the dense gradient and the
    sparse row gradients. All may run in background threads (``pipelined``). Membership: join every shard, renew the lease with
    heartbeats (one thread per shard, so an unreachable shard never lets the others' leases run out),
    leave at the end.

    Shard outages: every call retries an unreachable shard (``PSClient(retry_timeout=...)``); the
    client's ``ShardWatch`` says so through ``say`` (default: plain lines on stderr): when a shard
    becomes unreachable, every 5 s while it stays so (since when, the step training waits at), and
    when it is back. A BSP shard (``sync``, the dense table of ``dense-sync``) that comes back at an
    older clock (restarted from an older checkpoint) refuses the worker's push or pull for its step;
    the worker then goes back to the shards' *common clock*, the lowest BSP clock any shard holds
    (``MembershipView.sync_clock``: where a worker started afresh would start), and answers the
    trainer's fetch with ``Fetched(step=common clock, batch=None)``: the trainer goes back to that step
    and fetches it with its batch. From there every step is pushed to every shard; the shards still
    ahead drop the pushes for clocks they applied already as *late* (counted, said once when this
    worker has caught up with them), the one behind applies them. The result is that of every
    worker restarted at the common clock. Async and SSP pushes apply wherever they land: a restored
    shard goes on from its older values; SSP waits there catch up with the next heartbeat.
    """

    pipelined = True

    def __init__(
        self, model: torch.nn.Module, client: PSClient, prefix: str, *, mode: str = "async", staleness: int = 4,
        backup_workers: int = 0, staleness_aware_lr: bool = False, worker_index: int = 0, num_workers: int = 1,
        worker_name: str = "", lease_s: float = 10.0, start_timeout_s: float = 300.0,
        dense_optimizer: Any = None, device: torch.device | str = "cpu", stop: threading.Event | None = None,
        sparse_ids: Callable[[Any], dict[str, torch.Tensor]] | None = None, dense: bool = True,
        steps: int | None = None, reset: bool = False, say: Callable[[str], None] | None = say_line,
    ) -> None:
        self.mode = check_ps_mode(mode)
        self.name = mode
        self.client = client
        self.prefix = prefix
        self.staleness, self.backup_workers, self.staleness_aware_lr = staleness, backup_workers, staleness_aware_lr
        self.worker_index, self.num_workers = worker_index, num_workers
        self.lease_s, self.start_timeout_s = lease_s, start_timeout_s
        self.dense_optimizer = dense_optimizer
        self.stop = stop or threading.Event()
        self.sparse_ids = sparse_ids  # batch -> {PSEmbedding module name: ids}, to prefetch rows
        self.steps = steps  # the clock the run trains to, if known: a restart already there waits for nobody
        self.reset = reset  # a fresh run on shards that may hold an earlier one (see start_fresh)
        client.worker = worker_name or f"w{worker_index}"
        self.device = torch.device(device)
        self.embeddings: dict[str, PSEmbedding] = {n: m for n, m in model.named_modules() if isinstance(m, PSEmbedding)}
        for m in self.embeddings.values():
            m.client = client
        # dense=False: only the PSEmbedding rows go through the PS (the dense part is synchronised
        # elsewhere: peer mode's hybrid all-reduces it)
        self.flat = FlatParams.of(model, self.device) if dense else FlatParams([], self.device)
        self.dense_table = f"{prefix}/dense"
        cuda = self.device.type == "cuda"
        n = self.flat.numel
        # host buffers the PS reads from / writes into; pinned so copies to and from the GPU are async.
        # Two, by step parity: fetch(t+1) fills one while step t's (possibly asynchronous) copy to the
        # device reads the other
        self._staging = [torch.empty(n, pin_memory=cuda) for _ in range(2)]
        self._send = [torch.empty(n, pin_memory=cuda) for _ in range(2)]
        # one thread per table each for fetches and pushes: a BSP fetch blocks its thread until the round
        # completes, and the pushes that complete it must never queue behind it
        per = max(1, len(self.embeddings))
        self._fetch_pool = ThreadPoolExecutor(max_workers=per, thread_name_prefix=f"{client.worker}-fetch")
        self._push_pool = ThreadPoolExecutor(max_workers=per, thread_name_prefix=f"{client.worker}-push")
        self._hb_stop = threading.Event()
        self._hb_wake = [threading.Event() for _ in range(client.num_shards)]  # set: heartbeat that shard now
        self._hb: list[threading.Thread] = []
        # shard outages, said in plain lines (``say`` None: the ps.outages logger)
        self.say = say
        self._doing: tuple[int, int] | None = None  # (step, next step) of the training call under way
        self._rewind: _Rewind | None = None
        self._rewind_lock = threading.Lock()
        self._reread_clock = False  # a shard came back: the clock row may be an older one
        client.watch.say = self._say if say is not None else None
        client.watch.doing = self._doing_text
        client.watch.on_back.append(self._shard_back)
        self.committed = 0  # steps whose pushes have completed (what heartbeats report)
        self._versions: tuple[int, ...] = ()  # of the values loaded last
        self._left = False
        self._recorded = -1  # this worker's clock as its row of the clock table holds it (-1: not read)
        tables = [m.table for m in self.embeddings.values()]
        self._shared_tables = len(set(tables)) != len(tables)

    # ------------------------------------------------------------------ policies
    @property
    def dense_sync(self) -> bool:
        """True if the dense table is BSP (modes ``sync`` and ``dense-sync``)."""
        return self.mode in _SYNC_DENSE

    def dense_policy(self, step: int) -> SyncPolicy:
        """The consistency rule of the dense table's pull and push for ``step``."""
        return self._policy(step, sync=self.dense_sync)

    def sparse_policy(self, step: int) -> SyncPolicy:
        """The consistency rule of the sparse tables' pulls and pushes for ``step``."""
        return self._policy(step, sync=self.mode == "sync")  # dense-sync: sparse tables are async

    def _policy(self, step: int, sync: bool) -> SyncPolicy:
        if sync:
            return SyncPolicy(clock=step, sync=True, backup_workers=self.backup_workers)
        return SyncPolicy(clock=step, staleness=self.staleness if self.mode == "ssp" else -1, staleness_aware_lr=self.staleness_aware_lr)

    # ------------------------------------------------------------------ tables and membership
    @property
    def ready_table(self) -> str:
        """The marker table worker 0 creates once every other table holds its initial values."""
        return f"{self.prefix}/ready"

    def create_tables(self, creator: bool, timeout: float = 120.0, generation: int | None = None) -> None:
        """``creator`` (worker 0) creates every table, seeds the dense one with the model's own initial
        values, then marks the model ready; the others wait for that mark, so nobody reads a table
        before its initial values are in. ``generation``: the creator marks the tables as those of
        this fresh run (``start_fresh``; None: a first run or a continued one keeps the mark it finds)."""
        if creator:
            if self.flat.numel:
                self.client.create_dense(self.dense_table, self.flat.numel, optimizer=self.dense_optimizer, init=self.flat.data.cpu().numpy())
            for m in self.embeddings.values():
                self.client.create_sparse(m.table, m.dim, optimizer=m.optimizer, init=m.init, seed=m.seed, row_dtype=m.row_dtype)
            self.client.create_sparse(self.clock_table, 1, optimizer="sgd", lr=1.0)
            if generation is not None:
                self.client.create_dense(self.ready_table, 1, seed=generation)
            elif self.generation() < 0:
                self.client.create_dense(self.ready_table, 1)
            return
        t0 = time.monotonic()
        deadline, noted = t0 + timeout, t0
        while True:
            try:
                self.client.describe(self.ready_table)
                break
            except TableNotFoundError:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"tables of {self.prefix!r} not ready after {timeout:.0f} s: is worker 0 running?") from None
                if now - noted >= WAIT_NOTE_S:
                    noted = now
                    log.warning("%s: waiting %.0f s for worker 0 to create the tables of %r (gives up after %.0f s)",
                                self.client.worker, now - t0, self.prefix, timeout)
                time.sleep(0.2)
        if self.flat.numel:
            self.client.describe(self.dense_table)
        for m in self.embeddings.values():
            self.client.describe(m.table)

    def generation(self) -> int:
        """The generation of the run whose tables the shards hold: the ready marker's seed (0: a run
        started on fresh shards, one more per ``reset``); -1: no ready marker (none yet, or dropped)."""
        try:
            return int(self.client.describe(self.ready_table)[0].spec.seed)
        except TableNotFoundError:
            return -1

    def run_tables(self) -> list[str]:
        """The tables of this run on the shards: the ready marker, the dense table, the embeddings'
        tables, the clock table, and any other table named ``PREFIX/...``."""
        names = [self.ready_table, self.dense_table, *(m.table for m in self.embeddings.values()), self.clock_table]
        for st in self.client.stats():
            names += [t.name for t in st.tables if t.name.startswith(f"{self.prefix}/")]
        return list(dict.fromkeys(names))

    def start_fresh(self) -> None:
        """``reset``: a fresh run on shards that may hold an earlier run's tables; every worker of the
        run is started with it. Each joins as fresh (its clock restarts at 0). Worker 0 waits until all
        ``num_workers`` are live, drops the run's tables (``run_tables``), creates them as a first run
        does and marks them ready with the next generation. Any other worker reads the generation
        *before* it joins and waits for a higher one: worker 0 drops only after every worker joined,
        so the old run's tables are never taken for the fresh ones."""
        seen = self.generation()  # before joining: worker 0 cannot have reset yet
        views = self.client.join(self.lease_s, fresh=True)
        t0 = time.monotonic()
        deadline, noted = t0 + self.start_timeout_s, t0
        while True:
            if self.worker_index == 0:
                if min(len(v.live) for v in views) >= self.num_workers:
                    break
                what = (f"workers to join before it resets the tables of {self.prefix!r}: "
                        f"{min(len(v.live) for v in views)} of {self.num_workers} joined")
            else:
                if self.generation() > seen:
                    break
                what = f"worker 0 to reset the tables of {self.prefix!r} (is it running with --reset?)"
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{self.client.worker}: --reset: still waiting for {what} after {self.start_timeout_s:.0f} s")
            if now - noted >= WAIT_NOTE_S:
                noted = now
                log.warning("%s: waiting %.0f s for %s; gives up after %.0f s", self.client.worker, now - t0, what, self.start_timeout_s)
            if self.stop.wait(0.2):
                raise TimeoutError(f"{self.client.worker}: stopped while waiting for {what}")
            views = self.client.heartbeat(0)
        if self.worker_index == 0:
            ahead = [v.min_clock for v in views if v.min_clock > 0]
            if ahead:
                raise RuntimeError(
                    f"{self.client.worker}: --reset: a live worker is at clock {max(ahead)} of the earlier run; "
                    "start every worker of the run with --reset (or stop the old run's workers first)"
                )
            generation = max(seen, self.generation()) + 1
            dropped = self.client.drop_tables(self.run_tables(), missing_ok=True)
            log.warning("%s: --reset: dropped %d tables of %r (%s); fresh run, generation %d", self.client.worker,
                        len(dropped), self.prefix, ", ".join(dropped) or "none there", generation)
            self.create_tables(creator=True, generation=generation)
        else:
            self.create_tables(creator=False)

    def join(self) -> int:
        """Create or find the tables, join the shards, start heartbeats; returns the clock this worker starts at."""
        if self.reset:
            self.start_fresh()
        else:
            self.create_tables(creator=self.worker_index == 0)
        # the dense table's versions before this worker's first call that makes it live on the shards
        # (resume_clock's pull, the join): from then on the others may start and, in a short async run,
        # train and leave before its next call returns (a slow link: --net-delay)
        joined_at = [i.version for i in self.client.describe(self.dense_table)] if self.flat.numel else []
        # async/SSP: a run restarted on the same shards continues from the clock this worker reached
        # in it (BSP: from the tables' clock, which the shards keep)
        resume = 0 if self.dense_sync else self.resume_clock()
        views = self.client.join(self.lease_s)
        # at the start of a run, wait for all num_workers (so step 0 is everyone's); a worker that joins
        # a run already under way starts at once from the current clock
        joining_late = self._under_way(views)
        if self.steps is not None:
            # a finished run started again with the same --steps: nothing to train, nobody to wait for
            done = min(v.sync_clock for v in views) if self.dense_sync else resume
            joining_late = joining_late or done >= self.steps
        # --reset: every worker of the fresh run joined before worker 0 made its tables (start_fresh
        # waited for all of them), so none joins late and none waits here, whatever an async worker 0
        # has trained (or finished) since: each starts at its own clock, 0 in the fresh clock table
        member = self.reset
        if member:
            joining_late = False
        t0 = time.monotonic()
        deadline, noted, checked = t0 + self.start_timeout_s, t0, t0
        while (not member and not joining_late and not self._under_way(views)
               and min(len(v.live) for v in views) < self.num_workers):
            now = time.monotonic()
            if now - noted >= WAIT_NOTE_S:  # never a silent wait: say who is missing, every few seconds
                noted = now
                live = sorted(set().union(*(v.live for v in views)))
                log.warning("%s: waiting %.0f s for workers: %d of %d joined (%s); gives up after %.0f s",
                            self.client.worker, now - t0, min(len(v.live) for v in views), self.num_workers,
                            ", ".join(live) or "none", self.start_timeout_s)
            if self.flat.numel and now - checked >= 0.5:
                # the others may have trained and left between two polls (a short async run): updates
                # applied to the dense table since this worker joined mean the run is under way, not
                # waiting for them (updates from before, a finished run's, do not)
                checked = now
                versions = [i.version for i in self.client.describe(self.dense_table)]
                if any(v > b for v, b in zip(versions, joined_at)):
                    joining_late = True
                    break
            if now > deadline:
                raise TimeoutError(
                    f"{self.client.worker}: only {min(len(v.live) for v in views)} of {self.num_workers} workers "
                    f"joined within {self.start_timeout_s:.0f} s"
                )
            if self.stop.wait(0.05):
                break
            views = self.client.heartbeat(0)
        if self.dense_sync:
            start = min(v.sync_clock for v in views)
        else:
            others = [v.min_clock for v in views if v.min_clock >= 0]
            start = max(min(others) if others and joining_late else 0, resume)
            if start:
                self.client.heartbeat(start)  # the shards count this worker from its start, for SSP waits
        self.committed = start
        self._hb = [
            threading.Thread(target=self._heartbeats, args=(i,), name=f"{self.client.worker}-heartbeat{i}", daemon=True)
            for i in range(self.client.num_shards)
        ]
        if not self.dense_sync:
            self._hb.append(threading.Thread(target=self._clock_records, name=f"{self.client.worker}-clock", daemon=True))
        for t in self._hb:
            t.start()
        return start

    @property
    def clock_table(self) -> str:
        """Async/SSP: the steps each worker of the run has committed, as row ``worker_index`` (dim 1,
        SGD lr 1 from zeros: a worker pushes minus its clock's increase, so each row is its own
        worker's clock and concurrent writers never race). A restarted worker continues from its row."""
        return f"{self.prefix}/clock"

    def resume_clock(self) -> int:
        """Async/SSP: the clock this worker (by index) reached in an earlier run of these tables on
        these shards (0 on fresh ones). Worker 0 creates the clock table with the others (creating
        tables takes the admin role); without one (tables of an older version) nothing is recorded.
        BSP runs continue from the tables' own clock (the rounds applied) instead."""
        try:
            row = self.client.pull_sparse(self.clock_table, np.array([self.worker_index], np.int64))
        except TableNotFoundError:
            self._recorded = -1
            return 0
        self._recorded = int(round(float(row[0, 0])))
        return self._recorded

    def _record_clock(self) -> None:
        """Async/SSP: raise this worker's row of the clock table to ``committed`` (heartbeats and leave)."""
        if self.dense_sync or self._recorded < 0:
            return
        if self._reread_clock:  # its shard may have come back from an older checkpoint
            self._reread_clock = False
            self.resume_clock()
            if self._recorded < 0:
                return
        done = self.committed
        if done > self._recorded:
            grad = np.array([[-(done - self._recorded)]], np.float32)  # SGD lr 1: the row rises by the increase
            self.client.push_sparse(self.clock_table, np.array([self.worker_index], np.int64), grad)
            self._recorded = done

    def _under_way(self, views: list[Any]) -> bool:
        """Another live worker is past step 0 (``min_clock`` counts live workers only), or the BSP clock
        is and another worker is live: a run under way, which a worker joins at once. A BSP clock with
        nobody else live is a finished run being restarted: its workers start together again."""
        me = self.client.worker
        return any(v.min_clock > 0 or (v.sync_clock > 0 and any(w != me for w in v.live)) for v in views)

    def _heartbeats(self, shard: int) -> None:
        """Renew the lease on ``shard`` every lease/4 s, and at once when it is back from an outage."""
        period = self.lease_s / 4
        wake = self._hb_wake[shard]
        while True:
            wake.wait(period)
            wake.clear()
            if self._hb_stop.is_set():
                return
            try:
                self.client.heartbeat(self.committed, shards=[shard])
            except ShardUnavailableError as e:  # the shard watch has said so; the next one retries
                log.debug("heartbeat to shard %d failed: %s", shard, e)
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is retried; the lease absorbs it
                log.warning("heartbeat to shard %d failed: %s", shard, e)

    def _clock_records(self) -> None:
        """Async/SSP: record this worker's clock on the shards every lease/4 s."""
        while not self._hb_stop.wait(self.lease_s / 4):
            try:
                self._record_clock()
            except Exception as e:  # noqa: BLE001 - the next one records the whole increase
                log.debug("recording the clock failed: %s", e)

    # ------------------------------------------------------------------ shard outages
    def _say(self, text: str) -> None:
        if self.say is not None:
            self.say(f"{self.client.worker}: {text}")

    def _doing_text(self) -> str:
        d = self._doing
        if d is None:
            return ""
        step, nxt = d
        if nxt < 0:
            return f"training waits at step {step} (its push)"
        if nxt == step:
            return f"training waits at step {step} (its pull)"
        return f"training waits at step {step} (push of step {step}, pull for step {nxt})"

    def _shard_back(self, shard: int, down_s: float) -> None:
        """A shard answers again: renew the lease there now (and with it this worker's clock, which a
        restored shard's SSP waits need); async/SSP: re-read this worker's clock row before the next record."""
        self._reread_clock = True
        if shard < len(self._hb_wake):
            self._hb_wake[shard].set()

    def _went_back(self, step: int) -> int | None:
        """A BSP call for ``step`` was refused FAILED_PRECONDITION. If a shard came back at an older
        clock, the shards' common clock (< ``step``) this worker now continues from; otherwise None
        (the error stands). Waits (up to two leases) until every shard has the same live workers, so
        a restarted shard that forgot a worker does not apply a round without it."""
        if not self.dense_sync:
            return None
        views = self.client.heartbeat(0)  # (0: no clock declared; a shard that forgot this worker rejoins it)
        common = min(v.sync_clock for v in views)
        if common >= step:
            return None
        with self._rewind_lock:
            if self._rewind is None or self._rewind.clock != common:
                rw = _Rewind(common, step, {v.shard_index: v.sync_clock for v in views if v.sync_clock > common},
                             [v.shard_index for v in views if v.sync_clock == common])
                self._rewind, self.committed = rw, common
                ahead = ", ".join(f"{i} at clock {c}" for i, c in sorted(rw.ahead.items())) or "none"
                self._say(
                    f"shard {', '.join(map(str, rw.behind))} came back at clock {common} (restarted from an older "
                    f"checkpoint), behind step {step} of this worker (shards ahead: {ahead}): going back to the "
                    f"shards' common clock {common} and training on from there; the shards ahead drop this worker's "
                    "pushes for the clocks they applied already (late)"
                )
        deadline = time.monotonic() + 2 * self.lease_s
        while len({v.live for v in views}) > 1 and time.monotonic() < deadline and not self.stop.wait(0.1):
            views = self.client.heartbeat(0)
        return common

    def _pushed(self, step: int, late: int) -> None:
        """After going back: count the shards' late drops; once caught up with them, say so (once)."""
        rw = self._rewind
        if rw is None:
            return
        rw.late += late
        if step + 1 >= rw.until:
            with self._rewind_lock:
                if self._rewind is not rw:
                    return
                self._rewind = None
            ahead = ", ".join(str(i) for i in sorted(rw.ahead)) or "none"
            self._say(
                f"caught up at clock {step + 1} (went back from step {rw.left} to clock {rw.clock}): shard {ahead} "
                f"dropped {rw.late} of this worker's pushes as late (clocks {rw.clock}..{rw.until - 1}, applied there "
                "before the restart); training goes on"
            )

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        self._hb_stop.set()
        for e in self._hb_wake:
            e.set()
        for t in self._hb:
            t.join()  # the clock record must not race the final one
        try:
            self._record_clock()
        except Exception as e:  # noqa: BLE001 - a restart then repeats the steps since the last record
            log.warning("recording the clock failed: %s", e)
        try:
            self.client.leave()
        except Exception as e:  # noqa: BLE001 - the lease will expire instead
            log.warning("leave failed: %s", e)

    def close(self) -> None:
        self._fetch_pool.shutdown(wait=True)
        self._push_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ steps
    def fetch(self, step: int, batch: Any) -> Fetched:
        """Dense parameters (into a staging buffer) and the batch's sparse rows for ``step``: the tables
        concurrently. A shard that came back at an older clock: ``Fetched(common clock, None, ...)``
        (the trainer goes back there, see the class docstring)."""
        self._doing = (step, step)
        try:
            return self._fetch(step, batch)
        except FailedPreconditionError:
            common = self._went_back(step)
            if common is None:
                raise
            return Fetched(common, None, common, None)

    def _fetch(self, step: int, batch: Any) -> Fetched:
        clock, versions = 0, ()
        futs = {}
        policy = self.sparse_policy(step)
        for name, ids in (self.sparse_ids(batch) if self.sparse_ids is not None else {}).items():
            futs[name] = self._fetch_pool.submit(self.embeddings[name].fetch, ids, policy)
        if self.flat.numel:
            _, (clock, versions) = self.client.pull_dense(
                self.dense_table, out=self._staging[step % 2], policy=self.dense_policy(step), return_clock=True
            )
        rows: dict[str, _Rows] = {}
        for name, fut in futs.items():
            rows[name] = r = fut.result()
            if policy.sync:
                clock = min(clock, r.clock) if self.flat.numel else r.clock
        if not self.dense_sync and self.mode != "sync":
            clock = step  # async/SSP: no catching up, the clock is the step
        return Fetched(step, batch, clock, (versions, rows))

    def load(self, fetched: Fetched) -> None:
        versions, rows = fetched.state
        self._versions = versions
        step = max(fetched.step, fetched.clock)
        if self.flat.numel:
            self.flat.load_(self._staging[fetched.step % 2])
            if step != fetched.step and self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the next fetch may reuse this buffer
        for name, r in rows.items():
            self.embeddings[name].prefetched(r)
        for m in self.embeddings.values():
            m.policy = self.sparse_policy(step)

    def discard(self) -> None:
        """Drop prefetched rows and pending row gradients (a step that will not be computed)."""
        for m in self.embeddings.values():
            m.discard()

    def gradients(self, step: int) -> Grads:
        sparse = [g for g in (m.gradients() for m in self.embeddings.values()) if g is not None]
        send = None
        if self.flat.numel:
            send = self._send[step % 2]
            send.copy_(self.flat.grad, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        return Grads(send, sparse, self._versions)  # the dense slices' versions it was computed from

    def push(self, step: int, grads: Grads) -> PushResult:
        """Dense gradient and sparse row gradients, the tables concurrently (blocking; BSP: until the
        shards have it, not until the round completes). A shard that came back at an older clock:
        nothing more is pushed (this worker goes back, and its next fetch says where)."""
        self._doing = (step, -1)
        try:
            pushed = self._push(step, grads)
        except FailedPreconditionError:
            if self._went_back(step) is None:
                raise
            return PushResult([], 0)
        self._pushed(step, pushed.late)
        return pushed

    def _push(self, step: int, grads: Grads) -> PushResult:
        jobs: list[Callable[[], Any]] = []
        dense, versions = grads.dense, grads.state
        if dense is not None:
            jobs.append(lambda: self.client.push_dense(
                self.dense_table, dense, base_version=versions or -1, policy=self.dense_policy(step)
            ))
        for g in grads.sparse:
            jobs.append(functools.partial(
                self.client.push_sparse, g.table, g.ids, g.grads, g.base_versions, policy=self.sparse_policy(step)
            ))
        futs = [self._push_pool.submit(j) for j in jobs[1:]]  # tables concurrently; the first in this thread
        results = [jobs[0]()] if jobs else []
        results += [f.result() for f in futs]
        self.committed = max(self.committed, step + 1)
        return self._push_result(results)

    @property
    def lookahead(self) -> int:  # type: ignore[override]
        """How far ahead ``push_fetch`` fetches: BSP (and SSP with a bound under 1) needs step t's round
        in step t + 1's values, so 1; async and SSP fetch step t + 2 with step t's push, so that step
        t + 1 computes while the call is in flight (the same overlap as a prefetch). 0 (separate calls)
        when two embeddings share a table (the Step call keys sparse parts by table), or when an
        embedding has a hot-row cache (``worker.emb_cache``: its rows are fetched through the cache)."""
        if self._shared_tables or any(getattr(m, "cache", None) is not None for m in self.embeddings.values()):
            return 0
        if self.mode in ("sync", "dense-sync") or (self.mode == "ssp" and self.staleness < 1):
            return 1
        return 2

    def push_fetch(self, step: int, grads: Grads, next_step: int | None, next_batch: Any) -> tuple[PushResult, Fetched | None]:
        """Step ``step``'s dense and sparse gradients and the values for ``next_step`` (dense slices into
        a staging buffer, the rows of ``next_batch``'s unique ids) in one ``PSClient.step``: one Step call
        per shard. The shards apply the pushes before they answer the pulls, and a BSP pull waits for the
        round the pushes complete, so the values are what separate ``push`` and ``fetch`` calls would give."""
        finish = self.push_fetch_begin(step, grads, next_step, next_batch)
        return finish() if finish is not None else super().push_fetch(step, grads, next_step, next_batch)

    def push_fetch_begin(
        self, step: int, grads: Grads, next_step: int | None, next_batch: Any,
    ) -> Callable[[], tuple[PushResult, Fetched | None]] | None:
        """``push_fetch``'s exchange sent now (``PSClient.step_begin``); the function returned completes it
        on the thread that calls it. None without a lookahead (separate calls)."""
        if not self.lookahead:
            return None
        dense, versions = grads.dense, grads.state
        push_dense = {self.dense_table: dense} if dense is not None else {}
        push_sparse = {g.table: (g.ids, g.grads, g.base_versions) for g in grads.sparse}
        policy: dict[str, SyncPolicy] = {n: self.dense_policy(step) for n in push_dense}
        policy.update({n: self.sparse_policy(step) for n in push_sparse})
        pull_dense: dict[str, Any] = {}
        pull_sparse: dict[str, np.ndarray] = {}
        pull_policy: dict[str, SyncPolicy] = {}
        wanted: dict[str, tuple[Any, np.ndarray, np.ndarray]] = {}  # module name -> (ids, uniq, inverse)
        if next_step is not None:
            if self.flat.numel:
                pull_dense[self.dense_table] = self._staging[next_step % 2]
                pull_policy[self.dense_table] = self.dense_policy(next_step)
            for name, ids in (self.sparse_ids(next_batch) if self.sparse_ids is not None else {}).items():
                table = self.embeddings[name].table
                flat = ids.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
                uniq, inverse = np.unique(flat, return_inverse=True)
                wanted[name] = (ids, uniq, inverse.reshape(tuple(ids.shape)))
                pull_sparse[table] = uniq
                pull_policy[table] = self.sparse_policy(next_step)
        self._doing = (step, next_step if next_step is not None else -1)
        try:
            replies = self.client.step_begin(
                push_dense=push_dense, push_sparse=push_sparse, pull_dense=pull_dense, pull_sparse=pull_sparse,
                policy=policy, pull_policy=pull_policy, base_versions={self.dense_table: versions or -1} if push_dense else None,
            )
        except FailedPreconditionError as e:
            return lambda: self._went_back_fetched(step, next_step, e)
        return lambda: self._push_fetched(step, next_step, next_batch, replies, wanted, pull_policy)

    def _went_back_fetched(self, step: int, next_step: int | None, error: FailedPreconditionError) -> tuple[PushResult, Fetched | None]:
        """Step ``step``'s exchange was refused ``error``: if a shard came back at an older clock, nothing
        was pushed and the fetch is from the common clock; else ``error`` is raised."""
        common = self._went_back(step)
        if common is None:
            raise error
        return PushResult([], 0), (Fetched(common, None, common, None) if next_step is not None else None)

    def _push_fetched(
        self, step: int, next_step: int | None, next_batch: Any, replies: Callable[[], Any], wanted: dict[str, Any],
        pull_policy: dict[str, SyncPolicy],
    ) -> tuple[PushResult, Fetched | None]:
        try:
            res = replies()
        except FailedPreconditionError as e:
            return self._went_back_fetched(step, next_step, e)
        self.committed = max(self.committed, step + 1)
        pushed = self._push_result(list(res.pushed.values()))
        self._pushed(step, pushed.late)
        if next_step is None:
            return pushed, None
        clock = res.clock.get(self.dense_table, 0) if self.flat.numel else 0
        rows: dict[str, _Rows] = {}
        for name, (ids, uniq, inverse) in wanted.items():
            table = self.embeddings[name].table
            r, v = res.sparse.get(table, (np.zeros((0, self.embeddings[name].dim), np.float32), np.zeros(0, np.int64)))
            c = res.clock.get(table, 0)
            rows[name] = _Rows(ids, uniq, inverse, r, v, c)
            if pull_policy[table].sync:
                clock = min(clock, c) if self.flat.numel else c
        if not self.dense_sync and self.mode != "sync":
            clock = next_step
        return pushed, Fetched(next_step, next_batch, clock, (res.dense_versions.get(self.dense_table, ()), rows))

    @staticmethod
    def _push_result(results: list[Any]) -> PushResult:
        stale: list[int] = []
        late = 0
        for r in results:
            late += r.late
            if hasattr(r, "versions"):
                stale.extend(s for s in r.staleness if s >= 0)
            elif r.mean_staleness >= 0:
                stale.append(round(r.mean_staleness))
        return PushResult(stale, late)

    def evaluate(self, step: int, final: bool, fn: Callable[[], dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
        """Evaluate on the latest parameters, pulled now (so the model reflects every applied push);
        at the end, sync modes wait for the last round to be applied. The step in progress keeps the
        parameters it fetched."""
        saved = self.flat.data.clone() if not final else None
        waits = final and self.dense_sync
        updates = 0.0
        if self.flat.numel:
            # into a buffer of its own: a prefetch may be filling the staging buffers right now
            values, (_, versions) = self.client.pull_dense(
                self.dense_table, out=torch.empty(self.flat.numel), policy=self.dense_policy(step) if waits else None,
                return_clock=True,
            )
            self.flat.load_(values.to(self.device))
            updates = float(np.mean([v for v in versions if v >= 0]))  # optimizer steps applied to the model
        for m in self.embeddings.values():
            m.policy = self.sparse_policy(step) if waits and self.mode == "sync" else None
        metrics = fn()
        if saved is not None:
            self.flat.load_(saved)
        return metrics, {"updates": updates}

    def stats(self) -> dict[str, Any]:
        return {"acked": dict(self.client.acked), "duplicates": self.client.duplicates}
