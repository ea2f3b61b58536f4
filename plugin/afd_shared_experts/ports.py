"""Listening ports a process picks for itself (the selfcheck's rendezvous when none is given).

A port found by binding to port 0 lies in the kernel's ephemeral range, which the kernel also
hands out as the source port of every outgoing connection (gloo, ZMQ, HTTP clients). Between the
pick and the server's own bind any such connection can take it, and the bind fails with
EADDRINUSE. A port outside that range is taken only by an explicit bind, so a pick there can
lose only to another process that picks the same port on purpose.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

LOWEST_PORT = 10000
# Kubernetes' default Service NodePort range (kube-proxy's on a node of this host).
NODE_PORTS = range(30000, 32768)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(range_file: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range, inclusive (Linux's default where the file is absent)."""
    try:
        low, high = range_file.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def pickable_ports(range_file: Path = EPHEMERAL_RANGE_FILE) -> list[int]:
    """Ports from LOWEST_PORT up that no outgoing connection and no NodePort can take, ascending."""
    low, high = ephemeral_range(range_file)
    ports = [p for p in range(LOWEST_PORT, 65536) if not low <= p <= high and p not in NODE_PORTS]
    if not ports:
        raise RuntimeError(f"no port from {LOWEST_PORT} up lies outside the ephemeral range {low}-{high} "
                           f"({range_file}) and the NodePort range")
    return ports


def bindable(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listen_ports(count: int, host: str = "0.0.0.0") -> list[int]:
    """``count`` distinct ports outside the ephemeral range that nobody listens on now, from a
    per-process starting point (two processes picking at once rarely probe the same ports)."""
    if count == 0:
        return []
    ports = pickable_ports()
    start = (os.getpid() * 7919) % len(ports)
    picked = []
    for port in ports[start:] + ports[:start]:
        if bindable(port, host):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise RuntimeError(f"only {len(picked)} of {count} ports outside the ephemeral range are free on {host}")
