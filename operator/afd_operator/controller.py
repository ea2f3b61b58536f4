"""The controller's decisions: observed instances + spec -> actions. Pure: no I/O, the clock
is an argument.

Instances are the unit of everything: created in waves (FFN pods, then Attention pods
once the FFN side runs), served only while every pod is Ready, recreated whole when any
rank fails (with exponential backoff and a restart budget), drained in order (leave the
Service, wait, delete Attention pods, then FFN pods, then the instance's objects), and
rolled by replacing whole instances so that revisions never mix inside a world.

Instance slots: a new instance takes the lowest index that no live instance (of any
revision) uses. Names carry the revision, so an instance is identified by its name;
ports are offset by the index, so live instances never share ports on a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional

from .api import AFDDeploymentSpec, Phase, UpdateStrategySpec
from .decisions import CreatePods, Decision, DeletePods, Event, InstanceRecord, InstanceView, SetServing, StartDrain
from .observe import ObservedPod
from .planner import attention_layout, ffn_layout, rollout_budget


def expected_pods(spec: AFDDeploymentSpec) -> dict[str, int]:
    return {"ffn": ffn_layout(spec).pods, "attention": attention_layout(spec).pods}


def backoff_seconds(spec: AFDDeploymentSpec, consecutive_failures: int) -> float:
    rec = spec.recovery
    return float(min(rec.backoff_seconds * 2 ** max(consecutive_failures - 1, 0), rec.max_backoff_seconds))


def _phase(view: InstanceView, expected: dict[str, int], policy: str) -> Phase:
    if view.draining:
        return Phase.DRAINING
    rec = view.record
    if view.failure or view.exhausted:
        return Phase.FAILED
    # A failed instance stays Failed while it is torn down, waits for its retry, or is left
    # alone (recovery.policy None).
    if rec.phase == Phase.FAILED and (not view.pods or any(p.deleting for p in view.pods) or policy == "None"):
        return Phase.FAILED
    complete = all(len(view.of_role(role)) == count for role, count in expected.items())
    if complete and all(p.ready for p in view.pods):
        return Phase.READY
    if complete and all(p.phase == "Running" for p in view.pods):
        return Phase.STARTING
    return Phase.PENDING


def _detect_failure(view: InstanceView, spec: AFDDeploymentSpec, expected: dict[str, int], now: float) -> Optional[str]:
    """Why a live (not draining) instance can no longer serve, or None."""
    for pod in view.pods:
        if pod.deleting:
            return f"pod {pod.name} was deleted"
        if pod.phase == "Failed":
            return f"pod {pod.name} failed: {pod.termination or 'phase Failed'}"
        if pod.phase == "Succeeded":
            return f"pod {pod.name} exited"
        if pod.cannot_start:
            return f"pod {pod.name} cannot start: {pod.cannot_start}"
    # Once Attention pods exist the world is (being) formed: a missing rank breaks it.
    if view.of_role("attention") or view.record.first_ready is not None:
        for role, count in expected.items():
            present = {p.ordinal for p in view.of_role(role)}
            missing = sorted(set(range(count)) - present)
            if missing:
                return f"{role} pod(s) {missing} disappeared"
    if view.record.first_ready is not None:
        grace = spec.recovery.unready_grace_seconds
        for pod in view.pods:
            if not pod.ready and pod.ready_changed_at is not None and now - pod.ready_changed_at >= grace:
                return f"pod {pod.name} not Ready for {int(now - pod.ready_changed_at)}s (grace {grace}s)"
    if view.record.first_ready is None and view.pods:
        created = min((p.created_at for p in view.pods if p.created_at is not None), default=now)
        if now - created >= spec.startup.timeout_seconds:
            waiting = [p for p in view.pods if not p.scheduled]
            if waiting:
                detail = waiting[0].unschedulable or "not scheduled"
                return f"Unschedulable: {len(waiting)} pod(s) still Pending after {spec.startup.timeout_seconds}s ({detail})"
            return f"StartupTimeout: not Ready within {spec.startup.timeout_seconds}s"
    return None


def _views(records: Iterable[InstanceRecord], pods: Iterable[ObservedPod]) -> dict[str, InstanceView]:
    views: dict[str, InstanceView] = {}
    for rec in records:
        views[rec.name] = InstanceView(record=rec, pods=[])
    for pod in pods:
        if pod.instance not in views:
            views[pod.instance] = InstanceView(
                record=InstanceRecord(name=pod.instance, revision=pod.revision, index=pod.index, phase=Phase.PENDING),
                pods=[],
            )
        views[pod.instance].pods.append(pod)
    for view in views.values():
        view.previous_phase = view.record.phase
        view.pods.sort(key=lambda p: (p.role, p.ordinal))
        view.draining = view.record.phase == Phase.DRAINING or any(p.drain_started_at is not None for p in view.pods)
    return views


def _old_instances_kept(us: UpdateStrategySpec, old_count: int) -> int:
    """Old-revision instances a rollout keeps: the partition (RollingUpdate), none (Recreate)."""
    return min(us.partition, old_count) if us.type == "RollingUpdate" else 0


def _pick(views: list[InstanceView], count: int) -> list[InstanceView]:
    """Instances to remove first: those that stay down, not Ready ones, then the highest index."""
    return sorted(views, key=lambda v: (not v.exhausted, v.record.phase == Phase.READY, -v.index))[:max(count, 0)]


@dataclass
class _Fleet:
    """The live (not draining) instances, sorted by what the rollout does with them."""

    current: list[InstanceView]  # the spec's revision, able to run
    exhausted_current: list[InstanceView]  # the spec's revision, past the restart budget
    old: list[InstanceView]  # other revisions
    kept: list[InstanceView] = field(default_factory=list)  # old instances a partition keeps
    excess_old: list[InstanceView] = field(default_factory=list)  # old instances still to replace
    serving: int = 0  # Ready instances left after this decision's drains


class _Decider:
    """Accumulates one decision; each step of `decide` is one method, named for its rule."""

    def __init__(self, spec: AFDDeploymentSpec, name: str, revision: str, now: float,
                 layouts: Mapping[str, Mapping[str, int]], idle_heads: frozenset[str],
                 views: dict[str, InstanceView]):
        self.spec, self.name, self.revision, self.now = spec, name, revision, now
        self.idle_heads = idle_heads
        self.layouts = {**layouts, revision: expected_pods(spec)}
        self.views = views
        self.budget = rollout_budget(spec)
        self.decision = Decision()

    def expected(self, view: InstanceView) -> dict[str, int]:
        """Pods per role of the view's revision; for a revision whose layout is unknown
        (its snapshot is gone), the pods that exist."""
        known = self.layouts.get(view.revision)
        if known is not None:
            return dict(known)
        return {role: len(view.of_role(role)) for role in ("ffn", "attention")}

    def phase_of(self, view: InstanceView) -> Phase:
        return _phase(view, self.expected(view), self.spec.recovery.policy)

    # -- 1. classify ----------------------------------------------------------------------
    def classify(self) -> None:
        """Failures of live instances (draining ones are on their way out anyway, failed
        ones are already being handled) and instances past their restart budget."""
        for view in self.views.values():
            if not view.draining and view.pods and view.record.phase != Phase.FAILED:
                view.failure = _detect_failure(view, self.spec, self.expected(view), self.now)
            view.exhausted = (view.record.phase == Phase.FAILED
                              and view.record.consecutive_failures > self.spec.recovery.max_restarts)

    def fleet(self) -> _Fleet:
        alive = [v for v in self.views.values() if not v.draining]
        for v in alive:
            v.record = replace(v.record, phase=self.phase_of(v))
        return _Fleet(
            current=[v for v in alive if v.revision == self.revision and not v.exhausted],
            exhausted_current=[v for v in alive if v.revision == self.revision and v.exhausted],
            old=[v for v in alive if v.revision != self.revision],
            serving=sum(1 for v in alive if v.record.phase == Phase.READY),
        )

    # -- 2. old instances that never served ------------------------------------------------
    def drop_unserved_old(self, fleet: _Fleet) -> None:
        """Old instances that do not serve (never Ready, failed) go at once: quick successive
        updates and reverts never wait on them."""
        for v in [v for v in fleet.old if v.record.phase != Phase.READY]:
            self.drain(v, f"revision {v.revision} replaced by {self.revision} before it served")
            fleet.old.remove(v)

    # -- 3. the partition ----------------------------------------------------------------
    def keep_partition(self, fleet: _Fleet) -> None:
        """Old Ready instances a partition keeps; exhausted old ones are replaced like the rest."""
        old_ready = sorted(fleet.old, key=lambda v: v.index)
        fleet.kept = old_ready[:_old_instances_kept(self.spec.update_strategy, len(old_ready))]
        fleet.excess_old = [v for v in old_ready if v not in fleet.kept]

    def wanted_current(self, fleet: _Fleet) -> int:
        return max(self.spec.replicas - len(fleet.kept), 0)

    # -- 4. scale down ---------------------------------------------------------------------
    def scale_down(self, fleet: _Fleet) -> None:
        """Instances that stay down first, then not Ready ones, then the highest index."""
        excess = len(fleet.current) + len(fleet.exhausted_current) - self.wanted_current(fleet)
        if excess <= 0:
            return
        for v in _pick(fleet.exhausted_current + fleet.current, excess):
            if v.record.phase == Phase.READY:
                fleet.serving -= 1
            self.drain(v, f"scaling down to {self.spec.replicas} instance(s)")
            (fleet.exhausted_current if v in fleet.exhausted_current else fleet.current).remove(v)

    # -- 5. replace old instances ------------------------------------------------------------
    def replace_old(self, fleet: _Fleet) -> None:
        """Recreate drains every old instance; RollingUpdate drains old Ready instances while
        serving instances stay >= the budget's floor."""
        if self.spec.update_strategy.type == "Recreate":
            for v in fleet.excess_old:
                self.drain(v, f"Recreate: replacing revision {v.revision} with {self.revision}")
            fleet.excess_old = []
            return
        for v in sorted(fleet.excess_old, key=lambda v: -v.index):
            if fleet.serving - 1 < self.budget.floor:
                break
            fleet.serving -= 1
            self.drain(v, f"rolling update to revision {self.revision}")
            fleet.excess_old.remove(v)

    # -- 6. create instances ---------------------------------------------------------------
    def create_instances(self, fleet: _Fleet) -> None:
        """Current-revision instances within replicas + maxSurge (draining ones still hold
        devices, so they count). Recreate waits until the old revision is gone."""
        in_flight = sum(1 for v in self.views.values() if v.draining)
        total = (len(fleet.current) + len(fleet.excess_old) + len(fleet.kept) + in_flight
                 + len(fleet.exhausted_current))
        old_left = any(v.revision != self.revision for v in self.views.values())
        may_create = self.spec.update_strategy.type == "RollingUpdate" or not old_left
        used = {v.index for v in self.views.values()}
        limit = self.spec.replicas + self.budget.surge
        while may_create and len(fleet.current) + len(fleet.exhausted_current) < self.wanted_current(fleet) \
                and total < limit:
            index = next(i for i in range(len(used) + 1) if i not in used)
            used.add(index)
            rec = InstanceRecord(name=f"{self.name}-{self.revision}-{index}", revision=self.revision, index=index,
                                 phase=Phase.PENDING)
            view = InstanceView(record=rec, pods=[])
            self.views[rec.name] = view
            fleet.current.append(view)
            total += 1
            self.decision.events.append(Event("Normal", "CreatingInstance",
                                              f"instance {rec.name} (revision {self.revision})"))

    # -- 7. bring instances up, keep serving labels true --------------------------------------
    def advance_creation(self, view: InstanceView) -> None:
        """Create the next wave of an instance's pods (FFN first when asked)."""
        if view.record.retry_after is not None and view.record.retry_after > self.now:
            self.decision.wake_at(view.record.retry_after)
            return
        if view.exhausted or view.failure or any(p.deleting for p in view.pods):
            return  # the previous world's pods must be gone before names are reused
        act = self.decision.actions
        expected = self.expected(view)
        missing_ffn = len(view.of_role("ffn")) < expected["ffn"]
        if missing_ffn:
            act.append(CreatePods(view.name, view.revision, view.index, role="ffn"))
        ffn_running = not missing_ffn and all(p.phase == "Running" for p in view.of_role("ffn"))
        start_attention = self.spec.startup.order == "Parallel" or ffn_running
        if start_attention and len(view.of_role("attention")) < expected["attention"]:
            act.append(CreatePods(view.name, view.revision, view.index, role="attention"))

    def label_serving(self) -> None:
        for v in self.views.values():
            head = v.head
            if v.draining or v.failure or head is None or head.deleting:
                continue
            want_serving = self.phase_of(v) == Phase.READY
            if head.serving != want_serving:
                self.decision.actions.append(SetServing(v.name, pods=(head.name,), serving=want_serving))

    # -- 8. drains and timers --------------------------------------------------------------
    def drain(self, view: InstanceView, reason: str) -> None:
        """Advance the ordered drain of an instance by one step."""
        act = self.decision.actions
        if not view.draining:
            self.decision.events.append(Event("Normal", "DrainingInstance", f"instance {view.name}: {reason}"))
        view.draining = True
        if not view.pods:
            self.decision.gone.add(view.name)
            return
        head = view.head
        serving = head is not None and (head.serving or head.drain_started_at is not None)
        if serving and head.drain_started_at is None:
            act.append(StartDrain(view.name, pods=(head.name,)))
            self.decision.wake_at(self.now + self.spec.termination.drain_seconds)
            return
        window_open = serving and self.now < head.drain_started_at + self.spec.termination.drain_seconds
        if window_open and head.name not in self.idle_heads:
            self.decision.wake_at(head.drain_started_at + self.spec.termination.drain_seconds)
            return
        # The head goes first and alone: through its preStop and vLLM's drain it still serves
        # what kube-proxy routes to it, and every step of its engine needs its DP peers in the
        # other Attention pods. Deleted together, a peer exited within a second and the head's
        # request in flight failed with HTTP 500 (the real node, a roll from DP 2 over 2 pods).
        if head is not None:
            if not head.deleting:
                act.append(DeletePods(view.name, pods=(head.name,)))
            return
        attention = [p for p in view.of_role("attention") if not p.deleting]
        if attention:
            act.append(DeletePods(view.name, pods=tuple(p.name for p in attention)))
            return
        if view.of_role("attention"):
            return  # Attention pods still terminating: the FFN side goes last
        ffn = [p for p in view.of_role("ffn") if not p.deleting]
        if ffn:
            act.append(DeletePods(view.name, pods=tuple(p.name for p in ffn)))

    def continue_drains(self) -> None:
        stepped = {a.instance for a in self.decision.actions if isinstance(a, (StartDrain, DeletePods))}
        for v in self.views.values():
            if v.draining and v.name not in self.decision.gone and v.name not in stepped:
                self.drain(v, "")

    def watch_timers(self) -> None:
        """Wake up when startup timeouts and unready grace periods elapse."""
        spec, d = self.spec, self.decision
        for v in self.views.values():
            if v.draining or v.record.phase == Phase.FAILED:
                continue
            for pod in v.pods:
                if pod.created_at is not None and v.record.first_ready is None:
                    d.wake_at(pod.created_at + spec.startup.timeout_seconds)
                if not pod.ready and pod.ready_changed_at is not None and v.record.first_ready is not None:
                    d.wake_at(pod.ready_changed_at + spec.recovery.unready_grace_seconds)

    # -- failures ------------------------------------------------------------------------
    def handle_failure(self, view: InstanceView) -> None:
        rec, spec = view.record, self.spec
        if spec.recovery.policy == "None":
            view.record = replace(rec, phase=Phase.FAILED, last_failure=view.failure)
            self.decision.events.append(Event("Warning", "InstanceFailed",
                                              f"instance {view.name} failed: {view.failure}; recovery.policy is None"))
            return
        failures = rec.consecutive_failures + 1
        exhausted = failures > spec.recovery.max_restarts
        retry = None if exhausted else self.now + backoff_seconds(spec, failures)
        view.record = replace(rec, phase=Phase.FAILED, consecutive_failures=failures, last_failure=view.failure,
                              restarts=rec.restarts if exhausted else rec.restarts + 1, retry_after=retry,
                              first_ready=None)
        view.exhausted = exhausted
        if exhausted:
            msg = (f"instance {view.name} failed {failures} times in a row (recovery.maxRestarts "
                   f"{spec.recovery.max_restarts}); it stays down: {view.failure}")
            self.decision.events.append(Event("Warning", "RestartBudgetExhausted", msg))
        else:
            self.decision.restarted += 1
            msg = f"instance {view.name} failed: {view.failure}; recreating in {retry - self.now:.0f}s"
            self.decision.events.append(Event("Warning", "InstanceFailed", msg))
            self.decision.wake_at(retry)
        # A world cannot survive the loss of a rank: take the whole instance down at once.
        live = [p for p in view.pods if not p.deleting]
        if live:
            self.decision.actions.append(DeletePods(view.name, pods=tuple(p.name for p in live)))

    # -- 9. rollout progress ----------------------------------------------------------------
    def report_progress(self, fleet: _Fleet, paused: bool) -> None:
        d, revision, replicas = self.decision, self.revision, self.spec.replicas
        old_remaining = [v for v in self.views.values() if v.revision != revision]
        # An instance whose pods could not be scheduled is retried with backoff; until it runs,
        # the rollout says why it is stuck instead of waiting silently.
        unschedulable = [v for v in fleet.current if v.record.phase == Phase.FAILED
                         and (v.record.last_failure or "").startswith("Unschedulable")]
        wanted = max(replicas - _old_instances_kept(self.spec.update_strategy, len(old_remaining)), 0)
        d.rollout_in_progress = bool(old_remaining) or len(fleet.current) != wanted or \
            any(v.record.phase != Phase.READY for v in fleet.current)
        if paused:
            d.progress_reason, d.progress_message = "Paused", "updateStrategy.paused is set"
        elif unschedulable:
            d.progress_reason = "SurgeUnschedulable" if old_remaining else "Unschedulable"
            d.progress_message = f"instance {unschedulable[0].name}: {unschedulable[0].record.last_failure}"
        elif d.rollout_in_progress:
            d.progress_reason = "RollingUpdate" if old_remaining else "Scaling"
            ready = sum(1 for v in fleet.current if v.record.phase == Phase.READY)
            d.progress_message = (f"{ready}/{replicas} instance(s) of revision {revision} Ready, "
                                  f"{len(old_remaining)} of other revisions left")

    # -- the new status records --------------------------------------------------------------
    def finish(self) -> Decision:
        d, spec, now = self.decision, self.spec, self.now
        # New serving heads join the Service before old ones leave it, so a surge never dips.
        d.actions.sort(key=lambda a: 0 if isinstance(a, SetServing) and a.serving else 1)
        for view in sorted(self.views.values(), key=lambda v: (v.index, v.revision)):
            if view.name in d.gone:
                continue
            phase = self.phase_of(view)
            rec = view.record
            if phase == Phase.READY and rec.first_ready is None:
                created = min((pod.created_at for pod in view.pods if pod.created_at is not None), default=now)
                d.became_ready.append((view.name, now - created))
            if phase != view.previous_phase:
                d.events.append(Event("Normal" if phase != Phase.FAILED else "Warning", "InstancePhase",
                                      f"instance {view.name}: {view.previous_phase} -> {phase}"))
            if phase == Phase.FAILED and view.exhausted:
                d.degraded.append(f"instance {view.name} stays down after {rec.consecutive_failures} consecutive "
                                  f"failures (recovery.maxRestarts {spec.recovery.max_restarts}): {rec.last_failure}")
            elif phase == Phase.FAILED and spec.recovery.policy == "None":
                d.degraded.append(f"instance {view.name} failed and recovery.policy is None: {rec.last_failure}")
            # A world that crashes soon after becoming Ready must not restart forever: only one
            # that stayed Ready for recovery.stableSeconds has recovered.
            recovered = (phase == Phase.READY and rec.first_ready is not None
                         and now - rec.first_ready >= spec.recovery.stable_seconds)
            if phase == Phase.READY and rec.consecutive_failures and not recovered:
                d.wake_at((rec.first_ready or now) + spec.recovery.stable_seconds)
            d.instances.append(replace(
                rec, phase=phase,
                first_ready=now if phase == Phase.READY and rec.first_ready is None else rec.first_ready,
                consecutive_failures=0 if recovered else rec.consecutive_failures,
                retry_after=None if phase != Phase.FAILED else rec.retry_after,
            ))
        return d


