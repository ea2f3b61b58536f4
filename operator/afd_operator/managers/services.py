"""Services: the deployment's API Service (selects serving heads) and one headless Service
per instance of the current revision (stable pod DNS), deleted with their instance."""

from __future__ import annotations

from .. import naming
from ..observe import Observed
from ..render import render_instance_service
from ..writer import Writer
from . import Round, as_observed, ensure


class ServiceManager:
    def sync(self, r: Round) -> None:
        services = {o.name: o for o in r.observed.objects if o.kind == "Service"}
        live = r.live_instances()
        if not r.deleting:
            api = r.shared["Service"]
            ensure(r.writer, api, as_observed(services.get(api["metadata"]["name"])))
            for instance in r.current_instances:
                desired = render_instance_service(r.spec, r.plan, instance, r.owner)
                ensure(r.writer, desired, as_observed(services.get(instance.name)))
        for o in services.values():
            if o.labels.get(naming.LABEL_COMPONENT) == "instance" and o.name not in live:
                r.writer.delete("v1", "Service", r.plan.namespace, o.name)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        for o in observed.objects:
            if o.kind == "Service":
                writer.delete("v1", "Service", namespace, o.name)
