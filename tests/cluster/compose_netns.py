"""Run a profile of ``docker-compose.yml`` for real without a Docker engine: every service is a
process tree in a network namespace of its own (``worker.netns.Fabric``: veth pairs to a bridge),
as compose would run its container:

* the command: the image's entry point (``tessera``, from this checkout's environment) plus the
  service's ``command``, with the file's ``${VAR}`` / ``${VAR:-default}`` interpolated from
  ``.env`` and the given overrides (a variable given wins over ``.env``, as the shell's does);
* host names: every service name resolves to its namespace's address (``/etc/netns/NS/hosts``,
  which ``ip netns exec`` bind-mounts over ``/etc/hosts``); the UTS name is the ``hostname``;
* secrets at ``/run/secrets/NAME`` and named volumes at their container paths (bind mounts in a
  private mount namespace of the service; missing mount points are created on the host and left
  there: removing one detaches the bind of every process still mounted on it, in any namespace, so
  a run ending beside another one, e.g. a second test session's, took that run's secrets away);
* ``depends_on`` conditions (``service_started``, ``service_healthy`` with the service's
  ``healthcheck`` polled as compose does, ``service_completed_successfully``), and
  ``restart: on-failure`` (a service the test kills stays dead, as after ``docker kill``).

Under the suite's fork server (tests/zygote.py) a service's Python program is forked into those
namespaces instead of exec'd through ``ip netns exec``, ``unshare`` and ``mount`` (same namespaces,
without a torch import per start).

Needs root and iproute2 (and util-linux ``unshare``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests import zygote
from worker.netns import Fabric

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = [str(Path(sys.executable).with_name("tessera"))]
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def read_dotenv(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip().strip('"').strip("'")
    return out


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ``$$``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$VAR``."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(4)
            op, default = m.group(2), m.group(3) or ""
            v = env.get(name)
            if op == ":-" and not v:
                return default
            if op == "-" and v is None:
                return default
            if op in (":?", "?") and not v:
                raise KeyError(f"required variable {name}: {default}")
            return v or ""
        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load(compose: Path, profiles: tuple[str, ...] = (), overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose model with variables interpolated and the services of ``profiles`` selected."""
    env = {**read_dotenv(compose.parent / ".env"), **(overrides or {})}
    model = interpolate(yaml.safe_load(compose.read_text()), env)
    model["services"] = {
        name: svc for name, svc in model["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }
    return model


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    d = svc.get("depends_on") or {}
    if isinstance(d, list):
        return {n: "service_started" for n in d}
    return {n: (c or {}).get("condition", "service_started") for n, c in d.items()}


def _seconds(v: Any, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, (int, float)):
        return float(v)
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(v))
    return float(m.group(1) or 0) * 60 + float(m.group(2) or 0) if m else default


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    log: Path | None = None
    starts: int = 0
    killed: bool = False
    healthy: bool = False
    health_checks: list[str] = field(default_factory=list)  # the statuses the probes printed


class ComposeRun:
    """``with ComposeRun(compose, profiles, overrides, workdir) as run: run.up(); run.wait_exit(...)``."""

    def __init__(self, compose: Path, profiles: tuple[str, ...] = (), overrides: dict[str, str] | None = None,
                 workdir: Path | None = None) -> None:
        self.compose = compose
        self.model = load(compose, profiles, overrides)
        self.services = {n: Service(n, s) for n, s in self.model["services"].items()}
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="compose-run-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.fabric = Fabric(list(self.services))
        self._hosts: list[Path] = []

    # ---------------------------------------------------------------- set-up and tear-down
    def __enter__(self) -> ComposeRun:  # noqa: PYI034 - Python 3.10 has no typing.Self
        self.fabric.__enter__()
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.fabric.address(n)} {n} {s.spec.get('hostname', n)}\n" for n, s in self.services.items()
        )
        for n in self.services:
            d = Path("/etc/netns") / self.ns(n)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)
            self._hosts.append(d)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.services.values():
            self._stop(s, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for s in self.services.values():
            if s.proc is not None:
                try:
                    s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._stop(s, signal.SIGKILL)
                    s.proc.wait()
        self.fabric.__exit__()
        for d in self._hosts:
            shutil.rmtree(d, ignore_errors=True)

    def ns(self, name: str) -> str:
        return self.fabric.prefix(name)[-1]

    def address(self, name: str) -> str:
        return self.fabric.address(name)

    def volume(self, name: str) -> Path:
        p = self.workdir / "volumes" / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    def _command(self, s: Service, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        """``argv`` and its environment, run inside the service's namespaces with its secrets and
        volumes mounted. Under the suite's fork server (tests/zygote.py) a Python command is forked
        into them (``zygote.NAMESPACES``); otherwise ``ip netns exec`` + ``unshare`` + ``mount`` exec it."""
        binds: list[tuple[str, str]] = []
        secrets = s.spec.get("secrets") or []
        if secrets:
            d = self.workdir / "secrets" / s.name
            d.mkdir(parents=True, exist_ok=True)
            for item in secrets:
                name = item if isinstance(item, str) else item["source"]
                target = name if isinstance(item, str) else item.get("target", name)
                src = Path(self.model["secrets"][name]["file"])
                src = src if src.is_absolute() else (self.compose.parent / src)
                if not (d / target).exists():  # a health probe runs this again: never rewrite a file a service reads
                    shutil.copyfile(src, d / target)
            binds.append((str(d), "/run/secrets"))
        for v in s.spec.get("volumes") or []:
            src, _, dst = v.partition(":")
            dst = dst.split(":")[0]
            path = Path(src) if src.startswith(("/", ".")) else self.volume(src)
            binds.append((str(path), dst))
        for _, dst in binds:
            Path(dst).mkdir(parents=True, exist_ok=True)  # (never removed: see the module's docstring)
        env = self._env(s)
        hostname = s.spec.get("hostname", s.name)
        if env.get(zygote.ENV) and zygote.python_command(argv) is not None:
            hosts = (Path("/etc/netns") / self.ns(s.name) / "hosts", Path("/etc/hosts"))  # as ip netns exec binds it
            env[zygote.NAMESPACES] = json.dumps({"netns": f"/run/netns/{self.ns(s.name)}", "hostname": hostname,
                                                 "binds": [list(map(str, hosts)), *map(list, binds)]})
            return argv, env
        script = [f"hostname {hostname}", *(f"mount --bind '{src}' '{dst}'" for src, dst in binds), 'exec "$@"']
        return [*self.fabric.prefix(s.name), "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", " && ".join(script), "sh", *argv], env

    def _env(self, s: Service) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        e = s.spec.get("environment") or {}
        if isinstance(e, list):
            e = dict(x.partition("=")[::2] for x in e)
        env.update({k: str(v) for k, v in e.items()})
        return env

    # ---------------------------------------------------------------- running
    def start(self, name: str) -> None:
        s = self.services[name]
        command = s.spec.get("command") or []
        entry = s.spec.get("entrypoint") or ENTRYPOINT
        s.log = self.workdir / f"{name}.log"
        s.starts += 1
        with open(s.log, "a") as log:
            log.write(f"--- start {s.starts}: {' '.join(map(str, command))}\n")
            log.flush()
            args, env = self._command(s, [*entry, *map(str, command)])
            s.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                      start_new_session=True)

    def _stop(self, s: Service, sig: int) -> None:
        if s.proc is not None and s.proc.poll() is None:
            try:
                os.killpg(s.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, name: str) -> None:
        """``docker kill``: SIGKILL the service's processes and take its link down; no restart."""
        s = self.services[name]
        s.killed = True
        self._stop(s, signal.SIGKILL)
        self.fabric.cut(name)

    def poll(self) -> None:
        """``restart: on-failure``: restart a service that exited non-zero (unless killed)."""
        for s in self.services.values():
            if s.proc is None or s.killed or s.proc.poll() in (None, 0):
                continue
            if s.spec.get("restart") == "on-failure" and s.starts < 4:
                self.start(s.name)

    def check_health(self, name: str) -> bool:
        s = self.services[name]
        hc = s.spec.get("healthcheck") or {}
        test = hc.get("test")
        if not test or hc.get("disable"):
            return s.proc is not None and s.proc.poll() is None
        argv = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else ["sh", "-c", test]
        if argv and argv[0] == "tessera":
            argv = [*ENTRYPOINT, *argv[1:]]
        try:
            # at least 30 s: Docker's probe timeout assumes the container's own CPU, while here the probe (a
            # Python start, TLS) shares 2 cores with the whole suite (5 s probes timed out at load 12)
            args, env = self._command(s, argv)
            r = subprocess.run(args, check=False, capture_output=True, text=True, env=env,
                               timeout=max(30.0, _seconds(hc.get("timeout"), 30)))
            s.health_checks.append((r.stdout + r.stderr).strip())
            return r.returncode == 0
        except subprocess.TimeoutExpired:
            s.health_checks.append("(the probe timed out)")
            return False

    def wait_healthy(self, name: str, timeout: float) -> None:
        s = self.services[name]
        hc = s.spec.get("healthcheck") or {}
        interval = _seconds(hc.get("interval"), 30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.check_health(name):
                s.healthy = True
                return
            time.sleep(interval)
        raise TimeoutError(f"{name} not healthy within {timeout:.0f} s; last probes: {s.health_checks[-3:]}; log:\n{self.tail(name)}")

    def wait_exit(self, name: str, timeout: float) -> int:
        """Wait for the service's (last) process to exit with 0 (restarting on failure meanwhile)."""
        s = self.services[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            assert s.proc is not None
            code = s.proc.poll()
            if code == 0 or (code is not None and (s.killed or s.spec.get("restart") != "on-failure" or s.starts >= 4)):
                return code
            time.sleep(0.3)
        raise TimeoutError(f"{name} did not finish within {timeout:.0f} s; log:\n{self.tail(name)}")

    def up(self, timeout: float = 120.0, only: tuple[str, ...] | None = None) -> None:
        """Start the services in ``depends_on`` order, honouring each dependency's condition."""
        pending = [n for n in self.services if only is None or n in only]
        done = {n for n, s in self.services.items() if s.proc is not None}  # started by an earlier up()
        deadline = time.monotonic() + timeout
        while pending:
            ready = [n for n in pending if all(d in done for d in _depends(self.services[n].spec))]
            if not ready:
                raise RuntimeError(f"depends_on cannot be satisfied for {pending}")
            for n in ready:
                for dep, cond in _depends(self.services[n].spec).items():
                    left = max(1.0, deadline - time.monotonic())
                    if cond == "service_healthy" and not self.services[dep].healthy:
                        self.wait_healthy(dep, left)
                    elif cond == "service_completed_successfully":
                        code = self.wait_exit(dep, left)
                        if code != 0:
                            raise RuntimeError(f"{n} depends on {dep} completing successfully; it exited {code}:\n{self.tail(dep)}")
                self.start(n)
                done.add(n)
                pending.remove(n)

    def tail(self, name: str, lines: int = 30) -> str:
        s = self.services[name]
        if s.log is None or not s.log.exists():
            return "(no log)"
        return "\n".join(s.log.read_text(errors="replace").splitlines()[-lines:])

    def scrape(self, name: str, port: int = 9100) -> str:
        """GET /metrics of a service (from the root namespace, which reaches every namespace). A
        shard's or the federated server's endpoint is behind its security, scraped as
        deploy/prometheus.yml does: HTTPS with the CA (and the client certificate under mutual TLS)
        and the reader token of metrics.bearer."""
        import ssl
        import urllib.request

        cmd = [str(x) for x in self.services[name].spec.get("command") or []]
        if not (cmd[:2] in (["ps", "serve"], ["fed", "server"]) and "--tls-cert" in cmd):
            with urllib.request.urlopen(f"http://{self.address(name)}:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        d = Path(self.model["secrets"]["tls_ca"]["file"]).parent
        ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
        ctx.check_hostname = False  # reached by its namespace's address; the certificate names the service
        if "--tls-ca" in cmd:
            ctx.load_cert_chain(str(d / "client.crt"), str(d / "client.key"))
        req = urllib.request.Request(f"https://{self.address(name)}:{port}/metrics",
                                     headers={"Authorization": f"Bearer {(d / 'metrics.bearer').read_text().strip()}"})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.read().decode()


def make_secrets(out: Path) -> None:
    """deploy/make-secrets.sh, as the README says to run it."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    subprocess.run(["sh", str(ROOT / "deploy" / "make-secrets.sh"), str(out)], check=True, env=env,
                   capture_output=True, text=True)
