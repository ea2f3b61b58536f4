"""The dev cluster's port allocator: ports outside the kernel's ephemeral range, each handed
out once, never one that something already listens on."""

from __future__ import annotations

import socket

from afd_devcluster import ports


def test_ports_lie_outside_the_ephemeral_range_and_are_not_repeated():
    low, high = ports.ephemeral_range()
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == len(handed)
    assert all(p >= 10000 and not low <= p <= high for p in handed)


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        probe.bind(("127.0.0.1", 0))
        idle = probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(ports, "candidate_ports", lambda: [busy.getsockname()[1], idle])
        assert ports.free_port() == idle


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t64000\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", range_file)
    candidates = ports.candidate_ports()
    assert set(candidates) == set(range(10000, 20000)) | set(range(64001, 65536))


def test_a_stable_port_is_the_same_for_its_key_and_never_anothers(monkeypatch):
    monkeypatch.setattr(ports, "_stable_ports", {})
    first = ports.stable_port("offline-deepseek_v2-ffn")
    assert ports.stable_port("offline-deepseek_v2-ffn") == first
    # A new process (empty memory of keys, nothing handed out) finds the same port again.
    monkeypatch.setattr(ports, "_stable_ports", {})
    monkeypatch.setattr(ports, "_handed_out", set())
    assert ports.stable_port("offline-deepseek_v2-ffn") == first
    others = {ports.stable_port(f"key-{i}") for i in range(20)} | {ports.free_port() for _ in range(20)}
    assert first not in others and len(others) == 40


def test_a_stable_port_in_use_moves_to_the_next_free_one(monkeypatch):
    monkeypatch.setattr(ports, "_stable_ports", {})
    monkeypatch.setattr(ports, "_handed_out", set())
    usual = ports.stable_port("taken")
    monkeypatch.setattr(ports, "_stable_ports", {})
    monkeypatch.setattr(ports, "_handed_out", set())
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", usual))
        busy.listen()
        moved = ports.stable_port("taken")
    assert moved != usual and moved >= 10000
