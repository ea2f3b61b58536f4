"""One small manager per kind of child object: each turns one reconciliation's decision
into the writes for its kind (create what is missing, patch what drifted, delete what is no
longer wanted) and removes its kind at teardown. The reconciler calls them in order:
snapshots, Services, PDBs, NetworkPolicies, PodMonitor, PodGroups, then pods (a pod's Service,
snapshot, budget, policy and gang exist before it does)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Optional, Protocol

from ..api import AFDDeploymentSpec
from ..decisions import Decision
from ..memory import DeploymentMemory
from ..observe import Observed, ObservedObject
from ..planner import InstancePlan, Plan, instance_frame
from ..policy import ClusterPolicy
from ..render import render_shared
from ..writer import Writer, check_holder


@dataclass(frozen=True)
class Round:
    """One reconciliation of one deployment, as the managers see it."""

    writer: Writer
    spec: AFDDeploymentSpec
    plan: Plan  # the current revision, planned once per reconciliation (its instances: current_instances)
    owner: Mapping[str, Any]
    observed: Observed
    decision: Decision
    memory: DeploymentMemory
    now: float
    deleting: bool  # teardown: only removals, nothing is created or patched
    policy: ClusterPolicy

    @cached_property
    def shared(self) -> dict[str, dict[str, Any]]:
        """The desired objects shared by the revision's instances, by kind (a PodMonitor only
        when one is asked for)."""
        return {obj["kind"]: obj for obj in render_shared(self.spec, self.plan, self.owner)}

    def live_instances(self) -> set[str]:
        return {r.name for r in self.decision.instances}

    @cached_property
    def current_instances(self) -> tuple[InstancePlan, ...]:
        """The live instances of the current revision, without their pods: framed once, for
        every manager (the pods manager plans the pods of those it creates)."""
        return tuple(instance_frame(self.spec, self.plan.name, self.plan.namespace, rec.revision, rec.index)
                     for rec in self.decision.instances if rec.revision == self.plan.revision)


class ChildManager(Protocol):
    def sync(self, r: Round) -> None:
        """Bring this kind of child in line with the round's decision."""

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        """Delete every child of this kind once the deployment's pods are gone."""


def contains(observed: Any, desired: Any) -> bool:
    """Whether `observed` already has every field `desired` sets (server defaults ignored)."""
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(contains(observed.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(observed, list) and len(observed) == len(desired) and all(
            contains(o, d) for o, d in zip(observed, desired))
    return observed == desired


def as_observed(seen: Optional[ObservedObject]) -> Optional[dict]:
    """A watch-cache summary as `ensure` compares it (its spec)."""
    return None if seen is None else {"spec": seen.spec}


def ensure(writer: Writer, desired: Mapping[str, Any], observed: Optional[Mapping[str, Any]],
           section: str = "spec") -> None:
    """Create `desired` if missing; patch its `section` if it drifted."""
    meta = desired["metadata"]
    if observed is None:
        writer.create(desired)
    elif not contains(observed.get(section), desired.get(section)):
        writer.patch(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"],
                     {section: desired[section]})


def ensure_fetched(writer: Writer, desired: Mapping[str, Any]) -> None:
    """`ensure` for kinds no watch cache holds: read the object first; one of that name held by
    someone else is a NameConflictError, never patched."""
    meta = desired["metadata"]
    existing = writer.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    check_holder(desired, existing)
    ensure(writer, desired, existing)
