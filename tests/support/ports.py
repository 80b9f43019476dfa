"""Ports for the servers a test starts: each pytest-xdist worker picks from a range of its own, below the kernel's
ephemeral range, so two workers (or an outgoing connection) never race for the same port between its check and its
bind."""

from __future__ import annotations

import itertools
import os
import socket

#: Where the workers' ranges start; the kernel hands out ephemeral ports from 32768 (net.ipv4.ip_local_port_range).
FIRST = 20000
#: Ports per worker: up to 12 workers fit below the ephemeral range.
PER_WORKER = 1000


def worker_number() -> int:
    """0 for the controller or a run without xdist, else the worker's number (``gw3`` is 3)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0)


def _candidates() -> itertools.cycle[int]:
    start = FIRST + worker_number() * PER_WORKER
    return itertools.cycle(range(start, start + PER_WORKER))


_NEXT = _candidates()


def free_port() -> int:
    """The next port of this worker's range that nobody listens on (so a port just given out is not reused soon)."""
    for _ in range(PER_WORKER):
        port = next(_NEXT)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port left in worker {worker_number()}'s range")
