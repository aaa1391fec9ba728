"""Secure aggregation (Bonawitz et al., "Practical Secure Aggregation for
Privacy-Preserving Machine Learning", CCS 2017) as pure message-passing state
machines: every message is ``bytes`` (msgpack, never pickle), so a transport can
carry them opaquely. No grpc, no protobuf here.

The server learns only the sum of the inputs of the clients in ``U3`` (those whose
masked input arrived), even when clients drop out, as long as at least
``threshold`` clients answer every round.

Protocol (semi-honest variant, Fig. 4 of the paper without signatures; rounds
are named after the paper):

0. AdvertiseKeys: each client makes two X25519 key pairs, ``c`` (to encrypt shares)
   and ``s`` (to derive pairwise masks), and sends both public keys. The server
   broadcasts the list ``U1``.
1. ShareKeys: each client draws a self-mask seed ``b_u``, splits ``b_u`` and
   ``s_u^SK`` into ``threshold``-of-``|U1|`` Shamir shares over GF(2^521 - 1), and
   sends every other client ``v`` its two shares, encrypted with AES-GCM under
   ``HKDF(X25519(c_u^SK, c_v^PK))`` (the ids are authenticated data). It also
   commits to ``b_u`` with ``SHA-256``, so a wrong reconstruction is detected.
   The server forwards the ciphertexts (``U2`` = who sent them).
2. MaskedInputCollection: each client fixed-point-encodes its vector into
   ``Z_{2^k}`` and adds ``PRG(b_u)`` and, for every other ``v`` in ``U2``,
   ``+-PRG(HKDF(X25519(s_u^SK, s_v^PK)))`` (+ if u's index is lower); the PRG is the
   AES-256-CTR keystream. ``U3`` = who sent a masked input.
3. Unmasking: each client in ``U3`` reveals, for every ``v`` in ``U2``, its share of
   ``b_v`` if ``v`` is in ``U3`` and its share of ``s_v^SK`` otherwise (never both for
   one ``v``). The server reconstructs them, removes the self masks of ``U3`` and
   the pairwise masks between ``U3`` and the dropped ``U2 \\ U3``, and decodes the sum.
   Each reconstruction is checked (the commitment to ``b_u``, the public key of
   ``s_u^SK``); with more than ``threshold`` clients unmasking, the spare shares
   outvote wrong ones (up to ``|U3| - threshold``) and their senders are named
   (``SecAggServer.bad_shares``).

Fixed point: ``x -> round(x * 2^scale_bits) mod 2^ring_bits`` (two's complement), so
the sum of up to ``max_clients`` inputs decodes exactly (as signed) when every entry
satisfies ``|x| < 2^(ring_bits - 1 - scale_bits) / max_clients``
(:attr:`SecAggConfig.value_bound`); an input outside is refused, never wrapped.
The recovered ring sum equals the plain sum of the encodings exactly.

Not covered (documented limits): no signatures / PKI (a malicious server could
impersonate clients; add a per-client credential at the transport), no
consistency-check round (the active-adversary variant). Choose ``threshold >
n/2`` so that no two disjoint groups of clients can each reach the threshold.
Each object runs one aggregation: make new ones per round (fresh keys).
Objects are not thread-safe.

Weighted means: the sum is all the server gets, so a client that wants an
example-weighted mean sends ``n_k * delta_k`` with ``n_k`` appended as the last entry.
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import math
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

__all__ = [
    "SecAggError",
    "SecAggConfig",
    "Round",
    "SecAggClient",
    "SecAggServer",
    "encode_fixed",
    "decode_fixed",
    "secagg_overhead_bytes",
]

PRIME = 2 ** 521 - 1
"""Shamir field: the Mersenne prime 2^521 - 1 (any 32-byte secret is below it)."""
_SHARE_BYTES = 66  # ceil(521 / 8)
_KEY_BYTES = 32
_NONCE_BYTES = 12
_GCM_TAG = 16
_VERSION = b"tessera/secagg/v1"
_MAX_ID_LEN = 256


class SecAggError(ValueError):
    """Protocol violation or failure: wrong round, unknown or duplicate client, fewer
    than ``threshold`` participants (the server refuses to unmask), malformed message,
    a share that fails authentication, an input out of the fixed-point range. The
    message names the client when one is to blame."""


class Round(enum.IntEnum):
    """Where a client or server stands: the round whose input it expects next."""

    ADVERTISE_KEYS = 0
    SHARE_KEYS = 1
    MASKED_INPUT = 2
    UNMASKING = 3
    DONE = 4


@dataclass(frozen=True)
class SecAggConfig:
    """``threshold``: t, the minimum number of clients that must answer every round and
    the number of shares that reconstruct a secret (>= 2; choose > n/2).
    ``ring_bits``: k, 32 or 64 (bytes per entry on the wire: k/8).
    ``scale_bits``: fractional bits of the fixed-point encoding (resolution 2^-scale_bits).
    ``max_clients``: the most inputs that may be summed; sets the value bound."""

    threshold: int
    ring_bits: int = 32
    scale_bits: int = 20
    max_clients: int = 100

    def __post_init__(self) -> None:
        for name in ("threshold", "ring_bits", "scale_bits", "max_clients"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise SecAggError(f"{name} must be an int, got {v!r}")
        if self.threshold < 2:
            raise SecAggError(f"threshold must be >= 2 (1 would let the server unmask anyone), got {self.threshold}")
        if self.ring_bits not in (32, 64):
            raise SecAggError(f"ring_bits must be 32 or 64, got {self.ring_bits}")
        if self.max_clients < self.threshold:
            raise SecAggError(f"max_clients {self.max_clients} is below threshold {self.threshold}")
        headroom = self.ring_bits - 1 - math.ceil(math.log2(self.max_clients))
        if not 0 <= self.scale_bits < headroom:
            raise SecAggError(f"scale_bits must be in [0, {headroom}) for ring_bits={self.ring_bits} and "
                              f"max_clients={self.max_clients}, got {self.scale_bits}")

    @property
    def value_bound(self) -> float:
        """Inputs must satisfy ``|x| < value_bound`` so the sum of ``max_clients`` of them
        decodes exactly: ``2^(ring_bits - 1 - scale_bits) / max_clients``."""
        return 2.0 ** (self.ring_bits - 1 - self.scale_bits) / self.max_clients

    @property
    def ring_dtype(self) -> np.dtype:
        """Unsigned little-endian dtype of the ring Z_(2^ring_bits) (uint32 or uint64)."""
        return np.dtype("<u4") if self.ring_bits == 32 else np.dtype("<u8")

    @property
    def signed_dtype(self) -> np.dtype:
        """Signed dtype of the same width (decoding the unmasked sum)."""
        return np.dtype("<i4") if self.ring_bits == 32 else np.dtype("<i8")


def encode_fixed(x: np.ndarray, config: SecAggConfig) -> np.ndarray:
    """Fixed-point encode a float vector into Z_{2^k}: ``round(x * 2^scale_bits) mod 2^k``
    as a 1-D unsigned array (``config.ring_dtype``). Raises SecAggError for non-finite
    entries or ``|x| >= config.value_bound``."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if not np.isfinite(a).all():
        raise SecAggError("input holds non-finite values (NaN or Inf)")
    if a.size and float(np.abs(a).max()) >= config.value_bound:
        i = int(np.abs(a).argmax())
        raise SecAggError(f"input entry {i} = {float(a[i])!r} is outside the fixed-point range |x| < "
                          f"{config.value_bound:g} (ring_bits={config.ring_bits}, scale_bits={config.scale_bits}, "
                          f"max_clients={config.max_clients})")
    q = np.rint(a * (2.0 ** config.scale_bits)).astype(np.int64)
    return q.astype(config.signed_dtype).view(config.ring_dtype)


