"""Who is connected, what was asked of whom, and the answers as they arrive.

The servicer calls in from gRPC threads (a node connects or leaves, fetches a blob,
submits an answer); the round loop calls in from its own thread (sample the
connected clients, issue tasks, wait for answers until a deadline). Everything is
guarded by one lock; waits use one condition variable. No grpc here: a node is
reached through the ``send`` callable the servicer hands in.

Memory: the registry keeps one small record per connected client id and per task
in flight; tasks are forgotten when their round collects them, blobs when the
round drops them, so nothing grows with the number of rounds.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from federated.errors import (
    InvalidUpdateError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TaskClosedError,
    UnknownTaskError,
)
from federated.protocol import Answer, Blob, Task
from federated.sampling import participant_of

__all__ = ["Registry", "Node", "Pending", "Cancel", "Shutdown", "Stopping", "Outcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cancel:
    """Server -> node: stop working on ``task_id`` (its round closed)."""

    task_id: str
    reason: str


@dataclass(frozen=True)
class Shutdown:
    """Server -> node: the server is going away; exit cleanly."""

    reason: str


@dataclass(frozen=True)
class Stopping:
    """Server -> node: the server is draining (e.g. SIGTERM); the stream ends UNAVAILABLE and the
    node reconnects (to this server restarted from its checkpoint, or another)."""

    reason: str


Event = Task | Cancel | Shutdown | Stopping


@dataclass(eq=False)
class Node:
    """One connected client process (one Connect stream) and the client ids it hosts."""

    node_id: str
    identity: str | None
    client_ids: tuple[str, ...]
    send: Callable[[Event], None]
    connected_at: float = field(default_factory=time.monotonic)
    alive: bool = True


Outcome = Any
"""What a task's ``accept`` callable made of a valid answer (e.g. a ClientUpdate)."""


@dataclass(eq=False)
class Pending:
    """A task in flight. ``accept(answer)`` validates an answer and returns what the
    round keeps; it raises InvalidUpdateError (or a subclass) to reject it."""

    task: Task
    node: Node
    accept: Callable[[Answer], Outcome]
    issued_at: float = field(default_factory=time.monotonic)
    done: bool = False
    ok: bool = False
    outcome: Outcome = None
    answer: Answer | None = None
    error: str = ""
    bytes_down: int = 0  # blob bytes the server streamed for this task
    bytes_up: int = 0  # Submit bytes received for this task
    finished_at: float = 0.0
    timed_out: bool = False  # closed by its round without an answer (deadline or straggler rule)

    @property
    def client_id(self) -> str:
        """The client the task went to."""
        return self.task.client_id


def owns(identity: str | None, client_id: str) -> bool:
    """With authentication on, identity ``alice`` may host client ``alice`` and ``alice/...``."""
    return identity is None or client_id == identity or client_id.startswith(identity + "/")


