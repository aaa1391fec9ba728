"""Secure aggregation (Bonawitz et al. 2017): exact sums with and without dropouts,
masked inputs that look uniform, refusals below the threshold, tampering detected."""
from __future__ import annotations

import math
from typing import Callable

import msgpack
import numpy as np
import pytest

from federated.secagg import (
    PRIME,
    Round,
    SecAggClient,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    decode_fixed,
    encode_fixed,
    secagg_overhead_bytes,
    shamir_combine,
    shamir_split,
)

L = 10_000  # mask expansion for 10k entries keeps each run in milliseconds


def _ids(n: int) -> list[str]:
    return [f"client{i:02d}" for i in range(n)]  # 8 characters, as secagg_overhead_bytes assumes


class Run:
    """Drives clients and server through the rounds, recording every message."""

    def __init__(self, n: int = 5, config: SecAggConfig | None = None, seed: int = 0, scale: float = 1.0) -> None:
        self.cfg = config or SecAggConfig(threshold=3)
        self.ids = _ids(n)
        rng = np.random.default_rng(seed)
        self.x = {c: rng.uniform(-scale, scale, L) for c in self.ids}
        self.clients = {c: SecAggClient(c, self.cfg) for c in self.ids}
        self.server = SecAggServer(self.cfg, self.ids, L)
        self.sent: dict[str, list[bytes]] = {c: [] for c in self.ids}
        self.received: dict[str, list[bytes]] = {c: [] for c in self.ids}

    def _up(self, c: str, data: bytes) -> bytes:
        self.sent[c].append(data)
        return data

    def advertise(self, who: list[str]) -> bytes:
        for c in who:
            self.server.receive_advertise(c, self._up(c, self.clients[c].advertise_keys()))
        kb = self.server.broadcast_keys()
        for c in self.server.u1:
            self.received[c].append(kb)
        return kb

    def share(self, who: list[str], kb: bytes) -> dict[str, bytes]:
        for c in who:
            self.server.receive_shares(c, self._up(c, self.clients[c].share_keys(kb)))
        fw = self.server.forward_shares()
        for c, m in fw.items():
            self.received[c].append(m)
        return fw

    def mask(self, who: list[str], fw: dict[str, bytes]) -> bytes:
        for c in who:
            self.server.receive_masked_input(c, self._up(c, self.clients[c].masked_input(fw[c], self.x[c])))
        sv = self.server.broadcast_survivors()
        for c in self.server.included:
            self.received[c].append(sv)
        return sv

    def unmask(self, who: list[str], sv: bytes) -> np.ndarray:
        for c in who:
            self.server.receive_unmasking(c, self._up(c, self.clients[c].unmasking(sv)))
        return self.server.finish()

    def plain_ring_sum(self, who: list[str]) -> np.ndarray:
        acc = np.zeros(L, dtype=self.cfg.ring_dtype)
        for c in who:
            acc += encode_fixed(self.x[c], self.cfg)  # wraps mod 2^k, like the protocol
        return acc


# --------------------------------------------------------------------------- exact sums

@pytest.mark.parametrize("ring_bits, scale_bits", [(32, 20), (64, 40)])
def test_sum_is_exact_without_dropouts(ring_bits: int, scale_bits: int) -> None:
    r = Run(config=SecAggConfig(threshold=3, ring_bits=ring_bits, scale_bits=scale_bits, max_clients=5))
    kb = r.advertise(r.ids)
    fw = r.share(r.ids, kb)
    sv = r.mask(r.ids, fw)
    out = r.unmask(r.ids, sv)
    np.testing.assert_array_equal(r.server.result_ring(), r.plain_ring_sum(r.ids))  # integers, exactly
    plain = sum(r.x[c] for c in r.ids)
    assert np.abs(out - plain).max() <= 5 * 2.0 ** -(scale_bits + 1) + 1e-12  # rounding only
    assert r.server.included == r.ids and r.server.dropped == []
    assert all(c.round == Round.DONE for c in r.clients.values())


def test_sum_is_exact_when_one_client_drops_after_key_exchange() -> None:
    r = Run()
    kb = r.advertise(r.ids)
    fw = r.share(r.ids, kb)           # everyone shared keys: everyone's pairwise masks are in
    live = r.ids[:2] + r.ids[3:]      # client02 vanishes before sending its masked input
    sv = r.mask(live, fw)
    assert r.server.dropped == ["client02"]
    out = r.unmask(live, sv)
    np.testing.assert_array_equal(r.server.result_ring(), r.plain_ring_sum(live))
    assert np.abs(out - sum(r.x[c] for c in live)).max() < 1e-5


