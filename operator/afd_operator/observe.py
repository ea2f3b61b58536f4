"""Observed state: what the cluster says about a deployment's children. Pure parsing.

Raw objects come from the operator's watch caches (kopf indexes); each is reduced to the
few facts the controller decides on, so decisions are testable with plain data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Optional

from afd_shared_experts.config import REFUSAL_MARKER

from . import naming
from .api import MAX_ROLE_RANKS

def parse_time(value: Optional[str]) -> Optional[float]:
    if not value:
        return None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _annotated_time(value: Any) -> Optional[float]:
    """A time the operator wrote into an annotation; None if anyone made it unreadable (the pod
    stays in the watch cache, and a drain the operator wants is stamped again)."""
    try:
        return parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def format_time(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ObservedPod:
    name: str
    instance: str
    revision: str
    index: int
    role: str
    ordinal: int
    head: bool
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    scheduled: bool
    ready: bool
    ready_changed_at: Optional[float]  # lastTransitionTime of the Ready condition
    created_at: Optional[float]
    deleting: bool
    serving: bool
    drain_started_at: Optional[float]
    termination: Optional[str]  # why the container stopped, when it did
    unschedulable: Optional[str]  # the scheduler's message while Pending
    pod_ip: Optional[str] = None
    cannot_start: Optional[str] = None  # why kubelet cannot start the container (WAITING_FAILURES), if so
    api_port: Optional[int] = None  # the container port named "api" (Attention heads)
    owner_uid: Optional[str] = None  # the uid of its controller (ownerReferences), None without one


@dataclass(frozen=True)
class ObservedObject:
    """A Service or ConfigMap owned by a deployment, as the watch cache saw it."""

    kind: str
    name: str
    labels: Mapping[str, str]
    spec: Mapping[str, Any]  # Services: spec; ConfigMaps: the revision's plan summary ({} when unreadable)
    owner_uid: Optional[str] = None  # the uid of its controller (ownerReferences), None without one
    problem: Optional[str] = None  # ConfigMaps: why the plan summary could not be read


@dataclass(frozen=True)
class Observed:
    """One deployment's children in the watch caches."""

    pods: tuple[ObservedPod, ...]
    objects: tuple[ObservedObject, ...]  # Services and ConfigMaps
    # Pods the API Service's EndpointSlices still list: requests may still be routed to them.
    routed: frozenset[str] = frozenset()


def controller_uid(meta: Mapping[str, Any]) -> Optional[str]:
    """The uid of an object's controller (its ownerReference marked controller), or None."""
    for reference in meta.get("ownerReferences") or ():
        if isinstance(reference, Mapping) and reference.get("controller") is True:
            uid = reference.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def owned_by(observed: Observed, uid: str) -> Observed:
    """The children a deployment controls: labels are only where the watch looks (anyone who may
    create a pod or a ConfigMap can copy them); the controller reference names the deployment by
    uid. Anything else is never adopted, changed or deleted: a create under its name is
    refused as a name conflict (writer.NameConflictError)."""
    return Observed(pods=tuple(p for p in observed.pods if p.owner_uid == uid),
                    objects=tuple(o for o in observed.objects if o.owner_uid == uid), routed=observed.routed)


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return {}


# How much of a failed container's last log line the failure reason carries (it goes into
# events and the status, which the API server bounds).
TERMINATION_LINE_CHARS = 240


