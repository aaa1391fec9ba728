"""Worker names and identities (ps.names), and pulls as reads of membership (Membership.renew).

Pins come from the token file (tessera.service.WorkerNames, the parser's object); first-come
binding holds only where nothing is pinned; ``check`` (what pulls use) never binds."""
from __future__ import annotations

import pytest

from ps.consistency import Membership
from ps.errors import PermissionDeniedError, ResourceExhaustedError
from ps.names import OPEN, WorkerNames
from tessera.service import WorkerNames as Pins


def test_unpinned_names_are_bound_first_come_by_claims_only() -> None:
    names = WorkerNames()
    assert names.check("alice", "w9") is False  # free: a check binds nothing
    assert names.bindings() == {}
    names.claim("alice", "w9")
    assert names.check("alice", "w9") is True and names.bindings() == {"w9": "alice"}
    with pytest.raises(PermissionDeniedError, match=r"'w9' belongs to identity 'alice', not 'bob'"):
        names.claim("bob", "w9")
    with pytest.raises(PermissionDeniedError):
        names.check("bob", "w9")
    assert names.bindings() == {"w9": "alice"}


def test_pinned_names_belong_to_their_identity_whoever_comes_first() -> None:
    names = WorkerNames(Pins({"trainers": ["w0", "gpu-*"], "solo": ["w1"]}))
    for early in ("w0", "gpu-3"):  # another identity cannot take a pinned name before its owner starts
        with pytest.raises(PermissionDeniedError, match=rf"'{early}' is pinned to identity 'trainers', not 'intruder'"):
            names.claim("intruder", early)
    names.claim("trainers", "gpu-3")
    names.claim("trainers", "w0")
    assert names.bindings() == {}  # pinned names are never bound
    with pytest.raises(PermissionDeniedError, match="may use only the worker names"):
        names.claim("trainers", "w7")  # an identity with pins may use only them
    with pytest.raises(PermissionDeniedError, match="pinned to identity 'solo'"):
        names.claim("trainers", "w1")
    names.claim("other", "w7")  # unpinned name, identity without pins: first come
    assert names.bindings() == {"w7": "other"}


def test_open_servers_check_nothing_and_bind_nothing() -> None:
    names = WorkerNames(Pins({"trainers": ["w0"]}))
    names.claim(OPEN, "w0")
    assert names.check(OPEN, "anything") is True and names.bindings() == {}


def test_bindings_are_bounded() -> None:
    names = WorkerNames(max_names=2)
    names.claim("a", "x")
    names.claim("a", "y")
    with pytest.raises(ResourceExhaustedError, match="2 worker names"):
        names.claim("a", "z")
    names.claim("a", "x")  # its own: fine


def test_renew_refreshes_a_live_member_only() -> None:
    now = [0.0]
    m = Membership(10.0, now=lambda: now[0])
    assert m.renew("ghost") is False and m.live() == frozenset()  # a pull never adds a member
    m.join("w0")
    now[0] = 8.0
    assert m.renew("w0") is True
    now[0] = 15.0
    assert m.expire() == []  # renewed at 8: alive until 18
    now[0] = 30.0
    assert m.expire() == ["w0"]
    assert m.renew("w0") is False and m.live() == frozenset()  # a pull never brings a member back
    assert m.touch("w0") is True and m.live() == {"w0"}  # a push or heartbeat does
