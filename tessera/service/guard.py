"""Who may call what, and how much of a server one identity may hold: the one admission path of
every Tessera server (gRPC and the bulk plane alike).

A caller is identified by its bearer token, or under mutual TLS by its client certificate's
common name (:class:`Access.caller`). Each identity has roles; each method admits some roles. A
server with neither tokens nor client certificates is *open*: every caller is anonymous with
every role (per-identity limits cannot apply; the server-wide ones do).

**Admission before a thread is taken.** :meth:`Access.interceptor` admits a call in gRPC's
``intercept_service``, which grpcio runs on the server's polling thread, before the call gets
one of the ``pool`` handler threads (certificate callers, whose certificate a handler context
alone shows, are admitted as their handler starts). Each admitted call holds slots until it
ends:

* per identity: at most ``security.max_concurrent`` calls in flight, of which at most
  ``security.max_waiting`` of the methods in ``waits`` (calls that may block: BSP/SSP pulls,
  push streams a client feeds); ``security.rate`` calls per second if set;
* server-wide (gRPC plane): ordinary calls share ``pool - admin_reserve - health_reserve -
  headroom`` slots, of which ``per_protected`` are kept for each identity in
  :meth:`Access.protect` (the PS: identities of live workers) that others may not take; admin
  callers may also use ``admin_reserve`` slots; the gRPC health service has
  ``health_reserve`` slots of its own (no token needed); ``headroom`` threads are never
  admitted to, so a refusal (a few microseconds of a thread) always finds one.

A refused call gets RESOURCE_EXHAUSTED (UNAUTHENTICATED, PERMISSION_DENIED) naming the identity
and the limit; nothing of it ran. Waits are capped server-side (:meth:`Access.wait_budget`).

**Draining** (:meth:`Access.drain`): health NOT_SERVING for every service at once, new calls
UNAVAILABLE ("... the server is stopping"), ``stopping`` set so that waits end.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import grpc

from tessera.service.errors import (
    ErrorTable,
    PermissionDeniedError,
    RateLimitedError,
    ServerStoppingError,
    UnauthenticatedError,
)
from tessera.service.tls import ServerSecurity
from tessera.service.tokens import TOKEN_HEADER, Identities, WorkerNames, token_from

__all__ = ["ANONYMOUS", "Access", "Caller", "Limits", "Method", "guarded_handler", "current_call"]

log = logging.getLogger(__name__)

ANONYMOUS = ""
HEALTH_SERVICE = "grpc.health.v1.Health"

# per call: what the runtime learned about it ({"identity": ...}); the metrics interceptor sets a
# fresh dict around each call and labels its counts with it (the bound identity label)
_CALL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("tessera_call", default=None)


def current_call() -> dict[str, Any] | None:
    """The running call's record (None outside a call): ``identity`` once admitted."""
    return _CALL.get()


def new_call() -> tuple[dict[str, Any], contextvars.Token]:
    """Start a call's record (the outermost interceptor does, see tessera.metrics)."""
    info: dict[str, Any] = {}
    return info, _CALL.set(info)


def end_call(token: contextvars.Token) -> None:
    """End the call record :func:`new_call` started (a generator closed elsewhere: nothing to reset)."""
    try:
        _CALL.reset(token)
    except ValueError:
        pass


def _note(identity: str) -> None:
    info = _CALL.get()
    if info is not None:
        info["identity"] = identity


@dataclass(frozen=True)
class Caller:
    identity: str
    roles: frozenset[str]

    def has(self, role: str) -> bool:
        return role in self.roles


@dataclass(frozen=True)
class Limits:
    """Server-wide shares of the handler pool (see the module doc). ``max_wait_s``: the longest
    any wait may block, whatever deadline the caller sent. ``start_timeout_s``: an admitted call
    whose handler has not started by then (its request still arriving, or cancelled before it
    arrived) gives its slots back."""

    admin_reserve: int = 4
    health_reserve: int = 4
    headroom: int = 4
    per_protected: int = 2
    max_wait_s: float = 60.0
    start_timeout_s: float = 30.0
    # roles whose callers have no per-identity cap and may use the admin reserve: a service's own
    # peers (the PS's replica: a primary forwards each of its concurrent mutations to its backup)
    peer_roles: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Method:
    """One method of a service: ``fn(request, context, caller)``; ``request_stream``: fn gets the
    request iterator; ``response_stream``: fn is a generator."""

    fn: Callable[..., Any]
    request_stream: bool = False
    response_stream: bool = False


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at = tokens, at