def decide(
    spec: AFDDeploymentSpec,
    name: str,
    revision: str,
    pods: Iterable[ObservedPod],
    records: Iterable[InstanceRecord],
    now: float,
    deleting: bool = False,
    layouts: Mapping[str, Mapping[str, int]] = {},
    idle_heads: frozenset[str] = frozenset(),
) -> Decision:
    """Everything the operator should do now for one AFDDeployment. `layouts` gives the pods
    per role of older revisions (from their snapshots), so their instances are judged by
    their own shape; `idle_heads` are draining heads that no Service endpoint lists any more
    and that report no running request, whose drain need not wait out termination.drainSeconds."""
    step = _Decider(spec, name, revision, now, layouts, idle_heads, _views(records, pods))
    step.classify()
    if deleting:
        for view in step.views.values():
            step.drain(view, "AFDDeployment is being deleted")
        return step.finish()
    for view in step.views.values():
        if view.failure and not view.draining:
            step.handle_failure(view)
    fleet = step.fleet()
    paused = spec.update_strategy.paused and bool(fleet.old)
    if not paused:
        step.drop_unserved_old(fleet)
        step.keep_partition(fleet)
        step.scale_down(fleet)
        step.replace_old(fleet)
        step.create_instances(fleet)
    for view in fleet.current:
        if not view.failure:
            step.advance_creation(view)
    step.label_serving()
    step.continue_drains()
    step.watch_timers()
    step.report_progress(fleet, paused)
    return step.finish()
