"""The README's federated client (under 30 lines) works as written: two copies of it, as processes,
train with a real `tessera fed server` over TLS with tokens for two rounds, each reading its token
from the file `tessera fed tokens` wrote (`start_client(..., token_file=, identity=)`, issue 31
item 4), and both exit when the server is done."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from ps.cli import read_first_line

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_federated_client(tmp_path) -> None:
    text = open(README).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "start_client(" in b)
    assert len(block.strip().splitlines()) < 30
    (tmp_path / "my_client.py").write_text(block)
    results = tmp_path / "history.json"
    fed = [sys.executable, "-m", "tessera.cli", "fed"]
    for cmd in (["cert", "--out-dir", "fed-demo/tls"], ["tokens", "alice", "bob", "--out", "fed-demo/tokens.txt"]):
        subprocess.run([*fed, *cmd], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    server = subprocess.Popen(
        [*fed, "server", "--task", "digits", "--rounds", "2", "--min-clients", "2", "--port", "0", "--results", str(results),
         "--tls-cert", "fed-demo/tls/server.crt", "--tls-key", "fed-demo/tls/server.key", "--token-file", "fed-demo/tokens.txt"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    clients: list[subprocess.Popen] = []
    try:
        line = read_first_line(server, time.monotonic() + 60)
        assert "listening on" in line, line
        address = line.split("listening on ")[1].split()[0]
        clients = [
            subprocess.Popen([sys.executable, str(tmp_path / "my_client.py"), address, str(i), "2", who],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            for i, who in enumerate(("alice", "bob"))
        ]
        for c in clients:
            _, err = c.communicate(timeout=120)
            assert c.returncode == 0, err[-2000:]
        server.wait(60)
        assert server.returncode == 0, server.stderr.read()[-2000:] if server.stderr else ""
    finally:
        for p in [server, *clients]:
            if p.poll() is None:
                p.kill()
    history = json.loads(results.read_text())["history"]
    assert len(history) >= 2, history
    assert {r.get("round") for r in history} >= {1, 2}, history
    assert all(set(r["clients"]) == {"alice", "bob"} for r in history[:2]), history  # named by their tokens
