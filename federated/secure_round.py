"""One round of training under secure aggregation, on both sides, over the ordinary
task protocol. ``federated.secagg`` holds the cryptography as state machines whose
messages are opaque bytes; this module moves those bytes as uint8 tensors (group
"secagg") in FIT / SECAGG tasks and answers, and decides what is summed.

Stages of a round (Bonawitz et al. 2017):

0. FIT with ``secagg=True``: the client answers at once with its public keys
   (AdvertiseKeys) and starts training in the background. The answers form U1.
1. SECAGG stage 1: the server's key list -> the client's encrypted Shamir shares.
2. SECAGG stage 2: the shares addressed to the client -> (once its training is
   done) its masked vector, with its example count and training metrics.
3. SECAGG stage 3: the survivor list U3 -> the client's unmasking shares.

The two key-exchange stages thus overlap local training. Stage 2 waits until the
round's timeout (counted from stage 0); the others wait ``stage_timeout``.

Then the server unmasks the sum of U3's vectors. What is summed: without DP,
``[min(n_k, S) * delta_k / S, min(n_k, S) / S]`` (the example-weighted mean delta is
the first part over the last entry; ``S`` = ``max_examples`` keeps entries within
the fixed-point range); with DP, ``[clip_C(delta_k) (+ local noise), 1{||delta_k|| <= C}]``
(the unweighted DP-FedAvg mean, and the count for adaptive clipping). Every
coordinate is clipped to ``clip_range`` first (reported as ``secagg_clipped``).
A stage's closing step raising SecAggError (fewer than ``threshold`` clients) makes
the round start over with a new sample and fresh keys.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from federated.compress import EncodedTensor
from federated.errors import InvalidUpdateError
from federated.privacy import DPConfig, privatize_update
from federated.protocol import FIT, SECAGG, SECAGG_GROUP, Answer, Task
from federated.secagg import SecAggClient, SecAggConfig, SecAggError, SecAggServer
from federated.strategy import Weights
from federated.wire import make_blob

if TYPE_CHECKING:
    from federated.orchestrator import Orchestrator
    from federated.runtime import ClientRuntime

__all__ = ["SecureRound", "secagg_config_for", "client_start", "client_step", "bytes_tensor"]

log = logging.getLogger(__name__)


def secagg_config_for(num_clients: int, threshold_fraction: float, clip_range: float, ring_bits: int = 32) -> SecAggConfig:
    """The SecAggConfig of a round over ``num_clients``: threshold ``ceil(fraction * m)``
    (at least 2) and the most fractional bits that keep ``m`` entries of magnitude
    ``clip_range`` summable without wrapping."""
    m = max(2, num_clients)
    t = min(m, max(2, math.ceil(threshold_fraction * m)))
    headroom = ring_bits - 1 - math.ceil(math.log2(m))
    scale = math.floor(ring_bits - 1 - math.log2(m * clip_range)) - 1
    scale = max(0, min(headroom - 1, scale))
    return SecAggConfig(threshold=t, ring_bits=ring_bits, scale_bits=scale, max_clients=m)


def bytes_tensor(data: bytes) -> EncodedTensor:
    """Opaque secure-aggregation bytes as a uint8 tensor of the "secagg" group."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return EncodedTensor("raw", (len(arr),), "uint8", (arr,), group=SECAGG_GROUP)


def _bytes_of(tensors: Sequence[EncodedTensor], who: str) -> bytes:
    ts = [t for t in tensors if t.group == SECAGG_GROUP]
    if len(ts) != 1 or len(ts[0].parts) != 1 or ts[0].parts[0].dtype != np.uint8:
        raise InvalidUpdateError(f"{who}: expected one uint8 secure-aggregation message")
    return ts[0].parts[0].tobytes()


# --------------------------------------------------------------------------- client side
def client_start(rt: "ClientRuntime", task: Task, weights: Weights, config: dict[str, Any], base: dict[str, Any]) -> Answer:
    """Stage 0 on the client: advertise keys now; train in the background (the vector to
    sum is needed only at stage 2, so local training overlaps the key exchange)."""
    cfg = SecAggConfig(threshold=int(config["secagg_threshold"]), ring_bits=int(config["secagg_ring_bits"]),
                       scale_bits=int(config["secagg_scale_bits"]), max_clients=int(config["secagg_max_clients"]))
    sa = SecAggClient(task.client_id, cfg)
    future = rt.background().submit(_train_vector, rt, task.client_id, weights, config, cfg)
    with rt._lock:
        for key in [k for k in rt._secagg if k[0] == task.client_id and k[1] != task.round]:
            del rt._secagg[key]  # an earlier round that never finished
        rt._secagg[(task.client_id, task.round)] = (sa, future)
    return Answer(**base, tensors=(bytes_tensor(sa.advertise_keys()),))


