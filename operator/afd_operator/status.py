"""AFDDeployment status: computed from a decision (pure), written by one function elsewhere.

Built through the API's status models (api.py, which also give the CRD its status schema) and
written as they serialize, so a condition type outside `ConditionType`, or any field the
models do not hold, fails here instead of reaching the API. Conditions follow the Kubernetes
convention: the full list every time (kopf/JSON merge patches replace lists whole),
`lastTransitionTime` kept while a condition's status stays the same, `observedGeneration` on
each. `ApiWriteFailed` is there only while the API refuses a write (like a Deployment's
`ReplicaFailure`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from pydantic import ValidationError

from . import naming
from .api import AFDDeploymentSpec, AFDDeploymentStatus, Condition, ConditionType, InstanceStatus, Phase
from .decisions import Decision, InstanceRecord
from .observe import ObservedPod, format_time, parse_time
from .planner import rollout_budget, topology_string, uses_host_network
from .policy import NetworkIsolation
from .problems import Problem
from .writer import ApiWriteError, NameConflictError


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


def _wire(status: AFDDeploymentStatus) -> dict[str, Any]:
    """The status as it is written. None is left out (a null deletes the key through the merge
    patch, and an empty message travels as null through the client's), and so is a field
    neither set here nor read from the previous status: a status that stands keeps its keys."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True)


def _previous_conditions(previous: Mapping[str, Any]) -> dict[ConditionType, Condition]:
    """The previous status's conditions by type; one the model cannot read is written afresh."""
    conditions: dict[ConditionType, Condition] = {}
    for item in previous.get("conditions") or []:
        try:
            condition = Condition.model_validate(item)
        except ValidationError:
            continue
        conditions[condition.type] = condition
    return conditions


def _condition(previous: Mapping[ConditionType, Condition], kind: ConditionType, ok: bool, reason: str,
               message: str, generation: Optional[int], now: float) -> Condition:
    status = "True" if ok else "False"
    before = previous.get(kind)
    changed = before is None or before.status != status
    return Condition(
        type=kind, status=status, reason=reason, message=message or None,
        last_transition_time=format_time(now) if changed else before.last_transition_time or format_time(now),
        observed_generation=generation,
    )


def _instance_status(rec: InstanceRecord, pods_ready: int, pods_total: int) -> InstanceStatus:
    return InstanceStatus(
        name=rec.name, index=rec.index, revision=rec.revision, phase=rec.phase,
        pods_ready=pods_ready, pods_total=pods_total, restarts=rec.restarts,
        consecutive_failures=rec.consecutive_failures, last_failure=rec.last_failure or None,
        retry_after=None if rec.retry_after is None else format_time(rec.retry_after),
        first_ready_time=None if rec.first_ready is None else format_time(rec.first_ready),
    )


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
    unreadable_snapshots: Sequence[str] = (),
) -> dict[str, Any]:
    previous = previous or {}
    prev_conditions = _previous_conditions(previous)
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
        _condition(prev_conditions, ConditionType.READY, is_ready, ready_reason, ready_msg, generation, now),
        _condition(prev_conditions, ConditionType.AVAILABLE, available,
                   "MinimumInstancesReady" if available else "TooFewInstancesReady",
                   f"{len(ready)} Ready, at least {floor} required", generation, now),
        _condition(prev_conditions, ConditionType.PROGRESSING, decision.rollout_in_progress,
                   decision.progress_reason, decision.progress_message or f"revision {revision} rolled out",
                   generation, now),
        _condition(prev_conditions, ConditionType.DEGRADED, bool(decision.degraded),
                   "InstancesDown" if decision.degraded else "AsExpected", "; ".join(decision.degraded),
                   generation, now),
        _condition(prev_conditions, ConditionType.CONFIG_VALID, True, "Valid", "", generation, now),
        _condition(prev_conditions, ConditionType.NETWORK_ISOLATED, *isolation(spec, network), generation, now),
    ]
    if unreadable_snapshots:
        conditions.append(_condition(
            prev_conditions, ConditionType.SNAPSHOT_UNREADABLE, True, "PlanSummaryUnreadable",
            "; ".join(unreadable_snapshots) + " (not what the operator wrote: the current revision's is replaced, "
            "an older revision's layout is counted from its pods)", generation, now))
    return _wire(AFDDeploymentStatus(
        observed_generation=generation,
        replicas=len(live),
        ready_replicas=len(ready),
        updated_replicas=len(updated),
        current_revision=current_revision,
        update_revision=revision,
        topology=topology_string(spec),
        instances=[_instance_status(r, *pod_counts.get(r.name, (0, 0))) for r in records],
        conditions=conditions,
        selector=f"{naming.LABEL_DEPLOYMENT}={name},{naming.LABEL_HEAD}=true",
    ))


def _with_condition(previous: Optional[Mapping[str, Any]], kind: ConditionType, ok: bool, reason: str,
                    message: str, generation: Optional[int], now: float) -> AFDDeploymentStatus:
    """The previous status with one condition set: what a reconciliation that changed nothing
    reports. The previous status is normally one these models wrote (the CRD's schema, generated
    from them, prunes anything else), so it is read whole; one stored under another version's
    schema keeps only its conditions rather than stopping the reconciliation."""
    previous = previous or {}
    prev_conditions = _previous_conditions(previous)
    try:
        status = AFDDeploymentStatus.model_validate({**previous, "conditions": []})
    except ValidationError:
        status = AFDDeploymentStatus()
    status.conditions = [c for c in prev_conditions.values() if c.type != kind]
    status.conditions.append(_condition(prev_conditions, kind, ok, reason, message, generation, now))
    return status


# Conditions about the writes of a reconciliation, present only while it meets them.
WRITE_CONDITIONS = (ConditionType.API_WRITE_FAILED, ConditionType.NAME_CONFLICT, ConditionType.SNAPSHOT_UNREADABLE)


def invalid_status(problems: list[Problem], previous: Optional[Mapping[str, Any]], generation: Optional[int],
                   now: float) -> dict[str, Any]:
    """An invalid spec changes nothing in the cluster; only ConfigValid says why (and no write
    condition of an earlier spec stands: nothing is written now)."""
    message = "; ".join(str(p) for p in problems)
    status = _with_condition(previous, ConditionType.CONFIG_VALID, False, "InvalidSpec", message, generation, now)
    status.conditions = [c for c in status.conditions if c.type not in WRITE_CONDITIONS]
    status.observed_generation = generation
    return _wire(status)


def write_failure_reason(err: ApiWriteError) -> str:
    """One CamelCase word naming the verb, the kind and the API's reason: CreatePodForbidden;
    NameConflict for a name held by an object the deployment does not control."""
    if isinstance(err, NameConflictError):
        return "NameConflict"
    return f"{err.verb.capitalize()}{err.kind.split('/')[0]}{err.reason}"


def write_failed_status(err: ApiWriteError, previous: Optional[Mapping[str, Any]], generation: Optional[int],
                        now: float) -> dict[str, Any]:
    """A refused write: the previous status stands (the decision was not carried out), and
    ApiWriteFailed (True) says what the API refused; the next reconciliation retries, and
    build_status, which the first one whose writes all succeed reports, has no such condition."""
    kind = ConditionType.NAME_CONFLICT if isinstance(err, NameConflictError) else ConditionType.API_WRITE_FAILED
    message = err.message if isinstance(err, NameConflictError) else str(err)
    return _wire(_with_condition(previous, kind, True, write_failure_reason(err), message, generation, now))
