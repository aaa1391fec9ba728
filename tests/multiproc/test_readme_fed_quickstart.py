"""The README's federated quick start (issue 17 item 13) runs as written, as one bash script in a
fresh directory, with two substitutions: the port 5000 by a free one and `--rounds 30` by
`--rounds 3` (time). A TLS + token server, both clients the server waits for (alice and bob, each
contributing every round), then a simulation that writes fed-demo/sim/results.json. Everything it
writes is under fed-demo/ (issue 31 item 8), which .gitignore ignores."""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


@pytest.mark.timeout(200)
def test_readme_federated_quick_start(tmp_path) -> None:
    text = open(README).read()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "tessera fed cert" in b)
    assert block.count("--rounds 30") == 2 and "5000" in block
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = block.replace("5000", str(port)).replace("--rounds 30", "--rounds 3")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=190, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert os.listdir(tmp_path) == ["fed-demo"]  # nothing else in the directory it ran in
    demo = tmp_path / "fed-demo"
    assert stat.S_IMODE(os.stat(demo / "tokens.txt").st_mode) == 0o600
    assert re.search(r"round 3: 2/2 clients", p.stdout), p.stdout[-3000:]
    assert p.stdout.count("server finished; exiting (3 update(s) contributed)") == 2, p.stdout[-3000:]
    assert (demo / "ckpt.msgpack").stat().st_size > 0
    summary = json.loads((demo / "sim" / "results.json").read_text())["summary"]
    assert 0 < summary["final_accuracy"] <= 1
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "fed-demo/tokens.txt"],
                             cwd=os.path.dirname(README), timeout=30)
    assert ignored.returncode == 0, "fed-demo/ is not in .gitignore"