class _Ticket:
    """The slots one admitted call holds: released once (by its handler's end, or reclaimed when
    the handler never started within ``start_timeout_s``)."""

    __slots__ = ("identity", "waits", "pool", "at", "started", "released")

    def __init__(self, identity: str, waits: bool, pool: str) -> None:
        self.identity, self.waits, self.pool = identity, waits, pool
        self.at = time.monotonic()
        self.started = self.released = False


class Access:
    """Authentication, authorization, admission and draining for one service (module doc).

    ``method_roles``: method name -> the roles that may call it (a method not listed may be
    called by nobody but ``admin``). ``all_roles``: every role of the service (an open server's
    anonymous caller has them all). ``waits``: the methods that may block. ``pool``: the gRPC
    server's handler threads. Thread-safe."""

    def __init__(
        self, security: ServerSecurity, method_roles: Mapping[str, Iterable[str]], all_roles: Iterable[str],
        waits: Iterable[str] = (), pool: int = 64, limits: Limits | None = None,
    ) -> None:
        self.security = security
        self.method_roles = {m: frozenset(r) for m, r in method_roles.items()}
        self.all_roles = frozenset(all_roles)
        self.waits = frozenset(waits)
        self.limits = limits or Limits()
        self.pool = pool
        self.identities = (
            Identities(security.tokens, security.roles, security.default_roles) if security.tokens is not None else None
        )
        self.worker_names = WorkerNames(security.workers)
        lim = self.limits
        self.general = max(1, pool - lim.admin_reserve - lim.health_reserve - lim.headroom)
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._used = {"general": 0, "admin": 0, "health": 0}
        self._tickets: set[_Ticket] = set()
        self._buckets: dict[str, _Bucket] = {}
        self._protected: frozenset[str] = frozenset()
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, outcome code name)
        self.refused: Counter[str] = Counter()  # refusals at admission, by reason
        self.stopping = threading.Event()
        self.stop_reason = ""
        self.health: Any = None  # the health servicer (build_server sets it) and its service names
        self.service_names: tuple[str, ...] = ("",)

    # ------------------------------------------------------------------ who
    def caller(self, metadata: Iterable[Any] | None, auth_context: Mapping[str, Any] | None = None) -> Caller:
        """Who is calling (UnauthenticatedError if nobody we know)."""
        token = token_from(metadata)
        if self.identities is not None and (token is not None or not self.security.mutual):
            identity = self.identities.lookup(token)
            if identity is None:
                raise UnauthenticatedError(
                    "unknown token" if token else f"no token ('{TOKEN_HEADER}: Bearer <token>' metadata)"
                )
            return Caller(identity, self.identities.roles[identity])
        if self.security.mutual:
            names = (auth_context or {}).get("x509_common_name") or []
            if not names:
                raise UnauthenticatedError("no client certificate" + (" and no token" if self.identities is not None else ""))
            identity = names[0].decode() if isinstance(names[0], bytes) else str(names[0])
            if self.identities is not None and identity not in self.security.certificates:
                # tokens are how this server names callers; a certificate names one only if the token file says so
                raise UnauthenticatedError(
                    f"no token ('{TOKEN_HEADER}: Bearer <token>' metadata), and certificate {identity!r} is not a "
                    "certificate identity of the token file (token '-')"
                )
            roles = frozenset(self.security.roles.get(identity, ())) or frozenset(self.security.default_roles)
            return Caller(identity, roles)
        return Caller(ANONYMOUS, self.all_roles)

    def _early_caller(self, metadata: Iterable[Any] | None) -> Caller | None:
        """The caller if its metadata alone tells (tokens, open server); None if only the
        certificate can (mutual TLS), which a handler context shows."""
        if self.identities is None and self.security.mutual:
            return None
        if self.identities is not None and self.security.mutual and token_from(metadata) is None:
            return None
        return self.caller(metadata)

    def authorize(self, method: str, caller: Caller) -> None:
        allowed = self.method_roles.get(method, frozenset({"admin"}))
        if not (caller.roles & allowed):
            raise PermissionDeniedError(
                f"{method}: identity {caller.identity!r} (roles {sorted(caller.roles) or 'none'}) may not call it; "
                f"it needs one of {sorted(allowed)}"
            )

    def protect(self, identities: Iterable[str]) -> None:
        """Keep ``limits.per_protected`` slots for each of ``identities`` (e.g. those of live
        workers) that other identities may not take. Replaces the previous set."""
        with self._lock:
            self._protected = frozenset(identities)

    # ------------------------------------------------------------------ admission
    def _reclaim(self, now: float) -> None:
        """Caller holds _lock: give back the slots of calls whose handler never started."""
        stale = [t for t in self._tickets if not t.started and now - t.at > self.limits.start_timeout_s]
        for t in stale:
            self._free(t)

    def _free(self, t: _Ticket) -> None:
        if t.released:
            return
        t.released = True
        self._tickets.discard(t)
        self._used[t.pool] -= 1
        if t.identity is not None:
            self._in_flight[t.identity] -= 1
            if self._in_flight[t.identity] <= 0:
                del self._in_flight[t.identity]
            if t.waits:
                self._waiting[t.identity] -= 1
                if self._waiting[t.identity] <= 0:
                    del self._waiting[t.identity]

    def release(self, t: _Ticket) -> None:
        with self._lock:
            self._free(t)

    def _refuse(self, reason: str, exc: Exception) -> Exception:
        self.refused[reason] += 1
        return exc

    def acquire(self, method: str, caller: Caller | None, plane: str = "grpc") -> _Ticket:
        """Admit one call (module doc); raises the refusal. ``caller`` None: a health probe.
        ``plane`` "bulk": a bulk connection's own thread serves it, so only the identity's
        limits apply, not the gRPC pool's shares."""
        if self.stopping.is_set() and caller is not None:
            raise self._refuse("stopping", ServerStoppingError(f"{method}: {self.stop_reason}: the server is stopping"))
        s, lim = self.security, self.limits
        now = time.monotonic()
        with self._lock:
            self._reclaim(now)
            if caller is None:
                watch = method == "Watch"
                cap = lim.health_reserve if not watch else max(1, lim.health_reserve // 2)
                if self._used["health"] >= cap:
                    raise self._refuse("health", RateLimitedError(f"health: {cap} health calls in flight already"))
                t = _Ticket(None, False, "health")  # type: ignore[arg-type]
                self._used["health"] += 1
                self._tickets.add(t)
                return t
            who = caller.identity
            waits = method in self.waits
            per_identity = who != ANONYMOUS and not (caller.roles & lim.peer_roles)
            if per_identity:
                if self._in_flight[who] >= s.max_concurrent:
                    raise self._refuse("identity", RateLimitedError(
                        f"{method}: identity {who!r} has {s.max_concurrent} calls in flight already (the limit)"
                    ))
                if waits and self._waiting[who] >= s.max_waiting:
                    raise self._refuse("waiting", RateLimitedError(
                        f"{method}: identity {who!r} has {s.max_waiting} waiting calls in flight already "
                        f"(the limit for {', '.join(sorted(self.waits))})"
                    ))
                if s.rate > 0:
                    b = self._buckets.setdefault(who, _Bucket(2 * s.rate, now))
                    b.tokens = min(2 * s.rate, b.tokens + (now - b.at) * s.rate)
                    b.at = now
                    if b.tokens < 1:
                        raise self._refuse("rate", RateLimitedError(f"{method}: identity {who!r} is over {s.rate:g} calls per second"))
            pool = "bulk" if plane == "bulk" else self._pool_for(who, caller)
            if pool is None:
                raise self._refuse("server", RateLimitedError(
                    f"{method}: the server's {self.general} shared call slots are taken (identity {who!r} has "
                    f"{self._in_flight[who]}); retry later"
                ))
            if s.rate > 0 and per_identity:
                self._buckets[who].tokens -= 1
            t = _Ticket(who if per_identity else None, waits and per_identity, pool)  # type: ignore[arg-type]
            self._used.setdefault(pool, 0)
            self._used[pool] += 1
            if per_identity:
                self._in_flight[who] += 1
                if waits:
                    self._waiting[who] += 1
            self._tickets.add(t)
            return t

    def _pool_for(self, who: str, caller: Caller) -> str | None:
        """Caller holds _lock: which share of the pool a call of ``who`` takes, None if none is free."""
        per = self.limits.per_protected
        kept = sum(max(0, per - self._in_flight[p]) for p in self._protected if p != who)
        mine = who in self._protected and self._in_flight[who] < per
        if self._used["general"] + kept < self.general or (mine and self._used["general"] < self.general):
            return "general"
        if (caller.has("admin") or caller.roles & self.limits.peer_roles) and self._used["admin"] < self.limits.admin_reserve:
            return "admin"
        return None

    @contextlib.contextmanager
    def admit(self, method: str, context: Any) -> Iterator[Caller]:
        """Admission inside a handler (a server built without :meth:`interceptor`, e.g. a test's
        own service): authenticate, authorize, hold the call's slots until the block ends."""
        caller = self.caller(context.invocation_metadata(), context.auth_context())
        self.authorize(method, caller)
        t = self.acquire(method, caller, "bulk")  # the thread is taken already: only the identity's limits
        t.started = True
        try:
            yield caller
        finally:
            self.release(t)

    def in_flight(self) -> dict[str, int]:
        """Calls in flight by identity (a copy)."""
        with self._lock:
            return dict(self._in_flight)

    def count(self, method: str, code: grpc.StatusCode) -> None:
        with self._lock:
            self.counts[(method, code.name)] += 1

    # ------------------------------------------------------------------ waits and draining
    def wait_budget(self, context: Any) -> float:
        """Seconds a wait of this call may block: the caller's deadline, at most ``limits.max_wait_s``."""
        left = context.time_remaining() if context is not None else None
        cap = self.limits.max_wait_s
        return cap if left is None else max(0.0, min(cap, left - 0.05))

    def drain(self, reason: str = "SIGTERM") -> None:
        """Start stopping: health NOT_SERVING for every service now, new calls refused UNAVAILABLE
        (ServerStoppingError), ``stopping`` set for the waits to end. Idempotent."""
        self.stop_reason = reason
        self.stopping.set()
        if self.health is not None:
            from grpc_health.v1 import health_pb2

            for name in self.service_names:
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    # ------------------------------------------------------------------ the interceptor
    def interceptor(self) -> grpc.ServerInterceptor:
        """The server interceptor that admits every call of the server (health included)."""
        return _Admission(self)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, name: str, identity: str | None) -> Any:
    """A handler of ``handler``'s shape that only ends the call with ``code`` (a few microseconds)."""
    from tessera.service.errors import ERROR_CLASS_HEADER

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        if identity is not None:
            _note(identity)
        context.set_trailing_metadata(((ERROR_CLASS_HEADER, name),))
        context.abort(code, message)

    def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        deny(request, context)
        yield b""  # pragma: no cover - abort raised

    kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