def _train_vector(rt: "ClientRuntime", client_id: str, weights: Weights, config: dict[str, Any],
                  cfg: SecAggConfig) -> tuple[np.ndarray, int, dict[str, float]]:
    """Local training, then the vector this client feeds into the secure sum."""
    global_w, new, n, metrics, _ = rt.run_fit(client_id, weights, config)
    clip_range = float(config["secagg_clip_range"])
    delta = [a.astype(np.float64) - g.astype(np.float64) for a, g in zip(new, global_w)]
    dp_clip = float(config.get("dp_clip", 0.0) or 0.0)
    if dp_clip > 0:
        dp = DPConfig(clip_norm=dp_clip, noise_multiplier=float(config.get("dp_noise", 0.0)),
                      mode=str(config.get("dp_mode", "central")))  # type: ignore[arg-type]
        clipped, norm = privatize_update(delta, dp, rt._rng)
        flat = np.concatenate([c.ravel() for c in clipped] + [np.array([1.0 if norm <= dp_clip else 0.0])])
    else:
        s = float(config["secagg_max_examples"])
        w = min(float(n), s) / s
        flat = np.concatenate([d.ravel() * w for d in delta] + [np.array([w])])
    # stay inside the fixed-point range whatever the update; count what had to be clipped
    bound = min(clip_range, cfg.value_bound * (1 - 1e-9))
    clipped_n = int(np.count_nonzero(np.abs(flat) > bound))
    flat = np.clip(flat, -bound, bound)
    metrics["secagg_clipped"] = clipped_n / max(1, flat.size)
    return flat, n, metrics


def client_step(rt: "ClientRuntime", task: Task, tensors: Sequence[EncodedTensor], base: dict[str, Any]) -> Answer:
    """Stages 1-3 on the client: feed the server's message to the state machine."""
    with rt._lock:
        state = rt._secagg.get((task.client_id, task.round))
    if state is None:
        raise SecAggError(f"client {task.client_id!r}: no secure aggregation in progress for round {task.round}")
    sa, future = state
    msg = _bytes_of(tensors, f"client {task.client_id!r}")
    if task.secagg_stage == 1:
        out = sa.share_keys(msg)
    elif task.secagg_stage == 2:
        flat, n, metrics = future.result(timeout=task.timeout_s or None)  # the training started at stage 0
        return Answer(**base, num_examples=n, metrics=metrics, tensors=(bytes_tensor(sa.masked_input(msg, flat)),))
    elif task.secagg_stage == 3:
        out = sa.unmasking(msg)
        rt.forget_round(task.client_id, task.round)
    else:
        raise SecAggError(f"unknown secure-aggregation stage {task.secagg_stage}")
    return Answer(**base, tensors=(bytes_tensor(out),))


