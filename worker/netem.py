"""A real slow link for experiments: a network namespace joined to this host by a veth pair, with
``tc netem`` delay on the namespace's side. Processes started with ``prefix()`` run inside it and
reach the host at ``host_address``; everything they send crosses the delayed link.

Needs root and iproute2 (``ip``, ``tc``). Traffic stays between this host and the namespace.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Any

__all__ = ["NetemLink", "netem_available", "namespaces_available"]


def namespaces_available() -> str | None:
    """None if network namespaces and veth links can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


@functools.lru_cache(maxsize=None)
def netem_available() -> str | None:
    """None if a delayed NetemLink can be made here, else why not (probes the kernel's netem qdisc once)."""
    why = namespaces_available()
    if why:
        return why
    probe = f"tsp{os.getpid() % 100000}"
    try:
        if subprocess.run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"], capture_output=True).returncode:
            return "cannot create veth links"
        r = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"], capture_output=True, text=True)
        return None if r.returncode == 0 else f"the kernel has no netem qdisc ({r.stderr.strip()})"
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


class NetemLink:
    """``with NetemLink(delay_ms) as link:`` -> start servers on ``link.host_address``, run the
    delayed process with ``link.prefix() + cmd``. Removed on exit (also after errors)."""

    def __init__(self, delay_ms: float, name: str | None = None, subnet: int | None = None) -> None:
        """``delay_ms`` 0: the namespace and link without a delay."""
        why = netem_available() if delay_ms > 0 else namespaces_available()
        if why:
            raise RuntimeError(f"--netem {why}")
        tag = name or f"ts{os.getpid() % 100000}"
        self.ns = f"{tag}-ns"
        self.veth_host, self.veth_ns = f"{tag}h", f"{tag}n"
        octet = subnet if subnet is not None else 64 + os.getpid() % 128
        self.host_address = f"10.213.{octet}.1"
        self.ns_address = f"10.213.{octet}.2"
        self.delay_ms = delay_ms

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def __enter__(self) -> "NetemLink":
        try:
            self._run("ip", "netns", "add", self.ns)
            self._run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
            self._run("ip", "link", "set", self.veth_ns, "netns", self.ns)
            self._run("ip", "addr", "add", f"{self.host_address}/30", "dev", self.veth_host)
            self._run("ip", "link", "set", self.veth_host, "up")
            ns = ("ip", "netns", "exec", self.ns)
            self._run(*ns, "ip", "addr", "add", f"{self.ns_address}/30", "dev", self.veth_ns)
            self._run(*ns, "ip", "link", "set", self.veth_ns, "up")
            self._run(*ns, "ip", "link", "set", "lo", "up")
            if self.delay_ms > 0:
                self._run(*ns, "tc", "qdisc", "add", "dev", self.veth_ns, "root", "netem", "delay", f"{self.delay_ms}ms")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise RuntimeError(f"could not set up the netem link: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["ip", "link", "del", self.veth_host], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]
