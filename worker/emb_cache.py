"""``EmbCache``: the hot rows of one ``PSEmbedding`` table, kept on the worker's device.

With Zipf-distributed ids a few rows are in almost every batch; a worker that pulls them from the
PS every step spends its step on host work (gathering rows, copying them to the GPU). The cache
holds ``rows`` of them in a fixed device table (GPU memory on a CUDA worker, CPU memory on a CPU
one) with, per slot, the row's id, its PS version (updates applied to it) with its shard's
eviction epoch, and the step it was pulled at. The PS stays the source of truth: every gradient still goes to it (summed per unique
id on the device by the lookup's backward, then pushed), and the cache only decides which rows
need to come from the PS for a step.

Id -> slot: the resident ids sorted, with their slots beside them; a lookup is one
``torch.searchsorted`` on the device (no Python per id). The map is rebuilt (one device sort)
only in steps that admitted rows.

Admission by frequency (TinyLFU): a count-min sketch on the device counts how many steps each id
was in (``depth x width`` int32 counters, keyed hashes, conservative update, halved every
``10 x width`` sightings). A missed id seen at least ``admit`` times enters a free slot, or takes
the slot of the resident seen least often if it was seen more often than that resident.

Refresh, by consistency mode (``staleness`` = K):

- ``sync``: a cached row is never older than the current clock. Every step's pull names every id
  of the batch, and for resident rows the version the cache holds (a conditional pull,
  ``PSClient.pull_sparse_changed``): the PS answers with every row's version but sends values only
  for rows whose version moved past the cached one (and for missed rows). Unchanged rows are served
  from the device table, so they cost neither the wire nor the host gather nor the copy; every pulled
  resident row is refreshed (value, version, step), so a row pulled at step t is current at t.
  Results are exactly those without the cache (same values, same versions). What it saves is bounded
  by what changed: the PS applies the optimizer, so a worker's own push of step t changes every row
  it used in step t, and the cache cannot hold that row's new value without pulling it. A row is a
  hit only when nobody pushed it since this worker last pulled it: rows a lookup reads without
  training them (no gradient pushed, e.g. frozen or no-grad lookups), or pulled by this worker after
  another worker's push and not pushed since. A training step that pushes every row it read (the
  ctr task) gets no sync hits (bench/RESULTS.md, issue 16).
  Eviction: a version names a value only while the row lives on its shard (a row evicted by
  ``eviction.ttl_steps`` or ``max_rows`` and created again restarts at version 0), so each slot also
  holds the eviction epoch of its shard at which its version was read (``ChangedRows.epochs``), and
  the PS trusts a cached version only when that epoch is still the shard's: after any eviction on a
  shard, its next pull sends every row (exact, at the cost of one full transfer per eviction).
  Admission needs no such care: a row the PS does not admit yet comes back at version 0 with the
  initial values a later creation stores (the initializer is deterministic per id).
- ``ssp``: a row pulled at step c is served without asking the PS for steps c..c+K (never more
  than K clocks old), then pulled again (conditionally, as in sync: an unchanged row is not sent and
  counts as pulled at this step).
- ``async``: refreshed every K steps (served for steps c..c+K-1; K >= 1; the refresh is conditional, as in ssp).

On CUDA the fetch thread does its device work on a side stream: ids and rows go through pinned
staging buffers with non-blocking copies, the step's rows are assembled there, and an event
marks them ready; the compute stream waits on that event (``EmbCache.ready``), never on the
device. Row gradients come back through a pinned buffer the same way, waiting on an event.

Thread-safety: ``fetch`` may be called from a prefetch thread while the main thread computes
on earlier rows (each step's rows are a fresh tensor, never a view of the table); calls are
serialised by a lock and must come in step order (one fetch thread per table does that).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ps import PSClient, SyncPolicy

__all__ = ["CACHE_MODES", "CacheStats", "CachedRows", "EmbCache", "attach_caches", "cache_mode"]

log = logging.getLogger(__name__)

CACHE_MODES = ("sync", "ssp", "async")
_EMPTY = torch.iinfo(torch.int64).max  # the sorted map's key of a free slot
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MUL = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64


def cache_mode(ps_mode: str) -> str:
    """The cache's refresh rule for a PS mode: sparse tables are BSP only in ``sync``; ``dense-sync``
    keeps them async."""
    return {"sync": "sync", "ssp": "ssp", "async": "async", "dense-sync": "async"}[ps_mode]


@dataclass
class CacheStats:
    """Counters since the cache was made. ``lookups``: ids looked up (with repeats, as the batch has
    them); ``hits``: of those, served from the device table; ``rows``/``row_hits``: the same per unique
    id of a step; ``pulled``: rows asked of the PS (a conditional pull names their cached versions);
    ``transferred``: rows whose values came over the wire (the PS sends only rows whose version moved
    past the cached one, and every missed row); ``copied``: rows copied host -> device (the same rows);
    ``refreshed``: resident rows that had changed on the PS and were replaced by the pulled row."""

    steps: int = 0
    lookups: int = 0
    hits: int = 0
    rows: int = 0
    row_hits: int = 0
    pulled: int = 0
    transferred: int = 0
    copied: int = 0
    refreshed: int = 0
    admitted: int = 0
    evicted: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"lookup": 0.0, "pull": 0.0, "assemble": 0.0})

    @property
    def hit_rate(self) -> float:
        """Share of id lookups served from the device table."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def row_hit_rate(self) -> float:
        """Share of a step's unique rows served from the device table (rows not copied to the device)."""
        return self.row_hits / self.rows if self.rows else 0.0