def _cause_line(message: Optional[str]) -> str:
    """The plugin's refusal line (from its marker on) where the message holds one, else its
    last line: an engine refusing its config ends its log with vLLM's traceback after it."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    refusals = [line[line.index(REFUSAL_MARKER):] for line in lines if REFUSAL_MARKER in line]
    line = (refusals or lines or [""])[-1]
    return line if len(line) <= TERMINATION_LINE_CHARS else line[:TERMINATION_LINE_CHARS - 3] + "..."


def _termination(status: Mapping[str, Any]) -> Optional[str]:
    """Why the pod's container ended, with the cause from its termination message: the tail
    of its log when it failed (the pods' terminationMessagePolicy), the plugin's refusal line
    or else the last line, usually the error, so the event still names the cause after the pod
    is recreated."""
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            reason = term.get("reason") or "Terminated"
            ended = f"container {cs.get('name')} {reason} (exit code {term.get('exitCode')})"
            last = _cause_line(term.get("message"))
            return f"{ended}: {last}" if last else ended
    return None


# Waiting reasons kubelet keeps reporting until someone changes the image, the spec or the
# objects it refers to (ErrImagePull alone may be a registry hiccup: its retry is
# ImagePullBackOff). Waiting in them, a pod never starts: the startup timeout would say so only
# after spec.startup.timeoutSeconds, without the cause.
WAITING_FAILURES = ("ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError")


def _cannot_start(status: Mapping[str, Any]) -> Optional[str]:
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_FAILURES:
            message = _cause_line(waiting.get("message"))
            return f"container {cs.get('name')} {waiting['reason']}" + (f": {message}" if message else "")
    return None


def _named_port(spec: Mapping[str, Any], name: str) -> Optional[int]:
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return port.get("containerPort")
    return None


def summarize_pod(body: Mapping[str, Any], created_at: Optional[float] = None) -> Optional[ObservedPod]:
    """The controller's view of one pod; None for pods without the operator's labels.
    `created_at` stands in for the server's creationTimestamp of a pod just sent."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        instance = labels[naming.LABEL_AFD_INSTANCE]
        revision = labels[naming.LABEL_REVISION]
        role = labels[naming.LABEL_ROLE]
        ordinal = int(labels[naming.LABEL_POD_ORDINAL])
        index = int(instance.rsplit("-", 1)[1])
    except (KeyError, ValueError, IndexError):
        return None
    status = body.get("status") or {}
    ready = _condition(status, "Ready")
    scheduled = _condition(status, "PodScheduled")
    spec = body.get("spec") or {}
    return ObservedPod(
        name=meta.get("name", ""),
        instance=instance,
        revision=revision,
        index=index,
        role=role,
        ordinal=ordinal,
        head=labels.get(naming.LABEL_HEAD) == "true",
        phase=status.get("phase") or "Pending",
        scheduled=bool(spec.get("nodeName")),
        ready=ready.get("status") == "True",
        ready_changed_at=parse_time(ready.get("lastTransitionTime")),
        created_at=parse_time(meta.get("creationTimestamp")) or created_at,
        deleting=bool(meta.get("deletionTimestamp")),
        serving=labels.get(naming.LABEL_SERVING) == "true",
        drain_started_at=_annotated_time((meta.get("annotations") or {}).get(naming.ANNOTATION_DRAIN_STARTED)),
        termination=_termination(status),
        unschedulable=scheduled.get("message") if scheduled.get("reason") == "Unschedulable" else None,
        pod_ip=status.get("podIP"),
        cannot_start=_cannot_start(status),
        api_port=_named_port(spec, "api"),
        owner_uid=controller_uid(meta),
    )


def summarize_object(kind: str, body: Mapping[str, Any]) -> ObservedObject:
    """The controller's view of an owned Service (its spec) or ConfigMap (its plan summary).
    The kind is an argument: objects of a list response carry none."""
    meta = body["metadata"]
    spec, problem = read_plan_summary(body.get("data")) if kind == "ConfigMap" else (dict(body.get("spec") or {}), None)
    return ObservedObject(kind=kind, name=meta["name"], labels=dict(meta.get("labels") or {}), spec=spec,
                          owner_uid=controller_uid(meta), problem=problem)


# What the operator writes into a snapshot's plan.json (render.render_runtime_configmap) is a few
# hundred bytes; its pod counts are bounded like the spec's ranks.
MAX_PLAN_SUMMARY_BYTES = 4096
PLAN_POD_COUNTS = ("attentionPods", "ffnPods")


def read_plan_summary(data: Any) -> tuple[dict[str, Any], Optional[str]]:
    """A snapshot ConfigMap's plan summary, read as strictly as it was written: a JSON object of at
    most MAX_PLAN_SUMMARY_BYTES whose pod counts are integers in [1, MAX_ROLE_RANKS]. Anything else
    is ({}, why): the controller then counts the pods that exist; never an exception."""
    text = data.get("plan.json") if isinstance(data, Mapping) else None
    if not isinstance(text, str):
        return {}, "data has no plan.json string"
    if len(text) > MAX_PLAN_SUMMARY_BYTES:
        return {}, f"plan.json is {len(text)} characters, more than the {MAX_PLAN_SUMMARY_BYTES} the operator writes"
    try:
        summary = json.loads(text)
    except (ValueError, RecursionError):
        return {}, "plan.json is not JSON"
    if not isinstance(summary, dict):
        return {}, "plan.json is not a JSON object"
    for key in PLAN_POD_COUNTS:
        value = summary.get(key)
        if type(value) is not int or not 1 <= value <= MAX_ROLE_RANKS:
            return {}, f"plan.json {key} must be an integer in [1, {MAX_ROLE_RANKS}]"
    return summary, None


def endpoint_pods(body: Mapping[str, Any], service: str) -> Optional[frozenset[str]]:
    """The pods an EndpointSlice of `service` lists, whatever their conditions: while a pod is
    listed, kube-proxy may still send it connections. None for a slice the EndpointSlice
    controller did not make for that Service (anyone who may write slices can copy its labels,
    and a forged slice listing a head would hold that head's drain open)."""
    references = (body.get("metadata") or {}).get("ownerReferences") or ()
    if not any(isinstance(ref, Mapping) and ref.get("controller") is True and ref.get("kind") == "Service"
               and ref.get("name") == service for ref in references):
        return None
    return frozenset(ref["name"] for ep in body.get("endpoints") or []
                     if (ref := ep.get("targetRef") or {}).get("kind") == "Pod" and ref.get("name"))
