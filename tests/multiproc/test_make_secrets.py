"""deploy/make-secrets.sh does what it prints (issue 31 item 8): run as root (as here, and as the
cluster test runs it), private keys and tokens are mode 0600 owned by the containers' user
(uid 10001, or TESSERA_UID), certificates 0644, the directory 0700, and ca.key is deleted, or
kept 0600 and owned by the caller with KEEP_CA_KEY=1; its last lines say exactly that."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0, reason="the root branch (chown to the containers' user) needs root")]


def _run(out: Path, **env: str) -> list[str]:
    e = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **env}
    r = subprocess.run(["sh", str(ROOT / "deploy" / "make-secrets.sh"), str(out)], env=e, capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout.splitlines()


def _mode_owner(p: Path) -> tuple[int, int]:
    st = p.stat()
    return stat.S_IMODE(st.st_mode), st.st_uid


def test_what_it_prints_is_what_it_did(tmp_path) -> None:
    out = tmp_path / "secrets"
    lines = _run(out)
    assert lines == [f"secrets written to {out} (directory mode 0700)",
                     "private keys and tokens: mode 0600, owned by uid 10001 (the containers' user); certificates: mode 0644",
                     "ca.key deleted: nothing more can be signed with this CA (KEEP_CA_KEY=1 keeps it)"], lines
    assert stat.S_IMODE(out.stat().st_mode) == 0o700 and not (out / "ca.key").exists()
    private = [p for p in out.iterdir() if p.suffix in (".key", ".token", ".tokens")]
    assert {p.name for p in private} >= {"server.key", "client.key", "ps.tokens", "fed.tokens", "w0.token", "c2.token"}
    for p in private:
        assert _mode_owner(p) == (0o600, 10001), p.name
    for p in out.glob("*.crt"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name
    # nothing the script leaves is readable by others than its owner, except the certificates
    for p in out.iterdir():
        if p.suffix != ".crt":
            assert not stat.S_IMODE(p.stat().st_mode) & 0o077, p.name


def test_keep_ca_key_and_another_uid(tmp_path) -> None:
    out = tmp_path / "secrets"
    lines = _run(out, KEEP_CA_KEY="1", TESSERA_UID="12345")
    assert lines[1].startswith("private keys and tokens: mode 0600, owned by uid 12345"), lines
    assert lines[2].startswith("ca.key kept (mode 0600, owned by root)"), lines
    assert _mode_owner(out / "ca.key") == (0o600, os.geteuid())  # the caller's, never the containers'
    assert _mode_owner(out / "server.key") == (0o600, 12345)
