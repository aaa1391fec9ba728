"""Frozen configs of the federated server and of a client node, checked on creation.

The ``tessera fed`` CLI only fills these in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from federated.compress import parse_compression
from federated.errors import ConfigError
from federated.privacy import DPConfig

__all__ = ["ServerConfig", "NodeConfig", "SecAggSettings", "ROLES", "DEFAULT_ROLES"]

# the roles a federated identity may have: ``client`` joins rounds (Connect, Fetch, Submit);
# ``reader`` and ``admin`` may scrape the server's /metrics and nothing else (neither joins a round)
ROLES = ("client", "reader", "admin")
DEFAULT_ROLES = ("client",)  # an identity whose token file line lists no roles


@dataclass(frozen=True)
class SecAggSettings:
    """Secure aggregation (Bonawitz et al. 2017; ``federated.secure_round``).

    ``threshold``: the Shamir threshold as a fraction of the sampled clients (at
    least 2; the sum is recovered while that many survive every stage; keep it above
    1/2). ``clip_range``: every summed coordinate is clipped to +-this so the 32-bit
    fixed-point ring never wraps (the fractional bits are chosen from it and the
    number of clients). ``max_examples``: S, the example count at which a client's
    weight saturates (weights are min(n, S) / S, so entries stay in range).
    ``stage_timeout``: seconds each of the three key/mask/unmask stages waits (0: the
    round timeout).
    """

    enabled: bool = False
    threshold: float = 0.6
    clip_range: float = 8.0
    max_examples: float = 1000.0
    stage_timeout: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"secagg threshold must be a fraction in (0, 1], got {self.threshold}")
        if not self.clip_range > 0:
            raise ConfigError(f"secagg clip range must be > 0, got {self.clip_range}")
        if not self.max_examples >= 1:
            raise ConfigError(f"secagg max_examples must be >= 1, got {self.max_examples}")
        if self.stage_timeout < 0:
            raise ConfigError("secagg stage timeout must be >= 0")


@dataclass(frozen=True)
class ServerConfig:
    """What a federated server does.

    Rounds: sample ``max(min_clients, ceil(fraction * connected))`` of the
    connected participants (at least ``min_available`` must be connected; a participant
    is an authenticated identity with all its client ids, or without authentication one
    client id: ``federated.sampling``; a drawn identity trains one of its ids), send the
    global weights, and collect until every sampled client answered or
    ``round_timeout`` seconds passed. Straggler rule, once at least half of the sampled
    clients answered: when the slowest answer took ``t`` seconds, a client that has not
    answered ``(1 + straggler_factor) * max(t, straggler_min_s)`` seconds after its task
    went out is a straggler; with ``min_clients`` answers the round closes without the stragglers, short
    of them other participants are asked in their place (participants that keep missing
    rounds are drawn less: ``federated.sampling``).
    Aggregate if at least ``min_clients`` answered, else retry the round (up to
    ``max_retries`` times in a row, waiting
    ``retry_backoff`` seconds before the first retry, doubling up to
    ``retry_backoff_max``); a round that still fails raises
    :class:`~federated.orchestrator.RoundFailedError` from :meth:`FedServer.run`
    (clients are told the run failed).
    ``eval_fraction`` of the connected clients evaluate the new weights every
    ``eval_every`` rounds (0: never). ``checkpoint``: a file written after every
    round and read at start (resume).

    Randomness: without DP, client sampling is seeded by ``seed`` (reproducible and
    public: nothing private rests on it). With ``dp``, the client sampling, the
    central noise and the noise on the adaptive clip count come from the OS CSPRNG
    (``federated.privacy.secure_rng``, reseeded for every draw), so a client holding
    the global weights cannot predict and subtract the noise.
    ``insecure_reproducible_seed`` seeds every server-side draw instead, for
    reproducibility runs that claim no privacy; it is refused together with ``dp``.

    Security: ``tls_cert``/``tls_key`` serve TLS (PEM files or bytes); ``tls_ca`` also
    requires client certificates signed by that CA (mutual TLS; without ``tokens`` a
    client is then named by its certificate's common name). ``tokens``: identity ->
    bearer token. ``roles``: identity -> its roles (:data:`ROLES`); an identity not listed is a
    ``client``, one listed has exactly its roles (``{"metrics": ["reader"]}``: may read
    /metrics, may not join a round, so it is never connected, sampled or counted).
    ``certificates``: identities named by their client certificate's common name (mutual TLS
    with tokens; a token file's ``-`` token). The service runtime's rules (``tessera.service.ServerSecurity.check``,
    applied by ``FedServer``): tokens over plaintext, and an open server (no tokens, no
    mutual TLS) on a non-loopback address, are refused unless ``insecure``.
    """

    host: str = "127.0.0.1"
    port: int = 0
    rounds: int = 10
    fraction: float = 1.0
    min_clients: int = 2
    min_available: int = 0  # 0: min_clients
    round_timeout: float = 60.0
    straggler_factor: float = 1.0  # a client (1 + this) x slower than the slowest answer is a straggler
    straggler_min_s: float = 0.1  # ... but never before (1 + straggler_factor) x this: ms-scale jitter drops nobody
    eval_fraction: float = 1.0
    eval_every: int = 1
    eval_timeout: float = 0.0  # 0: round_timeout
    wait_timeout: float | None = None  # how long to wait for min_available clients (None: forever)
    max_retries: int = 20
    retry_backoff: float = 1.0  # seconds before the first retry of a failed round; doubles per retry
    retry_backoff_max: float = 30.0
    seed: int = 0  # client sampling without DP (public; never used for anything private)
    insecure_reproducible_seed: int | None = None  # seeded server draws; refused with dp
    checkpoint: str | None = None
    compress: str = ""
    client_config: Mapping[str, float | int | str | bool] = field(default_factory=dict)
    dp: DPConfig | None = None  # client-level DP-FedAvg (None: off)
    secagg: SecAggSettings = field(default_factory=SecAggSettings)
    tls_cert: str | bytes | None = None
    tls_key: str | bytes | None = None
    tls_ca: str | bytes | None = None  # require client certificates signed by this CA (mutual TLS)
    tokens: Mapping[str, str] | None = None  # identity -> token; None: no authentication
    roles: Mapping[str, Sequence[str]] = field(default_factory=dict)  # identity -> roles (not listed: client)
    certificates: frozenset[str] = frozenset()  # certificate identities (mutual TLS; token file token '-')
    insecure: bool = False  # allow tokens over plaintext / an open non-loopback server (experiments only)
    max_nodes: int = 256  # concurrent Connect streams (one thread each)
    max_clients: int = 1_000_000
    # per authenticated identity (with ``tokens``), so that one cannot crowd out the others:
    max_clients_per_identity: int = 10_000  # client ids held at once
    max_calls_per_identity: int = 64  # calls open at once (Connect, Fetch, Submit, SubmitOne)
    max_num_examples: int = 100_000_000  # a client reporting more is refused (INVALID_ARGUMENT)
    chunk_bytes: int = 1 << 20
    inline_bytes: int = 64 << 10  # blobs up to this size travel inside the task message (no Fetch)
    max_message_bytes: int = 64 << 20
    shutdown_clients: bool = True  # tell clients to exit when the rounds are done
    async_concurrency: int = 0  # FedBuff: clients training at once (0: from fraction)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"fraction must be in (0, 1], got {self.fraction}")
        if not 0 <= self.eval_fraction <= 1:
            raise ConfigError(f"eval fraction must be in [0, 1], got {self.eval_fraction}")
        if self.min_clients < 1:
            raise ConfigError(f"min clients must be >= 1, got {self.min_clients}")
        if self.min_available and self.min_available < self.min_clients:
            raise ConfigError(f"min available ({self.min_available}) must be >= min clients ({self.min_clients})")
        if not self.round_timeout > 0:
            raise ConfigError(f"round timeout must be > 0, got {self.round_timeout}")
        if not self.straggler_factor >= 0 or not self.straggler_min_s >= 0:
            raise ConfigError(f"straggler factor and minimum must be >= 0, got {self.straggler_factor}, "
                              f"{self.straggler_min_s}")
        if self.retry_backoff < 0 or self.retry_backoff_max < self.retry_backoff:
            raise ConfigError("need 0 <= retry_backoff <= retry_backoff_max")
        if self.eval_every < 0 or self.max_retries < 0:
            raise ConfigError("eval_every and max_retries must be >= 0")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port {self.port} out of range")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both a certificate and a key")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("mutual TLS (tls_ca) needs the server's own tls_cert and tls_key")
        if self.tokens is not None and not self.tokens:
            raise ConfigError("an empty token list would refuse every client")
        for identity, roles in self.roles.items():
            unknown = sorted(set(roles) - set(ROLES))
            if unknown:
                raise ConfigError(f"identity {identity!r}: unknown role {', '.join(map(repr, unknown))} "
                                  f"(a federated identity's roles: {', '.join(ROLES)})")
        if self.tokens is not None and not any(
            "client" in (self.roles.get(i) or DEFAULT_ROLES) for i in (*self.tokens, *self.certificates)
        ):
            raise ConfigError("no identity of the token list has the client role: no client could join "
                              "(a line without roles is a client)")
        for name in ("max_nodes", "max_clients", "max_clients_per_identity", "max_calls_per_identity",
                     "max_num_examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_bytes < 1024 or self.chunk_bytes + 65536 > self.max_message_bytes:
            raise ConfigError("chunk_bytes must be >= 1 KiB and fit in max_message_bytes with its header")
        parse_compression(self.compress)  # raises ConfigError
        if self.insecure_reproducible_seed is not None and self.dp is not None:
            raise ConfigError(
                "insecure_reproducible_seed makes the server's DP noise and client sampling predictable to anyone "
                "who knows the seed (a client could subtract the noise); it cannot combine with dp, which reports "
                "epsilon. Drop the seed for a private run, or dp for a reproducible one."
            )
        if self.secagg.enabled and self.compress:
            raise ConfigError("secure aggregation sends fixed-point masked updates; it cannot combine with --compress")

    @property
    def needed(self) -> int:
        """Clients that must be connected before a round starts: ``max(min_available, min_clients)``."""
        return max(self.min_available, self.min_clients)


@dataclass(frozen=True)
class NodeConfig:
    """How a client node talks to the server.

    ``address``: ``"HOST:PORT"``. ``token``: this client's bearer token (None: none).
    ``root_cert``: PEM file name or bytes of the CA to trust (TLS; None: plaintext);
    ``tls_cert``/``tls_key``: this client's certificate and key (mutual TLS).
    ``reconnect_timeout``: give up (ServerUnavailableError) after this many seconds
    without a connection; backoff starts at ``backoff_min`` and doubles to
    ``backoff_max``; a warning says the server is unreachable every ``note_every``
    seconds. ``workers``: tasks run at once (threads). ``rpc_timeout``: deadline of each
    Fetch/Submit call. ``chunk_bytes``: size of uploaded chunks; ``max_message_bytes``
    and ``max_blob_bytes``: the largest message and download accepted. ``name``: the
    node's name in the server's logs.
    """

    address: str
    token: str | None = None
    root_cert: str | bytes | None = None  # the CA to trust (TLS); None: plaintext
    server_name: str | None = None
    reconnect_timeout: float = 60.0
    backoff_min: float = 0.1
    backoff_max: float = 5.0
    workers: int = 4
    rpc_timeout: float = 120.0
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 64 << 20
    max_blob_bytes: int = 1 << 40
    name: str = ""
    tls_cert: str | bytes | None = None  # this client's certificate (mutual TLS) ...
    tls_key: str | bytes | None = None  # ... and its private key
    note_every: float = 5.0  # while the server is unreachable, say so this often (seconds)

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError("client needs a server address HOST:PORT")
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        if not self.note_every > 0:
            raise ConfigError("note_every must be > 0 seconds")
        if not (0 < self.backoff_min <= self.backoff_max):
            raise ConfigError("need 0 < backoff_min <= backoff_max")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a client certificate needs its key (tls_cert and tls_key)")
        if self.tls_cert is not None and self.root_cert is None:
            raise ConfigError("a client certificate (mutual TLS) needs TLS: give the CA to trust (root_cert / --tls-ca)")
