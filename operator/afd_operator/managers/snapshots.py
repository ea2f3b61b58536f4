"""Per-revision ConfigMap snapshots: created once per revision (immutable), deleted once no
instance of their revision is left. Their plan summary tells the controller the layout of
older revisions. One whose summary cannot be read (someone who may write ConfigMaps recreated it)
is reported; the current revision's is replaced, an older one's layout is counted from its pods."""

from __future__ import annotations

from typing import Mapping

from .. import naming
from ..observe import Observed
from ..writer import Writer
from . import Round


def layouts(observed: Observed) -> dict[str, Mapping[str, int]]:
    """Pods per role of every revision that still has a snapshot."""
    return {o.labels.get(naming.LABEL_REVISION, ""): {"ffn": o.spec["ffnPods"], "attention": o.spec["attentionPods"]}
            for o in observed.objects if o.kind == "ConfigMap" and o.spec}


def unreadable(observed: Observed) -> list[str]:
    """What is wrong with each snapshot whose plan summary cannot be read, one line each."""
    return [f"ConfigMap {o.name}: {o.problem}" for o in observed.objects if o.kind == "ConfigMap" and o.problem]


class SnapshotManager:
    def sync(self, r: Round) -> None:
        if r.deleting:
            return
        snapshots = [o for o in r.observed.objects if o.kind == "ConfigMap"]
        desired = r.shared["ConfigMap"]
        name = desired["metadata"]["name"]
        current = next((o for o in snapshots if o.name == name), None)
        if current is None:
            r.writer.create(desired)
        elif current.problem:
            # Immutable: written anew by deleting it (the next round creates it).
            r.writer.delete("v1", "ConfigMap", r.plan.namespace, name)
        keep = {rec.revision for rec in r.decision.instances} | {r.plan.revision}
        for o in snapshots:
            if o.labels.get(naming.LABEL_REVISION) not in keep:
                r.writer.delete("v1", "ConfigMap", r.plan.namespace, o.name)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        for o in observed.objects:
            if o.kind == "ConfigMap":
                writer.delete("v1", "ConfigMap", namespace, o.name)
