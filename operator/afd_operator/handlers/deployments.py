"""AFDDeployment handlers: one reconcile loop per object, ordered teardown on deletion."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import kopf

from ..api import GROUP, PLURAL, VERSION
from ..reconciler import Observed

log = logging.getLogger(__name__)
ERROR_RETRY_SECONDS = 2.0


def _observed(namespace: str, name: str, afd_pods: kopf.Index, afd_services: kopf.Index,
              afd_configmaps: kopf.Index) -> Observed:
    key = (namespace, name)
    return Observed(
        pods=tuple(afd_pods.get(key, ())),
        objects=tuple(afd_services.get(key, ())) + tuple(afd_configmaps.get(key, ())),
    )


def _snapshot(body: kopf.Body) -> dict[str, Any]:
    # A daemon's body is a live view: decide on one consistent copy.
    return copy.deepcopy({"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)})


@kopf.on.event(GROUP, VERSION, PLURAL)
def wake_on_change(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, name)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
def reconcile_loop(stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                   afd_pods: kopf.Index, afd_services: kopf.Index, afd_configmaps: kopf.Index, **_: Any) -> None:
    wake = memo.wakeups.event(namespace, name)
    while not stopped and not body.metadata.get("deletionTimestamp"):
        wake.clear()
        delay = memo.resync_seconds
        try:
            with memo.wakeups.lock(namespace, name):
                result = memo.reconciler.reconcile(
                    _snapshot(body), _observed(namespace, name, afd_pods, afd_services, afd_configmaps))
            if result.next_wakeup is not None:
                delay = min(delay, max(result.next_wakeup - time.time(), 0.05))
        except Exception:
            log.exception("reconciling %s/%s failed; retrying", namespace, name)
            delay = ERROR_RETRY_SECONDS
        memo.wakeups.wait(wake, stopped, delay)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def tear_down(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, afd_pods: kopf.Index,
              afd_services: kopf.Index, afd_configmaps: kopf.Index, **_: Any) -> None:
    with memo.wakeups.lock(namespace, name):
        result = memo.reconciler.reconcile(
            _snapshot(body), _observed(namespace, name, afd_pods, afd_services, afd_configmaps), deleting=True)
    if not result.finished:
        delay = memo.resync_seconds if result.next_wakeup is None else max(result.next_wakeup - time.time(), 0.2)
        raise kopf.TemporaryError("draining instances before removing the finalizer", delay=min(delay, 5.0))
    memo.wakeups.forget(namespace, name)
