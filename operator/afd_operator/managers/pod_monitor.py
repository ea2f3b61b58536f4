"""The Prometheus Operator PodMonitor, when asked for and served by the cluster."""

from __future__ import annotations

from .. import naming
from ..observe import Observed
from ..api import KIND as DEPLOYMENT_KIND
from ..writer import Writer, controlled_by
from . import Round, ensure_fetched

API_VERSION, KIND = "monitoring.coreos.com/v1", "PodMonitor"


class PodMonitorManager:
    def sync(self, r: Round) -> None:
        if r.deleting or not r.writer.serves(API_VERSION, KIND):
            return
        if KIND in r.shared:
            ensure_fetched(r.writer, r.shared[KIND])
        else:
            self.remove_all(r.writer, r.plan.namespace, r.plan.name, r.observed)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        """The deployment's PodMonitor, never another's of the same name."""
        if not writer.serves(API_VERSION, KIND):
            return
        existing = writer.get(API_VERSION, KIND, namespace, naming.pod_monitor_name(name))
        if controlled_by(existing, DEPLOYMENT_KIND, name):
            writer.delete(API_VERSION, KIND, namespace, naming.pod_monitor_name(name))
