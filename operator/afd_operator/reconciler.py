"""One reconciliation of one AFDDeployment: observe -> validate/plan -> decide -> diff -> write.

Level-based: every run starts from what is observed (watch caches) and what the status
recorded, so running it again, or after an operator restart, converges to the same place.
A run with nothing to do writes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Optional

from . import naming
from .api import AFDDeploymentSpec
from .controller import Decision, decide
from .metrics import OperatorMetrics
from .observe import ObservedPod, format_time, parse_time, summarize_pod
from .planner import Plan, plan, plan_instance
from .render import owner_reference, render_instance_service, render_pod, render_pod_group, render_shared
from .revision import revision_of
from .status import build_status, invalid_status, records_from_status
from .validation import validate_spec
from .writer import Writer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObservedObject:
    """A Service or ConfigMap owned by a deployment, as the watch cache saw it."""

    kind: str
    name: str
    labels: Mapping[str, str]
    spec: Mapping[str, Any]  # Services: spec; ConfigMaps: the revision's plan summary


@dataclass(frozen=True)
class Observed:
    pods: tuple[ObservedPod, ...]
    objects: tuple[ObservedObject, ...]  # Services and ConfigMaps


INTENT_TTL_SECONDS = 30.0
DRAIN_PROBE_TIMEOUT_SECONDS = 0.5
# vLLM's gauge of requests being processed; a draining head at 0 has finished its work.
RUNNING_REQUESTS_METRIC = "vllm:num_requests_running"


class Intents:
    """Writes this process made that the watch cache may not show yet.

    The cache lags the API by a few milliseconds to seconds; deciding on it alone would,
    for example, see a pod created a moment ago as missing and fail its instance. Each
    intent overlays the observed pods until the cache reflects it or it expires.
    """

    def __init__(self) -> None:
        # Every store maps (namespace, pod) -> (when, what was intended).
        self._created: dict[tuple[str, str], tuple[float, ObservedPod]] = {}
        self._deleted: dict[tuple[str, str], tuple[float, None]] = {}
        self._labels: dict[tuple[str, str], tuple[float, tuple[bool, Optional[float]]]] = {}  # serving, drain start
        self._lock = threading.Lock()  # reconciliations of different deployments run in parallel

    def created(self, namespace: str, pod: ObservedPod, now: float) -> None:
        with self._lock:
            self._created[(namespace, pod.name)] = (now, pod)

    def deleted(self, namespace: str, name: str, now: float) -> None:
        with self._lock:
            self._deleted[(namespace, name)] = (now, None)

    def labelled(self, namespace: str, name: str, serving: bool, drain_started_at: Optional[float], now: float) -> None:
        with self._lock:
            self._labels[(namespace, name)] = (now, (serving, drain_started_at))

    def overlay(self, namespace: str, deployment: str, pods: Iterable[ObservedPod], now: float) -> tuple[ObservedPod, ...]:
        with self._lock:
            return self._overlay(namespace, deployment, pods, now)

    def _overlay(self, namespace: str, deployment: str, pods: Iterable[ObservedPod], now: float) -> tuple[ObservedPod, ...]:
        for store in (self._created, self._deleted, self._labels):
            for key in [k for k, (when, _) in store.items() if now - when > INTENT_TTL_SECONDS]:
                del store[key]
        out = []
        seen = set()
        for pod in pods:
            key = (namespace, pod.name)
            seen.add(key)
            self._created.pop(key, None)
            if key in self._deleted:
                if pod.deleting:
                    del self._deleted[key]
                else:
                    pod = replace(pod, deleting=True)
            if key in self._labels:
                _, (serving, drain) = self._labels[key]
                if pod.serving == serving and pod.drain_started_at == drain:
                    del self._labels[key]
                else:
                    pod = replace(pod, serving=serving, drain_started_at=drain)
            out.append(pod)
        for key, (_, pod) in list(self._created.items()):
            if key[0] == namespace and key not in seen and pod.instance.startswith(f"{deployment}-"):
                out.append(pod)
        # A deleted pod that is gone from the cache needs no overlay any more.
        for key in [k for k in self._deleted if k[0] == namespace and k not in seen]:
            del self._deleted[key]
        return tuple(out)


@dataclass(frozen=True)
class ReconcileResult:
    finished: bool  # deletion only: every child is gone
    next_wakeup: Optional[float]


def contains(observed: Any, desired: Any) -> bool:
    """Whether `observed` already has every field `desired` sets (server defaults ignored)."""
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(contains(observed.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(observed, list) and len(observed) == len(desired) and all(
            contains(o, d) for o, d in zip(observed, desired))
    return observed == desired


class Reconciler:
    def __init__(self, writer: Writer, metrics: OperatorMetrics):
        self.writer = writer
        self.metrics = metrics
        self._pod_groups_present: set[tuple[str, str]] = set()
        self.intents = Intents()
        # The last status this process wrote, with the resourceVersion it produced: the watch
        # cache may hand us the object from before that write.
        self._written: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    # -- entry point ----------------------------------------------------------------------
    def reconcile(self, body: Mapping[str, Any], observed: Observed, now: Optional[float] = None,
                  deleting: bool = False) -> ReconcileResult:
        start = time.monotonic()
        try:
            result = self._reconcile(body, observed, time.time() if now is None else now, deleting)
        except Exception:
            self.metrics.reconciles.labels("error").inc()
            raise
        self.metrics.reconciles.labels("success").inc()
        self.metrics.reconcile_duration.observe(time.monotonic() - start)
        return result

    def _reconcile(self, body: Mapping[str, Any], observed: Observed, now: float, deleting: bool) -> ReconcileResult:
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        generation = meta.get("generation")
        previous = self._latest_status(namespace, name, meta.get("resourceVersion"), body.get("status") or {})
        spec, problems = validate_spec(body.get("spec") or {}, name)
        if spec is None:
            if deleting:  # nothing can be planned: tear down what exists without order
                return self._teardown_unplannable(namespace, name, observed)
            status = invalid_status(problems, previous, generation, now)
            if status != previous:
                self._write_status(namespace, name, status)
                self.writer.event(body, "Warning", "InvalidSpec", "; ".join(str(p) for p in problems))
            return ReconcileResult(finished=False, next_wakeup=None)

        revision = revision_of(spec)
        owner = owner_reference(name, meta["uid"])
        pods = self.intents.overlay(namespace, name, observed.pods, now)
        observed = Observed(pods=pods, objects=observed.objects)
        layouts = {o.labels.get(naming.LABEL_REVISION, ""): {"ffn": o.spec["ffnPods"], "attention": o.spec["attentionPods"]}
                   for o in observed.objects if o.kind == "ConfigMap" and "ffnPods" in o.spec}
        idle = frozenset(p.name for p in pods if p.head and p.drain_started_at is not None and not p.deleting
                         and self.head_is_idle(p))
        decision = decide(spec, name, revision, pods, records_from_status(previous), now, deleting, layouts, idle)
        for action in decision.actions:
            log.info("%s/%s: %s %s %s", namespace, name, action.kind, action.instance,
                     action.role or ",".join(action.pods))
        if decision.actions:
            log.debug("%s/%s observed pods: %s", namespace, name,
                      [(p.name, p.phase, p.ready, p.deleting) for p in observed.pods])
        current_plan = plan(spec, name, namespace, indices=[])

        live_names = {r.name for r in decision.instances}
        if not deleting:
            self._ensure_shared(spec, current_plan, observed, owner, {r.revision for r in decision.instances})
            for rec in decision.instances:
                if rec.revision == revision:
                    self._ensure_instance_objects(spec, current_plan, rec.index, observed, owner)
        self._delete_instance_objects(namespace, observed, live_names, decision)
        self._execute(spec, current_plan, decision, owner, now)
        for event in decision.events:
            self.writer.event(body, event.type, event.reason, event.message)

        if deleting:
            finished = not decision.instances and not observed.pods
            if finished:
                self._delete_shared(namespace, name, observed)
                self.metrics.forget(namespace, name)
            return ReconcileResult(finished=finished, next_wakeup=decision.next_wakeup)

        counts = self._pod_counts(observed.pods)
        status = build_status(name, spec, revision, decision, counts, previous, generation, now)
        if status != previous:
            self._write_status(namespace, name, status)
        self._record_metrics(namespace, name, decision)
        return ReconcileResult(finished=False, next_wakeup=decision.next_wakeup)

    # -- drain probe ------------------------------------------------------------------------
    @staticmethod
    def head_is_idle(pod: ObservedPod) -> bool:
        """Whether a draining Attention head reports no running request on its vLLM /metrics.
        Unreachable or unreadable metrics mean "not known idle": the drain waits its window."""
        if not pod.pod_ip or not pod.api_port:
            return False
        try:
            with urllib.request.urlopen(f"http://{pod.pod_ip}:{pod.api_port}/metrics",
                                        timeout=DRAIN_PROBE_TIMEOUT_SECONDS) as resp:
                text = resp.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return False
        running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(RUNNING_REQUESTS_METRIC) and not line.startswith("#")]
        return bool(running) and sum(running) == 0

    # -- status ---------------------------------------------------------------------------
    def _latest_status(self, namespace: str, name: str, resource_version: Optional[str],
                       observed: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            written = self._written.get((namespace, name))
            if written is None or resource_version is None:
                return observed
            written_rv, status = written
            try:
                stale = int(resource_version) < written_rv  # etcd revisions: integers in practice
            except ValueError:
                return observed
            if not stale:
                del self._written[(namespace, name)]
                return observed
            return status

    def _write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        rv = self.writer.patch_status(namespace, name, status)
        if rv is not None and rv.isdigit():
            with self._lock:
                self._written[(namespace, name)] = (int(rv), status)

    # -- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _pod_counts(pods: Iterable[ObservedPod]) -> dict[str, tuple[int, int]]:
        counts: dict[str, tuple[int, int]] = {}
        for pod in pods:
            ready, total = counts.get(pod.instance, (0, 0))
            counts[pod.instance] = (ready + int(pod.ready), total + 1)
        return counts

    def _record_metrics(self, namespace: str, name: str, decision: Decision) -> None:
        self.metrics.record_instances(namespace, name, [r.phase for r in decision.instances])
        self.metrics.rollout_in_progress.labels(namespace, name).set(int(decision.rollout_in_progress))
        if decision.restarted:
            self.metrics.instance_restarts.labels(namespace, name).inc(decision.restarted)
        for _, seconds in decision.became_ready:
            self.metrics.time_to_ready.observe(seconds)

    def _ensure(self, desired: Mapping[str, Any], observed: Optional[Mapping[str, Any]], compare: str) -> None:
        """Create `desired` if missing; patch its `compare` section if it drifted."""
        meta = desired["metadata"]
        if observed is None:
            self.writer.create(desired)
        elif not contains(observed.get(compare), desired.get(compare)):
            self.writer.patch(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"],
                              {compare: desired[compare]})

    def _ensure_shared(self, spec: AFDDeploymentSpec, current_plan: Plan, observed: Observed,
                       owner: Mapping[str, Any], live_revisions: set[str]) -> None:
        by_name = {(o.kind, o.name): o for o in observed.objects}
        for obj in render_shared(spec, current_plan, owner):
            kind, meta = obj["kind"], obj["metadata"]
            if kind in ("Service", "ConfigMap"):
                seen = by_name.get((kind, meta["name"]))
                if kind == "ConfigMap":
                    if seen is None:
                        self.writer.create(obj)  # per-revision snapshots are immutable
                    continue
                self._ensure(obj, None if seen is None else {"spec": seen.spec}, "spec")
            elif self.writer.serves(obj["apiVersion"], kind):
                self._ensure(obj, self.writer.get(obj["apiVersion"], kind, meta["namespace"], meta["name"]), "spec")
        if not (spec.metrics.enabled and spec.metrics.pod_monitor) and self.writer.serves(
                "monitoring.coreos.com/v1", "PodMonitor"):
            name = naming.pod_monitor_name(current_plan.name)
            if self.writer.get("monitoring.coreos.com/v1", "PodMonitor", current_plan.namespace, name):
                self.writer.delete("monitoring.coreos.com/v1", "PodMonitor", current_plan.namespace, name)
        # Snapshots of revisions no instance uses any more.
        keep = live_revisions | {current_plan.revision}
        for o in observed.objects:
            if o.kind == "ConfigMap" and o.labels.get(naming.LABEL_REVISION) not in keep:
                self.writer.delete("v1", "ConfigMap", current_plan.namespace, o.name)

    def _ensure_instance_objects(self, spec: AFDDeploymentSpec, current_plan: Plan, index: int,
                                 observed: Observed, owner: Mapping[str, Any]) -> None:
        instance = plan_instance(spec, current_plan.name, current_plan.namespace, current_plan.revision, index)
        service = render_instance_service(spec, current_plan, instance, owner)
        seen = next((o for o in observed.objects if o.kind == "Service" and o.name == instance.name), None)
        self._ensure(service, None if seen is None else {"spec": seen.spec}, "spec")
        if spec.scheduling.gang.provider == "volcano":
            key = (current_plan.namespace, instance.name)
            if key not in self._pod_groups_present:
                group = render_pod_group(spec, current_plan, instance, owner)
                if self.writer.get(group["apiVersion"], "PodGroup", *key) is None:
                    self.writer.create(group)
                self._pod_groups_present.add(key)

    def _delete_instance_objects(self, namespace: str, observed: Observed, live: set[str], decision: Decision) -> None:
        for o in observed.objects:
            if o.kind == "Service" and o.labels.get(naming.LABEL_COMPONENT) == "instance" and o.name not in live:
                self.writer.delete("v1", "Service", namespace, o.name)
        for instance in decision.gone:
            key = (namespace, instance)
            if key in self._pod_groups_present or self.writer.serves("scheduling.volcano.sh/v1beta1", "PodGroup"):
                self.writer.delete("scheduling.volcano.sh/v1beta1", "PodGroup", namespace, instance)
                self._pod_groups_present.discard(key)

    def _execute(self, spec: AFDDeploymentSpec, current_plan: Plan, decision: Decision,
                 owner: Mapping[str, Any], now: float) -> None:
        ns = current_plan.namespace
        for action in decision.actions:
            if action.kind == "create_pods":
                assert action.revision == current_plan.revision, "only the current revision is ever created"
                instance = plan_instance(spec, current_plan.name, ns, action.revision, action.index)
                for pod in instance.pods_of(action.role):  # type: ignore[arg-type]
                    body = render_pod(spec, current_plan, instance, pod, owner)
                    self.writer.create(body)
                    self.intents.created(ns, summarize_pod(body, created_at=now), now)
            elif action.kind == "set_serving":
                value = "true" if action.serving else None
                for pod in action.pods:
                    self.writer.patch("v1", "Pod", ns, pod, {"metadata": {"labels": {naming.LABEL_SERVING: value}}})
                    self.intents.labelled(ns, pod, action.serving, None, now)
            elif action.kind == "start_drain":
                stamp = format_time(now)
                for pod in action.pods:
                    self.writer.patch("v1", "Pod", ns, pod, {"metadata": {
                        "labels": {naming.LABEL_SERVING: None},
                        "annotations": {naming.ANNOTATION_DRAIN_STARTED: stamp},
                    }})
                    self.intents.labelled(ns, pod, False, parse_time(stamp), now)
            elif action.kind == "delete_pods":
                for pod in action.pods:
                    self.writer.delete("v1", "Pod", ns, pod)
                    self.intents.deleted(ns, pod, now)
            else:
                raise ValueError(f"unknown action {action.kind}")

    def _delete_shared(self, namespace: str, name: str, observed: Observed) -> None:
        for o in observed.objects:
            self.writer.delete("v1", o.kind, namespace, o.name)
        self.writer.delete("policy/v1", "PodDisruptionBudget", namespace, naming.pdb_name(name))
        if self.writer.serves("monitoring.coreos.com/v1", "PodMonitor"):
            self.writer.delete("monitoring.coreos.com/v1", "PodMonitor", namespace, naming.pod_monitor_name(name))

    def _teardown_unplannable(self, namespace: str, name: str, observed: Observed) -> ReconcileResult:
        for pod in observed.pods:
            if not pod.deleting:
                self.writer.delete("v1", "Pod", namespace, pod.name)
        if not observed.pods:
            self._delete_shared(namespace, name, observed)
        return ReconcileResult(finished=not observed.pods, next_wakeup=None)
