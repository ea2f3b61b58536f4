"""Volcano PodGroups (gang scheduling), one per instance of the current revision, deleted
when their instance is gone. The deployment's memory notes which exist, so a steady state
reads nothing."""

from __future__ import annotations

from ..observe import Observed
from ..render import render_pod_group
from ..api import KIND as DEPLOYMENT_KIND
from ..writer import Writer, check_holder, controlled_by
from . import Round

API_VERSION, KIND = "scheduling.volcano.sh/v1beta1", "PodGroup"


class PodGroupManager:
    def sync(self, r: Round) -> None:
        known = r.memory.pod_groups
        if not r.deleting and r.spec.scheduling.gang.provider == "volcano":
            for instance in r.current_instances:
                if instance.name in known:
                    continue
                desired = render_pod_group(r.spec, r.plan, instance, r.owner)
                existing = r.writer.get(API_VERSION, KIND, r.plan.namespace, instance.name)
                if existing is None:
                    r.writer.create(desired)
                else:
                    check_holder(desired, existing)  # a squatted name: NameConflict, not adopted
                known.add(instance.name)
        for instance in r.decision.gone:
            if instance in known or (r.writer.serves(API_VERSION, KIND) and controlled_by(
                    r.writer.get(API_VERSION, KIND, r.plan.namespace, instance), DEPLOYMENT_KIND, r.plan.name)):
                r.writer.delete(API_VERSION, KIND, r.plan.namespace, instance)
                known.discard(instance)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        """Each PodGroup went with its instance."""
