"""Watch caches (kopf indexes) of the operator's children, and wake-ups on their changes."""

from __future__ import annotations

from typing import Any

import kopf

from .. import naming
from ..observe import endpoint_pods, summarize_object, summarize_pod

OWNED = {naming.LABEL_MANAGED_BY: naming.MANAGER, naming.LABEL_DEPLOYMENT: kopf.PRESENT}


@kopf.index("pods", labels=OWNED)
async def afd_pods(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    pod = summarize_pod(body)
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): pod} if pod else None


@kopf.index("services", labels=OWNED)
async def afd_services(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): summarize_object("Service", body)}


@kopf.index("configmaps", labels=OWNED)
async def afd_configmaps(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): summarize_object("ConfigMap", body)}


# No version: the cluster's preferred one (policy/v1 from Kubernetes 1.21, v1beta1 before).
DISRUPTION_BUDGETS = ("policy", "poddisruptionbudgets")
NETWORK_POLICIES = ("networking.k8s.io", "networkpolicies")


@kopf.index(*DISRUPTION_BUDGETS, labels=OWNED)
async def afd_disruption_budgets(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): summarize_object("PodDisruptionBudget", body)}


@kopf.index(*NETWORK_POLICIES, labels=OWNED)
async def afd_network_policies(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): summarize_object("NetworkPolicy", body)}


# The EndpointSlice controller copies a Service's labels onto its slices, so OWNED finds them.
# No version: the cluster's preferred one (v1 since Kubernetes 1.21, v1beta1 before; both
# carry endpoints[].targetRef).
ENDPOINT_SLICES = ("discovery.k8s.io", "endpointslices")


@kopf.index(*ENDPOINT_SLICES, labels={**OWNED, naming.LABEL_SERVICE_NAME: kopf.PRESENT})
async def afd_routed_pods(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    deployment = labels[naming.LABEL_DEPLOYMENT]
    service = naming.api_service_name(deployment)
    if labels[naming.LABEL_SERVICE_NAME] != service:
        return None  # an instance's headless Service: it routes no client request
    routed = endpoint_pods(body, service)
    return None if routed is None else {(namespace, deployment): routed}


@kopf.on.event("pods", labels=OWNED)
async def wake_on_pod_change(namespace: str, labels: dict, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels[naming.LABEL_DEPLOYMENT])


@kopf.on.event("services", labels=OWNED)
@kopf.on.event(*DISRUPTION_BUDGETS, labels=OWNED)
@kopf.on.event(*NETWORK_POLICIES, labels=OWNED)
async def wake_on_owned_object_change(namespace: str, labels: dict, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels[naming.LABEL_DEPLOYMENT])


@kopf.on.event(*ENDPOINT_SLICES, labels={**OWNED, naming.LABEL_SERVICE_NAME: kopf.PRESENT})
async def wake_on_endpoints_change(namespace: str, labels: dict, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels[naming.LABEL_DEPLOYMENT])
