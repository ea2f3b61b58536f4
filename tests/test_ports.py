"""The suite's port plan (afd_devcluster.ports) and the plugin's own port pick
(afd_shared_experts.ports): outside the kernel's ephemeral range, disjoint blocks per xdist
worker, spans for vLLM's own picks, and no other way of picking a port in the tree."""

from __future__ import annotations

import ast
import os
import socket
from pathlib import Path

import pytest

from afd_devcluster import ports
from afd_shared_experts import ports as plugin_ports

PORT_MODULES = ("devcluster/afd_devcluster/ports.py", "plugin/afd_shared_experts/ports.py")


@pytest.fixture
def fresh_plan(monkeypatch):
    """The plan as a new process sees it (no cursor, no stable key remembered)."""
    monkeypatch.setattr(ports, "_cursors", {})
    monkeypatch.setattr(ports, "_stable_ports", {})
    monkeypatch.setattr(ports, "_stable_handed_out", set())
    return monkeypatch


def outside_reserved(port: int) -> bool:
    low, high = ports.ephemeral_range()
    return port >= 10000 and not low <= port <= high and port not in plugin_ports.NODE_PORTS


@pytest.mark.parametrize("worker", ["gw0", "gw1", "gw7", None])
def test_every_kind_of_port_lies_in_the_workers_block_outside_the_ephemeral_range(fresh_plan, worker):
    if worker is None:
        fresh_plan.delenv("PYTEST_XDIST_WORKER", raising=False)
        block = set(ports.block_of(ports.OUTSIDE_XDIST))
    else:
        fresh_plan.setenv("PYTEST_XDIST_WORKER", worker)
        block = set(ports.block_of(int(worker[2:])))
    singles = [ports.free_port() for _ in range(50)]
    bases = [ports.port_span_base() for _ in range(5)]
    spans = [port for base in bases for port in range(base, base + ports.PORT_SPAN)]
    assert len(set(singles)) == len(singles) and len(set(spans)) == len(spans)
    assert not set(singles) & set(spans)
    assert set(singles) | set(spans) <= block
    assert all(outside_reserved(port) for port in singles + spans)
    stable = ports.stable_port("some-key")
    assert stable in ports.block_of(ports.STABLE) and outside_reserved(stable)


def test_no_two_blocks_share_a_port():
    blocks = [set(ports.block_of(index)) for index in range(ports.BLOCKS)]
    assert all(blocks)
    assert sum(len(block) for block in blocks) == len(set().union(*blocks))


def test_a_worker_past_the_plan_is_refused_with_the_limit(fresh_plan):
    fresh_plan.setenv("PYTEST_XDIST_WORKER", f"gw{ports.WORKER_BLOCKS}")
    with pytest.raises(RuntimeError, match=r"blocks for gw0\.\.gw7 \(run pytest with -n 8 or fewer\)"):
        ports.free_port()


def test_a_port_in_use_is_skipped_and_its_owner_named(fresh_plan):
    fresh_plan.setenv("PYTEST_XDIST_WORKER", "gw3")
    expected = ports.free_port()
    fresh_plan.setattr(ports, "_cursors", {})
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", expected))
        busy.listen()
        assert ports.free_port() != expected
        owner = ports.port_owner(expected)
        assert owner.startswith(f"pid {os.getpid()}: ")
        log = f"DistNetworkError: failed to listen. port: {expected}, useIpv6: false, code: -98, name: EADDRINUSE"
        assert ports.describe_bind_failure(log) == f"port {expected} held by {owner}"
    assert ports.port_owner(expected) == "nobody"
    assert ports.describe_bind_failure("no bind failure here") == ""


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t64000\n")
    assert set(plugin_ports.pickable_ports(range_file)) == set(range(10000, 20000)) | set(range(64001, 65536))
    monkeypatch.setattr(ports, "_range_file", range_file)
    assert set().union(*(ports.block_of(i) for i in range(ports.BLOCKS))) < set(range(10000, 20000)) | \
        set(range(64001, 65536))
    range_file.write_text("1024\t65535\n")
    with pytest.raises(RuntimeError, match="outside the ephemeral range 1024-65535"):
        ports.block_of(0)


def test_a_stable_port_is_the_same_for_its_key_and_never_anothers(fresh_plan):
    first = ports.stable_port("offline-deepseek_v2-ffn")
    assert ports.stable_port("offline-deepseek_v2-ffn") == first
    # A new process (no memory of keys) finds the same port again.
    fresh_plan.setattr(ports, "_stable_ports", {})
    fresh_plan.setattr(ports, "_stable_handed_out", set())
    assert ports.stable_port("offline-deepseek_v2-ffn") == first
    others = {ports.stable_port(f"key-{i}") for i in range(20)}
    assert first not in others and len(others) == 20


def test_a_stable_port_in_use_moves_to_the_next_free_one(fresh_plan):
    usual = ports.stable_port("taken")
    fresh_plan.setattr(ports, "_stable_ports", {})
    fresh_plan.setattr(ports, "_stable_handed_out", set())
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", usual))
        busy.listen()
        moved = ports.stable_port("taken")
    assert moved != usual and moved in ports.block_of(ports.STABLE)


def test_the_plugins_own_pick_avoids_the_ephemeral_range():
    assert plugin_ports.listen_ports(0) == []
    picked = plugin_ports.listen_ports(20, "127.0.0.1")
    assert len(set(picked)) == 20 and all(outside_reserved(port) for port in picked)


def picks_of(path: Path) -> list[str]:
    """Ways of picking a port in one file: a function named like a port picker, a bind to
    port 0 whose port is read back (``getsockname``), or a port range scanned by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                any(word in node.name for word in ("free_port", "open_port", "unused_port", "listen_port")):
            found.append(f"{path}:{node.lineno}: def {node.name}")
        if isinstance(node, ast.Attribute) and node.attr == "getsockname":
            found.append(f"{path}:{node.lineno}: getsockname")
    return found


def test_every_port_pick_in_the_tree_goes_through_the_plan(repo_root):
    files = [path for folder in ("operator", "plugin", "devcluster", "tests", "benchmarks", "images", "scripts")
             for path in sorted((repo_root / folder).rglob("*.py"))]
    assert len(files) > 100
    allowed = {repo_root / module for module in PORT_MODULES} | {Path(__file__).resolve()}
    picks = [pick for path in files if path not in allowed for pick in picks_of(path)]
    assert picks == []
