"""Per-instance guards: a PodDisruptionBudget (at most one pod of the instance disrupted at a
time) and a NetworkPolicy (ingress from the instance's own pods, the API port, the scrapers),
one of each per instance of the current revision, from the watch caches; deleted when their
instance is gone (or, for NetworkPolicies, when the cluster or host networking leaves them out)."""

from __future__ import annotations

from typing import Any, Optional

from ..observe import Observed
from ..planner import InstancePlan
from ..render import covers_pods, render_network_policy, render_pdb
from ..writer import Writer
from . import Round, as_observed, ensure


class _PerInstance:
    api_version: str
    kind: str

    def desired(self, r: Round, instance: InstancePlan) -> Optional[dict[str, Any]]:
        raise NotImplementedError

    def sync(self, r: Round) -> None:
        seen = {o.name: o for o in r.observed.objects if o.kind == self.kind}
        wanted: set[str] = set()
        if not r.deleting:
            for instance in r.current_instances:
                desired = self.desired(r, instance)
                if desired is not None:
                    ensure(r.writer, desired, as_observed(seen.get(instance.name)))
                    wanted.add(instance.name)
        current = {i.name for i in r.current_instances}
        live = r.live_instances()
        for name in seen:
            # Gone instances, the current revision's when not wanted any more, and anything of the
            # deployment named otherwise (the deployment-wide PDB of earlier versions).
            if name not in live or (name in current and name not in wanted and not r.deleting):
                r.writer.delete(self.api_version, self.kind, r.plan.namespace, name)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        for o in observed.objects:
            if o.kind == self.kind:
                writer.delete(self.api_version, self.kind, namespace, o.name)


# PodDisruptionBudget's unhealthyPodEvictionPolicy: beta, on by default, from Kubernetes 1.27.
UNHEALTHY_EVICTION_POLICY_SINCE = (1, 27)


class DisruptionBudgetManager(_PerInstance):
    api_version, kind = "policy/v1", "PodDisruptionBudget"

    def desired(self, r: Round, instance: InstancePlan) -> Optional[dict[str, Any]]:
        return render_pdb(r.plan, instance, r.owner,
                          unhealthy_eviction_policy=r.writer.server_version() >= UNHEALTHY_EVICTION_POLICY_SINCE)


class NetworkPolicyManager(_PerInstance):
    api_version, kind = "networking.k8s.io/v1", "NetworkPolicy"

    def desired(self, r: Round, instance: InstancePlan) -> Optional[dict[str, Any]]:
        if not covers_pods(r.spec, r.policy.network):
            return None
        return render_network_policy(r.spec, r.plan, instance, r.policy.network, r.owner)