def test_dropouts_at_every_stage() -> None:
    r = Run(n=7, config=SecAggConfig(threshold=3))
    kb = r.advertise(r.ids[1:])                    # client00: never advertised
    fw = r.share(r.ids[2:], kb)                    # client01: advertised, never shared
    sv = r.mask(r.ids[3:], fw)                     # client02: shared, no masked input
    out = r.unmask(r.ids[4:], sv)                  # client03: masked input, then silent
    included = r.ids[3:]
    assert r.server.included == included
    np.testing.assert_array_equal(r.server.result_ring(), r.plain_ring_sum(included))
    assert np.abs(out - sum(r.x[c] for c in included)).max() < 1e-5


# --------------------------------------------------------------------------- what the server sees

def _ks_uniform(u: np.ndarray) -> float:
    """Kolmogorov-Smirnov statistic of samples in [0, 1) against U(0, 1)."""
    s = np.sort(u)
    n = s.size
    i = np.arange(1, n + 1)
    return float(max((i / n - s).max(), (s - (i - 1) / n).max()))


def _chi2_top_byte(words: np.ndarray, bits: int) -> float:
    counts = np.bincount((words >> np.uint64(bits - 8)).astype(np.int64), minlength=256)
    exp = words.size / 256
    return float(((counts - exp) ** 2 / exp).sum())


# Critical values at significance 0.001 (a correct implementation fails for about 1 seed
# in 1000; the seeds here are fixed): KS for large n: sqrt(-ln(0.001 / 2) / 2) / sqrt(n)
# = 1.9495 / sqrt(n) (Kolmogorov's asymptotic distribution); chi-square with 255 degrees
# of freedom: 330.52 (Wilson-Hilferty: 255 * (1 - 2/(9*255) + 3.0902 * sqrt(2/(9*255)))^3).
# critical values at alpha = 1e-6 (the masks are truly random, so a test at alpha = 1e-3 failed about one
# CI run in 250): KS c(alpha) = sqrt(-ln(alpha / 2) / 2); chi-square 255 df by Wilson-Hilferty
KS_CRIT = 2.6937 / math.sqrt(L)
CHI2_CRIT_255 = 377.2


@pytest.mark.parametrize("ring_bits", [32, 64])
def test_masked_input_is_indistinguishable_from_uniform(ring_bits: int) -> None:
    cfg = SecAggConfig(threshold=2, ring_bits=ring_bits, scale_bits=16, max_clients=3)
    r = Run(n=3, config=cfg)
    r.x = {c: np.zeros(L) for c in r.ids}  # the most structured input there is
    r.x[r.ids[0]][:] = 0.25
    kb = r.advertise(r.ids)
    fw = r.share(r.ids, kb)
    r.mask(r.ids, fw)
    raw = msgpack.unpackb(r.sent["client00"][-1], raw=False)["y"]
    y = np.frombuffer(raw, dtype=cfg.ring_dtype).astype(np.uint64)
    d = _ks_uniform(y.astype(np.float64) / 2.0 ** ring_bits)
    chi2 = _chi2_top_byte(y, ring_bits)
    assert d < KS_CRIT, (d, KS_CRIT)
    assert chi2 < CHI2_CRIT_255, chi2
    # the same tests reject the unmasked encoding (they have power)
    plain = encode_fixed(r.x["client00"], cfg).astype(np.uint64)
    assert _ks_uniform(plain.astype(np.float64) / 2.0 ** ring_bits) > KS_CRIT
    assert _chi2_top_byte(plain, ring_bits) > CHI2_CRIT_255


def test_server_sees_no_input_in_the_clear() -> None:
    r = Run(n=3, config=SecAggConfig(threshold=2))
    kb = r.advertise(r.ids)
    fw = r.share(r.ids, kb)
    r.mask(r.ids, fw)
    for c in r.ids:
        enc = encode_fixed(r.x[c], r.cfg).tobytes()
        assert all(enc[:64] not in m for m in r.sent[c])


# --------------------------------------------------------------------------- refusals

def test_below_threshold_server_refuses_to_unmask() -> None:
    r = Run(config=SecAggConfig(threshold=3))
    kb = r.advertise(r.ids)
    fw = r.share(r.ids, kb)
    for c in r.ids[:2]:
        r.server.receive_masked_input(c, r.clients[c].masked_input(fw[c], r.x[c]))
    with pytest.raises(SecAggError, match="only 2 clients sent masked inputs, threshold is 3; refusing"):
        r.server.broadcast_survivors()
    assert r.server.round == Round.MASKED_INPUT  # nothing changed; more inputs may still arrive