_CODES: dict[type[Exception], grpc.StatusCode] = {
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    RateLimitedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ServerStoppingError: grpc.StatusCode.UNAVAILABLE,
}


class _Admission(grpc.ServerInterceptor):
    """Admits each call before its handler is scheduled (module doc of tessera.service.guard).
    The admitted handler runs with its :class:`Caller` known (:func:`guarded_handler` reads it)."""

    def __init__(self, access: Access) -> None:
        self.access = access

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        full = details.method or ""
        service, _, method = full.lstrip("/").rpartition("/")
        plane = getattr(details, "plane", "grpc")
        a = self.access
        caller: Caller | None = None
        try:
            if service == HEALTH_SERVICE:
                ticket = a.acquire(method, None, plane)
                return _wrap(handler, a, ticket, None, method, None)
            auth = getattr(details, "auth_context", None)  # the bulk plane knows the certificate already
            caller = a.caller(details.invocation_metadata, auth) if auth is not None else a._early_caller(details.invocation_metadata)
            if caller is None:  # a certificate caller: admitted as its handler starts
                return _wrap(handler, a, None, None, method, plane)
            a.authorize(method, caller)
            ticket = a.acquire(method, caller, plane)
        except tuple(_CODES) as e:  # type: ignore[misc]
            return _refusal(handler, _CODES[type(e)], str(e), type(e).__name__, caller.identity if caller else None)
        return _wrap(handler, a, ticket, caller, method, plane)


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("tessera_caller", default=None)


