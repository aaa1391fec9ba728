"""Federated hardening (issue 10), without sockets: where the server's randomness comes
from, secure aggregation that finds and names a wrong share, token files only their
owner can read."""
from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

import msgpack
import numpy as np
import pytest

from federated.cli import add_fed_commands
from federated.config import ServerConfig
from federated.orchestrator import Orchestrator
from federated.privacy import DPConfig
from federated.registry import Registry
from federated.secagg import PRIME, SecAggClient, SecAggConfig, SecAggError, SecAggServer, encode_fixed
from federated.strategy import make_strategy
from tessera.service import load_token_file

W0 = [np.zeros((3, 4), np.float32)]
IDS = [f"c{i:02d}" for i in range(20)]


def _orch(**cfg: object) -> Orchestrator:
    return Orchestrator(ServerConfig(fraction=0.5, **cfg), make_strategy("fedavg"), Registry(), W0)  # type: ignore[arg-type]


def _draws(o: Orchestrator) -> list[list[str]]:
    return [o._sample({c: [c] for c in IDS}, 0.5, rnd, 0, 0).client_ids for rnd in range(1, 31)]


def test_dp_client_sampling_is_unpredictable_and_plain_sampling_reproducible() -> None:
    dp = DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    a, b = _draws(_orch(dp=dp)), _draws(_orch(dp=dp))
    assert a != b  # 30 draws of 10 of 20: equal by chance with probability 1/184756^30
    assert all(len(s) == 10 and len(set(s)) == 10 for s in a)
    assert _draws(_orch()) == _draws(_orch())  # without DP the public seed reproduces the samples
    assert _draws(_orch(insecure_reproducible_seed=3)) == _draws(_orch(insecure_reproducible_seed=3))


def _secagg(n: int, threshold: int, drop: list[str], wrong: dict[str, int]) -> tuple[SecAggServer, np.ndarray]:
    """One aggregation of n clients; ``drop`` vanish before masking; ``wrong[c]`` = how many
    of c's unmasking shares (of each kind) it replaces by random field elements (independent
    errors: colluders could make theirs cancel at 0, see ``_ShareDecoder``). Returns the server (finished) and
    the plain ring sum of the survivors' encodings."""
    cfg = SecAggConfig(threshold=threshold, max_clients=n)
    ids = [f"c{i}" for i in range(n)]
    rng = np.random.default_rng(5)
    x = {c: rng.uniform(-1, 1, 50) for c in ids}
    clients = {c: SecAggClient(c, cfg) for c in ids}
    server = SecAggServer(cfg, ids, 50)
    for c in ids:
        server.receive_advertise(c, clients[c].advertise_keys())
    kb = server.broadcast_keys()
    for c in ids:
        server.receive_shares(c, clients[c].share_keys(kb))
    fw = server.forward_shares()
    live = [c for c in ids if c not in drop]
    for c in live:
        server.receive_masked_input(c, clients[c].masked_input(fw[c], x[c]))
    sv = server.broadcast_survivors()
    for c in live:
        msg = msgpack.unpackb(clients[c].unmasking(sv), raw=False)
        for table in ("b_shares", "s_shares"):
            for v in sorted(msg[table])[: wrong.get(c, 0)]:
                msg[table][v] = (int.from_bytes(rng.bytes(66), "big") % PRIME).to_bytes(66, "big")
        server.receive_unmasking(c, msgpack.packb(msg, use_bin_type=True))
    plain = sum(encode_fixed(x[c], cfg).astype(np.uint64) for c in live) % (1 << 32)
    return server, plain.astype(np.uint32)


def test_secagg_outvotes_several_wrong_shares_with_dropouts() -> None:
    # 7 clients, threshold 3, one dropped: 6 unmask, so up to 3 wrong shares per secret are survived
    server, plain = _secagg(7, 3, drop=["c6"], wrong={"c0": 99, "c2": 99})
    server.finish()
    np.testing.assert_array_equal(server.result_ring(), plain)
    assert sorted(server.bad_shares) == ["c0", "c2"] and server.unresolved_shares == []
    assert len(server.bad_shares["c0"]) == 6 + 1  # every survivor's seed and the dropped client's key
    assert "dropped client 'c6''s mask key" in server.bad_shares["c2"]


def test_secagg_names_no_one_when_wrong_shares_tie_with_right_ones() -> None:
    # c0's seed and c6's key get 3 wrong shares of 6: still recovered (the checks pass), but 3
    # against 3 could be colluders framing honest clients, so c4 is not named for them
    server, plain = _secagg(7, 3, drop=["c6"], wrong={"c0": 99, "c2": 99, "c4": 1})
    server.finish()
    np.testing.assert_array_equal(server.result_ring(), plain)
    assert sorted(server.bad_shares) == ["c0", "c2"]
    assert server.unresolved_shares == ["client 'c0''s self-mask seed", "dropped client 'c6''s mask key"]


def test_secagg_with_more_wrong_shares_than_spares_fails_and_says_so() -> None:
    server, _ = _secagg(5, 3, drop=[], wrong={"c0": 99, "c1": 99, "c2": 99})
    with pytest.raises(SecAggError, match="no 3 of the 5 shares pass its check.*a share is wrong"):
        server.finish()


# --------------------------------------------------------------------------- 5. token file mode
def _fed(*argv: str) -> int:
    p = argparse.ArgumentParser()
    add_fed_commands(p.add_subparsers(dest="command"))
    args = p.parse_args(["fed", *argv])
    return int(args.func(args))


_probe: dict[str, Any] = {}


def _audit(event: str, args: tuple) -> None:
    """Records the mode of the watched file at every audit event after it was opened
    (an audit hook cannot be removed: it idles when nothing is watched)."""
    path = _probe.get("path")
    if path is None or _probe.get("busy"):
        return
    if event == "open" and args and args[0] == path:
        _probe["opened"] = True
    elif _probe.get("opened") and os.path.exists(path):
        _probe["busy"] = True
        try:
            _probe["modes"].append((event, stat.S_IMODE(os.stat(path).st_mode)))
        finally:
            _probe["busy"] = False


def test_token_file_is_owner_only_from_its_first_byte(tmp_path) -> None:
    if not _probe.get("installed"):
        sys.addaudithook(_audit)
        _probe["installed"] = True
    path = str(tmp_path / "tokens.txt")
    old_umask = os.umask(0)  # the most permissive umask: only the code's own mode protects the file
    try:
        _probe.update(path=path, opened=False, modes=[])
        assert _fed("tokens", "alice", "bob", "--out", path) == 0
        seen = list(_probe["modes"])
        _probe.pop("path")
        # never readable by others, not even between creating and chmod-ing it
        assert all(m == 0o600 for _, m in seen), seen
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        tokens, _ = load_token_file(path)
        assert sorted(tokens) == ["alice", "bob"] and all(len(t) == 64 for t in tokens.values())
        # an existing world-readable file is made private too, and its old content replaced
        with open(path, "w") as f:
            f.write("mallory x\n" * 100)
        os.chmod(path, 0o644)
        assert _fed("tokens", "carol", "--out", path) == 0
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and list(load_token_file(path)[0]) == ["carol"]
        # the TLS key of `tessera fed cert` as well
        assert _fed("cert", "--out-dir", str(tmp_path / "tls")) == 0
        assert stat.S_IMODE(os.stat(tmp_path / "tls" / "server.key").st_mode) == 0o600
    finally:
        _probe.pop("path", None)
        os.umask(old_umask)
