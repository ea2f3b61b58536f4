"""What the operator remembers about each AFDDeployment between reconciliations.

Everything is keyed by the deployment itself, `(namespace, name)`, never by a name prefix:
deployments `a` and `a-b` share a prefix, not state. A deployment's memory is dropped when
its teardown finishes. Reconciliations of one deployment never overlap (the handlers hold a
lock per deployment), so one `DeploymentMemory` needs no lock of its own; the registry does,
since different deployments reconcile on different threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Iterable, Optional, TypeVar

from .observe import ObservedPod

INTENT_TTL_SECONDS = 30.0

T = TypeVar("T")


@dataclass
class _Expiring(Generic[T]):
    """pod name -> (when noted, what was intended)."""

    items: dict[str, tuple[float, T]] = field(default_factory=dict)

    def note(self, pod: str, what: T, now: float) -> None:
        self.items[pod] = (now, what)

    def expire(self, now: float) -> None:
        for pod in [p for p, (when, _) in self.items.items() if now - when > INTENT_TTL_SECONDS]:
            del self.items[pod]


class Intents:
    """Pod writes this process made that the watch cache may not show yet.

    The cache lags the API by a few milliseconds to seconds; deciding on it alone would,
    for example, see a pod created a moment ago as missing and fail its instance. Each
    intent overlays the observed pods until the cache reflects it or it expires.
    """

    def __init__(self) -> None:
        self.created: _Expiring[ObservedPod] = _Expiring()
        self.deleted: _Expiring[None] = _Expiring()
        self.labelled: _Expiring[tuple[bool, Optional[float]]] = _Expiring()  # serving, drain start

    def overlay(self, pods: Iterable[ObservedPod], now: float) -> tuple[ObservedPod, ...]:
        for store in (self.created, self.deleted, self.labelled):
            store.expire(now)
        out = []
        for pod in pods:
            self.created.items.pop(pod.name, None)
            if pod.name in self.deleted.items:
                if pod.deleting:
                    del self.deleted.items[pod.name]
                else:
                    pod = replace(pod, deleting=True)
            if pod.name in self.labelled.items:
                _, (serving, drain) = self.labelled.items[pod.name]
                if pod.serving == serving and pod.drain_started_at == drain:
                    del self.labelled.items[pod.name]
                else:
                    pod = replace(pod, serving=serving, drain_started_at=drain)
            out.append(pod)
        seen = {pod.name for pod in out}
        out += [pod for _, pod in self.created.items.values()]
        # A deleted pod that is gone from the cache needs no overlay any more.
        for name in [n for n in self.deleted.items if n not in seen]:
            del self.deleted.items[name]
        return tuple(out)


@dataclass
class DeploymentMemory:
    intents: Intents = field(default_factory=Intents)
    # The last status this process wrote, with the resourceVersion it produced: the watch
    # cache may hand us the object from before that write.
    written_status: Optional[tuple[int, dict[str, Any]]] = None
    pod_groups: set[str] = field(default_factory=set)  # instances whose PodGroup is known to exist

    def latest_status(self, resource_version: Optional[str], observed: dict[str, Any]) -> dict[str, Any]:
        """The observed status, or the one this process wrote if the observed object predates it."""
        if self.written_status is None or resource_version is None:
            return observed
        written_rv, status = self.written_status
        try:
            stale = int(resource_version) < written_rv  # etcd revisions: integers in practice
        except ValueError:
            return observed
        if not stale:
            self.written_status = None
            return observed
        return status

    def status_written(self, resource_version: Optional[str], status: dict[str, Any]) -> None:
        if resource_version is not None and resource_version.isdigit():
            self.written_status = (int(resource_version), status)


class Memory:
    """Every deployment's memory, created on first use and dropped after teardown."""

    def __init__(self) -> None:
        self._deployments: dict[tuple[str, str], DeploymentMemory] = {}
        self._lock = threading.Lock()

    def of(self, namespace: str, name: str) -> DeploymentMemory:
        with self._lock:
            return self._deployments.setdefault((namespace, name), DeploymentMemory())

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._deployments.pop((namespace, name), None)

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._deployments