def test_below_threshold_in_unmasking_round() -> None:
    r = Run(config=SecAggConfig(threshold=3))
    sv = r.mask(r.ids[:3], r.share(r.ids, r.advertise(r.ids)))
    for c in r.ids[:2]:
        r.server.receive_unmasking(c, r.clients[c].unmasking(sv))
    with pytest.raises(SecAggError, match="only 2 clients answered the unmasking round"):
        r.server.finish()
    with pytest.raises(SecAggError, match="no result yet"):
        r.server.result()


def test_client_refuses_a_forged_survivor_list_below_threshold() -> None:
    r = Run(config=SecAggConfig(threshold=3))
    fw = r.share(r.ids, r.advertise(r.ids))
    for c in r.ids:
        r.clients[c].masked_input(fw[c], r.x[c])
    forged = msgpack.packb({"kind": "survivors", "clients": ["client00", "client01"]}, use_bin_type=True)
    with pytest.raises(SecAggError, match="only 2 survivors, threshold is 3; refusing to reveal shares"):
        r.clients["client00"].unmasking(forged)
    outsider = msgpack.packb({"kind": "survivors", "clients": ["client00", "client01", "mallory"]},
                             use_bin_type=True)
    with pytest.raises(SecAggError, match="outside U2"):
        r.clients["client00"].unmasking(outsider)


def test_below_threshold_key_list_refused() -> None:
    cfg = SecAggConfig(threshold=3)
    server = SecAggServer(cfg, _ids(5), L)
    clients = {c: SecAggClient(c, cfg) for c in _ids(2)}
    for c, cl in clients.items():
        server.receive_advertise(c, cl.advertise_keys())
    with pytest.raises(SecAggError, match="only 2 clients advertised keys"):
        server.broadcast_keys()


def test_tampered_share_ciphertext_names_the_sender() -> None:
    r = Run()
    fw = r.share(r.ids, r.advertise(r.ids))
    bundle = msgpack.unpackb(fw["client02"], raw=False)
    blob = bytearray(bundle["shares"]["client04"])
    blob[-20] ^= 0x01
    bundle["shares"]["client04"] = bytes(blob)
    with pytest.raises(SecAggError, match="client 'client02': the share from client 'client04' fails authentication"):
        r.clients["client02"].masked_input(msgpack.packb(bundle, use_bin_type=True), r.x["client02"])
    assert r.clients["client02"].round == Round.MASKED_INPUT  # still usable with the genuine bundle
    r.clients["client02"].masked_input(fw["client02"], r.x["client02"])


def test_wrong_share_in_unmasking_is_outvoted_and_its_sender_named() -> None:
    # 4 clients unmask for threshold 3: the spare share finds the wrong one (issue 10: one
    # wrong share used to fail the whole aggregation)
    r = Run()
    sv = r.mask(r.ids[:4], r.share(r.ids, r.advertise(r.ids)))
    msgs = {c: r.clients[c].unmasking(sv) for c in r.ids[:4]}
    bad = msgpack.unpackb(msgs["client00"], raw=False)
    bad["b_shares"]["client01"] = (123).to_bytes(66, "big")
    r.server.receive_unmasking("client00", msgpack.packb(bad, use_bin_type=True))
    for c in r.ids[1:4]:
        r.server.receive_unmasking(c, msgs[c])
    r.server.finish()
    np.testing.assert_array_equal(r.server.result_ring(), r.plain_ring_sum(r.ids[:4]))
    assert r.server.bad_shares == {"client00": ["client 'client01''s self-mask seed"]}
    assert r.server.unresolved_shares == []


def test_wrong_share_without_a_spare_is_detected() -> None:
    r = Run()
    sv = r.mask(r.ids[:3], r.share(r.ids, r.advertise(r.ids)))
    msgs = {c: r.clients[c].unmasking(sv) for c in r.ids[:3]}
    bad = msgpack.unpackb(msgs["client00"], raw=False)
    bad["s_shares"]["client04"] = (123).to_bytes(66, "big")
    r.server.receive_unmasking("client00", msgpack.packb(bad, use_bin_type=True))
    for c in r.ids[1:3]:
        r.server.receive_unmasking(c, msgs[c])
    with pytest.raises(SecAggError, match="client 'client04'.*a share is wrong.*no spare share"):
        r.server.finish()
    assert r.server.round == Round.UNMASKING  # nothing changed


