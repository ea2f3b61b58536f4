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

from .api import AFDDeploymentSpec, UpdateStrategySpec
from .observe import ObservedPod
from .planner import attention_layout, ffn_layout
from .validation import resolve_int_or_percent

READY, STARTING, PENDING, DRAINING, FAILED = "Ready", "Starting", "Pending", "Draining", "Failed"


@dataclass(frozen=True)
class InstanceRecord:
    """What the previous status says about an instance (the operator's own memory)."""

    name: str
    revision: str
    index: int
    phase: str
    restarts: int = 0
    consecutive_failures: int = 0
    last_failure: Optional[str] = None
    retry_after: Optional[float] = None
    first_ready: Optional[float] = None  # set once the world has been Ready; cleared when it is recreated


@dataclass(frozen=True)
class Action:
    kind: str  # create_pods | set_serving | start_drain | delete_pods
    instance: str
    revision: str = ""
    index: int = -1
    role: str = ""
    pods: tuple[str, ...] = ()
    serving: bool = False


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class InstanceView:
    """One instance as this decision sees it."""

    record: InstanceRecord
    pods: list[ObservedPod]
    previous_phase: str = PENDING  # as the last status recorded it
    draining: bool = False
    failure: Optional[str] = None
    exhausted: bool = False

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def revision(self) -> str:
        return self.record.revision

    def of_role(self, role: str) -> list[ObservedPod]:
        return [p for p in self.pods if p.role == role]

    @property
    def head(self) -> Optional[ObservedPod]:
        return next((p for p in self.pods if p.head), None)


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    instances: list[InstanceRecord] = field(default_factory=list)  # the new status records
    rollout_in_progress: bool = False
    progress_reason: str = "Complete"
    progress_message: str = ""
    degraded: list[str] = field(default_factory=list)
    became_ready: list[tuple[str, float]] = field(default_factory=list)  # (instance, seconds to Ready)
    restarted: int = 0
    gone: set[str] = field(default_factory=set)  # instances fully drained: their records are dropped
    next_wakeup: Optional[float] = None  # the earliest time a timer elapses

    def wake_at(self, when: float) -> None:
        self.next_wakeup = when if self.next_wakeup is None else min(self.next_wakeup, when)


def expected_pods(spec: AFDDeploymentSpec) -> dict[str, int]:
    return {"ffn": ffn_layout(spec).pods, "attention": attention_layout(spec).pods}


def backoff_seconds(spec: AFDDeploymentSpec, consecutive_failures: int) -> float:
    rec = spec.recovery
    return float(min(rec.backoff_seconds * 2 ** max(consecutive_failures - 1, 0), rec.max_backoff_seconds))


def _phase(view: InstanceView, expected: dict[str, int], policy: str) -> str:
    if view.draining:
        return DRAINING
    rec = view.record
    if view.failure or view.exhausted:
        return FAILED
    # A failed instance stays Failed while it is torn down, waits for its retry, or is left
    # alone (recovery.policy None).
    if rec.phase == FAILED and (not view.pods or any(p.deleting for p in view.pods) or policy == "None"):
        return FAILED
    complete = all(len(view.of_role(role)) == count for role, count in expected.items())
    if complete and all(p.ready for p in view.pods):
        return READY
    if complete and all(p.phase == "Running" for p in view.pods):
        return STARTING
    return PENDING


def _detect_failure(view: InstanceView, spec: AFDDeploymentSpec, expected: dict[str, int], now: float) -> Optional[str]:
    """Why a live (not draining) instance can no longer serve, or None."""
    for pod in view.pods:
        if pod.deleting:
            return f"pod {pod.name} was deleted"
        if pod.phase == "Failed":
            return f"pod {pod.name} failed: {pod.termination or 'phase Failed'}"
        if pod.phase == "Succeeded":
            return f"pod {pod.name} exited"
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
                record=InstanceRecord(name=pod.instance, revision=pod.revision, index=pod.index, phase=PENDING),
                pods=[],
            )
        views[pod.instance].pods.append(pod)
    for view in views.values():
        view.previous_phase = view.record.phase
        view.pods.sort(key=lambda p: (p.role, p.ordinal))
        view.draining = view.record.phase == DRAINING or any(p.drain_started_at is not None for p in view.pods)
    return views


