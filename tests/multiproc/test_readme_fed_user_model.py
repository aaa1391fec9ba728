"""The README's federated server for a user model runs as written (issue 17 items 4 and 13): its
`my_task.py` and `my_numpy_client.py` blocks are saved as files and its shell block is run by bash
in that directory, with the README's port 5001 replaced by a free one (the README says any free
port will do). `tessera fed server --task my_task:make` finds the module in the current
directory, evaluates centrally every round, and the central MSE falls; both clients exit 0."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ports import free_port  # type: ignore[import-not-found]  # (tests/ports.py)

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def block(lang: str, marker: str) -> str:
    text = open(README).read()
    return next(b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if marker in b)



@pytest.mark.timeout(150)
def test_readme_server_for_a_user_model(tmp_path) -> None:
    (tmp_path / "my_task.py").write_text(block("python", "my_task.py:"))
    (tmp_path / "my_numpy_client.py").write_text(block("python", "my_numpy_client.py:"))
    shell = block("bash", "--task my_task:make").replace("5001", str(free_port()))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the module is found in the current directory, not through the environment
    p = subprocess.run(["bash", "-c", shell + "\nwait\n"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=140, start_new_session=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rounds = re.findall(r"round (\d+): 2/2 clients, .*central loss (\S+), mse (\S+),", p.stdout)
    assert [int(r) for r, _, _ in rounds] == [1, 2, 3, 4, 5], p.stdout
    mse = [float(m) for _, _, m in rounds]
    assert all(b < a for a, b in zip(mse, mse[1:])) and mse[-1] < 0.01, mse  # least squares converges
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