def decode_fixed(r: np.ndarray, config: SecAggConfig) -> np.ndarray:
    """Inverse of :func:`encode_fixed` for a (sum of) encodings: signed, float64."""
    a = np.ascontiguousarray(r, dtype=config.ring_dtype)
    return a.view(config.signed_dtype).astype(np.float64) / (2.0 ** config.scale_bits)


# ---------------------------------------------------------------------------
# primitives from `cryptography`, and Shamir's scheme over GF(PRIME)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=_KEY_BYTES, salt=None, info=_VERSION + b"/" + info).derive(secret)


def _prg(seed: bytes, n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` uniform ring elements: the AES-256-CTR keystream under ``seed`` (fresh per session)."""
    enc = Cipher(algorithms.AES(seed), modes.CTR(b"\x00" * 16)).encryptor()
    buf = enc.update(bytes(n * dtype.itemsize)) + enc.finalize()
    return np.frombuffer(buf, dtype=dtype)


def _pub_bytes(key: X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _priv_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _agree(sk: X25519PrivateKey, pk: bytes, who: str) -> bytes:
    try:
        return sk.exchange(X25519PublicKey.from_public_bytes(pk))
    except ValueError as e:  # low-order point or wrong length
        raise SecAggError(f"{who}: bad public key ({e})") from None


def _pair_info(kind: bytes, a: str, b: str) -> bytes:
    lo, hi = sorted((a, b))
    return kind + b"/" + msgpack.packb([lo, hi], use_bin_type=True)


def shamir_split(secret: int, threshold: int, xs: Sequence[int]) -> dict[int, int]:
    """Shares ``f(x)`` for each ``x`` of a random degree ``threshold - 1`` polynomial with
    ``f(0) = secret`` over GF(PRIME). ``xs`` are distinct non-zero points."""
    if not 0 <= secret < PRIME:
        raise SecAggError("Shamir secret out of the field")
    coeffs = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        out[x] = acc
    return out


def shamir_combine(points: Sequence[tuple[int, int]]) -> int:
    """``f(0)`` from points ``(x, f(x))`` by Lagrange interpolation over GF(PRIME)."""
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs):
        raise SecAggError("Shamir: duplicate share points")
    total = 0
    for j, (xj, yj) in enumerate(points):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * (-xm) % PRIME
                den = den * (xj - xm) % PRIME
        total = (total + yj * num * pow(den, -1, PRIME)) % PRIME
    return total


class _ShareDecoder:
    """Recovers Shamir secrets from the unmasking round's shares when some are wrong.

    Each secret has a check (the commitment to ``b_u``; the public key of ``s_u^SK``),
    so a reconstruction is either right or detected. The first ``t`` shares are tried
    first (senders already caught sending a wrong share go last); when the check
    fails, subsets leaving out 1, 2, ... shares follow, so up to ``n - t`` wrong shares
    are survived (at most ``max_tries`` subsets per secret). The shares off the
    recovered polynomial are wrong; their senders are named in :attr:`bad` when that is
    the explanation with strictly the fewest wrong shares (``2a > n + t - 2`` for ``a``
    shares on it: a polynomial that passes the check but is not the dealt one agrees
    with at most ``t - 2`` right shares), else the secret is listed in :attr:`unresolved`.
    Not thread-safe."""

    def __init__(self, xs: Mapping[str, int], threshold: int, max_tries: int = 4096) -> None:
        self.xs = dict(xs)  # sender -> its share point
        self.t = threshold
        self.max_tries = max_tries
        self.bad: dict[str, list[str]] = {}  # sender -> the secrets it sent a wrong share of
        self.unresolved: list[str] = []
        self._inv_den: dict[tuple[int, ...], list[int]] = {}
        self._weights_at: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _weights(self, xs: tuple[int, ...], x: int) -> list[int]:
        """Lagrange basis of the points ``xs`` evaluated at ``x`` (cached: the points are
        the same for every secret of a round)."""
        key = (xs, x)
        w = self._weights_at.get(key)
        if w is None:
            inv = self._inv_den.get(xs)
            if inv is None:
                inv = []
                for j, xj in enumerate(xs):
                    den = 1
                    for k, xk in enumerate(xs):
                        if k != j:
                            den = den * (xj - xk) % PRIME
                    inv.append(pow(den, -1, PRIME))
                self._inv_den[xs] = inv
            diffs = [(x - xk) % PRIME for xk in xs]
            pre = [1]
            for d in diffs:
                pre.append(pre[-1] * d % PRIME)
            suf = [1] * (len(xs) + 1)
            for j in range(len(xs) - 1, -1, -1):
                suf[j] = suf[j + 1] * diffs[j] % PRIME
            w = [pre[j] * suf[j + 1] % PRIME * inv[j] % PRIME for j in range(len(xs))]
            self._weights_at[key] = w
        return w

    def _eval(self, xs: tuple[int, ...], ys: Sequence[int], x: int) -> int:
        return sum(l * y for l, y in zip(self._weights(xs, x), ys)) % PRIME

    def recover(self, what: str, shares: Mapping[str, int], check: Callable[[int], bool]) -> int:
        """The secret ``what`` from ``shares`` (sender -> share), the first candidate that
        passes ``check``. Raises SecAggError when none does."""
        order = sorted(shares, key=lambda w: (w in self.bad, w))
        n, t = len(order), self.t
        tries = 0
        for d in range(n - t + 1):
            # leave out d of the first t + d shares, always keeping the last of them (the
            # subsets without it were tried with fewer left out)
            for drop in itertools.combinations(range(t + d - 1), d):
                tries += 1
                if tries > self.max_tries:
                    raise SecAggError(f"reconstruction of {what} failed: no {t} of the {n} shares passed its check "
                                      f"in {self.max_tries} tries (too many shares are wrong)")
                cand = [order[i] for i in range(t + d) if i not in drop]
                xs = tuple(self.xs[w] for w in cand)
                ys = [shares[w] for w in cand]
                secret = self._eval(xs, ys, 0)
                if not check(secret):
                    continue
                off = [w for w in order if w not in cand and self._eval(xs, ys, self.xs[w]) != shares[w]]
                if off:
                    if 2 * (n - len(off)) > n + t - 2:
                        for w in off:
                            self.bad.setdefault(w, []).append(what)
                    else:
                        self.unresolved.append(what)
                return secret
        spare = "" if n > t else f"; with only {n} shares for threshold {t} there is no spare share to find it"
        raise SecAggError(f"reconstruction of {what} failed: no {t} of the {n} shares pass its check "
                          f"(a share is wrong{spare})")


# ---------------------------------------------------------------------------
# messages


def _pack(kind: str, body: Mapping[str, Any]) -> bytes:
    return msgpack.packb({"kind": kind, **body}, use_bin_type=True)


def _unpack(data: object, kind: str, who: str) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SecAggError(f"{who}: message must be bytes, got {type(data).__name__}")
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated classes for garbage
        raise SecAggError(f"{who}: malformed {kind} message ({type(e).__name__})") from None
    if not isinstance(msg, dict) or msg.get("kind") != kind:
        got = msg.get("kind") if isinstance(msg, dict) else type(msg).__name__
        raise SecAggError(f"{who}: expected a {kind!r} message, got {got!r}")
    return msg


def _field(msg: Mapping[str, Any], name: str, typ: type | tuple[type, ...], who: str) -> Any:
    if name not in msg or not isinstance(msg[name], typ):
        raise SecAggError(f"{who}: message field {name!r} missing or of the wrong type")
    return msg[name]


def _check_id(cid: object, who: str) -> str:
    if not isinstance(cid, str) or not cid or len(cid) > _MAX_ID_LEN:
        raise SecAggError(f"{who}: client id must be a non-empty string of at most {_MAX_ID_LEN} characters")
    return cid


def _key_list(msg: Mapping[str, Any], who: str) -> dict[str, tuple[bytes, bytes]]:
    rows = _field(msg, "clients", list, who)
    out: dict[str, tuple[bytes, bytes]] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[1], bytes) and isinstance(row[2], bytes)
                and len(row[1]) == _KEY_BYTES and len(row[2]) == _KEY_BYTES):
            raise SecAggError(f"{who}: malformed key list entry")
        cid = _check_id(row[0], who)
        if cid in out:
            raise SecAggError(f"{who}: client {cid!r} appears twice in the key list")
        out[cid] = (row[1], row[2])
    return out


# ---------------------------------------------------------------------------
# client


class SecAggClient:
    """One client's side of one secure aggregation. Call, in order:
    :meth:`advertise_keys`, :meth:`share_keys`, :meth:`masked_input`, :meth:`unmasking`;
    each takes the server's previous message and returns the bytes to send."""

    def __init__(self, client_id: str, config: SecAggConfig) -> None:
        self.client_id = _check_id(client_id, "client")
        self.config = config
        self.round = Round.ADVERTISE_KEYS
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk = X25519PrivateKey.generate()
        self._b = secrets.token_bytes(_KEY_BYTES)
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._index: dict[str, int] = {}
        self._own_shares: tuple[int, int] = (0, 0)
        self._received: dict[str, tuple[int, int]] = {}  # sender -> (s_sk share, b share) held for it
        self._u2: list[str] = []

    def _expect(self, r: Round) -> None:
        if self.round != r:
            raise SecAggError(f"client {self.client_id!r}: {r.name} called in round {self.round.name}")

    def advertise_keys(self) -> bytes:
        """Round 0: the two public keys."""
        self._expect(Round.ADVERTISE_KEYS)
        self.round = Round.SHARE_KEYS
        return _pack("advertise", {"id": self.client_id, "c_pk": _pub_bytes(self._c_sk.public_key()),
                                   "s_pk": _pub_bytes(self._s_sk.public_key())})

    def share_keys(self, key_broadcast: bytes) -> bytes:
        """Round 1: given the server's key list (U1), Shamir-share ``s^SK`` and ``b`` and
        encrypt one share pair to each other client."""
        self._expect(Round.SHARE_KEYS)
        who = f"client {self.client_id!r}"
        keys = _key_list(_unpack(key_broadcast, "keys", who), who)
        mine = (_pub_bytes(self._c_sk.public_key()), _pub_bytes(self._s_sk.public_key()))
        if keys.get(self.client_id) != mine:
            raise SecAggError(f"{who}: the key list does not hold this client's own keys")
        if len(keys) < self.config.threshold:
            raise SecAggError(f"{who}: only {len(keys)} clients advertised keys, threshold is "
                              f"{self.config.threshold}")
        if len(keys) > self.config.max_clients:
            raise SecAggError(f"{who}: {len(keys)} clients exceed max_clients={self.config.max_clients}")
        pks = [k for pair in keys.values() for k in pair]
        if len(set(pks)) != len(pks):
            raise SecAggError(f"{who}: the key list repeats a public key")
        self._keys = keys
        self._index = {cid: i + 1 for i, cid in enumerate(sorted(keys))}
        xs = list(self._index.values())
        s_shares = shamir_split(int.from_bytes(_priv_bytes(self._s_sk), "big"), self.config.threshold, xs)
        b_shares = shamir_split(int.from_bytes(self._b, "big"), self.config.threshold, xs)
        me = self._index[self.client_id]
        self._own_shares = (s_shares[me], b_shares[me])
        out: dict[str, bytes] = {}
        for v, (c_pk, _) in keys.items():
            if v == self.client_id:
                continue
            key = _hkdf(_agree(self._c_sk, c_pk, f"{who} (key of {v!r})"), _pair_info(b"share-key", self.client_id, v))
            x = self._index[v]
            plain = msgpack.packb([self.client_id, v, s_shares[x].to_bytes(_SHARE_BYTES, "big"),
                                   b_shares[x].to_bytes(_SHARE_BYTES, "big")], use_bin_type=True)
            nonce = secrets.token_bytes(_NONCE_BYTES)
            out[v] = nonce + AESGCM(key).encrypt(nonce, plain, msgpack.packb([self.client_id, v]))
        self.round = Round.MASKED_INPUT
        commit = hashlib.sha256(_VERSION + self.client_id.encode() + self._b).digest()
        return _pack("shares", {"id": self.client_id, "shares": out, "b_commit": commit})

    def _decrypt_share(self, sender: str, blob: object) -> tuple[int, int]:
        who = f"client {self.client_id!r}"
        if not isinstance(blob, bytes) or len(blob) < _NONCE_BYTES + _GCM_TAG:
            raise SecAggError(f"{who}: malformed share ciphertext from client {sender!r}")
        key = _hkdf(_agree(self._c_sk, self._keys[sender][0], f"{who} (key of {sender!r})"),
                    _pair_info(b"share-key", sender, self.client_id))
        try:
            plain = AESGCM(key).decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:],
                                        msgpack.packb([sender, self.client_id]))
        except InvalidTag:
            raise SecAggError(f"{who}: the share from client {sender!r} fails authentication "
                              "(tampered or wrong key)") from None
        try:
            u, v, s_b, b_b = msgpack.unpackb(plain, raw=False)
        except Exception:
            raise SecAggError(f"{who}: malformed share plaintext from client {sender!r}") from None
        if u != sender or v != self.client_id or not isinstance(s_b, bytes) or not isinstance(b_b, bytes):
            raise SecAggError(f"{who}: share from client {sender!r} names the wrong clients")
        s_i, b_i = int.from_bytes(s_b, "big"), int.from_bytes(b_b, "big")
        if s_i >= PRIME or b_i >= PRIME:
            raise SecAggError(f"{who}: share from client {sender!r} is out of the field")
        return s_i, b_i

    def masked_input(self, shares_msg: bytes, x: np.ndarray) -> bytes:
        """Round 2: check and decrypt the shares addressed to this client (their senders
        form U2), then send ``y = encode(x) + PRG(b) + sum_v +-PRG(s_uv) mod 2^k``.
        ``x``: a float vector (flattened), within ``config.value_bound``."""
        self._expect(Round.MASKED_INPUT)
        who = f"client {self.client_id!r}"
        msg = _unpack(shares_msg, "shares_for", who)
        blobs = _field(msg, "shares", dict, who)
        if msg.get("to") != self.client_id:
            raise SecAggError(f"{who}: share bundle is addressed to {msg.get('to')!r}")
        for sender in blobs:
            if sender not in self._keys or sender == self.client_id:
                raise SecAggError(f"{who}: share bundle holds a share from unknown client {sender!r}")
        u2 = sorted(set(blobs) | {self.client_id})
        if len(u2) < self.config.threshold:
            raise SecAggError(f"{who}: only {len(u2)} clients shared keys, threshold is {self.config.threshold}")
        received = {sender: self._decrypt_share(sender, blob) for sender, blob in blobs.items()}
        enc = encode_fixed(x, self.config)
        y = enc + _prg(self._b, enc.size, self.config.ring_dtype)
        me = self._index[self.client_id]
        for v in u2:
            if v == self.client_id:
                continue
            seed = _hkdf(_agree(self._s_sk, self._keys[v][1], f"{who} (key of {v!r})"),
                         _pair_info(b"mask", self.client_id, v))
            p = _prg(seed, enc.size, self.config.ring_dtype)
            y = y + p if me < self._index[v] else y - p
        self._received, self._u2 = received, u2
        self.round = Round.UNMASKING
        return _pack("masked", {"id": self.client_id, "ring_bits": self.config.ring_bits, "n": int(enc.size),
                                "y": y.astype(self.config.ring_dtype).tobytes()})

    def unmasking(self, survivors_msg: bytes) -> bytes:
        """Round 3: given U3 (who sent masked inputs), reveal the ``b`` share of each
        survivor and the ``s^SK`` share of each client of U2 that dropped; never both."""
        self._expect(Round.UNMASKING)
        who = f"client {self.client_id!r}"
        msg = _unpack(survivors_msg, "survivors", who)
        u3 = _field(msg, "clients", list, who)
        if len(set(u3)) != len(u3) or not all(isinstance(c, str) for c in u3):
            raise SecAggError(f"{who}: malformed survivor list")
        extra = set(u3) - set(self._u2)
        if extra:
            raise SecAggError(f"{who}: survivor list names clients outside U2: {sorted(extra)}")
        if self.client_id not in u3:
            raise SecAggError(f"{who}: this client is not among the survivors; refusing to reveal shares")
        if len(u3) < self.config.threshold:
            raise SecAggError(f"{who}: only {len(u3)} survivors, threshold is {self.config.threshold}; "
                              "refusing to reveal shares")
        alive = set(u3)
        b_out: dict[str, bytes] = {}
        s_out: dict[str, bytes] = {}
        for v in self._u2:
            s_sh, b_sh = self._own_shares if v == self.client_id else self._received[v]
            if v in alive:
                b_out[v] = b_sh.to_bytes(_SHARE_BYTES, "big")
            else:
                s_out[v] = s_sh.to_bytes(_SHARE_BYTES, "big")
        self.round = Round.DONE
        # this client's secrets are no longer needed
        self._received = {}
        return _pack("unmask", {"id": self.client_id, "b_shares": b_out, "s_shares": s_out})


# ---------------------------------------------------------------------------
# server


class SecAggServer:
    """The server's side of one secure aggregation over ``client_ids`` (the sampled
    clients) of vectors of ``vector_len`` entries.

    Each round: call ``receive_*`` once per arriving client message (a bad message
    raises SecAggError naming the client and changes nothing; that client just
    does not count), then the closing method, which raises SecAggError when fewer
    than ``threshold`` clients took part (and refuses to unmask)."""

    def __init__(self, config: SecAggConfig, client_ids: Sequence[str], vector_len: int) -> None:
        ids = [_check_id(c, "server") for c in client_ids]
        if len(set(ids)) != len(ids):
            raise SecAggError("client ids must be distinct")
        if len(ids) < config.threshold:
            raise SecAggError(f"{len(ids)} clients cannot reach threshold {config.threshold}")
        if len(ids) > config.max_clients:
            raise SecAggError(f"{len(ids)} clients exceed max_clients={config.max_clients}")
        if isinstance(vector_len, bool) or not isinstance(vector_len, int) or vector_len < 1:
            raise SecAggError(f"vector_len must be an int >= 1, got {vector_len!r}")
        self.config = config
        self.client_ids = ids
        self.vector_len = vector_len
        self.round = Round.ADVERTISE_KEYS
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._index: dict[str, int] = {}
        self._ciphertexts: dict[str, dict[str, bytes]] = {}
        self._commits: dict[str, bytes] = {}
        self._u2: list[str] = []
        self._masked: dict[str, np.ndarray] = {}
        self._u3: list[str] = []
        self._unmask: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        self._result: np.ndarray | None = None
        self.bad_shares: dict[str, list[str]] = {}  # after finish: sender -> secrets it sent a wrong share of
        self.unresolved_shares: list[str] = []  # secrets with wrong shares whose senders could not be told

    # -- helpers
    def _expect(self, r: Round, what: str) -> None:
        if self.round != r:
            raise SecAggError(f"server: {what} in round {self.round.name} (expected round {r.name})")

    def _sender(self, client_id: str, msg: Mapping[str, Any], allowed: Sequence[str] | set[str],
                seen: Mapping[str, Any]) -> str:
        if client_id not in self.client_ids:
            raise SecAggError(f"unknown client {client_id!r}")
        if msg.get("id") != client_id:
            raise SecAggError(f"client {client_id!r}: message claims to come from {msg.get('id')!r}")
        if client_id not in allowed:
            raise SecAggError(f"client {client_id!r} dropped out earlier and cannot rejoin this aggregation")
        if client_id in seen:
            raise SecAggError(f"client {client_id!r} already sent its message for round {self.round.name}")
        return client_id

    def _need(self, n: int, what: str) -> None:
        if n < self.config.threshold:
            raise SecAggError(f"only {n} clients {what}, threshold is {self.config.threshold}; "
                              "refusing to continue (nothing will be unmasked)")

    # -- round 0
    def receive_advertise(self, client_id: str, data: bytes) -> None:
        """Round 0: a sampled client's two public keys (and signature data); SecAggError for a
        message out of order, from an unknown or repeated sender, or malformed."""
        self._expect(Round.ADVERTISE_KEYS, "AdvertiseKeys message")
        msg = _unpack(data, "advertise", f"client {client_id!r}")
        self._sender(client_id, msg, self.client_ids, self._keys)
        c_pk = _field(msg, "c_pk", bytes, f"client {client_id!r}")
        s_pk = _field(msg, "s_pk", bytes, f"client {client_id!r}")
        if len(c_pk) != _KEY_BYTES or len(s_pk) != _KEY_BYTES or c_pk == s_pk:
            raise SecAggError(f"client {client_id!r}: public keys must be two distinct 32-byte X25519 keys")
        if any(c_pk in pair or s_pk in pair for pair in self._keys.values()):
            raise SecAggError(f"client {client_id!r}: public key already used by another client")
        self._keys[client_id] = (c_pk, s_pk)

    def broadcast_keys(self) -> bytes:
        """Close round 0: the key list U1, the same bytes for every client of U1."""
        self._expect(Round.ADVERTISE_KEYS, "broadcast_keys")
        self._need(len(self._keys), "advertised keys")
        self._index = {cid: i + 1 for i, cid in enumerate(sorted(self._keys))}
        self.round = Round.SHARE_KEYS
        return _pack("keys", {"clients": [[cid, *self._keys[cid]] for cid in sorted(self._keys)]})

    @property
    def u1(self) -> list[str]:
        """U1: the clients whose keys arrived in round 0, sorted."""
        return sorted(self._keys)

    # -- round 1
    def receive_shares(self, client_id: str, data: bytes) -> None:
        """Round 1: a client's encrypted Shamir shares, one per other U1 member; SecAggError as above."""
        self._expect(Round.SHARE_KEYS, "ShareKeys message")
        who = f"client {client_id!r}"
        msg = _unpack(data, "shares", who)
        self._sender(client_id, msg, set(self._keys), self._ciphertexts)
        blobs = _field(msg, "shares", dict, who)
        commit = _field(msg, "b_commit", bytes, who)
        want = set(self._keys) - {client_id}
        if set(blobs) != want:
            raise SecAggError(f"{who}: shares must be addressed to exactly the other {len(want)} clients of U1")
        for v, blob in blobs.items():
            if not isinstance(blob, bytes) or not _NONCE_BYTES + _GCM_TAG <= len(blob) <= 1024:
                raise SecAggError(f"{who}: malformed share ciphertext for client {v!r}")
        if len(commit) != 32:
            raise SecAggError(f"{who}: b_commit must be 32 bytes")
        self._ciphertexts[client_id] = dict(blobs)
        self._commits[client_id] = commit

    def forward_shares(self) -> dict[str, bytes]:
        """Close round 1: for each client v of U2, the ciphertexts addressed to it."""
        self._expect(Round.SHARE_KEYS, "forward_shares")
        self._need(len(self._ciphertexts), "shared keys")
        self._u2 = sorted(self._ciphertexts)
        out = {}
        for v in self._u2:
            out[v] = _pack("shares_for", {"to": v, "shares": {u: self._ciphertexts[u][v]
                                                             for u in self._u2 if u != v}})
        self.round = Round.MASKED_INPUT
        return out

    # -- round 2
    def receive_masked_input(self, client_id: str, data: bytes) -> None:
        """Round 2: a client's masked input vector (ring elements); SecAggError for a wrong length or sender."""
        self._expect(Round.MASKED_INPUT, "masked input")
        who = f"client {client_id!r}"
        msg = _unpack(data, "masked", who)
        self._sender(client_id, msg, set(self._u2), self._masked)
        if msg.get("ring_bits") != self.config.ring_bits or msg.get("n") != self.vector_len:
            raise SecAggError(f"{who}: masked input must have ring_bits={self.config.ring_bits} and "
                              f"n={self.vector_len}, got {msg.get('ring_bits')!r} and {msg.get('n')!r}")
        y = _field(msg, "y", bytes, who)
        if len(y) != self.vector_len * self.config.ring_dtype.itemsize:
            raise SecAggError(f"{who}: masked input has {len(y)} bytes, expected "
                              f"{self.vector_len * self.config.ring_dtype.itemsize}")
        self._masked[client_id] = np.frombuffer(y, dtype=self.config.ring_dtype)

    def broadcast_survivors(self) -> bytes:
        """Close round 2: the list U3 of clients whose masked input arrived."""
        self._expect(Round.MASKED_INPUT, "broadcast_survivors")
        self._need(len(self._masked), "sent masked inputs")
        self._u3 = sorted(self._masked)
        self.round = Round.UNMASKING
        return _pack("survivors", {"clients": self._u3})

    @property
    def included(self) -> list[str]:
        """U3: the clients whose inputs are in the sum (known after round 2)."""
        return list(self._u3)

    @property
    def dropped(self) -> list[str]:
        """Clients of U2 (shared keys) whose masked input never arrived."""
        return sorted(set(self._u2) - set(self._u3)) if self._u3 else []

    # -- round 3
    def receive_unmasking(self, client_id: str, data: bytes) -> None:
        """Round 3: a client's shares of dropped clients' keys and survivors' self-mask seeds;
        SecAggError for a malformed message or sender."""
        self._expect(Round.UNMASKING, "unmasking message")
        who = f"client {client_id!r}"
        msg = _unpack(data, "unmask", who)
        self._sender(client_id, msg, set(self._u3), self._unmask)
        b_sh = _field(msg, "b_shares", dict, who)
        s_sh = _field(msg, "s_shares", dict, who)
        alive, gone = set(self._u3), set(self._u2) - set(self._u3)
        if set(b_sh) != alive or set(s_sh) != gone:
            raise SecAggError(f"{who}: unmasking must reveal b shares of exactly U3 and s shares of exactly "
                              "the dropped clients")
        parsed: list[dict[str, int]] = []
        for table in (b_sh, s_sh):
            d: dict[str, int] = {}
            for v, raw in table.items():
                if not isinstance(raw, bytes) or len(raw) != _SHARE_BYTES:
                    raise SecAggError(f"{who}: malformed share for client {v!r}")
                val = int.from_bytes(raw, "big")
                if val >= PRIME:
                    raise SecAggError(f"{who}: share for client {v!r} is out of the field")
                d[v] = val
            parsed.append(d)
        self._unmask[client_id] = (parsed[0], parsed[1])

    def finish(self) -> np.ndarray:
        """Close round 3: reconstruct, unmask, and return the float64 sum of U3's inputs.

        Every secret is checked (commitment, public key); wrong shares are outvoted by
        the spare ones (more than ``threshold`` clients unmasking) and their senders
        named in :attr:`bad_shares`. Raises SecAggError when a secret cannot be
        recovered (then nothing changes)."""
        self._expect(Round.UNMASKING, "finish")
        self._need(len(self._unmask), "answered the unmasking round")
        k = self.config.ring_dtype
        n = self.vector_len
        dec = _ShareDecoder({w: self._index[w] for w in self._unmask}, self.config.threshold)

        def seed_ok(u: str) -> Callable[[int], bool]:
            return lambda b: b < 2 ** (8 * _KEY_BYTES) and hashlib.sha256(
                _VERSION + u.encode() + b.to_bytes(_KEY_BYTES, "big")).digest() == self._commits[u]

        def key_ok(d: str) -> Callable[[int], bool]:
            def ok(s: int) -> bool:
                if s >= 2 ** (8 * _KEY_BYTES):
                    return False
                sk = X25519PrivateKey.from_private_bytes(s.to_bytes(_KEY_BYTES, "big"))
                return _pub_bytes(sk.public_key()) == self._keys[d][1]
            return ok

        total = np.zeros(n, dtype=k)
        for u in self._u3:
            total += self._masked[u]
        # self masks of the survivors
        for u in self._u3:
            b_int = dec.recover(f"client {u!r}'s self-mask seed", {w: sh[0][u] for w, sh in self._unmask.items()},
                                seed_ok(u))
            total -= _prg(b_int.to_bytes(_KEY_BYTES, "big"), n, k)
        # pairwise masks between the survivors and each dropped client
        for d in self.dropped:
            sk_int = dec.recover(f"dropped client {d!r}'s mask key", {w: sh[1][d] for w, sh in self._unmask.items()},
                                 key_ok(d))
            sk = X25519PrivateKey.from_private_bytes(sk_int.to_bytes(_KEY_BYTES, "big"))
            for u in self._u3:
                seed = _hkdf(_agree(sk, self._keys[u][1], f"client {u!r}"), _pair_info(b"mask", u, d))
                p = _prg(seed, n, k)
                # u added +p if its index is lower than d's, else -p: undo that
                if self._index[u] < self._index[d]:
                    total -= p
                else:
                    total += p
        self.bad_shares = {w: list(v) for w, v in sorted(dec.bad.items())}
        self.unresolved_shares = list(dec.unresolved)
        self._result = total
        self.round = Round.DONE
        return decode_fixed(total, self.config)

    def result_ring(self) -> np.ndarray:
        """The unmasked sum in Z_{2^k} (equals the sum of the encodings exactly)."""
        if self._result is None:
            raise SecAggError("no result yet: the unmasking round has not finished")
        return self._result.copy()

    def result(self) -> np.ndarray:
        """The decoded float64 sum of U3's inputs."""
        return decode_fixed(self.result_ring(), self.config)


# ---------------------------------------------------------------------------
# accounting


def secagg_overhead_bytes(n_clients: int, vector_len: int, config: SecAggConfig, id_len: int = 8,
                          plain_bytes_per_entry: int = 4) -> dict[str, float]:
    """Bytes one client sends and receives in one secure aggregation of ``n_clients``
    (no dropouts), from the exact message layouts (ids of ``id_len`` characters), and
    the ratio of its uplink to a plain upload of ``vector_len`` entries of
    ``plain_bytes_per_entry`` bytes (float32: 4).

    Keys: ``up_advertise``, ``down_keys``, ``up_shares``, ``down_shares``, ``up_masked``,
    ``down_survivors``, ``up_unmask``, ``client_up``, ``client_down``, ``plain_up``,
    ``uplink_ratio``, ``total_ratio`` ((up + down extra) / plain up)."""
    if n_clients < 2 or vector_len < 1:
        raise SecAggError("need n_clients >= 2 and vector_len >= 1")
    ids = [f"{i:0{id_len}d}"[-id_len:] if id_len else str(i) for i in range(n_clients)]
    me, others = ids[0], ids[1:]
    key = bytes(_KEY_BYTES)
    share = bytes(_SHARE_BYTES)
    plain_len = len(msgpack.packb([me, others[0], share, share], use_bin_type=True))
    blob = bytes(_NONCE_BYTES + plain_len + _GCM_TAG)
    sizes = {
        "up_advertise": len(_pack("advertise", {"id": me, "c_pk": key, "s_pk": key})),
        "down_keys": len(_pack("keys", {"clients": [[c, key, key] for c in ids]})),
        "up_shares": len(_pack("shares", {"id": me, "shares": {v: blob for v in others}, "b_commit": key})),
        "down_shares": len(_pack("shares_for", {"to": me, "shares": {v: blob for v in others}})),
        "up_masked": len(_pack("masked", {"id": me, "ring_bits": config.ring_bits, "n": vector_len,
                                          "y": bytes(vector_len * config.ring_dtype.itemsize)})),
        "down_survivors": len(_pack("survivors", {"clients": ids})),
        "up_unmask": len(_pack("unmask", {"id": me, "b_shares": {v: share for v in ids}, "s_shares": {}})),
    }
    up = sizes["up_advertise"] + sizes["up_shares"] + sizes["up_masked"] + sizes["up_unmask"]
    down = sizes["down_keys"] + sizes["down_shares"] + sizes["down_survivors"]
    plain = vector_len * plain_bytes_per_entry
    out: dict[str, float] = {k: float(v) for k, v in sizes.items()}
    out.update(client_up=float(up), client_down=float(down), plain_up=float(plain), uplink_ratio=up / plain,
               total_ratio=(up + down) / plain)
    return out
