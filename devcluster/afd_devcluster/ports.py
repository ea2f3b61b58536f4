"""Ports for local servers started by the dev cluster and the tests.

A port found by binding to port 0 lies in the kernel's ephemeral range, which the kernel also
uses for the source ports of outgoing connections (gloo, ZMQ, HTTP clients). Between that
check and the server's own bind, any such connection can take it: CI saw ``vllm serve`` fail
with EADDRINUSE that way. Ports outside the ephemeral range are taken only by explicit binds,
and this process hands out each one at most once.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path

_LOWEST = 10000
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_lock = threading.Lock()
_handed_out: set[int] = set()
_stable_ports: dict[str, int] = {}


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when the file is not there)."""
    try:
        low, high = _EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def candidate_ports() -> list[int]:
    """Ports at or above 10000 outside the ephemeral range, starting at a per-process offset
    so that concurrent test runs on one machine rarely probe the same ports."""
    low, high = ephemeral_range()
    ports = [p for p in range(_LOWEST, 65536) if not low <= p <= high]
    if not ports:
        raise RuntimeError(f"no port at or above {_LOWEST} lies outside the ephemeral range {low}-{high}")
    start = (os.getpid() * 7919) % len(ports)
    return ports[start:] + ports[:start]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port no one listens on now, outside the ephemeral range, never returned before
    by this process."""
    with _lock:
        for port in candidate_ports():
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise RuntimeError("no free TCP port outside the ephemeral range")


def stable_port(key: str) -> int:
    """The same port for the same key, run after run, where it is free: for servers whose port
    ends up in a cache key (a docker build argument, a vLLM engine's config hash). Falls back
    to free_port(); within this process a key keeps its port, and no other caller gets it."""
    low, high = ephemeral_range()
    start = 20000 + int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5000
    with _lock:
        known = _stable_ports.get(key)
        if known is not None and _bindable(known):
            return known
        for port in range(start, start + 50):
            if port not in _handed_out and not low <= port <= high and _bindable(port):
                _handed_out.add(port)
                _stable_ports[key] = port
                return port
    return free_port()
