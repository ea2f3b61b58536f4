"""AFDDeployment handlers: one reconcile loop per object, ordered teardown on deletion."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from typing import Any

import kopf

from ..api import GROUP, PLURAL, VERSION
from ..observe import Observed, owned_by

log = logging.getLogger(__name__)
ERROR_RETRY_SECONDS = 2.0


def _observed(namespace: str, name: str, uid: str, indexes: dict[str, Any]) -> Observed:
    """The deployment's children in kopf's indexes (the handlers' keyword arguments): those its
    labels find and its uid controls."""
    key = (namespace, name)
    return owned_by(Observed(
        pods=tuple(indexes["afd_pods"].get(key, ())),
        objects=tuple(obj for index in OBJECT_INDEXES for obj in indexes[index].get(key, ())),
        routed=frozenset().union(*indexes["afd_routed_pods"].get(key, ())),
    ), uid)


# The kopf indexes (handlers/children.py) of the owned objects the managers diff against.
OBJECT_INDEXES = ("afd_services", "afd_configmaps", "afd_disruption_budgets", "afd_network_policies")


def _snapshot(body: kopf.Body) -> dict[str, Any]:
    # A daemon's body is a live view: decide on one consistent copy.
    return copy.deepcopy({"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)})


async def _reconcile(memo: kopf.Memo, body: kopf.Body, observed: Observed, deleting: bool = False):
    # Reconciliations make blocking API calls: run them on the operator's own thread pool so
    # that kopf's workers (and every other deployment's loop) stay free.
    snapshot = _snapshot(body)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        memo.executor, functools.partial(memo.reconciler.reconcile, snapshot, observed, deleting=deleting))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def wake_on_change(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, name)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def reconcile_loop(stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                         **kwargs: Any) -> None:
    wake = memo.wakeups.event(namespace, name)
    while not stopped and not body.metadata.get("deletionTimestamp"):
        wake.clear()
        delay = memo.resync_seconds
        try:
            async with memo.wakeups.lock(namespace, name):
                result = await _reconcile(memo, body, _observed(namespace, name, body.metadata.uid, kwargs))
            if result.next_wakeup is not None:
                delay = min(delay, max(result.next_wakeup - time.time(), 0.05))
        except Exception:
            log.exception("reconciling %s/%s failed; retrying", namespace, name)
            delay = ERROR_RETRY_SECONDS
        await memo.wakeups.wait(wake, stopped, delay)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def tear_down(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    async with memo.wakeups.lock(namespace, name):
        result = await _reconcile(memo, body, _observed(namespace, name, body.metadata.uid, kwargs), deleting=True)
    if not result.finished:
        delay = memo.resync_seconds if result.next_wakeup is None else max(result.next_wakeup - time.time(), 0.2)
        raise kopf.TemporaryError("draining instances before removing the finalizer", delay=min(delay, 5.0))
    memo.wakeups.forget(namespace, name)
