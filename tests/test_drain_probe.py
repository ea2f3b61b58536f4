"""The drain probe: a draining head ends its drain early only when no endpoint of the API
Service lists it and its vLLM /metrics (real HTTP) reports no running request."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from afd_devcluster.ports import free_port
from afd_operator.drain_probe import idle_heads
from afd_operator.observe import Observed, ObservedPod, endpoint_pods
from vllm_metrics import FakeVllmMetrics

NOW = 1_000_000.0


@pytest.fixture
def metrics() -> Iterator[FakeVllmMetrics]:
    server = FakeVllmMetrics("127.0.0.1", free_port())
    yield server
    server.close()


def draining_head(name: str, port: int) -> ObservedPod:
    return ObservedPod(name=name, instance="d-r-0", revision="r", index=0, role="attention", ordinal=0, head=True,
                       phase="Running", scheduled=True, ready=True, ready_changed_at=NOW, created_at=NOW,
                       deleting=False, serving=False, drain_started_at=NOW, termination=None, unschedulable=None,
                       pod_ip="127.0.0.1", api_port=port)


def test_endpoint_pods_are_the_pod_targets_of_a_slice_of_the_service() -> None:
    of_service = {"ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "d", "uid": "s1",
                                       "controller": True}]}
    body = {"metadata": of_service, "endpoints": [
        {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "head-a"}},
        {"addresses": ["10.0.0.2"], "conditions": {"terminating": True}, "targetRef": {"kind": "Pod", "name": "head-b"}},
        {"addresses": ["10.0.0.3"], "targetRef": {"kind": "Node", "name": "node-0"}},
        {"addresses": ["10.0.0.4"]},
    ]}
    assert endpoint_pods(body, "d") == {"head-a", "head-b"}
    assert endpoint_pods({"metadata": of_service, "endpoints": None}, "d") == frozenset()
    # A slice with the labels copied but made by someone else, or for another Service: ignored.
    assert endpoint_pods({**body, "metadata": {}}, "d") is None
    assert endpoint_pods(body, "other") is None
    not_controller = {"ownerReferences": [{**of_service["ownerReferences"][0], "controller": False}]}
    assert endpoint_pods({**body, "metadata": not_controller}, "d") is None


def test_an_idle_head_still_listed_by_an_endpoint_keeps_draining(metrics: FakeVllmMetrics) -> None:
    head = draining_head("d-r-0-attn-0", metrics.server.server_address[1])
    metrics.running = 0
    assert idle_heads(Observed(pods=(head,), objects=(), routed=frozenset({head.name}))) == frozenset()
    assert idle_heads(Observed(pods=(head,), objects=())) == {head.name}


def test_a_busy_unlisted_head_keeps_draining(metrics: FakeVllmMetrics) -> None:
    head = draining_head("d-r-0-attn-0", metrics.server.server_address[1])
    metrics.running = 2
    assert idle_heads(Observed(pods=(head,), objects=())) == frozenset()


def test_only_draining_heads_not_yet_deleted_are_probed(metrics: FakeVllmMetrics) -> None:
    head = draining_head("d-r-0-attn-0", metrics.server.server_address[1])
    metrics.running = 0
    others = (replace(head, name="serving", drain_started_at=None), replace(head, name="going", deleting=True),
              replace(head, name="rank-1", head=False), replace(head, name="no-ip", pod_ip=None))
    assert idle_heads(Observed(pods=others, objects=())) == frozenset()
