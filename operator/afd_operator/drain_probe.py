"""The drain probe: whether a draining Attention head still runs requests, read from its
vLLM /metrics. The one HTTP client of the operator besides the Kubernetes API."""

from __future__ import annotations

import urllib.request
from typing import Iterable

from .observe import ObservedPod

PROBE_TIMEOUT_SECONDS = 0.5
# vLLM's gauge of requests being processed; a draining head at 0 has finished its work.
RUNNING_REQUESTS_METRIC = "vllm:num_requests_running"


def head_is_idle(pod: ObservedPod) -> bool:
    """Whether a draining Attention head reports no running request on its vLLM /metrics.
    Unreachable or unreadable metrics mean "not known idle": the drain waits its window."""
    if not pod.pod_ip or not pod.api_port:
        return False
    try:
        with urllib.request.urlopen(f"http://{pod.pod_ip}:{pod.api_port}/metrics",
                                    timeout=PROBE_TIMEOUT_SECONDS) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return False
    running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(RUNNING_REQUESTS_METRIC) and not line.startswith("#")]
    return bool(running) and sum(running) == 0


def idle_heads(pods: Iterable[ObservedPod]) -> frozenset[str]:
    """The draining heads (not yet being deleted) that report no running request."""
    return frozenset(p.name for p in pods
                     if p.head and p.drain_started_at is not None and not p.deleting and head_is_idle(p))
