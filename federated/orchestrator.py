"""The server's round loop: sample -> send -> collect until all answered or the deadline
-> aggregate -> evaluate -> checkpoint. Pure Python: clients are reached through the
:class:`~federated.registry.Registry`, never through grpc directly.

Synchronous strategies run rounds; an ``asynchronous`` strategy (FedBuff) keeps
``async_concurrency`` clients busy and aggregates whenever ``buffer_size`` answers
have arrived, each aggregation counting as one round. Under secure aggregation the
fit phase is the Bonawitz protocol (``federated.secure_round``); under DP the
clipped deltas are summed, noised and averaged (``federated.privacy``).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from federated.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from federated.compress import encode_raw
from federated.config import ServerConfig
from federated.errors import ConfigError, FedError
from federated.privacy import AdaptiveClip, RDPAccountant, clip_update, noised_mean, secure_rng
from federated.protocol import EVALUATE, FIT, Task
from federated.registry import Pending, Registry
from federated.sampling import Responsiveness, Sample, participant_of, sample
from federated.strategy import Strategy, StrategyError, Weights
from federated.updates import Evaluation, Received, accept_evaluation, accept_fit
from federated.wire import make_blob

__all__ = ["Orchestrator", "EvaluateFn", "RoundFailedError", "check_combination"]

log = logging.getLogger(__name__)

EvaluateFn = Callable[[Weights], tuple[float, dict[str, float]]]
"""Central evaluation: ``evaluate_fn(weights) -> (loss, metrics)`` on the server's own
test set. ``weights`` is the global model as a list of numpy arrays (the order and
shapes of the initial weights; do not modify them); ``loss`` a float and ``metrics`` a
dict of metric name -> float (e.g. ``{"accuracy": 0.93}``). Called in the round
loop's thread after every round (blocking it), never concurrently."""

StatusFn = Callable[[str], None]
"""Receives one-line progress notes that are not round records: waiting for clients,
a round retried (e.g. ``print``; the default logs at INFO / WARNING)."""

_WAIT_NOTE_S = 5.0  # while waiting for clients, say so at least this often


class RoundFailedError(FedError):
    """A round could not gather ``min_clients`` answers in ``max_retries + 1`` attempts
    (or ``min_available`` clients did not connect within ``wait_timeout``). The message
    names the round, what was needed and the clients' last failures."""


def check_combination(config: ServerConfig, strategy: Strategy) -> None:
    """Refuse, before anything starts, combinations that cannot work."""
    if config.secagg.enabled:
        if strategy.needs_individual_updates:
            raise ConfigError(
                f"strategy {strategy.name!r} (robust aggregation) needs every client's individual update; "
                "secure aggregation reveals only their sum. Use fedavg, fedavgm, fedprox, fedadam, fedyogi "
                "or fedadagrad with --secagg, or drop --secagg."
            )
        if not strategy.supports_secure_aggregation:
            raise ConfigError(
                f"strategy {strategy.name!r} needs more than the sum of updates (per-client extras or staleness); "
                "it cannot run under secure aggregation"
            )
    if config.dp is not None and not strategy.supports_secure_aggregation:
        raise ConfigError(
            f"client-level DP averages clipped deltas; strategy {strategy.name!r} cannot aggregate from the mean delta"
        )
    if strategy.asynchronous and (config.secagg.enabled or config.dp is not None):
        raise ConfigError(f"asynchronous strategy {strategy.name!r} cannot combine with secure aggregation or DP")