class Registry:
    """Thread-safe registry of nodes, clients, blobs and tasks in flight.

    ``max_clients``: client ids held at once, in all; ``max_clients_per_identity``: by
    one authenticated identity (anonymous nodes, without tokens, are not told apart);
    ``max_num_examples``: the most examples an answer may report."""

    def __init__(self, max_clients: int = 1_000_000, max_clients_per_identity: int = 10_000,
                 max_num_examples: int = 100_000_000) -> None:
        self.max_clients = max_clients
        self.max_clients_per_identity = max_clients_per_identity
        self.max_num_examples = max_num_examples
        # participant (identity, or without authentication the client id) -> its client ids (a dict as an
        # ordered set): sampling draws participants, and counting them must not walk every client id
        self._members: dict[str, dict[str, None]] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._nodes: dict[str, Node] = {}
        self._clients: dict[str, Node] = {}
        self._blobs: dict[str, Blob] = {}
        self._tasks: dict[str, Pending] = {}
        self._ids = itertools.count(1)
        self._anon = itertools.count(1)
        self.closed = False

    # ------------------------------------------------------------------ nodes
    def connect(self, identity: str | None, client_ids: Sequence[str], send: Callable[[Event], None], name: str = "") -> Node:
        """Register a node. Empty ``client_ids``: one client named after the identity
        (or a fresh ``client-N`` without authentication). A client id already held by
        another node moves to this one (a reconnect); the old node's tasks for it fail.

        Raises PermissionDeniedError for ids the identity may not host.
        """
        ids = list(client_ids) or [identity or f"client-{next(self._anon)}"]
        bad = [c for c in ids if not owns(identity, c)]
        if bad:
            raise PermissionDeniedError(
                f"identity {identity!r} may host only client {identity!r} or {identity!r}/..., not {bad[:3]}"
            )
        if len(set(ids)) != len(ids):
            raise PermissionDeniedError("Hello lists a client id twice")
        if any(not c or len(c) > 256 for c in ids):
            raise PermissionDeniedError("client ids must be 1 to 256 characters")
        with self._cond:
            if self.closed:
                raise TaskClosedError("server is shutting down")
            new = sum(1 for c in ids if c not in self._clients)
            if len(self._clients) + new > self.max_clients:
                raise PermissionDeniedError(f"server holds its limit of {self.max_clients} clients")
            if identity is not None:
                # ids the identity holds already (a reconnect) do not count twice
                held = len(self._members.get(identity, ()))
                mine = sum(1 for c in ids if c not in self._clients or self._clients[c].identity != identity)
                if held + mine > self.max_clients_per_identity:
                    raise ResourceExhaustedError(
                        f"identity {identity!r} holds {held} client ids and asks for {mine} more; its limit is "
                        f"{self.max_clients_per_identity} (max_clients_per_identity)"
                    )
            node = Node(f"node-{next(self._ids)}", identity, tuple(ids), send)
            for c in ids:
                old = self._clients.get(c)
                if old is not None and old is not node:
                    self._fail_tasks_locked(_of(old, c), "client reconnected")
                    self._leave_locked(old.identity, c)
                self._clients[c] = node
                self._members.setdefault(participant_of(identity, c), {})[c] = None
            self._nodes[node.node_id] = node
            self._cond.notify_all()
        log.info("node %s connected (%s) with %d client(s)", node.node_id, identity or "anonymous", len(ids))
        return node

    def disconnect(self, node: Node) -> None:
        """The node's stream ended: its clients leave, their tasks fail at once."""
        with self._cond:
            node.alive = False
            self._nodes.pop(node.node_id, None)
            for c in node.client_ids:
                if self._clients.get(c) is node:
                    del self._clients[c]
                    self._leave_locked(node.identity, c)
            self._fail_tasks_locked(lambda p: p.node is node, "client disconnected")
            self._cond.notify_all()
        log.info("node %s disconnected", node.node_id)

    def connected(self) -> list[str]:
        """Client ids connected now, sorted (so sampling is reproducible)."""
        with self._lock:
            return sorted(self._clients)

    def num_connected(self) -> int:
        """Number of client ids connected now."""
        with self._lock:
            return len(self._clients)

    def participants(self) -> dict[str, list[str]]:
        """Participant -> its connected client ids: an authenticated identity with every id it
        registered, or without authentication each client id alone (``federated.sampling``)."""
        with self._lock:
            return {p: list(ids) for p, ids in self._members.items()}

    def num_participants(self) -> int:
        """Number of participants connected now (identities; client ids without authentication)."""
        with self._lock:
            return len(self._members)

    def wait_for_participants(self, n: int, timeout: float | None, stop: threading.Event | None = None) -> bool:
        """Block until at least ``n`` participants are connected (True), the timeout passes or
        ``stop`` is set (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._members) < n:
                if stop is not None and stop.is_set():
                    return False
                left = 0.5 if end is None else min(0.5, end - time.monotonic())
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def shutdown(self, reason: str, stopping: bool = False) -> None:
        """Refuse new nodes, fail the tasks in flight and end every node's stream: with a
        :class:`Shutdown` (the node exits: training is over), or with ``stopping`` a
        :class:`Stopping` (the server drains; the node reconnects later)."""
        with self._cond:
            self.closed = True
            nodes = list(self._nodes.values())
            self._fail_tasks_locked(lambda p: True, "server stopping" if stopping else "server shutting down")
            self._cond.notify_all()
        event = Stopping(reason) if stopping else Shutdown(reason)
        for n in nodes:
            try:
                n.send(event)
            except Exception:  # noqa: BLE001 - a dead stream must not stop the others
                pass

    # ------------------------------------------------------------------ blobs
    def put_blob(self, blob: Blob) -> str:
        """Store ``blob`` for clients to Fetch; returns its id (128 random bits). Thread-safe."""
        with self._lock:
            bid = f"b{secrets.token_hex(16)}"  # unguessable, like task ids
            self._blobs[bid] = blob
            return bid

    def blob(self, blob_id: str) -> Blob | None:
        """The stored blob ``blob_id`` (None: unknown or dropped)."""
        with self._lock:
            return self._blobs.get(blob_id)

    def drop_blobs(self, ids: Iterable[str]) -> None:
        """Forget these blobs (unknown ids are ignored); later Fetches of them get NOT_FOUND."""
        with self._lock:
            for b in ids:
                self._blobs.pop(b, None)

    def fetch(self, identity: str | None, blob_id: str, client_id: str, task_id: str) -> Blob:
        """The blob of task ``task_id``, for the client it was sent to only; raises
        UnknownTaskError / PermissionDeniedError / TaskClosedError (see :meth:`check_answer`)."""
        with self._lock:
            p = self._owned_task_locked(identity, task_id, client_id, "fetch for")
            if p.task.blob != blob_id:
                raise PermissionDeniedError(f"task {task_id!r} does not give client {client_id!r} blob {blob_id!r}")
            blob = self._blobs.get(blob_id)
            if blob is None:
                raise UnknownTaskError(f"blob {blob_id!r} is gone (its round closed)")
            p.bytes_down += blob.nbytes
            return blob

    # ------------------------------------------------------------------ tasks
    def issue(self, tasks: Sequence[tuple[Task, Callable[[Answer], Outcome]]]) -> list[Pending]:
        """Record and send tasks. A task for a client that is not connected fails at once."""
        out = []
        sends = []
        with self._cond:
            for task, accept in tasks:
                node = self._clients.get(task.client_id)
                p = Pending(task, node if node is not None else _GONE, accept)
                if task.inline is not None:
                    p.bytes_down += task.inline.nbytes
                self._tasks[task.task_id] = p
                if node is None:
                    self._finish_locked(p, ok=False, error="client not connected")
                else:
                    sends.append((node, task))
                out.append(p)
        for node, task in sends:
            try:
                node.send(task)
            except Exception as e:  # noqa: BLE001
                self._fail(task.task_id, f"send failed: {e}")
        return out

    def new_task_id(self) -> str:
        """128 random bits: a task id travels only down its node's Connect stream, so
        nobody else can name it (without tokens, knowing it is what entitles an answer)."""
        return f"t{secrets.token_hex(16)}"

    def check_answer(self, identity: str | None, task_id: str, client_id: str) -> None:
        """May ``identity`` answer ``task_id`` as ``client_id``? Called on a Submit's header,
        before any of its data is buffered. Raises PermissionDeniedError (another
        client's task, or a client id the identity may not host), UnknownTaskError (a
        task id never issued, or forgotten), TaskClosedError (already answered or timed
        out). Changes nothing."""
        with self._lock:
            self._owned_task_locked(identity, task_id, client_id, "answer for")

    def _owned_task_locked(self, identity: str | None, task_id: str, client_id: str, verb: str) -> Pending:
        if not owns(identity, client_id):
            raise PermissionDeniedError(f"identity {identity!r} may not {verb} client {client_id!r}")
        p = self._tasks.get(task_id)
        if p is None:
            raise UnknownTaskError(f"task {task_id!r} is unknown or its round is over")
        # the client id the task went to, registered by the same identity that asks now
        if p.client_id != client_id or p.node.identity != identity:
            raise PermissionDeniedError(f"task {task_id!r} was not issued to client {client_id!r}"
                                        + (f" of identity {identity!r}" if identity is not None else ""))
        if p.done:
            raise TaskClosedError(f"task {task_id!r} already closed ({p.error or 'answered'})")
        return p

    def submit(self, identity: str | None, answer: Answer) -> Pending:
        """An answer arrives. Validates ownership and that the task is still open, then
        ``accept``; on success the task is done and the round's waiter wakes.

        Raises PermissionDeniedError, UnknownTaskError, TaskClosedError, or the
        InvalidUpdateError that ``accept`` raised (the task then fails: a client
        that sends garbage gets no second try in this round)."""
        with self._lock:
            p = self._owned_task_locked(identity, answer.task_id, answer.client_id, "answer for")
            p.bytes_up += answer.bytes_sent
            mismatch = ""
            if answer.kind != p.task.kind or answer.round != p.task.round:
                mismatch = (f"task {answer.task_id!r} is a {p.task.kind} task of round {p.task.round}, "
                            f"the answer says {answer.kind} of round {answer.round}")
            elif answer.num_examples > self.max_num_examples:  # would outweigh everyone else
                mismatch = (f"num_examples {answer.num_examples} exceeds the server's limit of "
                            f"{self.max_num_examples} (max_num_examples)")
            elif p.task.kind == "secagg" and answer.secagg_stage != p.task.secagg_stage:
                mismatch = (f"task {answer.task_id!r} is secure-aggregation stage {p.task.secagg_stage}, "
                            f"the answer says {answer.secagg_stage}")
        if mismatch:
            self._fail(answer.task_id, f"rejected: {mismatch}", answer)
            raise InvalidUpdateError(f"client {answer.client_id!r}: {mismatch}")
        if answer.error:
            self._fail(answer.task_id, f"client error: {answer.error}", answer)
            return p
        try:
            outcome = p.accept(answer)  # outside the lock: decoding and checks may take a while
        except InvalidUpdateError as e:
            self._fail(answer.task_id, f"rejected: {e}", answer)
            raise
        with self._cond:
            if p.done:
                raise TaskClosedError(f"task {answer.task_id!r} closed while its answer was checked ({p.error})")
            p.outcome, p.answer = outcome, answer
            self._finish_locked(p, ok=True)
        return p

    def collect(self, pending: Sequence[Pending], deadline: float, stop: threading.Event | None = None,
                quorum: int = 0, straggler_factor: float | None = None, straggler_min_s: float = 0.0) -> bool:
        """Wait for the tasks in ``pending`` until every one is done, ``deadline``
        (time.monotonic()) passes or ``stop`` is set; then close the open ones (error
        ``"deadline passed"``), tell their nodes to cancel, forget every task and return True.

        The straggler rule (``quorum`` > 0 and ``straggler_factor`` given): when the slowest
        success took ``t`` seconds from its task's issue to its answer, an open task is a
        straggler once ``(1 + straggler_factor) * max(t, straggler_min_s)`` seconds passed
        since its own issue (each slower success moves it on). The rule applies once at least half of ``pending``
        succeeded (so that one quick answer among slow starters drops nobody); when every open
        task is then a straggler:

        * with ``quorum`` successes, the open tasks are closed (error ``"straggler: ..."``)
          and True returned;
        * with fewer, nothing is closed or forgotten and False is returned: the caller adds
          tasks for other clients to ``pending`` or waits on (collects again), and must
          collect until True."""
        rule = quorum > 0 and straggler_factor is not None
        cut = deadline
        with self._cond:
            while True:
                if all(p.done for p in pending) or (stop is not None and stop.is_set()):
                    break
                now = time.monotonic()
                cut = deadline
                answered = sum(1 for p in pending if p.ok)
                if rule and answered >= (len(pending) + 1) // 2:
                    took = max((p.finished_at - p.issued_at for p in pending if p.ok), default=None)
                    if took is not None:
                        took = max(took, straggler_min_s)
                        last = max(p.issued_at for p in pending if not p.done)
                        cut = min(deadline, last + (1.0 + straggler_factor) * took)  # type: ignore[operator]
                if cut <= now:
                    break
                self._cond.wait(min(cut - now, 0.25))
            answered = sum(1 for p in pending if p.ok)
            early = cut < deadline and not all(p.done for p in pending) and not (stop is not None and stop.is_set())
            if early and answered < quorum:
                return False
            cancels = []
            for p in pending:
                if not p.done:
                    p.timed_out = True
                    self._finish_locked(p, ok=False, error=(
                        f"straggler: {answered} sampled clients had answered; the round closed "
                        f"{straggler_factor:g} x the slowest one's time later" if early else "deadline passed"))
                    if p.node.alive:
                        cancels.append(p)
                self._tasks.pop(p.task.task_id, None)
        for p in cancels:
            try:
                p.node.send(Cancel(p.task.task_id, "round closed"))
            except Exception:  # noqa: BLE001
                pass
        return True

    def wait_any(self, pending: Sequence[Pending], deadline: float, stop: threading.Event | None = None) -> list[Pending]:
        """Block until at least one of ``pending`` is done (or deadline/stop); returns the done
        ones without forgetting them (FedBuff's arrival loop)."""
        with self._cond:
            while True:
                done = [p for p in pending if p.done]
                if done or (stop is not None and stop.is_set()) or time.monotonic() >= deadline:
                    return done
                self._cond.wait(min(0.25, max(0.0, deadline - time.monotonic())))

    def forget(self, pending: Iterable[Pending], reason: str = "") -> None:
        """Drop tasks (closing open ones and telling their nodes to cancel)."""
        cancels = []
        with self._cond:
            for p in pending:
                if not p.done:
                    self._finish_locked(p, ok=False, error=reason or "forgotten")
                    if p.node.alive:
                        cancels.append(p)
                self._tasks.pop(p.task.task_id, None)
        for p in cancels:
            try:
                p.node.send(Cancel(p.task.task_id, reason))
            except Exception:  # noqa: BLE001
                pass

    def in_flight(self) -> int:
        """Number of issued tasks not yet answered, failed or forgotten."""
        with self._lock:
            return len(self._tasks)

    # ------------------------------------------------------------------ internals
    def _leave_locked(self, identity: str | None, client_id: str) -> None:
        p = participant_of(identity, client_id)
        ids = self._members.get(p)
        if ids is not None:
            ids.pop(client_id, None)
            if not ids:
                del self._members[p]

    def _finish_locked(self, p: Pending, ok: bool, error: str = "") -> None:
        p.done, p.ok, p.finished_at = True, ok, time.monotonic()
        if not ok:
            p.error = error
        self._cond.notify_all()

    def _fail(self, task_id: str, error: str, answer: Answer | None = None) -> None:
        with self._cond:
            p = self._tasks.get(task_id)
            if p is not None and not p.done:
                p.answer = answer
                self._finish_locked(p, ok=False, error=error)

    def _fail_tasks_locked(self, pred: Callable[[Pending], bool], error: str) -> None:
        for p in self._tasks.values():
            if not p.done and pred(p):
                self._finish_locked(p, ok=False, error=error)


def _of(node: Node, client_id: str) -> Callable[[Pending], bool]:
    return lambda p: p.node is node and p.client_id == client_id


_GONE = Node("gone", None, (), lambda e: None, alive=False)
