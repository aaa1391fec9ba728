"""tessera.service's admission rules without sockets (README Security, "Fair share"): per-identity
in-flight and waiting caps, the server-wide shares (admin reserve, health reserve, headroom,
protected identities), the cap on waits, draining; and the token file's pins and certificate lines."""
from __future__ import annotations

import pytest

from tessera.service import (
    Access,
    Caller,
    ConfigError,
    Limits,
    RateLimitedError,
    ServerSecurity,
    ServerStoppingError,
    UnauthenticatedError,
    WorkerNames,
    read_token_file,
    write_token_file,
)

ROLES = {"CreateTable": {"admin"}, "Stats": {"admin", "worker", "reader"}, "PullDense": {"admin", "worker", "reader"}}
ALL = ("admin", "worker", "reader")


def _access(pool: int = 64, **sec: object) -> Access:
    security = ServerSecurity(tokens={f"id{i}": f"{i:016d}x" for i in range(40)}, insecure=True, **sec)  # type: ignore[arg-type]
    return Access(security, ROLES, ALL, waits={"PullDense"}, pool=pool)


def _c(name: str, *roles: str) -> Caller:
    return Caller(name, frozenset(roles or ("worker",)))


def test_per_identity_caps_16_calls_8_waiting() -> None:
    a = _access()
    held = [a.acquire("PullDense", _c("id1")) for _ in range(8)]
    with pytest.raises(RateLimitedError, match="identity 'id1' has 8 waiting calls in flight already"):
        a.acquire("PullDense", _c("id1"))
    held += [a.acquire("Stats", _c("id1")) for _ in range(8)]
    with pytest.raises(RateLimitedError, match="identity 'id1' has 16 calls in flight already"):
        a.acquire("Stats", _c("id1"))
    a.acquire("PullDense", _c("id2"))  # another identity is not affected
    a.release(held[0])
    a.acquire("Stats", _c("id1"))  # a slot given back is taken again
    assert a.refused["waiting"] == 1 and a.refused["identity"] == 1


def test_server_shares_admin_reserve_health_reserve_headroom() -> None:
    a = _access(pool=64)
    assert a.general == 64 - 4 - 4 - 4
    for i in range(52):  # 52 identities, one call each: the shared slots are taken
        a.acquire("Stats", _c(f"id{i % 40}x{i}"))
    with pytest.raises(RateLimitedError, match="the server's 52 shared call slots are taken"):
        a.acquire("Stats", _c("late"))
    for _ in range(4):  # an admin still gets in: 4 slots only admins may use
        a.acquire("CreateTable", _c("boss", "admin"))
    with pytest.raises(RateLimitedError):
        a.acquire("CreateTable", _c("boss", "admin"))
    for _ in range(4):  # health probes have their own 4 (no identity)
        a.acquire("Check", None)
    with pytest.raises(RateLimitedError, match="health calls in flight"):
        a.acquire("Check", None)


def test_protected_identities_keep_their_slots() -> None:
    a = _access(pool=64)
    a.protect({"w0", "w1"})  # live workers: 2 slots each that others may not take
    for i in range(48):
        a.acquire("Stats", _c(f"r{i}", "reader"))
    with pytest.raises(RateLimitedError):  # 48 + 2 x 2 kept = 52
        a.acquire("Stats", _c("r-late", "reader"))
    for w in ("w0", "w1"):
        a.acquire("PullDense", _c(w))
        a.acquire("PullDense", _c(w))


def test_waits_are_capped_whatever_the_deadline() -> None:
    a = _access()

    class Ctx:
        def __init__(self, left: float | None) -> None:
            self.left = left

        def time_remaining(self) -> float | None:
            return self.left

    assert a.wait_budget(Ctx(None)) == 60.0 and a.wait_budget(Ctx(3600.0)) == 60.0
    assert a.wait_budget(Ctx(2.0)) == pytest.approx(1.95)
    assert Access(ServerSecurity(), ROLES, ALL, limits=Limits(max_wait_s=5.0)).wait_budget(Ctx(None)) == 5.0


def test_draining_refuses_new_calls_but_answers_health() -> None:
    a = _access()
    a.drain("shard 0 received SIGTERM")
    with pytest.raises(ServerStoppingError, match="shard 0 received SIGTERM: the server is stopping"):
        a.acquire("Stats", _c("id1"))
    a.acquire("Check", None)  # probes still get their NOT_SERVING


def test_callers_by_token_and_by_certificate() -> None:
    sec = ServerSecurity(tls_cert=b"x", tls_key=b"y", tls_ca=b"z", tokens={"w0": "t" * 16}, roles={"ops": ["admin"]},
                         certificates=frozenset({"ops"}))
    a = Access(sec, ROLES, ALL)
    assert a.caller([("authorization", "Bearer " + "t" * 16)]).identity == "w0"
    assert a.caller([], {"x509_common_name": [b"ops"]}) == Caller("ops", frozenset({"admin"}))
    with pytest.raises(UnauthenticatedError, match="not a certificate identity"):
        a.caller([], {"x509_common_name": [b"mallory"]})
    with pytest.raises(UnauthenticatedError, match="unknown token"):
        a.caller([("authorization", "Bearer nope")], {"x509_common_name": [b"ops"]})


def test_token_file_pins_and_certificate_lines(tmp_path) -> None:
    p = tmp_path / "tokens"
    write_token_file(str(p), {"w0": "a" * 32, "gpus": "b" * 32, "ops": None, "plain": "c" * 32},
                     {"w0": ["worker"], "gpus": ["worker"], "ops": ["admin"]}, {"w0": ["w0"], "gpus": ["gpu-*"]})
    tf = read_token_file(str(p))
    assert tf.tokens == {"w0": "a" * 32, "gpus": "b" * 32, "plain": "c" * 32}
    assert tf.certificates == {"ops"} and tf.roles["ops"] == ["admin"] and "plain" not in tf.roles
    assert tf.workers == {"w0": ("w0",), "gpus": ("gpu-*",)}
    names = WorkerNames(tf.workers)
    assert names.owner("w0") == "w0" and names.owner("gpu-7") == "gpus" and names.owner("w1") is None
    assert names.allows("w0", "w0") and not names.allows("plain", "w0") and not names.allows("w0", "w1")
    assert names.allows("plain", "w1") and not names.allows("gpus", "w1")
    (tmp_path / "bad").write_text("w0 " + "a" * 32 + " worker colour=blue\n")
    with pytest.raises(ConfigError, match="bad:1: unknown option 'colour'"):
        read_token_file(str(tmp_path / "bad"))
    (tmp_path / "bad2").write_text("w0 " + "a" * 32 + " worker workers=a*b\n")
    with pytest.raises(ConfigError, match="only at the end"):
        read_token_file(str(tmp_path / "bad2"))


def test_peer_roles_are_not_capped_per_identity() -> None:
    """The PS's replica (its backup's peer) forwards every concurrent mutation: no per-identity cap,
    and it may use the admin reserve; the server-wide shares still bound it."""
    security = ServerSecurity(tokens={"replica": "r" * 16}, insecure=True)
    a = Access(security, {"Replicate": {"replica"}}, ("replica",), pool=64, limits=Limits(peer_roles=frozenset({"replica"})))
    for _ in range(56):  # 52 shared + 4 of the admin reserve
        a.acquire("Replicate", _c("replica", "replica"))
    with pytest.raises(RateLimitedError, match="shared call slots"):
        a.acquire("Replicate", _c("replica", "replica"))