def _wrap(handler: grpc.RpcMethodHandler, access: Access, ticket: _Ticket | None, caller: Caller | None,
          method: str, plane: str | None) -> Any:
    """``handler`` whose behavior runs with ``caller`` known and gives ``ticket`` back at its end.
    ``ticket`` None with a ``plane``: admit now, from the context's certificate."""

    def enter(context: Any) -> tuple[_Ticket | None, Caller | None]:
        t, c = ticket, caller
        if t is None and plane is not None:  # a certificate caller
            c = access.caller(context.invocation_metadata(), context.auth_context())
            access.authorize(method, c)
            t = access.acquire(method, c, plane)
        elif t is not None:
            with access._lock:
                if t.released:  # reclaimed while its request was arriving: admit it again
                    t = None
            if t is None:
                t = access.acquire(method, c, plane or "grpc")
            t.started = True
        if c is not None:
            _note(c.identity)
        return t, c

    def refuse(context: Any, e: Exception) -> None:
        from tessera.service.errors import ERROR_CLASS_HEADER

        context.set_trailing_metadata(((ERROR_CLASS_HEADER, type(e).__name__),))
        context.abort(_CODES[type(e)], str(e))

    # (built per call: no functools.wraps, ~3 us a call for names nothing reads)
    def unary(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def run(request: Any, context: Any) -> Any:
            try:
                t, c = enter(context)
            except tuple(_CODES) as e:  # type: ignore[misc]
                refuse(context, e)
                raise
            tok = _CALLER.set(c)
            try:
                return fn(request, context)
            finally:
                _CALLER.reset(tok)
                if t is not None:
                    access.release(t)
        return run

    def streaming(fn: Callable[[Any, Any], Iterator[Any]]) -> Callable[[Any, Any], Iterator[Any]]:
        def run(request: Any, context: Any) -> Iterator[Any]:
            try:
                t, c = enter(context)
            except tuple(_CODES) as e:  # type: ignore[misc]
                refuse(context, e)
                raise
            tok = _CALLER.set(c)
            try:
                yield from fn(request, context)
            finally:
                try:
                    _CALLER.reset(tok)
                except ValueError:  # a generator closed from another context: the value dies with it
                    pass
                if t is not None:
                    access.release(t)
        return run

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)
    return handler