def _weighted(items: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Example-weighted mean of each metric over the items that report it."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for n, m in items:
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + n * float(v)
            counts[k] = counts.get(k, 0.0) + n
    return {k: sums[k] / counts[k] for k in sums if counts[k] > 0}


class Orchestrator:
    """Runs the rounds of one training job. Not thread-safe: one thread calls :meth:`run`.

    ``initial_weights`` is used unless ``config.checkpoint`` names an existing file,
    in which case training resumes after the checkpoint's round. ``evaluate_fn`` is
    the central evaluation (None: none). ``on_round(record)`` is called after every
    round with the record appended to :attr:`history`.
    """

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        registry: Registry,
        initial_weights: Weights,
        evaluate_fn: EvaluateFn | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        on_status: StatusFn | None = None,
    ) -> None:
        check_combination(config, strategy)
        self.on_status = on_status
        self.config = config
        self.strategy = strategy
        self.registry = registry
        self.evaluate_fn = evaluate_fn
        self.on_round = on_round
        self.weights: Weights = [np.array(w, copy=True) for w in initial_weights]
        if not self.weights or any(w.dtype.kind != "f" for w in self.weights):
            raise ConfigError("initial weights must be a non-empty list of float arrays")
        self.round = 0  # last completed round
        self.history: list[dict[str, Any]] = []
        self.dp = config.dp
        self.clip: AdaptiveClip | None = None
        self.accountant: RDPAccountant | None = None
        if self.dp is not None:
            # the count noise protects who was clipped: never from a seed (config refuses one with dp)
            self.clip = AdaptiveClip.from_config(self.dp, secure_rng()) if self.dp.adaptive else None
            self.accountant = RDPAccountant(self.dp.noise_multiplier, 0.0)
        if config.checkpoint and os.path.exists(config.checkpoint):
            self._resume(config.checkpoint)
        self.strategy.setup(self.weights)
        self.model_bytes = int(sum(w.nbytes for w in self.weights))
        self.started = time.monotonic()
        self.training_started: float | None = None  # when the first tasks went out (clients connected)
        self.waited = 0.0  # seconds spent waiting for enough clients, reset every round
        self._secure: Any = None
        self.responsiveness = Responsiveness()

    # ------------------------------------------------------------------ checkpoints
    def _resume(self, path: str) -> None:
        ck = load_checkpoint(path)
        if len(ck.weights) != len(self.weights) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ck.weights, self.weights)
        ):
            raise ConfigError(f"checkpoint {path} holds weights of another model")
        self.weights, self.round, self.history = ck.weights, ck.round, ck.history
        try:
            self.strategy.load_state_dict(ck.strategy_state)
        except StrategyError as e:
            raise ConfigError(f"checkpoint {path}: strategy state does not load: {e}") from None
        if self.accountant is not None and "accountant" in ck.meta:
            self.accountant.load_state_dict(ck.meta["accountant"])
        if self.clip is not None and "clip" in ck.meta:
            self.clip.load_state_dict(ck.meta["clip"])
        log.info("resumed from %s after round %d", path, self.round)

    def checkpoint(self) -> None:
        """Write the checkpoint of the last completed round (``config.checkpoint``; none: nothing)."""
        if not self.config.checkpoint:
            return
        meta: dict[str, Any] = {"strategy": self.strategy.name, "params": self.strategy.params()}
        if self.accountant is not None:
            meta["accountant"] = self.accountant.state_dict()
        if self.clip is not None:
            meta["clip"] = self.clip.state_dict()
        save_checkpoint(
            self.config.checkpoint,
            Checkpoint(self.round, self.weights, self.strategy.state_dict(), self.history, meta),
        )

    # ------------------------------------------------------------------ helpers
    def _client_config(self, rnd: int) -> dict[str, Any]:
        cfg: dict[str, Any] = dict(self.config.client_config)
        cfg.update(self.strategy.client_config(rnd))
        cfg["round"] = rnd
        if self.dp is not None:
            cfg["dp_clip"] = self.clip.clip_norm if self.clip is not None else self.dp.clip_norm
            cfg["dp_noise"] = self.dp.noise_multiplier
            cfg["dp_mode"] = self.dp.mode
        return cfg

    def _seed(self) -> int:
        s = self.config.insecure_reproducible_seed
        return self.config.seed if s is None else s

    def dp_rng(self) -> np.random.Generator:
        """The generator of one DP draw (noise, sampling): fresh from the OS CSPRNG, so
        that clients cannot predict it (``ServerConfig`` refuses a seed with DP)."""
        assert self.config.insecure_reproducible_seed is None or self.dp is None
        return secure_rng()

    def _sample(self, participants: dict[str, list[str]], fraction: float, rnd: int, attempt: int, salt: int,
                min_clients: int | None = None) -> Sample:
        """One client id of each drawn participant (``federated.sampling.sample``): one vote per
        identity, fewer draws for participants that keep timing out."""
        # under DP, a client must not know in advance which rounds it (or anyone) takes part in
        rng = self.dp_rng() if self.dp is not None else np.random.default_rng([self._seed(), rnd, attempt, salt])
        k = self.config.min_clients if min_clients is None else min_clients
        return sample(participants, fraction, k, rng, self.responsiveness)

    def _collect(self, pending: list[Pending], timeout: float, stop: threading.Event, quorum: int,
                 replace: Callable[[set[str], int], list[Pending]] | None = None) -> list[Pending]:
        """Collect a phase's tasks under the straggler rule (``Registry.collect``): once
        ``quorum`` answered, the round does not wait for clients ``straggler_factor`` x slower
        than the slowest answer. Short of the quorum, ``replace(taken, n)`` issues tasks to up
        to ``n`` participants not in ``taken`` (the phase's so far) and the phase goes on with
        them; when none is left, it waits for those out there until the deadline. Returns
        every task of the phase and notes who answered and who timed out."""
        deadline = time.monotonic() + timeout
        factor: float | None = self.config.straggler_factor
        while not self.registry.collect(pending, deadline, stop, quorum, factor, self.config.straggler_min_s):
            taken = {participant_of(p.node.identity, p.client_id) for p in pending}
            extra = replace(taken, quorum - sum(1 for p in pending if p.ok)) if replace is not None else []
            if not extra:
                factor = None  # nobody else to ask: wait for the ones out there until the deadline
            pending = pending + extra
        self._note_responses(pending)
        return pending

    def _note_responses(self, pending: Sequence[Pending]) -> None:
        for p in pending:
            who = participant_of(p.node.identity, p.client_id)
            if p.answer is not None:  # an answer, even a rejected one: not silent
                self.responsiveness.answered(who)
            elif p.timed_out:
                self.responsiveness.timed_out(who)

    def _status(self, line: str, warning: bool = False) -> None:
        if self.on_status is not None:
            self.on_status(line)
        else:
            log.log(logging.WARNING if warning else logging.INFO, "%s", line)

    def _wait_for_clients(self, stop: threading.Event) -> bool:
        """Block until ``config.needed`` participants (identities; client ids without
        authentication) are connected, saying so when the count changes and every few
        seconds ("waiting for clients (1/2 connected)")."""
        need = self.config.needed
        if self.registry.num_participants() >= need:
            return True
        t0 = time.monotonic()
        end = None if self.config.wait_timeout is None else t0 + self.config.wait_timeout
        said: tuple[int, float] | None = None  # (count, when) of the last note
        ok = False
        while not stop.is_set():
            have = self.registry.num_participants()
            now = time.monotonic()
            if said is None or have != said[0] or now - said[1] >= _WAIT_NOTE_S:
                self._status(f"waiting for clients ({have}/{need} connected)")
                said = (have, now)
            slice_s = _WAIT_NOTE_S if end is None else min(_WAIT_NOTE_S, end - now)
            if slice_s <= 0:
                break
            # returns early when enough connect; a changed count is noted on the next pass
            if self.registry.wait_for_participants(need, min(slice_s, 1.0), stop):
                ok = True
                break
        self.waited += time.monotonic() - t0
        if not ok and not stop.is_set():
            raise RoundFailedError(
                f"only {self.registry.num_participants()} of the {need} clients needed connected within "
                f"{self.config.wait_timeout} s"
            )
        return ok

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1`` of a round (``attempt`` from 0):
        ``config.retry_backoff`` doubled per attempt, at most ``config.retry_backoff_max``."""
        b = self.config.retry_backoff
        return 0.0 if b <= 0 else min(self.config.retry_backoff_max, b * 2.0 ** attempt)

    def _weights_blob(self, payload: dict[str, Weights]) -> str:
        tensors = encode_raw(self.weights)
        for name, arrays in payload.items():
            tensors += encode_raw([np.asarray(a) for a in arrays], group=name)
        return self.registry.put_blob(make_blob(tensors))

    def _task(self, cid: str, rnd: int, kind: str, blob: str, config: dict[str, Any], timeout: float, **kw: Any) -> Task:
        if self.training_started is None:
            self.training_started = time.monotonic()
        b = self.registry.blob(blob) if blob else None
        nbytes = b.nbytes if b is not None else 0
        inline = None
        if b is not None and nbytes <= min(self.config.inline_bytes, self.config.chunk_bytes):
            inline, blob = b, ""  # small: ride in the task message, no Fetch round trip
        return Task(
            task_id=self.registry.new_task_id(), client_id=cid, round=rnd, kind=kind, config=config, blob=blob,
            blob_bytes=nbytes, timeout_s=timeout, compress=self.config.compress, inline=inline, **kw,
        )

    @staticmethod
    def _traffic(pending: Sequence[Pending], into: dict[str, list[int]]) -> None:
        for p in pending:
            t = into.setdefault(p.client_id, [0, 0])
            t[0] += p.bytes_up
            t[1] += p.bytes_down

    # ------------------------------------------------------------------ run
    def run(self, stop: threading.Event | None = None) -> list[dict[str, Any]]:
        """Run the remaining rounds (blocking). Returns the history. Stops early when
        ``stop`` is set. Raises RoundFailedError when a round cannot be completed."""
        stop = stop or threading.Event()
        if self.strategy.asynchronous:
            return self._run_async(stop)
        while self.round < self.config.rounds and not stop.is_set():
            rnd = self.round + 1
            t0 = time.monotonic()
            traffic: dict[str, list[int]] = {}
            rec: dict[str, Any] = {"round": rnd}
            if self.config.secagg.enabled:
                outcome = self._secure_fit(rnd, stop, rec, traffic)
            else:
                outcome = self._plain_fit(rnd, stop, rec, traffic)
            if outcome is None:  # stopped
                break
            self.round = rnd
            self._finish_round(rec, t0, traffic, stop)
        return self.history

    def _plain_fit(self, rnd: int, stop: threading.Event, rec: dict[str, Any], traffic: dict[str, list[int]]) -> Weights | None:
        cfg = self.config
        payload = self.strategy.client_payload(rnd)
        blob = self._weights_blob(payload)
        config = self._client_config(rnd)
        weights = self.weights
        keep_delta = self.dp is not None
        failures: dict[str, str] = {}
        try:
            for attempt in range(cfg.max_retries + 1):
                if not self._wait_for_clients(stop):
                    return None
                participants = self.registry.participants()
                self.responsiveness.prune(participants.keys())
                drawn = self._sample(participants, cfg.fraction, rnd, attempt, 0)
                sample = drawn.client_ids
                t_fit = time.monotonic()

                def fit(ids: list[str]) -> list[Pending]:
                    def accept(a: Any) -> Received:
                        return accept_fit(a, rnd, weights, self.strategy, keep_delta)

                    return self.registry.issue([(self._task(c, rnd, FIT, blob, config, cfg.round_timeout), accept)
                                                for c in ids])

                def replace(taken: set[str], n: int, attempt: int = attempt) -> list[Pending]:
                    # silent or slow participants in the draw: ask others, so that the round completes
                    # with the responsive ones (drawn from those not asked yet, responsiveness-weighted)
                    rest = {w: ids for w, ids in self.registry.participants().items() if w not in taken}
                    return fit(self._sample(rest, 0.0, rnd, attempt, 2 + len(taken), min_clients=n).client_ids)

                pending = self._collect(fit(sample), cfg.round_timeout, stop, cfg.min_clients, replace)
                sample = [p.client_id for p in pending]
                self._traffic(pending, traffic)
                ok = [p for p in pending if p.ok]
                failures.update({p.client_id: p.error for p in pending if not p.ok})
                rec.update(sampled=len(sample), answered=len(ok), attempts=attempt + 1, fit_s=time.monotonic() - t_fit)
                if stop.is_set():
                    return None
                if len(ok) >= cfg.min_clients:
                    received: list[Received] = [p.outcome for p in ok]
                    t_agg = time.monotonic()
                    new = self._aggregate(rnd, received, rec, num_sampled=len(sample), eligible=drawn.eligible)
                    rec["agg_s"] = time.monotonic() - t_agg
                    rec["agg_bytes"] = len(received) * self.model_bytes
                    rec["train_metrics"] = _weighted([(r.update.num_examples, r.update.metrics) for r in received])
                    rec["failed"] = failures
                    self.weights = new
                    return new
                if attempt == cfg.max_retries:
                    break
                delay = self.retry_delay(attempt)
                last = "; ".join(f"{k}: {v}" for k, v in list(failures.items())[-3:]) or "none answered in time"
                self._status(f"round {rnd} attempt {attempt + 1}/{cfg.max_retries + 1}: {len(ok)} of {len(sample)} "
                             f"sampled clients answered, {cfg.min_clients} needed; retrying in {delay:.1f} s "
                             f"(last failures: {last})", warning=True)
                if stop.wait(delay):
                    return None
        finally:
            self.registry.drop_blobs([blob])
        raise RoundFailedError(
            f"round {rnd}: fewer than {cfg.min_clients} clients answered in {cfg.max_retries + 1} attempts; last failures: "
            + ("; ".join(f"{k}: {v}" for k, v in list(failures.items())[-5:]) or "none answered in time")
        )

    def _aggregate(self, rnd: int, received: list[Received], rec: dict[str, Any], num_sampled: int,
                   eligible: int) -> Weights:
        if self.dp is None:
            return self.strategy.aggregate(rnd, self.weights, [r.update for r in received])
        dp = self.dp
        c = self.clip.clip_norm if self.clip is not None else dp.clip_norm
        total: list[np.ndarray] | None = None
        unclipped = 0
        for r in received:
            assert r.delta is not None
            d = r.delta
            if dp.mode == "central":  # a client that did not clip gets clipped here; local noise must not be
                d, norm = clip_update([x.astype(np.float64) for x in d], c)
            unclipped += int(r.update.metrics.get("dp_unclipped", 0.0) >= 0.5)
            total = [x.astype(np.float64) for x in d] if total is None else [t + x for t, x in zip(total, d)]
        assert total is not None
        mean = noised_mean(total, len(received), dp, self.dp_rng(), clip_norm=c)
        new = self.strategy.aggregate_mean_delta(rnd, self.weights, mean)
        self._account(rec, num_sampled, eligible, unclipped, len(received))
        return new

    def _account(self, rec: dict[str, Any], num_sampled: int, eligible: int, unclipped: int, num_answered: int) -> None:
        """DP accounting of one round: ``num_sampled`` drawn of ``eligible`` participants."""
        assert self.dp is not None and self.accountant is not None
        # the rate among the participants the draw was made from: those skipped for timing out
        # raise it for the others, never lower it
        q = min(1.0, num_sampled / max(1, eligible))
        self.accountant.step(1, sample_rate=q)
        rec["dp_clip"] = self.clip.clip_norm if self.clip is not None else self.dp.clip_norm
        if self.clip is not None and num_answered:
            self.clip.update_from_count(unclipped, num_answered)
        eps = self.accountant.epsilon(self.dp.delta) if self.dp.noise_multiplier > 0 else math.inf
        rec["epsilon"] = eps
        rec["delta"] = self.dp.delta

    def _secure_fit(self, rnd: int, stop: threading.Event, rec: dict[str, Any], traffic: dict[str, list[int]]) -> Weights | None:
        if self._secure is None:
            from federated.secure_round import SecureRound

            self._secure = SecureRound(self)
        return self._secure.run(rnd, stop, rec, traffic)

    # ------------------------------------------------------------------ evaluation + bookkeeping
    def _evaluate(self, rnd: int, stop: threading.Event, rec: dict[str, Any], traffic: dict[str, list[int]]) -> None:
        cfg = self.config
        t0 = time.monotonic()
        if cfg.eval_every and cfg.eval_fraction > 0 and rnd % cfg.eval_every == 0 and not stop.is_set():
            participants = self.registry.participants()
            if participants:
                blob = self._weights_blob({})
                try:
                    sample = self._sample(participants, cfg.eval_fraction, rnd, 0, 1).client_ids
                    timeout = cfg.eval_timeout or cfg.round_timeout
                    config = self._client_config(rnd)
                    pending = self.registry.issue(
                        [(self._task(c, rnd, EVALUATE, blob, config, timeout), accept_evaluation) for c in sample]
                    )
                    # evaluation is best effort: once half answered, the stragglers are dropped, however few answered
                    self._collect(pending, timeout, stop, 1)
                    self._traffic(pending, traffic)
                    evals: list[Evaluation] = [p.outcome for p in pending if p.ok]
                    total = sum(e.num_examples for e in evals)
                    rec["eval_clients"] = len(evals)
                    if total > 0:
                        rec["loss"] = sum(e.loss * e.num_examples for e in evals) / total
                        rec["metrics"] = _weighted([(e.num_examples, e.metrics) for e in evals])
                finally:
                    self.registry.drop_blobs([blob])
        if self.evaluate_fn is not None:
            loss, metrics = self.evaluate_fn(self.weights)
            rec["central_loss"] = float(loss)
            rec["central_metrics"] = {k: float(v) for k, v in metrics.items()}
        rec["eval_s"] = time.monotonic() - t0

    def _finish_round(self, rec: dict[str, Any], t0: float, traffic: dict[str, list[int]], stop: threading.Event) -> None:
        self._evaluate(rec["round"], stop, rec, traffic)
        self._record_round(rec, t0, traffic)
        log.info(
            "round %d: %s/%s answered, %.3f s, central %s",
            rec["round"], rec.get("answered"), rec.get("sampled"), rec["round_s"], rec.get("central_metrics"),
        )

    # ------------------------------------------------------------------ asynchronous (FedBuff)
    def _run_async(self, stop: threading.Event) -> list[dict[str, Any]]:
        """FedBuff: keep clients busy; every ``buffer_size`` arrivals is one aggregation ("round")."""
        cfg = self.config
        k_buf = int(getattr(self.strategy, "buffer_size", 1))
        in_flight: dict[str, Pending] = {}
        buffer: list[tuple[str, Received]] = []  # (participant, its update)
        blob_of: dict[int, str] = {}  # version -> blob id
        traffic: dict[str, list[int]] = {}
        failures: dict[str, str] = {}
        t_round = time.monotonic()
        draws = 0
        try:
            while self.round < cfg.rounds and not stop.is_set():
                if not self._wait_for_clients(stop):
                    break
                participants = self.registry.participants()
                want = cfg.async_concurrency or max(cfg.min_clients, math.ceil(cfg.fraction * len(participants)))
                # a participant whose update still waits in the buffer trains again only after it is used
                # (a buffer holds one update per participant), and one trains one client id at a time
                busy = {w for w, _ in buffer} | {participant_of(p.node.identity, c) for c, p in in_flight.items()}
                idle = {w: ids for w, ids in participants.items() if w not in busy}
                if len(in_flight) < want and idle:
                    draws += 1
                    rng = np.random.default_rng([self._seed(), draws, 3])  # no DP here (refused)
                    self.responsiveness.prune(participants.keys())
                    pick = sample(idle, 0.0, want - len(in_flight), rng, self.responsiveness).client_ids
                    version = self.round
                    if version not in blob_of:
                        blob_of[version] = self._weights_blob(self.strategy.client_payload(version))
                    config = self._client_config(version)
                    weights = self.weights

                    def accept(a: Any, version: int = version, weights: Weights = weights) -> Received:
                        # runs on a gRPC thread: shape checks only; staleness is checked below, in this thread
                        return accept_fit(a, version, weights, self.strategy, strategy_check=False)

                    tasks = [(self._task(c, version, FIT, blob_of[version], config, cfg.round_timeout), accept)
                             for c in pick]
                    for p in self.registry.issue(tasks):
                        in_flight[p.client_id] = p
                now = time.monotonic()
                deadline = min([p.issued_at + cfg.round_timeout for p in in_flight.values()], default=now + 0.5)
                done = self.registry.wait_any(list(in_flight.values()), deadline, stop)
                expired = [p for p in in_flight.values() if not p.done and time.monotonic() >= p.issued_at + cfg.round_timeout]
                for p in expired:
                    p.timed_out = True
                finished = done + expired
                self.registry.forget(finished, "deadline passed")
                self._note_responses(finished)
                self._traffic(finished, traffic)
                for p in finished:
                    in_flight.pop(p.client_id, None)
                    if not p.ok:
                        failures[p.client_id] = p.error
                        continue
                    try:
                        self.strategy.validate_update(self.round, self.weights, p.outcome.update)
                    except StrategyError as e:
                        failures[p.client_id] = f"rejected: {e}"
                        continue
                    buffer.append((participant_of(p.node.identity, p.client_id), p.outcome))
                if len(buffer) >= k_buf:
                    rnd = self.round + 1
                    used, buffer = buffer[:k_buf], buffer[k_buf:]
                    rec: dict[str, Any] = {"round": rnd, "answered": len(used), "sampled": len(used) + len(failures),
                                           "buffered": len(buffer), "in_flight": len(in_flight)}
                    updates = [r.update for _, r in used]
                    rec["staleness"] = [self.round - u.base_round for u in updates]
                    t_agg = time.monotonic()
                    try:
                        new = self.strategy.aggregate(self.round, self.weights, updates)
                    except StrategyError as e:  # e.g. an update went too stale while buffered: drop the buffer
                        log.warning("FedBuff aggregation refused (%s); dropping %d buffered updates", e, len(used))
                        continue
                    rec["agg_s"] = time.monotonic() - t_agg
                    rec["agg_bytes"] = len(used) * self.model_bytes
                    rec["train_metrics"] = _weighted([(u.num_examples, u.metrics) for u in updates])
                    rec["failed"] = failures
                    self.weights = new
                    self.round = rnd
                    live = {p.task.round for p in in_flight.values()}
                    self.registry.drop_blobs([b for v, b in blob_of.items() if v not in live])
                    blob_of = {v: b for v, b in blob_of.items() if v in live}
                    self._finish_async_round(rec, t_round, traffic)
                    traffic, failures, t_round = {}, {}, time.monotonic()
        finally:
            self.registry.forget(list(in_flight.values()), "training finished")
            self.registry.drop_blobs(blob_of.values())
        return self.history

    def _finish_async_round(self, rec: dict[str, Any], t0: float, traffic: dict[str, list[int]]) -> None:
        t_eval = time.monotonic()
        if self.evaluate_fn is not None and self.config.eval_every and rec["round"] % self.config.eval_every == 0:
            loss, metrics = self.evaluate_fn(self.weights)
            rec["central_loss"] = float(loss)
            rec["central_metrics"] = {k: float(v) for k, v in metrics.items()}
        rec["eval_s"] = time.monotonic() - t_eval
        self._record_round(rec, t0, traffic)

    def _record_round(self, rec: dict[str, Any], t0: float, traffic: dict[str, list[int]]) -> None:
        """Timings and traffic into ``rec``; append it to the history, checkpoint, notify."""
        rec["round_s"] = time.monotonic() - t0  # includes wait_s
        rec["wait_s"], self.waited = self.waited, 0.0
        rec["elapsed_s"] = time.monotonic() - self.started
        rec["train_elapsed_s"] = time.monotonic() - (self.training_started or self.started)
        rec["bytes_up"] = int(sum(v[0] for v in traffic.values()))
        rec["bytes_down"] = int(sum(v[1] for v in traffic.values()))
        rec["clients"] = {k: {"up": v[0], "down": v[1]} for k, v in sorted(traffic.items())}
        self.history.append(rec)
        self.checkpoint()
        if self.on_round is not None:
            self.on_round(rec)

