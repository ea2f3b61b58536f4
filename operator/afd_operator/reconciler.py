"""One reconciliation of one AFDDeployment: observe -> validate/plan -> decide -> diff -> write.

Level-based: every run starts from what is observed (watch caches) and what the status
recorded, so running it again, or after an operator restart, converges to the same place.
A run with nothing to do writes nothing. The reconciler only orchestrates: the controller
decides, one manager per child kind diffs and writes (managers/), the status module builds
the one status this module writes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from . import drain_probe
from .api import ConditionType
from .controller import decide
from .managers import ChildManager, Round
from .managers.instance_guards import DisruptionBudgetManager, NetworkPolicyManager
from .managers.pod_groups import PodGroupManager
from .managers.pod_monitor import PodMonitorManager
from .managers.pods import PodManager
from .managers.services import ServiceManager
from .managers.snapshots import SnapshotManager, layouts, unreadable
from .memory import DeploymentMemory, Memory
from .metrics import OperatorMetrics
from .observe import Observed
from .planner import plan
from .policy import ClusterPolicy
from .render import owner_reference
from .status import build_status, invalid_status, records_from_status, write_failed_status, write_failure_reason
from .validation import validate_spec
from .writer import ApiWriteError, Writer

log = logging.getLogger(__name__)

# A refused write is retried this soon (the API may accept it once quota or RBAC is fixed).
WRITE_RETRY_SECONDS = 2.0


@dataclass(frozen=True)
class ReconcileResult:
    finished: bool  # deletion only: every child is gone
    next_wakeup: Optional[float]
    write_refused: bool = False


@dataclass(frozen=True)
class _Target:
    """The deployment being reconciled and what the operator remembers about it."""

    body: Mapping[str, Any]
    namespace: str
    name: str
    memory: DeploymentMemory
    previous: dict[str, Any]  # the latest status known
    generation: Optional[int]


class Reconciler:
    def __init__(self, writer: Writer, metrics: OperatorMetrics, policy: ClusterPolicy = ClusterPolicy()):
        self.writer = writer
        self.metrics = metrics
        self.policy = policy
        self.memory = Memory()
        self.pods = PodManager()
        # In the order their children must exist: a pod's Service, snapshot, guards and gang first.
        self.managers: tuple[ChildManager, ...] = (
            SnapshotManager(), ServiceManager(), DisruptionBudgetManager(), NetworkPolicyManager(),
            PodMonitorManager(), PodGroupManager(), self.pods)

    # -- entry point ----------------------------------------------------------------------
    def reconcile(self, body: Mapping[str, Any], observed: Observed, now: Optional[float] = None,
                  deleting: bool = False) -> ReconcileResult:
        start = time.monotonic()
        try:
            result = self._reconcile(body, observed, time.time() if now is None else now, deleting)
        except Exception:
            self.metrics.reconciles.labels("error").inc()
            raise
        self.metrics.reconciles.labels("error" if result.write_refused else "success").inc()
        self.metrics.reconcile_duration.observe(time.monotonic() - start)
        return result

    def _reconcile(self, body: Mapping[str, Any], observed: Observed, now: float, deleting: bool) -> ReconcileResult:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        memory = self.memory.of(namespace, name)
        target = _Target(body, namespace, name, memory,
                         memory.latest_status(meta.get("resourceVersion"), body.get("status") or {}),
                         meta.get("generation"))
        try:
            return self._converge(target, observed, now, deleting)
        except ApiWriteError as err:
            return self._refused(target, err, now)

    def _converge(self, t: _Target, observed: Observed, now: float, deleting: bool) -> ReconcileResult:
        # Never raises: a spec that breaks the validator itself is a problem like any other, so it
        # sets ConfigValid=False and a teardown still runs (without order) instead of failing.
        spec, problems = validate_spec(t.body.get("spec") or {}, t.name, namespace=t.namespace, policy=self.policy)
        if spec is None:
            if deleting:  # nothing can be planned: tear down what exists without order
                return self._teardown_unplannable(t, observed)
            self._write_status(t, invalid_status(problems, t.previous, t.generation, now),
                               ("InvalidSpec", "; ".join(str(p) for p in problems)))
            return ReconcileResult(finished=False, next_wakeup=None)

        # The one plan (and revision hash) of this reconciliation: the decision, every manager and
        # the status share it.
        current = plan(spec, t.name, t.namespace, indices=[])
        observed = replace(observed, pods=t.memory.intents.overlay(observed.pods, now))
        decision = decide(spec, t.name, current.revision, observed.pods, records_from_status(t.previous), now,
                          deleting, layouts(observed), drain_probe.idle_heads(observed))
        for action in decision.actions:
            log.info("%s/%s: %s", t.namespace, t.name, action)
        if decision.actions:
            log.debug("%s/%s observed pods: %s", t.namespace, t.name,
                      [(p.name, p.phase, p.ready, p.deleting) for p in observed.pods])

        current_round = Round(writer=self.writer, spec=spec, plan=current,
                              owner=owner_reference(t.name, t.body["metadata"]["uid"]), observed=observed,
                              decision=decision, memory=t.memory, now=now, deleting=deleting, policy=self.policy)
        for manager in self.managers:
            manager.sync(current_round)
        for event in decision.events:
            self.writer.event(t.body, event.type, event.reason, event.message)

        if deleting and not decision.instances and not observed.pods:
            self._finish_teardown(t, observed)
            return ReconcileResult(finished=True, next_wakeup=decision.next_wakeup)

        # Written while deleting too: the instances' phases show the teardown, and the next
        # round starts from them, so each phase change is announced once.
        problems = unreadable(observed)
        status = build_status(t.name, spec, current.revision, decision, observed.pods, t.previous, t.generation, now,
                              self.policy.network, problems)
        known = any(c.get("type") == ConditionType.SNAPSHOT_UNREADABLE.value
                    for c in (t.previous or {}).get("conditions") or [])
        self._write_status(t, status, ("SnapshotUnreadable", "; ".join(problems)) if problems and not known else None)
        self.metrics.record_decision(t.namespace, t.name, decision)
        return ReconcileResult(finished=False, next_wakeup=decision.next_wakeup)

    # -- teardown -----------------------------------------------------------------------------
    def _finish_teardown(self, t: _Target, observed: Observed) -> None:
        """Every pod is gone: remove the rest, then forget the deployment."""
        for manager in self.managers:
            manager.remove_all(self.writer, t.namespace, t.name, observed)
        self.metrics.forget(t.namespace, t.name)
        self.memory.forget(t.namespace, t.name)

    def _teardown_unplannable(self, t: _Target, observed: Observed) -> ReconcileResult:
        if observed.pods:
            self.pods.remove_all(self.writer, t.namespace, t.name, observed)
            return ReconcileResult(finished=False, next_wakeup=None)
        self._finish_teardown(t, observed)
        return ReconcileResult(finished=True, next_wakeup=None)

    # -- status: the one writer ----------------------------------------------------------------
    def _write_status(self, t: _Target, status: dict[str, Any], warning: Optional[tuple[str, str]] = None) -> None:
        """Write `status` if it changed, with an optional Warning event (reason, message) that
        is posted only along with a change, so a standing problem is announced once."""
        if status == t.previous:
            return
        t.memory.status_written(self.writer.patch_status(t.namespace, t.name, status), status)
        if warning is not None:
            self.writer.event(t.body, "Warning", *warning)

    def _refused(self, t: _Target, err: ApiWriteError, now: float) -> ReconcileResult:
        """The API refused a write: nothing after it was attempted. Say so in status and an
        event, and retry soon; the decision is made again from the same observations."""
        log.warning("%s/%s: %s", t.namespace, t.name, err)
        self._write_status(t, write_failed_status(err, t.previous, t.generation, now),
                           (write_failure_reason(err), str(err)))
        return ReconcileResult(finished=False, next_wakeup=now + WRITE_RETRY_SECONDS, write_refused=True)