# --------------------------------------------------------------------------- server side
class SecureRound:
    """Runs the fit phase of a round under secure aggregation for an Orchestrator."""

    def __init__(self, orch: "Orchestrator") -> None:
        self.o = orch
        self.vector_len = int(sum(w.size for w in orch.weights)) + 1
        self.last_sum: np.ndarray | None = None  # the unmasked sum of the last round (for tests and reports)

    def _stage(self, sa: SecAggServer, lock: threading.Lock, method: str, rnd: int, stage: int,
               targets: dict[str, str], timeout: float, stop: threading.Event, traffic: dict[str, list[int]],
               check: Any = None) -> list[str]:
        """Send SECAGG ``stage`` tasks (client -> blob id); ``method`` of ``sa`` takes each answer
        (after ``check(answer)``, which may raise InvalidUpdateError)."""
        receive = getattr(sa, method)

        def accept(a: Answer) -> None:
            if check is not None:
                check(a)
            data = _bytes_of(a.tensors, f"client {a.client_id!r}")
            with lock:
                try:
                    receive(a.client_id, data)
                except SecAggError as e:
                    raise InvalidUpdateError(str(e)) from None

        o = self.o
        tasks = [(o._task(c, rnd, SECAGG, blob, {"round": rnd}, timeout, secagg_stage=stage), accept)
                 for c, blob in targets.items()]
        pending = o.registry.issue(tasks)
        # every stage waits for all its clients (the threshold, not a quorum, decides what survives)
        o.registry.collect(pending, time.monotonic() + timeout, stop)
        o._note_responses(pending)
        o._traffic(pending, traffic)
        return [p.client_id for p in pending if p.ok]

    def run(self, rnd: int, stop: threading.Event, rec: dict[str, Any], traffic: dict[str, list[int]]) -> Weights | None:
        """Run round ``rnd``'s fit phase as the Bonawitz protocol (retried with backoff up to
        ``max_retries`` times); returns the new global weights, None when ``stop`` was set.
        Fills ``rec`` (secagg stage counts) and ``traffic``. Raises RoundFailedError."""
        o = self.o
        cfg = o.config
        sc = cfg.secagg
        stage_timeout = sc.stage_timeout or cfg.round_timeout
        failures: dict[str, str] = {}
        for attempt in range(cfg.max_retries + 1):
            if attempt:  # a failed attempt: back off before the next (doubling, capped)
                delay = o.retry_delay(attempt - 1)
                o._status(f"round {rnd} secure aggregation attempt {attempt}/{cfg.max_retries + 1} failed "
                          f"({failures}); retrying in {delay:.1f} s", warning=True)
                if stop.wait(delay):
                    return None
            if not o._wait_for_clients(stop):
                return None
            drawn = o._sample(o.registry.participants(), cfg.fraction, rnd, attempt, 0)  # one id per identity
            sample = drawn.client_ids
            if len(sample) < 2:
                log.warning("round %d: secure aggregation needs 2 clients, %d sampled", rnd, len(sample))
                continue
            sa_cfg = secagg_config_for(len(sample), sc.threshold, sc.clip_range)
            sa = SecAggServer(sa_cfg, sample, self.vector_len)
            lock = threading.Lock()
            config = o._client_config(rnd)
            config.update(secagg_threshold=sa_cfg.threshold, secagg_ring_bits=sa_cfg.ring_bits,
                          secagg_scale_bits=sa_cfg.scale_bits, secagg_max_clients=sa_cfg.max_clients,
                          secagg_clip_range=float(sc.clip_range), secagg_max_examples=float(sc.max_examples))
            blobs: list[str] = [o._weights_blob(o.strategy.client_payload(rnd))]
            t0 = time.monotonic()
            fit_info: dict[str, tuple[int, dict[str, float]]] = {}

            def accept_fit(a: Answer) -> None:
                data = _bytes_of(a.tensors, f"client {a.client_id!r}")
                with lock:
                    try:
                        sa.receive_advertise(a.client_id, data)
                    except SecAggError as e:
                        raise InvalidUpdateError(str(e)) from None

            def on_masked(a: Answer) -> None:  # the masked input comes with the training's count and metrics
                if a.num_examples < 1:
                    raise InvalidUpdateError(f"client {a.client_id!r}: num_examples must be >= 1, got {a.num_examples}")
                for k, v in a.metrics.items():
                    if not math.isfinite(v):
                        raise InvalidUpdateError(f"client {a.client_id!r}: metric {k!r} is {v}")
                fit_info[a.client_id] = (a.num_examples, dict(a.metrics))

            try:
                tasks = [(o._task(c, rnd, FIT, blobs[0], config, cfg.round_timeout, secagg=True), accept_fit) for c in sample]
                pending = o.registry.issue(tasks)
                o.registry.collect(pending, time.monotonic() + stage_timeout, stop)
                o._note_responses(pending)
                o._traffic(pending, traffic)
                failures.update({p.client_id: p.error for p in pending if not p.ok})
                if stop.is_set():
                    return None
                stages: dict[str, float] = {"keys_s": time.monotonic() - t0}
                with lock:
                    keys = sa.broadcast_keys()
                kb = o.registry.put_blob(make_blob([bytes_tensor(keys)]))
                blobs.append(kb)
                t1 = time.monotonic()
                u1 = sa.u1
                ok1 = self._stage(sa, lock, "receive_shares", rnd, 1, {c: kb for c in u1}, stage_timeout, stop, traffic)
                stages["shares_s"] = time.monotonic() - t1
                with lock:
                    fwd = sa.forward_shares()
                targets = {}
                for c, data in fwd.items():
                    b = o.registry.put_blob(make_blob([bytes_tensor(data)]))
                    blobs.append(b)
                    targets[c] = b
                # local training (started at stage 0) must end, and the masked input arrive, within the
                # round's timeout from its start (and no sooner than a stage's timeout from now)
                t2 = time.monotonic()
                left = max(stage_timeout, t0 + cfg.round_timeout - t2) if sc.stage_timeout else cfg.round_timeout
                ok2 = self._stage(sa, lock, "receive_masked_input", rnd, 2, targets, left, stop, traffic, check=on_masked)
                stages["masked_s"] = time.monotonic() - t2
                with lock:
                    surv = sa.broadcast_survivors()
                sb = o.registry.put_blob(make_blob([bytes_tensor(surv)]))
                blobs.append(sb)
                ok3 = self._stage(sa, lock, "receive_unmasking", rnd, 3, {c: sb for c in sa.included}, stage_timeout, stop, traffic)
                t_agg = time.monotonic()
                with lock:
                    total = sa.finish()
                self.last_sum = total
                if sa.bad_shares or sa.unresolved_shares:
                    log.warning("round %d: wrong secure-aggregation shares outvoted; sent by %s (unattributed: %s)",
                                rnd, {c: len(v) for c, v in sa.bad_shares.items()}, sa.unresolved_shares)
                stages["unmask_s"] = t_agg - t2 - stages["masked_s"]
                stages["fit_s"] = t_agg - t0  # keys + shares + training/masking + unmasking
            except SecAggError as e:
                if stop.is_set():
                    return None
                log.warning("round %d attempt %d: secure aggregation failed (%s); retrying", rnd, attempt + 1, e)
                failures["secagg"] = str(e)
                continue
            finally:
                o.registry.drop_blobs(blobs)
            included = sa.included
            new = self._apply(rnd, total, included, len(sample), drawn.eligible, rec)
            rec.update(sampled=len(sample), answered=len(included), attempts=attempt + 1, **stages,
                       agg_s=time.monotonic() - t_agg, agg_bytes=len(ok2) * self.vector_len * sa_cfg.ring_dtype.itemsize,
                       secagg={"threshold": sa_cfg.threshold, "scale_bits": sa_cfg.scale_bits, "u1": len(u1),
                               "u2": len(ok1), "u3": len(included), "unmasked_by": len(ok3), "dropped": sa.dropped,
                               # senders of wrong unmasking shares (outvoted): client -> which secrets
                               "bad_shares": sa.bad_shares, "unresolved_shares": sa.unresolved_shares})
            infos = [fit_info[c] for c in included if c in fit_info]
            from federated.orchestrator import _weighted

            rec["train_metrics"] = _weighted(infos)
            rec["failed"] = failures
            o.weights = new
            return new
        from federated.orchestrator import RoundFailedError

        raise RoundFailedError(f"round {rnd}: secure aggregation failed {cfg.max_retries + 1} times; last: {failures}")

    def _apply(self, rnd: int, total: np.ndarray, included: list[str], num_sampled: int, eligible: int,
               rec: dict[str, Any]) -> Weights:
        """Turn the unmasked sum into new global weights via the strategy."""
        o = self.o
        parts: list[np.ndarray] = []
        pos = 0
        for w in o.weights:
            parts.append(total[pos : pos + w.size].reshape(w.shape))
            pos += w.size
        last = float(total[pos])
        if o.dp is None:
            if last <= 0:
                raise SecAggError("the summed example weights are not positive")
            mean = [p / last for p in parts]
            return o.strategy.aggregate_mean_delta(rnd, o.weights, mean)
        from federated.privacy import noised_mean

        c = o.clip.clip_norm if o.clip is not None else o.dp.clip_norm
        mean = noised_mean(parts, len(included), o.dp, o.dp_rng(), clip_norm=c)
        new = o.strategy.aggregate_mean_delta(rnd, o.weights, mean)
        o._account(rec, num_sampled, eligible, int(round(last)), len(included))
        return new

