"""The port plan of the test suite, the dev cluster, the real node and the benchmarks.

Every port they pick, and every port vLLM picks for itself in their processes, lies outside the
kernel's ephemeral range (``afd_shared_experts.ports``: why), so no outgoing connection can take
it between the pick and the bind (CI saw ``vllm serve`` and vLLM's data-parallel process group
fail with EADDRINUSE on ports picked by binding port 0).

Those ports are cut into disjoint blocks: one per pytest-xdist worker (``gw0`` ..), one for a
process outside xdist (the main job, a benchmark, ``pytest -n 0``) and one for stable ports.
A process hands out ports from its own block only, so two workers never pick the same port.
Inside a block, ``free_port`` serves single ports from its lower half and ``port_span_base``
spans of PORT_SPAN ports from its upper half: a vLLM process given ``VLLM_PORT`` scans upward from it for every port it opens itself (its data-parallel
master ports, the engine's process group), and the span keeps that scan inside ports no one
else is handed. Each kind is handed out in turn (a port comes back only after all others of its
kind); each process starts at an offset of its own (a worker's subprocesses, which inherit its
block, and a developer's pytest beside CI's), and a port is handed out only while nothing
listens on it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from afd_shared_experts.ports import EPHEMERAL_RANGE_FILE, bindable, ephemeral_range, pickable_ports

__all__ = ["WORKER_BLOCKS", "PORT_SPAN", "block_of", "ephemeral_range", "free_port", "port_owner",
           "stable_port", "port_span_base", "describe_bind_failure"]

# Blocks 0..WORKER_BLOCKS-1: xdist workers gw0.., then one for a process outside xdist, one for stable ports.
WORKER_BLOCKS = 8
OUTSIDE_XDIST, STABLE = WORKER_BLOCKS, WORKER_BLOCKS + 1
BLOCKS = WORKER_BLOCKS + 2
# vLLM 0.23 opens at most 5 data-parallel ports plus one per engine process group from VLLM_PORT
# up; the device check one rendezvous port per run (9).
PORT_SPAN = 32

_lock = threading.Lock()
_cursors: dict[str, int] = {}
_stable_handed_out: set[int] = set()
_stable_ports: dict[str, int] = {}
_range_file: Path = EPHEMERAL_RANGE_FILE


def _worker_block() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return OUTSIDE_XDIST
    match = re.fullmatch(r"gw(\d+)", worker)
    if match is None or int(match.group(1)) >= WORKER_BLOCKS:
        raise RuntimeError(f"PYTEST_XDIST_WORKER={worker!r}: the port plan has blocks for gw0..gw{WORKER_BLOCKS - 1} "
                           f"(run pytest with -n {WORKER_BLOCKS} or fewer)")
    return int(match.group(1))


def block_of(index: int) -> list[int]:
    """The ports of block ``index`` (ascending, contiguous in the plan's port list)."""
    ports = pickable_ports(_range_file)
    size = len(ports) // BLOCKS
    if size < 4 * PORT_SPAN:
        raise RuntimeError(f"{len(ports)} ports outside the ephemeral range make blocks of {size}, "
                           f"fewer than {4 * PORT_SPAN}")
    return ports[index * size:(index + 1) * size]


def _process_offset(count: int) -> int:
    return int(hashlib.sha256(str(os.getpid()).encode()).hexdigest(), 16) % count


def _hand_out(kind: str, candidates: list, usable) -> object:
    """The next usable candidate after the last one handed out of ``kind`` (a cursor that wraps:
    a port comes back only after every other one of its kind was handed out)."""
    with _lock:
        start = _cursors.setdefault(kind, _process_offset(len(candidates)))
        for step in range(len(candidates)):
            index = (start + step) % len(candidates)
            if usable(candidates[index]):
                _cursors[kind] = index + 1
                return candidates[index]
    return None


def free_port() -> int:
    """A TCP port of this process's block that no one listens on now (the lower half of the
    block, one port at a time)."""
    block = block_of(_worker_block())
    port = _hand_out("single", block[:len(block) // 2], bindable)
    if port is None:
        raise RuntimeError(f"no free TCP port in this process's block {block[0]}-{block[-1]}")
    return port


def port_span_base() -> int:
    """The first of PORT_SPAN consecutive ports of this process's block (its upper half), all
    free now: for a process that opens several ports from one base (a vLLM process's
    ``VLLM_PORT``, the device check's ``--port``)."""
    block = block_of(_worker_block())
    upper = block[len(block) // 2:]
    spans = [upper[i:i + PORT_SPAN] for i in range(0, len(upper) - PORT_SPAN + 1, PORT_SPAN)]
    span = _hand_out("vllm", [s for s in spans if s[-1] - s[0] == PORT_SPAN - 1],
                     lambda ports: all(bindable(port) for port in ports))
    if span is None:
        raise RuntimeError(f"no free span of {PORT_SPAN} ports in this process's block {block[0]}-{block[-1]}")
    return span[0]


def stable_port(key: str) -> int:
    """The same port for the same key, run after run, where it is free: for servers whose port
    ends up in a cache key (a docker build argument, a vLLM engine's config hash). From the
    stable block; falls back to the next free port there. Within this process a key keeps its
    port, and no other caller gets it."""
    block = block_of(STABLE)
    start = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(block)
    with _lock:
        known = _stable_ports.get(key)
        if known is not None and bindable(known):
            return known
        for port in block[start:] + block[:start]:
            if port not in _stable_handed_out and bindable(port):
                _stable_handed_out.add(port)
                _stable_ports[key] = port
                return port
    raise RuntimeError(f"no free TCP port left in the stable block {block[0]}-{block[-1]}")


def port_owner(port: int) -> str:
    """Who listens on TCP ``port`` on this host ("pid N: command line"), read from /proc, for a
    failure message that names the other owner of a port; "nobody" when no socket listens."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            if local_port == port and state == "0A":  # LISTEN
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return "nobody"
    owners = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                owners.append(f"pid {proc.name}: {command[:200]}")
        except OSError:
            continue
    return "; ".join(owners) or "a socket of a process this user cannot read"


# A port in a bind failure: torch's DistNetworkError ("port: N, ... EADDRINUSE"), asyncio/uvicorn
# ("bind on address ('host', N)"), ZMQ ("Address already in use (addr='tcp://host:N')").
_BIND_FAILURES = (r"port: (\d+)[^\n]*EADDRINUSE", r"bind on address \('[^']*', (\d+)\)",
                  r"Address already in use \(addr='tcp://[^']*:(\d+)'\)")


def describe_bind_failure(log: str) -> str:
    """For a process log: which process holds each port a bind failure in it names ("" if none)."""
    ports = sorted({int(port) for pattern in _BIND_FAILURES for port in re.findall(pattern, log)})
    return "; ".join(f"port {port} held by {port_owner(port)}" for port in ports)
