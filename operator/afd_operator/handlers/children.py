"""Watch caches (kopf indexes) of the operator's children, and wake-ups on their changes."""

from __future__ import annotations

import json
from typing import Any

import kopf

from .. import naming
from ..observe import summarize_pod
from ..reconciler import ObservedObject

OWNED = {naming.LABEL_MANAGED_BY: naming.MANAGER, naming.LABEL_DEPLOYMENT: kopf.PRESENT}


@kopf.index("pods", labels=OWNED)
async def afd_pods(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    pod = summarize_pod(body)
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): pod} if pod else None


def _object(kind: str, body: Any, spec: dict) -> ObservedObject:
    return ObservedObject(kind=kind, name=body["metadata"]["name"], labels=dict(body["metadata"].get("labels") or {}),
                          spec=spec)


def _plan_summary(body: Any) -> dict:
    try:
        return json.loads((body.get("data") or {}).get("plan.json") or "{}")
    except ValueError:
        return {}


@kopf.index("services", labels=OWNED)
async def afd_services(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): _object("Service", body, dict(body.get("spec") or {}))}


@kopf.index("configmaps", labels=OWNED)
async def afd_configmaps(namespace: str, labels: dict, body: Any, **_: Any) -> Any:
    return {(namespace, labels[naming.LABEL_DEPLOYMENT]): _object("ConfigMap", body, _plan_summary(body))}


@kopf.on.event("pods", labels=OWNED)
async def wake_on_pod_change(namespace: str, labels: dict, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels[naming.LABEL_DEPLOYMENT])


@kopf.on.event("services", labels=OWNED)
async def wake_on_service_change(namespace: str, labels: dict, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels[naming.LABEL_DEPLOYMENT])