@dataclass
class CachedRows:
    """One step's rows as the cache assembled them: ``leaf`` (len(uniq), dim) float32 on the device,
    a fresh tensor; ``versions`` int64 per unique id (the version each row was read at: the cached
    one for rows served from the table); ``ages`` steps since each row was pulled (0 for rows pulled
    now); ``ready`` a CUDA event the compute stream waits on (None on CPU)."""

    leaf: torch.Tensor
    versions: np.ndarray
    ages: np.ndarray
    clock: int
    ready: Any = None


class EmbCache:
    """A device table of ``rows`` hot rows of width ``dim`` for one sparse table (see the module doc).

    ``mode``: ``sync``, ``ssp`` or ``async`` (``cache_mode`` maps a PS mode); ``staleness``: K.
    ``admit``: sightings (steps an id was in) before a missed id may enter. ``sketch_width``: counters
    per sketch row (a power of two; default: 8 x rows, at least 1024).
    """

    def __init__(
        self, rows: int, dim: int, mode: str = "async", staleness: int = 4, device: torch.device | str = "cpu",
        admit: int = 2, sketch_depth: int = 4, sketch_width: int = 0, seed: int = 0,
    ) -> None:
        if rows < 1:
            raise ValueError(f"emb cache rows must be >= 1, got {rows}")
        if dim < 1:
            raise ValueError(f"emb cache dim must be >= 1, got {dim}")
        if mode not in CACHE_MODES:
            raise ValueError(f"emb cache mode must be one of {CACHE_MODES}, got {mode!r}")
        if staleness < 0 or (mode == "async" and staleness < 1):
            raise ValueError(
                f"emb cache staleness must be >= 0 (ssp) or >= 1 (async: rows are refreshed every K steps), got {staleness} for {mode}"
            )
        if admit < 1:
            raise ValueError(f"emb cache admit must be >= 1 sighting, got {admit}")
        width = sketch_width or max(1024, 1 << int(np.ceil(np.log2(8 * rows))))
        if width & (width - 1) or width < 16 or sketch_depth < 1:
            raise ValueError(f"sketch width must be a power of two >= 16 and depth >= 1, got {sketch_depth} x {width}")
        self.capacity, self.dim, self.mode, self.staleness, self.admit = rows, dim, mode, staleness, admit
        # served from the table while step - pulled_at <= max_age (sync: never without a version check)
        self.max_age = {"sync": -1, "ssp": staleness, "async": staleness - 1}[mode]
        self.device = dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        self.values = torch.zeros(rows, dim, dtype=torch.float32, device=dev)
        self.ids = torch.full((rows,), _EMPTY, dtype=torch.int64, device=dev)
        self.valid = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.versions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.epochs = torch.zeros(rows, dtype=torch.int64, device=dev)  # the shard's eviction epoch of each version
        self.pulled_at = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.sorted_ids = self.ids.clone()
        self.sorted_slots = torch.arange(rows, dtype=torch.int64, device=dev)
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randint(-(2**62), 2**62, (sketch_depth,), generator=g, dtype=torch.int64).to(dev)
        self.counters = torch.zeros(sketch_depth, width, dtype=torch.int32, device=dev)
        self.width, self._added, self._reset_every = width, 0, 10 * width
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device=dev) if self.cuda else None
        self._grad_stream = torch.cuda.Stream(device=dev) if self.cuda else None  # D2H of gradients (main thread)
        # pinned staging (CUDA): by step parity, so step t+1's rows are staged while step t's copy may
        # still read the other; each buffer's last copy is marked by an event waited on before reuse
        self._pinned: list[torch.Tensor] = []
        self._pinned_done: list[Any] = [None, None]
        self._grad_pinned: torch.Tensor | None = None
        self._parity = 0
        if self._stream is not None:  # the tables were written on this thread's current stream: order the side stream after
            self._stream.wait_stream(torch.cuda.current_stream(dev))

    # ------------------------------------------------------------------ sketch (device)
    def _cols(self, u: torch.Tensor) -> torch.Tensor:
        """(depth, n) counter column of each id in each sketch row: a keyed splitmix64-style mix."""
        h = u[None, :] ^ self.keys[:, None]
        h = h * _GOLDEN
        h = h ^ ((h >> 31) & 0x1FFFFFFFF)  # logical shift: mask the sign bits an arithmetic shift brings
        h = h * _MUL
        h = h ^ ((h >> 29) & 0x7FFFFFFFF)
        return h & (self.width - 1)

    def _estimate(self, cols: torch.Tensor) -> torch.Tensor:
        return torch.gather(self.counters, 1, cols).amin(dim=0)

    def _count(self, u: torch.Tensor) -> torch.Tensor:
        """One more sighting of each of ``u`` (unique ids); returns their estimates after it."""
        cols = self._cols(u)
        want = self._estimate(cols) + 1  # conservative update: raise only the counters below est + 1
        for r in range(cols.shape[0]):
            self.counters[r].scatter_reduce_(0, cols[r], want, reduce="amax")
        self._added += int(u.numel())
        if self._added >= self._reset_every:  # aging: old counts fade
            self.counters.bitwise_right_shift_(1)
            self._added //= 2
            want = want // 2
        return want

    # ------------------------------------------------------------------ staging (CUDA)
    def _stage(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (float32 rows or int64 ids, contiguous) onto the device; on CUDA through a pinned
        buffer and a non-blocking copy on the current (side) stream."""
        if not self.cuda:
            return host
        i = self._parity
        done = self._pinned_done[i]
        if done is not None:
            done.synchronize()  # the buffer's previous copy has finished reading it
        nbytes = host.numel() * host.element_size()
        if len(self._pinned) <= i:
            self._pinned.append(torch.empty(0, dtype=torch.uint8).pin_memory())
        if self._pinned[i].numel() < nbytes:
            self._pinned[i] = torch.empty(max(nbytes, 2 * self._pinned[i].numel()), dtype=torch.uint8).pin_memory()
        buf = self._pinned[i][:nbytes].view(host.dtype).view(host.shape)
        buf.copy_(host)
        out = buf.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._pinned_done[i] = ev
        self._parity ^= 1
        return out

    def grads_to_host(self, grad: torch.Tensor) -> np.ndarray:
        """A step's row gradients (summed per unique id on the device) as a host float32 array. On CUDA:
        a non-blocking copy into a pinned buffer on the side stream after the compute stream's event,
        waiting on the copy's own event, not on the device."""
        if not self.cuda:
            return grad.detach().cpu().numpy()
        assert self._grad_stream is not None
        nbytes = grad.numel() * 4
        if self._grad_pinned is None or self._grad_pinned.numel() < nbytes:
            self._grad_pinned = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8).pin_memory()
        computed = torch.cuda.Event()
        computed.record()  # on the compute stream: the backward that wrote grad
        with torch.cuda.stream(self._grad_stream):
            self._grad_stream.wait_event(computed)
            host = self._grad_pinned[:nbytes].view(torch.float32).view(grad.shape)
            host.copy_(grad.detach(), non_blocking=True)
            grad.record_stream(self._grad_stream)
            copied = torch.cuda.Event()
            copied.record()
        copied.synchronize()
        return host.numpy().copy()  # the pinned buffer is reused by the next step

    # ------------------------------------------------------------------ the step
    def fetch(
        self, client: PSClient, table: str, uniq: np.ndarray, counts: np.ndarray | None, step: int,
        policy: SyncPolicy | None,
    ) -> CachedRows:
        """The rows of ``uniq`` (sorted unique int64 ids) for ``step``: from the device table where the
        mode's rule allows, the rest pulled from the PS (``policy`` for the pull). Then refreshes the
        rows it pulled and admits frequent ones. ``counts``: how many times each id is in the batch
        (for the per-lookup hit rate; None: once each). Blocking; see the class doc for threads."""
        with self._lock, (torch.cuda.stream(self._stream) if self._stream is not None else _null()):
            t0 = time.perf_counter()
            n = len(uniq)
            u = self._stage(torch.from_numpy(np.ascontiguousarray(uniq, np.int64)))
            pos = torch.searchsorted(self.sorted_ids, u).clamp_(max=self.capacity - 1)
            slot = self.sorted_slots[pos]
            hit = (self.sorted_ids[pos] == u) & self.valid[slot]
            age = step - self.pulled_at[slot]
            fresh = hit & (age <= self.max_age) & (age >= 0)
            freq = self._count(u)
            # one copy back: what the host needs to decide what to pull
            info = torch.stack([hit.long(), fresh.long(), slot, self.versions[slot], self.epochs[slot], age]).cpu().numpy()
            hit_h, fresh_h, slot_h, cver_h, cep_h, age_h = info[0].astype(bool), info[1].astype(bool), *info[2:]
            t1 = time.perf_counter()
            need = np.flatnonzero(~fresh_h)
            clock = policy.clock if policy is not None else 0
            changed = np.zeros(0, bool)
            rows = np.zeros((0, self.dim), np.float32)
            pver = pep = np.zeros(0, np.int64)
            if len(need):  # a conditional pull: resident rows name their cached version, only changed rows come back
                known = np.where(hit_h[need], cver_h[need], -1)
                got = client.pull_sparse_changed(table, uniq[need], known, cep_h[need], policy=policy)
                changed, rows, pver, pep, clock = got.changed, got.rows, got.versions, got.epochs, got.clock
            t2 = time.perf_counter()
            versions, epochs = cver_h.copy(), cep_h.copy()
            versions[need], epochs[need] = pver, pep
            ages = np.where(fresh_h, age_h, 0)
            # rows served from the table: fresh ones, and pulled ones the PS did not send (a resident row at
            # the PS's current version, read in the shard's current eviction epoch)
            served = fresh_h.copy()
            served[need[~changed]] = True
            copy = need[changed]  # indices into uniq (ascending) of the rows that came over the wire, as ``rows`` holds them
            pulled_row = np.full(n, -1, np.int64)
            pulled_row[need] = np.arange(len(need))
            leaf = torch.empty(n, self.dim, dtype=torch.float32, device=self.device)
            serve_idx = np.flatnonzero(served)
            if len(serve_idx):
                si = self._stage(torch.from_numpy(np.stack([serve_idx, slot_h[serve_idx]])))
                leaf[si[0]] = self.values[si[1]]
            if len(copy):
                copied = self._stage(torch.from_numpy(rows))  # only the changed rows: no host gather
                ci = self._stage(torch.from_numpy(copy))
                leaf[ci] = copied
            # refresh: resident rows that were pulled get the PS's value, version, epoch and step (current at this step)
            refresh = need[hit_h[need]]
            if len(refresh):
                pr = pulled_row[refresh]
                rs = self._stage(torch.from_numpy(np.stack([slot_h[refresh], pver[pr], pep[pr], refresh])))
                self.values[rs[0]] = leaf[rs[3]]
                self.versions[rs[0]] = rs[1]
                self.epochs[rs[0]] = rs[2]
                self.pulled_at[rs[0]] = step
            admitted, evicted = self._admit(u, leaf, freq, hit, torch.from_numpy(np.stack([versions, epochs])), step)
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record()
            t3 = time.perf_counter()
            c = np.ones(n, np.int64) if counts is None else np.asarray(counts, np.int64)
            s = self.stats
            s.steps += 1
            s.lookups += int(c.sum())
            s.hits += int(c[served].sum())
            s.rows += n
            s.row_hits += int(served.sum())
            s.pulled += len(need)
            s.transferred += len(copy)
            s.copied += len(copy)
            s.refreshed += int(len(refresh) - (served[refresh].sum() if len(refresh) else 0))
            s.admitted += admitted
            s.evicted += evicted
            s.seconds["lookup"] += t1 - t0
            s.seconds["pull"] += t2 - t1
            s.seconds["assemble"] += t3 - t2
            return CachedRows(leaf, versions, ages, clock, ready)

    def _admit(
        self, u: torch.Tensor, leaf: torch.Tensor, freq: torch.Tensor, hit: torch.Tensor, versions: torch.Tensor, step: int,
    ) -> tuple[int, int]:
        """Missed ids seen at least ``admit`` times take free slots, then the slots of residents seen
        less often than they were (all on the device); ``versions``: (2, len(u)) host int64, each id's
        version and eviction epoch. Returns (admitted, evicted)."""
        cand = torch.nonzero(~hit & (freq >= self.admit)).reshape(-1)
        if cand.numel() == 0:
            return 0, 0
        cf, order = torch.sort(freq[cand], descending=True)
        cand = cand[order]
        score = torch.where(self.valid, self._estimate(self._cols(self.ids)), torch.full_like(self.ids, -1, dtype=torch.int32))
        vs, victims = torch.sort(score)
        m = min(cand.numel(), self.capacity)
        cand, cf, vs, victims = cand[:m], cf[:m], vs[:m], victims[:m]
        take = cf > vs  # candidates descending, victims ascending: a prefix
        k = int(take.sum())  # one sync: how many entered
        if k == 0:
            return 0, 0
        cand, victims, was_valid = cand[:k], victims[:k], self.valid[victims[:k]]
        evicted = int(was_valid.sum())
        self.values[victims] = leaf[cand].detach()
        self.ids[victims] = u[cand]
        ve = versions.to(self.device, non_blocking=True)[:, cand]
        self.versions[victims], self.epochs[victims] = ve[0], ve[1]
        self.pulled_at[victims] = step
        self.valid[victims] = True
        key = torch.where(self.valid, self.ids, torch.full_like(self.ids, _EMPTY))
        self.sorted_ids, self.sorted_slots = torch.sort(key)
        return k, evicted

    def ready(self, rows: CachedRows) -> torch.Tensor:
        """``rows.leaf``, safe to use on the current stream (which waits on the cache's event, not on the device)."""
        if rows.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(rows.ready)
            rows.leaf.record_stream(stream)
            rows.ready = None
        return rows.leaf

    def resident(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, versions, pulled_at) of the resident rows, sorted by id (host copies; for tests and stats)."""
        with self._lock:
            if self._stream is not None:  # the side stream writes the tables: read after it
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            v = self.valid.cpu().numpy()
            ids, ver, at = self.ids.cpu().numpy()[v], self.versions.cpu().numpy()[v], self.pulled_at.cpu().numpy()[v]
        o = np.argsort(ids)
        return ids[o], ver[o], at[o]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def attach_caches(
    model: torch.nn.Module, rows: int, staleness: int, ps_mode: str, device: torch.device | str, **kw: Any,
) -> dict[str, EmbCache]:
    """Give every ``PSEmbedding`` of ``model`` an ``EmbCache`` of ``rows`` rows on ``device`` (refresh rule
    from ``ps_mode``, see ``cache_mode``); returns {module name: cache}. ``rows`` 0: none (and removes any)."""
    from worker.binding import PSEmbedding

    if rows < 0:
        raise ValueError(f"emb cache rows must be >= 0 (0: no cache), got {rows}")
    made: dict[str, EmbCache] = {}
    if rows > 0 and cache_mode(ps_mode) == "sync":
        log.warning("emb cache in sync mode: exact; it serves only rows nobody pushed since this worker pulled them "
                    "(a worker's own push changes every row it trained on), so it saves transfers mainly in ssp and async modes")
    for name, m in model.named_modules():
        if isinstance(m, PSEmbedding):
            m.cache = EmbCache(rows, m.dim, cache_mode(ps_mode), staleness, device, **kw) if rows > 0 else None
            if m.cache is not None:
                made[name] = m.cache
    return made