class _Planner:
    """Accumulates one decision; methods read like the rules they implement."""

    def __init__(self, spec: AFDDeploymentSpec, name: str, revision: str, now: float,
                 layouts: Mapping[str, Mapping[str, int]], idle_heads: frozenset[str]):
        self.spec, self.name, self.revision, self.now = spec, name, revision, now
        self.idle_heads = idle_heads
        self.layouts = {**layouts, revision: expected_pods(spec)}
        self.decision = Decision()

    def expected(self, view: InstanceView) -> dict[str, int]:
        """Pods per role of the view's revision; for a revision whose layout is unknown
        (its snapshot is gone), the pods that exist."""
        known = self.layouts.get(view.revision)
        if known is not None:
            return dict(known)
        return {role: len(view.of_role(role)) for role in ("ffn", "attention")}

    # -- draining ------------------------------------------------------------------------
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
            act.append(Action("start_drain", view.name, pods=(head.name,)))
            self.decision.wake_at(self.now + self.spec.termination.drain_seconds)
            return
        window_open = serving and self.now < head.drain_started_at + self.spec.termination.drain_seconds
        if window_open and head.name not in self.idle_heads:
            self.decision.wake_at(head.drain_started_at + self.spec.termination.drain_seconds)
            return
        attention = [p for p in view.of_role("attention") if not p.deleting]
        if attention:
            act.append(Action("delete_pods", view.name, pods=tuple(p.name for p in attention)))
            return
        if view.of_role("attention"):
            return  # Attention pods still terminating: the FFN side goes last
        ffn = [p for p in view.of_role("ffn") if not p.deleting]
        if ffn:
            act.append(Action("delete_pods", view.name, pods=tuple(p.name for p in ffn)))

    # -- failures ------------------------------------------------------------------------
    def handle_failure(self, view: InstanceView) -> None:
        rec, spec = view.record, self.spec
        if spec.recovery.policy == "None":
            view.record = replace(rec, phase=FAILED, last_failure=view.failure)
            self.decision.events.append(Event("Warning", "InstanceFailed",
                                              f"instance {view.name} failed: {view.failure}; recovery.policy is None"))
            return
        failures = rec.consecutive_failures + 1
        exhausted = failures > spec.recovery.max_restarts
        retry = None if exhausted else self.now + backoff_seconds(spec, failures)
        view.record = replace(rec, phase=FAILED, consecutive_failures=failures, last_failure=view.failure,
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
            self.decision.actions.append(Action("delete_pods", view.name, pods=tuple(p.name for p in live)))

    # -- creation ------------------------------------------------------------------------
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
            act.append(Action("create_pods", view.name, view.revision, view.index, role="ffn"))
        ffn_running = not missing_ffn and all(p.phase == "Running" for p in view.of_role("ffn"))
        start_attention = self.spec.startup.order == "Parallel" or ffn_running
        if start_attention and len(view.of_role("attention")) < expected["attention"]:
            act.append(Action("create_pods", view.name, view.revision, view.index, role="attention"))


def _old_instances_kept(us: UpdateStrategySpec, old_count: int) -> int:
    """Old-revision instances a rollout keeps: the partition (RollingUpdate), none (Recreate)."""
    return min(us.partition, old_count) if us.type == "RollingUpdate" else 0


def _pick(views: list[InstanceView], count: int) -> list[InstanceView]:
    """Instances to remove first: those that stay down, not Ready ones, then the highest index."""
    return sorted(views, key=lambda v: (not v.exhausted, v.record.phase == READY, -v.index))[:max(count, 0)]


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
    their own shape; `idle_heads` are draining heads that report no running request, whose
    drain need not wait out termination.drainSeconds."""
    p = _Planner(spec, name, revision, now, layouts, idle_heads)
    d = p.decision
    views = _views(records, pods)

    # 1. Classify: failures of live instances (draining ones are on their way out anyway,
    #    failed ones are already being handled).
    for view in views.values():
        if not view.draining and view.pods and view.record.phase != FAILED:
            view.failure = _detect_failure(view, spec, p.expected(view), now)
        view.exhausted = view.record.phase == FAILED and view.record.consecutive_failures > spec.recovery.max_restarts

    if deleting:
        for view in views.values():
            p.drain(view, "AFDDeployment is being deleted")
        return _finish(p, views)

    for view in views.values():
        if view.failure and not view.draining:
            p.handle_failure(view)

    alive = [v for v in views.values() if not v.draining]
    current = [v for v in alive if v.revision == revision and not v.exhausted]
    old = [v for v in alive if v.revision != revision]
    exhausted_current = [v for v in alive if v.revision == revision and v.exhausted]

    replicas = spec.replicas
    us = spec.update_strategy
    surge = resolve_int_or_percent(us.max_surge, max(replicas, 1), round_up=True)
    unavailable = resolve_int_or_percent(us.max_unavailable, max(replicas, 1), round_up=False)
    floor = max(replicas - unavailable, 0)

    def phase_of(v: InstanceView) -> str:
        return _phase(v, p.expected(v), spec.recovery.policy)

    for v in alive:
        v.record = replace(v.record, phase=phase_of(v))
    serving = sum(1 for v in alive if v.record.phase == READY)
    paused_rollout = us.paused and bool(old)

    if not paused_rollout:
        # 2. Old instances that do not serve (never Ready, failed) go at once: quick
        #    successive updates and reverts never wait on them.
        for v in [v for v in old if v.record.phase != READY]:
            p.drain(v, f"revision {v.revision} replaced by {revision} before it served")
            old.remove(v)
        # 3. Exhausted old instances are dropped too (the new revision replaces them).
        old_ready = sorted(old, key=lambda v: v.index)
        kept = old_ready[:_old_instances_kept(us, len(old_ready))]
        excess_old = [v for v in old_ready if v not in kept]
        want_current = max(replicas - len(kept), 0)

        # 4. Scale down the current revision: instances that stay down first, then not
        #    Ready ones, then the highest index.
        excess = len(current) + len(exhausted_current) - want_current
        if excess > 0:
            for v in _pick(exhausted_current + current, excess):
                if v.record.phase == READY:
                    serving -= 1
                p.drain(v, f"scaling down to {replicas} instance(s)")
                (exhausted_current if v in exhausted_current else current).remove(v)

        if us.type == "Recreate":
            for v in excess_old:
                p.drain(v, f"Recreate: replacing revision {v.revision} with {revision}")
            excess_old = []
        else:
            # 5. Drain old Ready instances while serving instances stay >= replicas - maxUnavailable.
            for v in sorted(excess_old, key=lambda v: -v.index):
                if serving - 1 < floor:
                    break
                serving -= 1
                p.drain(v, f"rolling update to revision {revision}")
                excess_old.remove(v)

        # 6. Create current-revision instances within replicas + maxSurge (draining ones still
        #    hold devices, so they count). Recreate waits until the old revision is gone.
        in_flight = sum(1 for v in views.values() if v.draining)
        total = len(current) + len(excess_old) + len(kept) + in_flight + len(exhausted_current)
        old_left = any(v.revision != revision for v in views.values())
        may_create = us.type == "RollingUpdate" or not old_left
        used = {v.index for v in views.values()}
        while may_create and len(current) + len(exhausted_current) < want_current and total < replicas + surge:
            index = next(i for i in range(len(used) + 1) if i not in used)
            used.add(index)
            rec = InstanceRecord(name=f"{name}-{revision}-{index}", revision=revision, index=index, phase=PENDING)
            view = InstanceView(record=rec, pods=[])
            views[rec.name] = view
            current.append(view)
            total += 1
            d.events.append(Event("Normal", "CreatingInstance", f"instance {rec.name} (revision {revision})"))

    # 7. Bring live current instances up; keep serving labels true to readiness.
    for v in current:
        if not v.failure:
            p.advance_creation(v)
    for v in views.values():
        head = v.head
        if v.draining or v.failure or head is None or head.deleting:
            continue
        want_serving = phase_of(v) == READY
        if head.serving != want_serving:
            d.actions.append(Action("set_serving", v.name, pods=(head.name,), serving=want_serving))

    # 8. Draining instances continue their ordered drain.
    for v in views.values():
        if v.draining and v.name not in d.gone and not any(
                a.instance == v.name and a.kind in ("start_drain", "delete_pods") for a in d.actions):
            p.drain(v, "")
    # Keep watching timers: startup timeouts and unready grace periods.
    for v in views.values():
        if v.draining or v.record.phase == FAILED:
            continue
        for pod in v.pods:
            if pod.created_at is not None and v.record.first_ready is None:
                d.wake_at(pod.created_at + spec.startup.timeout_seconds)
            if not pod.ready and pod.ready_changed_at is not None and v.record.first_ready is not None:
                d.wake_at(pod.ready_changed_at + spec.recovery.unready_grace_seconds)

    old_remaining = [v for v in views.values() if v.revision != revision]
    # An instance whose pods could not be scheduled is retried with backoff; until it runs,
    # the rollout says why it is stuck instead of waiting silently.
    unschedulable = [v for v in current if v.record.phase == FAILED
                     and (v.record.last_failure or "").startswith("Unschedulable")]
    d.rollout_in_progress = bool(old_remaining) or any(v.record.phase != READY for v in current) or \
        len(current) != max(replicas - _old_instances_kept(us, len(old_remaining)), 0)
    if paused_rollout:
        d.progress_reason, d.progress_message = "Paused", "updateStrategy.paused is set"
    elif unschedulable:
        d.progress_reason = "SurgeUnschedulable" if old_remaining else "Unschedulable"
        d.progress_message = f"instance {unschedulable[0].name}: {unschedulable[0].record.last_failure}"
    elif d.rollout_in_progress:
        d.progress_reason = "RollingUpdate" if old_remaining else "Scaling"
        d.progress_message = (f"{sum(1 for v in current if v.record.phase == READY)}/{replicas} instance(s) of "
                              f"revision {revision} Ready, {len(old_remaining)} of other revisions left")
    return _finish(p, views)


def _action_order(action: Action) -> int:
    # New serving heads join the Service before old ones leave it, so a surge never dips.
    return 0 if action.kind == "set_serving" and action.serving else 1


def _finish(p: _Planner, views: dict[str, InstanceView]) -> Decision:
    d = p.decision
    d.actions.sort(key=_action_order)
    for view in sorted(views.values(), key=lambda v: (v.index, v.revision)):
        if view.name in d.gone:
            continue
        phase = _phase(view, p.expected(view), p.spec.recovery.policy)
        rec = view.record
        if phase == READY and rec.first_ready is None:
            created = min((pod.created_at for pod in view.pods if pod.created_at is not None), default=p.now)
            d.became_ready.append((view.name, p.now - created))
        if phase != view.previous_phase:
            d.events.append(Event("Normal" if phase != FAILED else "Warning", "InstancePhase",
                                  f"instance {view.name}: {view.previous_phase} -> {phase}"))
        if phase == FAILED and view.exhausted:
            d.degraded.append(f"instance {view.name} stays down after {rec.consecutive_failures} consecutive "
                              f"failures (recovery.maxRestarts {p.spec.recovery.max_restarts}): {rec.last_failure}")
        elif phase == FAILED and p.spec.recovery.policy == "None":
            d.degraded.append(f"instance {view.name} failed and recovery.policy is None: {rec.last_failure}")
        # A world that crashes soon after becoming Ready must not restart forever: only one
        # that stayed Ready for recovery.stableSeconds has recovered.
        recovered = (phase == READY and rec.first_ready is not None
                     and p.now - rec.first_ready >= p.spec.recovery.stable_seconds)
        if phase == READY and rec.consecutive_failures and not recovered:
            d.wake_at((rec.first_ready or p.now) + p.spec.recovery.stable_seconds)
        d.instances.append(replace(
            rec, phase=phase,
            first_ready=p.now if phase == READY and rec.first_ready is None else rec.first_ready,
            consecutive_failures=0 if recovered else rec.consecutive_failures,
            retry_after=None if phase != FAILED else rec.retry_after,
        ))
    return d
