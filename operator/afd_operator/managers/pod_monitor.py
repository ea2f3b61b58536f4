"""The Prometheus Operator PodMonitor, when asked for and served by the cluster."""

from __future__ import annotations

from .. import naming
from ..observe import Observed
from ..writer import Writer
from . import Round, ensure_fetched

API_VERSION, KIND = "monitoring.coreos.com/v1", "PodMonitor"


class PodMonitorManager:
    def sync(self, r: Round) -> None:
        if r.deleting or not r.writer.serves(API_VERSION, KIND):
            return
        if KIND in r.shared:
            ensure_fetched(r.writer, r.shared[KIND])
        elif r.writer.get(API_VERSION, KIND, r.plan.namespace, naming.pod_monitor_name(r.plan.name)):
            r.writer.delete(API_VERSION, KIND, r.plan.namespace, naming.pod_monitor_name(r.plan.name))

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        if writer.serves(API_VERSION, KIND):
            writer.delete(API_VERSION, KIND, namespace, naming.pod_monitor_name(name))
