"""Pods: the decision's actions carried out, each noted in the deployment's intents so the
next reconciliation sees it before the watch cache does."""

from __future__ import annotations

from .. import naming
from ..decisions import CreatePods, DeletePods, SetServing, StartDrain
from ..observe import Observed, format_time, parse_time, summarize_pod
from ..planner import plan_pods
from ..render import render_pod, role_pieces
from ..writer import Writer
from . import Round


class PodManager:
    def sync(self, r: Round) -> None:
        intents, ns, now = r.memory.intents, r.plan.namespace, r.now
        frames = {frame.index: frame for frame in r.current_instances}
        for action in r.decision.actions:
            match action:
                case CreatePods(revision=revision, index=index, role=role):
                    assert revision == r.plan.revision, "only the current revision is ever created"
                    instance = plan_pods(r.spec, r.plan.name, revision, frames[index])
                    pieces = role_pieces(r.spec, role)
                    bodies = [render_pod(r.spec, r.plan, instance, pod, r.owner, pieces)
                              for pod in instance.pods_of(role)]  # type: ignore[arg-type]
                    r.writer.create_all(bodies, lambda body: intents.created.note(
                        body["metadata"]["name"], summarize_pod(body, created_at=now), now))
                case SetServing(pods=pods, serving=serving):
                    for pod in pods:
                        r.writer.patch("v1", "Pod", ns, pod, {"metadata": {"labels": {
                            naming.LABEL_SERVING: "true" if serving else None}}})
                        intents.labelled.note(pod, (serving, None), now)
                case StartDrain(pods=pods):
                    stamp = format_time(now)
                    for pod in pods:
                        r.writer.patch("v1", "Pod", ns, pod, {"metadata": {
                            "labels": {naming.LABEL_SERVING: None},
                            "annotations": {naming.ANNOTATION_DRAIN_STARTED: stamp},
                        }})
                        intents.labelled.note(pod, (False, parse_time(stamp)), now)
                case DeletePods(pods=pods):
                    for pod in pods:
                        r.writer.delete("v1", "Pod", ns, pod)
                        intents.deleted.note(pod, None, now)

    def remove_all(self, writer: Writer, namespace: str, name: str, observed: Observed) -> None:
        """Without a plan (an invalid spec being deleted): every pod at once, no drain order."""
        for pod in observed.pods:
            if not pod.deleting:
                writer.delete("v1", "Pod", namespace, pod.name)
