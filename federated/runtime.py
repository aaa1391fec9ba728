"""What runs on a client, apart from the wire: the :class:`Client` contract users
implement, and :class:`ClientRuntime`, which carries out one server task on a Client
(decode the weights, fit or evaluate, then DP-clip, compress or secure-aggregate the
update) and produces the answer. No grpc here; ``federated.client`` moves the bytes.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import numpy as np

from federated.compress import Compressor, EncodedTensor, decode, encode_raw, parse_compression
from federated.errors import ClientFailedError
from federated.privacy import DPConfig, privatize_update
from federated.protocol import EVALUATE, FIT, SECAGG, WEIGHTS, Answer, Task
from federated.strategy import Weights

__all__ = ["Client", "ClientRuntime", "FitOutput"]

log = logging.getLogger(__name__)

FitOutput = tuple[Weights, int, dict[str, float]] | tuple[Weights, int, dict[str, float], dict[str, Weights]]


class Client(ABC):
    """A federated client: trains and evaluates a model on data that never leaves it.

    Weights are lists of numpy arrays in the model's parameter order (the arrays
    passed in are the client's own copies). ``config`` holds the server's scalars
    (``round``, the task's hyperparameters such as ``epochs`` and ``lr``, the
    strategy's ``proximal_mu``, ...) and any strategy payload as lists of arrays
    (SCAFFOLD's ``"c"``). Calls for one client never overlap.
    """

    @abstractmethod
    def fit(self, weights: Weights, config: dict[str, Any]) -> FitOutput:
        """Train from ``weights``; return ``(new_weights, num_examples, metrics)``, or
        with a fourth element ``extras`` (name -> arrays, e.g. SCAFFOLD's ``"delta_c"``)."""

    def evaluate(self, weights: Weights, config: dict[str, Any]) -> tuple[float, int, dict[str, float]]:
        """``(loss, num_examples, metrics)`` of ``weights`` on the client's test data."""
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate()")

    def client_state(self) -> dict[str, Weights]:
        """State to keep between rounds when the client object itself is not kept
        (simulation builds clients per task): e.g. SCAFFOLD's ``c_i``."""
        return {}

    def load_client_state(self, state: dict[str, Weights]) -> None:
        """Restore what :meth:`client_state` returned."""


def _normalize_fit(out: Any, like: Weights) -> tuple[Weights, int, dict[str, float], dict[str, Weights]]:
    if not isinstance(out, tuple) or len(out) not in (3, 4):
        raise ClientFailedError("fit() must return (weights, num_examples, metrics[, extras])")
    weights, n, metrics = out[0], out[1], out[2]
    extras = out[3] if len(out) == 4 else {}
    ws = [np.asarray(w) for w in weights]
    if len(ws) != len(like):
        raise ClientFailedError(f"fit() returned {len(ws)} arrays, the model has {len(like)}")
    for i, (w, g) in enumerate(zip(ws, like)):
        if w.shape != g.shape:
            raise ClientFailedError(f"fit() returned weights[{i}] of shape {w.shape}, expected {g.shape}")
    ws = [w.astype(g.dtype, copy=False) for w, g in zip(ws, like)]
    return ws, int(n), {k: float(v) for k, v in (metrics or {}).items()}, dict(extras or {})


class ClientRuntime:
    """Executes tasks for the clients a node hosts.

    ``client_fn(client_id)`` returns the Client for an id. With ``keep_clients``
    (one long-lived client per id, as ``start_client`` uses) the same object is
    reused; without it (simulation: thousands of virtual clients) a fresh one is
    made per task and only its :meth:`Client.client_state` is kept, so memory holds
    no model per idle client. Thread-safe: tasks of different clients run at once,
    tasks of one client one after another.
    """

    def __init__(self, client_fn: Callable[[str], Client], keep_clients: bool = True) -> None:
        self.client_fn = client_fn
        self.keep_clients = keep_clients
        self._clients: dict[str, Client] = {}
        self._states: dict[str, dict[str, Weights]] = {}
        self._compressors: dict[str, Compressor] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(secrets.randbits(128))  # local DP noise must be unpredictable
        self._secagg: dict[tuple[str, int], Any] = {}
        self._bg: Any = None

    def _client_lock(self, cid: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(cid, threading.Lock())

    def _client(self, cid: str) -> Client:
        if self.keep_clients:
            with self._lock:
                c = self._clients.get(cid)
            if c is None:
                c = self.client_fn(cid)
                with self._lock:
                    c = self._clients.setdefault(cid, c)
            return c
        c = self.client_fn(cid)
        state = self._states.get(cid)
        if state:
            c.load_client_state(state)
        return c

    def _release(self, cid: str, c: Client) -> None:
        if not self.keep_clients:
            state = c.client_state()
            if state:
                self._states[cid] = state

    def handle(self, task: Task, tensors: Sequence[EncodedTensor], bytes_received: int = 0) -> Answer:
        """Run ``task`` on its client; failures become an answer with ``error`` set."""
        base: dict[str, Any] = dict(task_id=task.task_id, client_id=task.client_id, round=task.round, kind=task.kind,
                    bytes_received=bytes_received, secagg_stage=task.secagg_stage)
        try:
            if task.kind == SECAGG:
                # not under the client's lock: the masking stage waits for a fit that holds it
                with self._client_lock("secagg:" + task.client_id):
                    return self._secagg_step(task, tensors, base)
            groups: dict[str, list[np.ndarray]] = {}
            for t in tensors:
                groups.setdefault(t.group, []).append(np.array(decode(t, f"{t.group} tensor"), copy=True))
            weights = groups.pop(WEIGHTS, [])
            config: dict[str, Any] = dict(task.config)
            config.update(groups)
            if task.kind == FIT and task.secagg:
                # answer the key advertisement at once and train in the background meanwhile:
                # the key-exchange stages overlap local training
                return self._secagg_start(task, weights, config, base)
            with self._client_lock(task.client_id):
                client = self._client(task.client_id)
                try:
                    if task.kind == EVALUATE:
                        loss, n, metrics = client.evaluate(weights, config)
                        return Answer(**base, loss=float(loss), num_examples=int(n),
                                      metrics={k: float(v) for k, v in (metrics or {}).items()})
                    assert task.kind == FIT
                    return self._fit(task, client, weights, config, base)
                finally:
                    self._release(task.client_id, client)
        except Exception as e:  # noqa: BLE001 - the user's code failed: tell the server, keep serving
            log.warning("client %s: %s task of round %d failed: %s", task.client_id, task.kind, task.round, e)
            return Answer(**base, error=f"{type(e).__name__}: {e}"[:1000])

    def run_fit(self, client_id: str, weights: Weights, config: dict[str, Any]
                ) -> tuple[Weights, Weights, int, dict[str, float], dict[str, Weights]]:
        """Fit one client under its lock: (global weights, new weights, n, metrics, extras)."""
        with self._client_lock(client_id):
            client = self._client(client_id)
            try:
                return self._fit_on(client, weights, config)
            finally:
                self._release(client_id, client)

    @staticmethod
    def _fit_on(client: Client, weights: Weights, config: dict[str, Any]
                ) -> tuple[Weights, Weights, int, dict[str, float], dict[str, Weights]]:
        t0 = time.perf_counter()
        global_w = [w.copy() for w in weights]
        new, n, metrics, extras = _normalize_fit(client.fit(weights, config), global_w)
        metrics["fit_seconds"] = time.perf_counter() - t0
        return global_w, new, n, metrics, extras

    def _fit(self, task: Task, client: Client, weights: Weights, config: dict[str, Any], base: dict[str, Any]) -> Answer:
        global_w, new, n, metrics, extras = self._fit_on(client, weights, config)
        dp_clip = float(config.get("dp_clip", 0.0) or 0.0)
        spec = parse_compression(task.compress)
        tensors: list[EncodedTensor]
        is_delta = False
        if dp_clip > 0 or spec.encoding != "raw":
            is_delta = True
            delta = [n_.astype(np.float64) - g.astype(np.float64) for n_, g in zip(new, global_w)]
            if dp_clip > 0:
                dp = DPConfig(clip_norm=dp_clip, noise_multiplier=float(config.get("dp_noise", 0.0)),
                              mode=str(config.get("dp_mode", "central")))  # type: ignore[arg-type]
                delta, norm = privatize_update(delta, dp, self._rng)
                metrics["dp_unclipped"] = 1.0 if norm <= dp_clip else 0.0
            delta = [d.astype(g.dtype) for d, g in zip(delta, global_w)]
            if spec.encoding == "raw":
                tensors = encode_raw(delta)
            else:
                comp = self._compressors.get(task.client_id)
                if comp is None or comp.spec != spec:
                    comp = self._compressors[task.client_id] = Compressor(spec)
                tensors = comp.encode(delta)
        else:
            tensors = encode_raw(new)
        for name, arrays in extras.items():
            tensors += encode_raw([np.asarray(a) for a in arrays], group=name)
        return Answer(**base, num_examples=n, metrics=metrics, tensors=tuple(tensors), is_delta=is_delta)

    # ------------------------------------------------------------------ secure aggregation
    def _secagg_start(self, task: Task, weights: Weights, config: dict[str, Any], base: dict[str, Any]) -> Answer:
        from federated.secure_round import client_start

        return client_start(self, task, weights, config, base)

    def background(self) -> Any:
        """A thread pool for work that outlives a task (secure aggregation's local training)."""
        with self._lock:
            if self._bg is None:
                from concurrent.futures import ThreadPoolExecutor

                self._bg = ThreadPoolExecutor(max_workers=16, thread_name_prefix="fedtrain")
            return self._bg

    def _secagg_step(self, task: Task, tensors: Sequence[EncodedTensor], base: dict[str, Any]) -> Answer:
        from federated.secure_round import client_step

        return client_step(self, task, tensors, base)

    def forget_round(self, client_id: str, rnd: int) -> None:
        """Drop the secure-aggregation state of ``client_id`` for round ``rnd`` (done or abandoned)."""
        self._secagg.pop((client_id, rnd), None)

