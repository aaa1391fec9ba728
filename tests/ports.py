"""A loopback port nothing listens on (for now): the tests' one way to choose a port before a server starts,
or to name an address where no server is."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 and took back (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
