"""Several hosts on one machine, for fault tests and benchmarks: each host is a network namespace
joined by a veth pair to one bridge (``10.215.N.0/24``; this process, in the root namespace, is
``.1`` and reaches every host). Links can be cut (``ip link set down``) and throttled (``tc tbf``).

Needs root and iproute2. Traffic stays between this machine's namespaces.
"""
from __future__ import annotations

import itertools
import os
import subprocess
from typing import Any, Sequence

from worker.netem import namespaces_available

__all__ = ["Fabric", "namespaces_available"]

_counter = itertools.count()
_SLOTS = 200  # fabrics at once on one machine: subnets 10.215.20-219.0/24


class Fabric:
    """``with Fabric(["p0", "b0", "w0"]) as f:`` -> run ``f.prefix("p0") + cmd`` on host p0, reach it at
    ``f.address("p0")``. Everything is removed on exit (also after errors)."""

    def __init__(self, hosts: Sequence[str]) -> None:
        why = namespaces_available()
        if why:
            raise RuntimeError(f"network namespaces: {why}")
        self.hosts = list(hosts)
        self._use_slot((os.getpid() * 7 + next(_counter)) % _SLOTS)

    def _use_slot(self, slot: int) -> None:
        """Names and addresses of slot ``slot``: one bridge name and one subnet per slot."""
        self._slot = slot % _SLOTS
        n = self._slot + 20
        self.tag = f"tf{n}"
        self.subnet = f"10.215.{n}"
        self.bridge = f"{self.tag}br"
        self._addr = {h: f"{self.subnet}.{i + 2}" for i, h in enumerate(self.hosts)}
        self._ns = {h: f"{self.tag}-{h}" for h in self.hosts}
        self._root_end = {h: f"{self.tag}r{i}" for i, h in enumerate(self.hosts)}
        self._ns_end = {h: f"{self.tag}n{i}" for i, h in enumerate(self.hosts)}

    @staticmethod
    def _run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def __enter__(self) -> "Fabric":
        # Claim a free slot: the kernel refuses a second link of one name, so creating the bridge is
        # the lock (another Fabric on this machine, e.g. one of a parallel test run, may hold this one).
        for _ in range(_SLOTS):
            r = subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], capture_output=True, text=True)
            if r.returncode == 0:
                break
            if "File exists" not in r.stderr:
                raise RuntimeError(f"could not build the host fabric: ip link add {self.bridge}: {r.stderr.strip()}")
            self._use_slot(self._slot + 1)
        else:
            raise RuntimeError(f"could not build the host fabric: all {_SLOTS} bridge names are taken")
        try:
            self._run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            self._run("ip", "link", "set", self.bridge, "up")
            for h in self.hosts:
                ns, root, inner = self._ns[h], self._root_end[h], self._ns_end[h]
                self._run("ip", "netns", "add", ns)
                self._run("ip", "link", "add", root, "type", "veth", "peer", "name", inner)
                self._run("ip", "link", "set", inner, "netns", ns)
                self._run("ip", "link", "set", root, "master", self.bridge)
                self._run("ip", "link", "set", root, "up")
                x = ("ip", "netns", "exec", ns)
                self._run(*x, "ip", "addr", "add", f"{self._addr[h]}/24", "dev", inner)
                self._run(*x, "ip", "link", "set", inner, "up")
                self._run(*x, "ip", "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            raise RuntimeError(f"could not build the host fabric: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "link", "del", self._root_end[h]], capture_output=True)
            subprocess.run(["ip", "netns", "del", self._ns[h]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def address(self, host: str) -> str:
        return self._addr[host]

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self._ns[host]]

    def cut(self, host: str) -> None:
        """Take the host's link down: nothing reaches it or leaves it until restore()."""
        self._run("ip", "link", "set", self._root_end[host], "down")

    def restore(self, host: str) -> None:
        self._run("ip", "link", "set", self._root_end[host], "up")

    def throttle(self, host: str, rate: str = "8mbit", burst: str = "64kb", latency: str = "500ms") -> None:
        """Limit the host's bandwidth both ways with a token bucket (tc tbf)."""
        self._run("tc", "qdisc", "add", "dev", self._root_end[host], "root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        self._run(
            *self.prefix(host), "tc", "qdisc", "add", "dev", self._ns_end[host], "root", "tbf", "rate", rate, "burst", burst,
            "latency", latency,
        )
