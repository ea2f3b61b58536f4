"""The vLLM harness's use of the port plan (vllm_harness.vllm_port_span)."""

from __future__ import annotations

from pathlib import Path

import vllm_harness
from afd_devcluster.ports import PORT_SPAN, port_span_base


def test_a_vllm_span_comes_without_the_shared_memory_a_killed_engine_left_on_its_ports(monkeypatch):
    """vLLM 0.23 names a CPU tensor-parallel group's /dev/shm segment after its process group's
    port; the plan gives out the same ports run after run, so a segment a killed engine left
    would make the next engine on that port fail (errno 17). Segments of other ports stay."""
    base = port_span_base()
    monkeypatch.setattr(vllm_harness, "port_span_base", lambda: base)
    shm = Path("/dev/shm")
    stale = [shm / f"{base}-tp:0-[0-1]-cpushm_0", shm / f"{base + PORT_SPAN - 1}-tp:0-[0-1]-cpushm_1"]
    other = shm / f"{base + PORT_SPAN}-tp:0-[0-1]-cpushm_0"
    try:
        for path in (*stale, other):
            path.write_bytes(b"\0")
        assert vllm_harness.vllm_port_span() == base
        assert not any(path.exists() for path in stale) and other.exists()
    finally:
        for path in (*stale, other):
            path.unlink(missing_ok=True)
