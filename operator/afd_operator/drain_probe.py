"""The drain probe: whether a draining Attention head is done, i.e. no longer listed in the API
Service's EndpointSlices (so kube-proxy stops sending it connections) and running no request
by its vLLM /metrics. The one HTTP client of the operator besides the Kubernetes API."""

from __future__ import annotations

import urllib.request

from .observe import Observed, ObservedPod

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


def idle_heads(observed: Observed) -> frozenset[str]:
    """The draining heads (not yet being deleted) that no Service endpoint lists any more and
    that report no running request. A head still listed may get a new connection any moment:
    between two requests it reads idle, and deleting it then would refuse that connection."""
    return frozenset(p.name for p in observed.pods
                     if p.head and p.drain_started_at is not None and not p.deleting
                     and p.name not in observed.routed and head_is_idle(p))