def guarded_handler(
    service: str, methods: Mapping[str, Method], access: Access, errors: ErrorTable,
    before: Callable[[str, Caller], None] | None = None, on_error: Callable[[str, grpc.StatusCode], None] | None = None,
) -> grpc.GenericRpcHandler:
    """The generic handler of ``service``: each method runs ``fn(request, context, caller)`` for
    the caller its server's :class:`Access` admitted (serve it with ``build_server(access=...)``
    or ``tessera.bulk.serve_bulk`` given ``access.interceptor()``), inside one error path: an
    exception becomes ``errors``' status code and message (unknown ones INTERNAL, logged); a
    stream the client cancelled is not an error. ``before(method, caller)`` runs first (e.g. a
    check that may raise); ``on_error(method, code)`` counts failures."""

    def fail(name: str, context: Any, exc: BaseException) -> None:
        code = errors.code_of(exc)
        if on_error is not None:
            on_error(name, code)
        access.count(name, code)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", name)
            msg = f"{name}: internal error: {type(exc).__name__}: {exc}"
        else:
            log.info("%s refused (%s): %s", name, code.name, exc)
            msg = str(exc)
        errors.abort(context, exc, msg)

    def who(context: Any) -> Caller:
        c = _CALLER.get()
        if c is None:
            if access.security.open:  # called without the interceptor (an in-process bench): open means anyone
                return Caller(ANONYMOUS, access.all_roles)
            # served without the admission interceptor (a programming error): refuse, never run open
            raise UnauthenticatedError("the call was not admitted (serve this handler through its Access)")
        return c

    def wrap(name: str, m: Method) -> Any:
        fn = m.fn
        if m.response_stream:
            @functools.wraps(fn)
            def gen(request: Any, context: Any) -> Iterator[Any]:
                try:
                    caller = who(context)
                    if before is not None:
                        before(name, caller)
                    yield from fn(request, context, caller)
                except grpc.RpcError:
                    # the request stream failed inside gRPC (cancelled, too large, deadline): the call has its status
                    if on_error is not None:
                        on_error(name, grpc.StatusCode.CANCELLED)
                except Exception as e:  # noqa: BLE001 - translated to a status
                    if not context.is_active():
                        if on_error is not None:
                            on_error(name, grpc.StatusCode.CANCELLED)
                        log.info("%s: cancelled by the client (%s)", name, type(e).__name__)
                        return
                    fail(name, context, e)
            return gen

        @functools.wraps(fn)
        def unary(request: Any, context: Any) -> Any:
            try:
                caller = who(context)
                if before is not None:
                    before(name, caller)
                return fn(request, context, caller)
            except Exception as e:  # noqa: BLE001
                fail(name, context, e)
                raise  # unreachable: abort raises

        return unary

    table = {}
    for name, m in methods.items():
        kind = (
            grpc.stream_stream_rpc_method_handler if m.request_stream and m.response_stream
            else grpc.stream_unary_rpc_method_handler if m.request_stream
            else grpc.unary_stream_rpc_method_handler if m.response_stream
            else grpc.unary_unary_rpc_method_handler
        )
        table[name] = kind(wrap(name, m))
    return grpc.method_handlers_generic_handler(service, table)
