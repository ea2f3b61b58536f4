"""AFDDeployment status: computed from a decision (pure), written by one function elsewhere.

Conditions follow the Kubernetes convention: the full list every time (kopf/JSON merge
patches replace lists whole), `lastTransitionTime` kept while a condition's status stays
the same, `observedGeneration` on each. `ApiWriteFailed` is there only while the API
refuses a write (like a Deployment's `ReplicaFailure`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from . import naming
from .api import AFDDeploymentSpec, Phase
from .controller import Decision, InstanceRecord
from .observe import ObservedPod, format_time, parse_time
from .planner import rollout_budget, topology_string, uses_host_network
from .policy import NetworkIsolation
from .validation import Problem
from .writer import ApiWriteError

API_WRITE_FAILED = "ApiWriteFailed"


def records_from_status(status: Optional[Mapping[str, Any]]) -> list[InstanceRecord]:
    records = []
    for item in (status or {}).get("instances") or []:
        try:
            records.append(InstanceRecord(
                name=item["name"], revision=item["revision"], index=int(item["index"]), phase=Phase(item["phase"]),
                restarts=int(item.get("restarts") or 0),
                consecutive_failures=int(item.get("consecutiveFailures") or 0),
                last_failure=item.get("lastFailure"),
                retry_after=parse_time(item.get("retryAfter")),
                first_ready=parse_time(item.get("firstReadyTime")),
            ))
        except (KeyError, TypeError, ValueError):
            continue  # a record we cannot read is rebuilt from the pods
    return records


def _condition(previous: Mapping[str, Mapping[str, Any]], kind: str, ok: bool, reason: str, message: str,
               generation: Optional[int], now: float) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind)
    changed = before is None or before.get("status") != status
    condition = {
        "type": kind,
        "status": status,
        "reason": reason,
        "lastTransitionTime": format_time(now) if changed else before.get("lastTransitionTime") or format_time(now),
        "observedGeneration": generation,
    }
    if message:  # an empty string would travel as null through the client's merge patch
        condition["message"] = message
    return condition


def _instance_status(rec: InstanceRecord, pods_ready: int, pods_total: int) -> dict[str, Any]:
    item: dict[str, Any] = {
        "name": rec.name, "index": rec.index, "revision": rec.revision, "phase": rec.phase,
        "podsReady": pods_ready, "podsTotal": pods_total, "restarts": rec.restarts,
        "consecutiveFailures": rec.consecutive_failures,
    }
    if rec.last_failure:
        item["lastFailure"] = rec.last_failure
    if rec.retry_after is not None:
        item["retryAfter"] = format_time(rec.retry_after)
    if rec.first_ready is not None:
        item["firstReadyTime"] = format_time(rec.first_ready)
    return item


def _pod_counts(pods: Iterable[ObservedPod]) -> dict[str, tuple[int, int]]:
    """(Ready pods, pods) of each instance."""
    counts: dict[str, tuple[int, int]] = {}
    for pod in pods:
        ready, total = counts.get(pod.instance, (0, 0))
        counts[pod.instance] = (ready + int(pod.ready), total + 1)
    return counts


def isolation(spec: AFDDeploymentSpec, network: NetworkIsolation) -> tuple[bool, str, str]:
    """NetworkIsolated: (status, reason, message)."""
    if not network.enabled:
        return False, "DisabledInCluster", "chart value networkPolicy.enabled is false: no NetworkPolicy is rendered"
    if uses_host_network(spec):
        return False, "HostNetwork", ("the pods use host networking (spec.ascend.hostNetwork): no NetworkPolicy can "
                                      "select them, so their connector, DP RPC and FFN ports are open on the nodes' "
                                      "addresses")
    return True, "PerInstancePolicies", "each instance admits its own pods, API clients and metrics scrapers"


def build_status(
    name: str,
    spec: AFDDeploymentSpec,
    revision: str,
    decision: Decision,
    pods: Iterable[ObservedPod],
    previous: Optional[Mapping[str, Any]],
    generation: Optional[int],
    now: float,
    network: NetworkIsolation = NetworkIsolation(),
) -> dict[str, Any]:
    previous = previous or {}
    prev_conditions = {c.get("type"): c for c in previous.get("conditions") or []}
    records = decision.instances
    pod_counts = _pod_counts(pods)
    live = [r for r in records if r.phase != Phase.DRAINING]
    ready = [r for r in live if r.phase == Phase.READY]
    updated = [r for r in live if r.revision == revision]
    failing = [r for r in records if r.phase == Phase.FAILED]
    floor = rollout_budget(spec).floor
    complete = not decision.rollout_in_progress
    current_revision = revision if complete else previous.get("currentRevision") or revision

    is_ready = complete and not failing and len(ready) == spec.replicas
    if is_ready:
        ready_reason, ready_msg = "AllInstancesReady", f"{len(ready)}/{spec.replicas} instances Ready"
    elif failing:
        ready_reason, ready_msg = "InstanceFailing", "; ".join(f"{r.name}: {r.last_failure}" for r in failing)
    elif decision.rollout_in_progress:
        ready_reason, ready_msg = decision.progress_reason, decision.progress_message
    else:
        ready_reason, ready_msg = "InstancesNotReady", f"{len(ready)}/{spec.replicas} instances Ready"
    available = len(ready) >= floor
    conditions = [
        _condition(prev_conditions, "Ready", is_ready, ready_reason, ready_msg, generation, now),
        _condition(prev_conditions, "Available", available,
                   "MinimumInstancesReady" if available else "TooFewInstancesReady",
                   f"{len(ready)} Ready, at least {floor} required", generation, now),
        _condition(prev_conditions, "Progressing", decision.rollout_in_progress,
                   decision.progress_reason, decision.progress_message or f"revision {revision} rolled out",
                   generation, now),
        _condition(prev_conditions, "Degraded", bool(decision.degraded),
                   "InstancesDown" if decision.degraded else "AsExpected", "; ".join(decision.degraded),
                   generation, now),
        _condition(prev_conditions, "ConfigValid", True, "Valid", "", generation, now),
        _condition(prev_conditions, "NetworkIsolated", *isolation(spec, network), generation, now),
    ]
    return {
        "observedGeneration": generation,
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "currentRevision": current_revision,
        "updateRevision": revision,
        "topology": topology_string(spec),
        "instances": [_instance_status(r, *pod_counts.get(r.name, (0, 0))) for r in records],
        "conditions": conditions,
        "selector": f"{naming.LABEL_DEPLOYMENT}={name},{naming.LABEL_HEAD}=true",
    }


def _with_condition(previous: Optional[Mapping[str, Any]], kind: str, ok: bool, reason: str, message: str,
                    generation: Optional[int], now: float) -> dict[str, Any]:
    """The previous status with one condition set: what a reconciliation that changed nothing reports."""
    status = dict(previous or {})
    prev_conditions = {c.get("type"): c for c in status.get("conditions") or []}
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != kind]
    conditions.append(_condition(prev_conditions, kind, ok, reason, message, generation, now))
    status["conditions"] = conditions
    return status


def invalid_status(problems: list[Problem], previous: Optional[Mapping[str, Any]], generation: Optional[int],
                   now: float) -> dict[str, Any]:
    """An invalid spec changes nothing in the cluster; only ConfigValid says why."""
    message = "; ".join(str(p) for p in problems)
    return {**_with_condition(previous, "ConfigValid", False, "InvalidSpec", message, generation, now),
            "observedGeneration": generation}


def write_failure_reason(err: ApiWriteError) -> str:
    """One CamelCase word naming the verb, the kind and the API's reason: CreatePodForbidden."""
    return f"{err.verb.capitalize()}{err.kind.split('/')[0]}{err.reason}"


def write_failed_status(err: ApiWriteError, previous: Optional[Mapping[str, Any]], generation: Optional[int],
                        now: float) -> dict[str, Any]:
    """A refused write: the previous status stands (the decision was not carried out), and
    ApiWriteFailed (True) says what the API refused; the next reconciliation retries, and
    build_status, which the first one whose writes all succeed reports, has no such condition."""
    return _with_condition(previous, API_WRITE_FAILED, True, write_failure_reason(err), str(err), generation, now)
