"""README "Dependencies": the row kernel is an optional extension, so where no C compiler works
``pip install`` still succeeds and the shards run the numpy path, saying why.

A copy of the project is built into a wheel by pip (as ``pip install`` builds it: PEP 517, build
isolation) with ``CC=/bin/false``, a compiler that fails every compilation. The build must succeed
without the kernel, and the package installed from that wheel (into a directory of its own, with
the test environment's numpy and torch) must load without it and say that it was not built. With
``optional=False`` in setup.py the build fails and so does this test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pip_builds_without_a_c_compiler_and_the_shard_runs_the_numpy_path(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for pkg in ("tessera", "ps", "worker", "federated"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    env = {**os.environ, "CC": "/bin/false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(src)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = wheels.glob("tessera-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "ps/rowkernel.py" in names
    assert not [n for n in names if "_rowkernel" in n and not n.endswith((".py", ".c"))], names  # no compiled kernel

    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)  # what `pip install` of the wheel puts in site-packages
    code = "import ps.rowkernel as k; print(k.__file__); print(k.KERNEL is None); print(k.path_of('adagrad', {}, 'float32'))"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True, text=True, timeout=120, check=True,
    )
    where, missing, path = r.stdout.splitlines()
    assert where.startswith(str(site)), where  # the copy from the wheel, not the checkout's
    assert missing == "True"
    assert path == "numpy (not built (no C compiler at install: pip install -e . with one builds it))"
