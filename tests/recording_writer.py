"""The unit tier of the reconciler's tests: an in-process stand-in for `Writer` that keeps
the objects it is sent, records every call, plays kubelet for the pods (Running and Ready
on request) and refuses the writes a test asks it to refuse. The API-server tier is
tests/test_operator.py and tests/test_operator_prefix_names.py."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from afd_operator import naming
from afd_operator.api import API_VERSION, KIND
from afd_operator.observe import Observed, format_time, summarize_object, summarize_pod
from afd_operator.writer import ApiWriteError

# Kinds a plain cluster serves (no Volcano, no Prometheus Operator).
SERVED = frozenset({"Pod", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "Event", KIND})
# Kinds the operator's watch caches hold (handlers/children.py).
WATCHED = ("Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy")


@dataclass(frozen=True)
class Call:
    verb: str  # create | patch | delete | patch_status
    kind: str
    namespace: str
    name: str
    deployment: Optional[str]  # the deployment label of the object written; None: no such object


def merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386: null removes a key, objects merge, everything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class RecordingWriter:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name) -> body
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}  # AFDDeployment (namespace, name) -> status
        self.calls: list[Call] = []
        self.events: list[tuple[str, str, str, str]] = []  # (deployment, type, reason, message)
        self.now = 0.0  # the clock stamped on creations and readiness
        # (verb, kind, name) -> the ApiWriteError that write meets, or None to let it through
        self.refuse: Callable[[str, str, str], Optional[ApiWriteError]] = lambda verb, kind, name: None
        self._versions = itertools.count(1)
        self.kubernetes_version = (1, 30)  # what server_version answers
        self.served = set(SERVED)  # kinds the "server" has (add PodMonitor, PodGroup to test them)

    # -- the Writer interface -----------------------------------------------------------------
    def serves(self, api_version: str, kind: str) -> bool:
        return kind in self.served

    def server_version(self) -> tuple[int, int]:
        return self.kubernetes_version

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found)

    def create(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self._write("create", obj["kind"], meta["namespace"], meta["name"], meta.get("labels") or {})
        body = copy.deepcopy(dict(obj))
        body["metadata"]["creationTimestamp"] = format_time(self.now)
        self.objects.setdefault((obj["kind"], meta["namespace"], meta["name"]), body)

    def create_all(self, objs: list[Mapping[str, Any]], on_created: Callable[[Mapping[str, Any]], None]) -> None:
        for obj in objs:  # in order: what the real writer sends concurrently, this one keeps
            self.create(obj)
            on_created(obj)

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        found = self.objects.get((kind, namespace, name))
        self._write("patch", kind, namespace, name, (found or {}).get("metadata", {}).get("labels") or {})
        if found is not None:
            merge_patch(found, patch)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        found = self.objects.get((kind, namespace, name))
        self._write("delete", kind, namespace, name, (found or {}).get("metadata", {}).get("labels") or {})
        self.objects.pop((kind, namespace, name), None)

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> Optional[str]:
        self._write("patch_status", KIND, namespace, name, {naming.LABEL_DEPLOYMENT: name})
        self.statuses[(namespace, name)] = copy.deepcopy(dict(status))
        return str(next(self._versions))

    def event(self, owner: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((owner["metadata"]["name"], type_, reason, message))

    def _write(self, verb: str, kind: str, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        refusal = self.refuse(verb, kind, name)
        if refusal is not None:
            raise refusal
        self.calls.append(Call(verb, kind, namespace, name, labels.get(naming.LABEL_DEPLOYMENT)))

    # -- the cluster around it ----------------------------------------------------------------
    def body(self, namespace: str, name: str, spec: Mapping[str, Any], deleting: bool = False) -> dict[str, Any]:
        """The AFDDeployment as a watch would deliver it, with the last status written."""
        meta = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}", "generation": 1}
        if deleting:
            meta["deletionTimestamp"] = format_time(self.now)
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": copy.deepcopy(dict(spec)),
                "status": copy.deepcopy(self.statuses.get((namespace, name), {}))}

    def observed(self, namespace: str, deployment: str) -> Observed:
        """What the operator's watch caches (indexed by the deployment label) would hold."""
        mine = [(kind, body) for (kind, ns, _), body in self.objects.items()
                if ns == namespace and (body["metadata"].get("labels") or {}).get(naming.LABEL_DEPLOYMENT) == deployment]
        return Observed(
            pods=tuple(p for p in (summarize_pod(body) for kind, body in mine if kind == "Pod") if p is not None),
            objects=tuple(summarize_object(kind, body) for kind, body in mine if kind in WATCHED),
        )

    def run_pods(self) -> None:
        """Kubelet: bind every pod and report it Running and Ready."""
        for (kind, _, name), body in self.objects.items():
            if kind == "Pod" and body.get("status", {}).get("phase") != "Running":
                body["spec"]["nodeName"] = "node-0"
                body["status"] = {"phase": "Running", "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True", "lastTransitionTime": format_time(self.now)}]}

    def pods(self, namespace: str) -> list[str]:
        return sorted(name for kind, ns, name in self.objects if kind == "Pod" and ns == namespace)