def test_wrong_round_unknown_client_malformed_and_impersonation() -> None:
    cfg = SecAggConfig(threshold=2)
    ids = _ids(3)
    server = SecAggServer(cfg, ids, L)
    a, b = SecAggClient("client00", cfg), SecAggClient("client01", cfg)
    with pytest.raises(SecAggError, match="SHARE_KEYS called in round ADVERTISE_KEYS"):
        a.share_keys(b"")
    with pytest.raises(SecAggError, match="unknown client 'mallory'"):
        server.receive_advertise("mallory", SecAggClient("mallory", cfg).advertise_keys())
    with pytest.raises(SecAggError, match="client 'client01': malformed advertise message"):
        server.receive_advertise("client01", b"\xc1\xff garbage")
    with pytest.raises(SecAggError, match="expected a 'advertise' message"):
        server.receive_advertise("client01", msgpack.packb({"kind": "masked"}))
    with pytest.raises(SecAggError, match="claims to come from 'client00'"):
        server.receive_advertise("client01", a.advertise_keys())
    server.receive_advertise("client01", b.advertise_keys())
    with pytest.raises(SecAggError, match="already sent"):
        server.receive_advertise("client01", msgpack.packb(
            {"kind": "advertise", "id": "client01", "c_pk": bytes(range(32)), "s_pk": bytes(range(1, 33))}))
    with pytest.raises(SecAggError, match="masked input in round ADVERTISE_KEYS"):
        server.receive_masked_input("client01", b"")
    with pytest.raises(SecAggError, match="public keys must be two distinct"):
        server.receive_advertise("client02", msgpack.packb({"kind": "advertise", "id": "client02",
                                                            "c_pk": b"short", "s_pk": b"x" * 32}))


def test_masked_input_of_wrong_length_and_dropped_client_rejoining() -> None:
    r = Run(n=4, config=SecAggConfig(threshold=2))
    fw = r.share(r.ids[:3], r.advertise(r.ids))  # client03 never shared keys
    good = r.clients["client00"].masked_input(fw["client00"], r.x["client00"])
    m = msgpack.unpackb(good, raw=False)
    m["y"] = m["y"][:-4]
    with pytest.raises(SecAggError, match="client 'client00': masked input has 39996 bytes"):
        r.server.receive_masked_input("client00", msgpack.packb(m, use_bin_type=True))
    r.server.receive_masked_input("client00", good)
    late = msgpack.packb({"kind": "masked", "id": "client03", "ring_bits": 32, "n": L, "y": bytes(4 * L)},
                         use_bin_type=True)
    with pytest.raises(SecAggError, match="client 'client03' dropped out earlier"):
        r.server.receive_masked_input("client03", late)


# --------------------------------------------------------------------------- pieces

def test_fixed_point_roundtrip_and_range() -> None:
    cfg = SecAggConfig(threshold=2, ring_bits=32, scale_bits=16, max_clients=4)
    assert cfg.value_bound == 2.0 ** 15 / 4
    x = np.array([0.0, 1.5, -1.5, -8191.99, 8191.99, 1e-6])
    np.testing.assert_allclose(decode_fixed(encode_fixed(x, cfg), cfg), np.rint(x * 65536) / 65536, rtol=0)
    # four inputs at the bound still decode (signed) without wrapping
    big = np.array([8191.0, -8191.0])
    total = sum((encode_fixed(big, cfg) for _ in range(4)), np.zeros(2, cfg.ring_dtype))
    np.testing.assert_array_equal(decode_fixed(total, cfg), 4 * big)
    with pytest.raises(SecAggError, match=r"entry 1 = 8192.0 is outside the fixed-point range \|x\| < 8192"):
        encode_fixed(np.array([0.0, 8192.0]), cfg)
    with pytest.raises(SecAggError, match="non-finite"):
        encode_fixed(np.array([np.nan]), cfg)
    with pytest.raises(SecAggError, match="scale_bits"):
        SecAggConfig(threshold=2, ring_bits=32, scale_bits=30, max_clients=4)
    with pytest.raises(SecAggError, match="threshold"):
        SecAggConfig(threshold=1)


def test_shamir_any_threshold_subset_reconstructs() -> None:
    secret = int.from_bytes(bytes(range(32)), "big")
    shares = shamir_split(secret, 3, [1, 2, 3, 4, 5])
    assert all(0 <= s < PRIME for s in shares.values())
    for subset in ([1, 2, 3], [5, 3, 1], [2, 4, 5]):
        assert shamir_combine([(x, shares[x]) for x in subset]) == secret
    assert shamir_combine([(x, shares[x]) for x in (1, 2)]) != secret  # t-1 shares: garbage


def test_overhead_accounting_matches_real_messages() -> None:
    r = Run(n=5)
    r.unmask(r.ids, r.mask(r.ids, r.share(r.ids, r.advertise(r.ids))))
    acc = secagg_overhead_bytes(5, L, r.cfg)
    me = "client00"
    assert acc["client_up"] == sum(len(m) for m in r.sent[me])
    assert acc["client_down"] == sum(len(m) for m in r.received[me])
    assert acc["plain_up"] == 4 * L and 1.0 < acc["uplink_ratio"] < 1.1
