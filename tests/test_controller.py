"""Controller decisions on plain data: lifecycle, failures, rollouts, drains (pure, no cluster)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from afd_operator.api import AFDDeploymentSpec
from afd_operator.controller import decide
from afd_operator.decisions import CreatePods, Decision, DeletePods, InstanceRecord, SetServing, StartDrain
from afd_operator.observe import TERMINATION_LINE_CHARS, ObservedPod, summarize_pod
from afd_operator.planner import RolloutBudget, rollout_budget
from afd_operator.revision import revision_of

NOW = 1_000_000.0


def spec_of(**overrides: Any) -> AFDDeploymentSpec:
    data: dict[str, Any] = {
        "replicas": 1, "image": "img:v1", "platform": "cpu",
        "model": {"name": "m", "path": "/m"},
        "attention": {"dataParallel": 2, "devicesPerPod": 1},  # 2 attention pods
        "ffn": {"ranks": 1},  # 1 FFN pod
        "recovery": {"backoffSeconds": 10, "maxBackoffSeconds": 40, "maxRestarts": 2, "unreadyGraceSeconds": 30},
        "termination": {"drainSeconds": 20},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return AFDDeploymentSpec.model_validate(data)


def pods_of(spec: AFDDeploymentSpec, index: int, state: str = "ready", revision: Optional[str] = None,
            roles: tuple[str, ...] = ("ffn", "attention"), serving: bool = False, **pod_fields: Any) -> list[ObservedPod]:
    rev = revision or revision_of(spec)
    inst = f"d-{rev}-{index}"
    counts = {"ffn": 1, "attention": 2}
    out = []
    for role in roles:
        for k in range(counts[role]):
            head = role == "attention" and k == 0
            out.append(ObservedPod(
                name=f"{inst}-{'attn' if role == 'attention' else 'ffn'}-{k}", instance=inst, revision=rev,
                index=index, role=role, ordinal=k, head=head,
                phase={"pending": "Pending"}.get(state, "Running"), scheduled=state != "pending",
                ready=state == "ready", ready_changed_at=NOW - 100, created_at=NOW - 200,
                deleting=False, serving=serving and head, drain_started_at=None, termination=None,
                unschedulable=None,
            ))
    return [replace(p, **pod_fields) for p in out]


def record(spec: AFDDeploymentSpec, index: int, phase: str, revision: Optional[str] = None, **kw: Any) -> InstanceRecord:
    rev = revision or revision_of(spec)
    return InstanceRecord(name=f"d-{rev}-{index}", revision=rev, index=index, phase=phase, **kw)


def run(spec: AFDDeploymentSpec, pods: list[ObservedPod], records: list[InstanceRecord], now: float = NOW,
        deleting: bool = False) -> Decision:
    return decide(spec, "d", revision_of(spec), pods, records, now, deleting)


def test_new_deployment_starts_ffn_first() -> None:
    spec = spec_of()
    d = run(spec, [], [])
    assert [(type(a), a.role, a.index) for a in d.actions] == [(CreatePods, "ffn", 0)]
    assert [r.phase for r in d.instances] == ["Pending"]
    # FFN pod created but not Running yet: nothing more.
    pending = pods_of(spec, 0, "pending", roles=("ffn",))
    assert run(spec, pending, d.instances).actions == []
    # FFN Running: Attention pods next.
    running = pods_of(spec, 0, "running", roles=("ffn",))
    assert [(type(a), a.role) for a in run(spec, running, d.instances).actions] == [(CreatePods, "attention")]


def test_parallel_start_creates_all_roles_at_once() -> None:
    d = run(spec_of(startup={"order": "Parallel"}), [], [])
    assert [(type(a), a.role) for a in d.actions] == [(CreatePods, "ffn"), (CreatePods, "attention")]


def test_ready_instance_gets_serving_label_then_nothing_to_do() -> None:
    spec = spec_of()
    pods = pods_of(spec, 0, "ready")
    d = run(spec, pods, [record(spec, 0, "Starting")])
    assert [(type(a), a.serving) for a in d.actions] == [(SetServing, True)]
    assert d.became_ready and d.instances[0].phase == "Ready" and d.instances[0].first_ready == NOW
    steady = run(spec, pods_of(spec, 0, "ready", serving=True), d.instances)
    assert steady.actions == [] and steady.events == [] and not steady.rollout_in_progress


def test_pod_failure_recreates_whole_instance_with_backoff() -> None:
    spec = spec_of()
    pods = pods_of(spec, 0, "ready", serving=True)
    pods[1] = replace(pods[1], phase="Failed", ready=False, termination="container attention Error (exit code 3)")
    d = run(spec, pods, [record(spec, 0, "Ready", first_ready=NOW - 50)])
    assert [(type(a), sorted(a.pods)) for a in d.actions] == [(DeletePods, sorted(p.name for p in pods))]
    (rec,) = d.instances
    assert rec.phase == "Failed" and rec.restarts == 1 and rec.consecutive_failures == 1
    assert rec.retry_after == NOW + 10 and "exit code 3" in rec.last_failure
    assert d.restarted == 1 and d.next_wakeup == NOW + 10
    # Pods terminating: no re-detection, no new pods.
    terminating = [replace(p, deleting=True) for p in pods]
    d2 = run(spec, terminating, d.instances, now=NOW + 1)
    assert d2.actions == [] and d2.instances[0].restarts == 1
    # Pods gone but backoff not elapsed: wait; elapsed: recreate (FFN first).
    assert run(spec, [], d2.instances, now=NOW + 5).actions == []
    d3 = run(spec, [], d2.instances, now=NOW + 11)
    assert [(type(a), a.role) for a in d3.actions] == [(CreatePods, "ffn")]


def test_a_failed_pods_reason_quotes_the_refusal_or_last_line_of_its_termination_message() -> None:
    def failed(message: Optional[str]) -> Optional[str]:
        terminated = {"exitCode": 1, "reason": "Error", **({"message": message} if message is not None else {})}
        body = {"metadata": {"name": "x-abc-0-attn-0", "labels": {
                    "afd.inference.dev/instance": "x-abc-0", "afd.inference.dev/revision": "abc",
                    "afd.inference.dev/role": "attention", "afd.inference.dev/pod-ordinal": "0"}},
                "status": {"phase": "Failed", "containerStatuses": [
                    {"name": "attention", "state": {"terminated": terminated}}]}}
        return summarize_pod(body).termination

    log_tail = "Traceback (most recent call last):\n  ...\nPeerLostError: rank 0 (attention): AFD rendezvous failed\n\n"
    assert failed(log_tail) == ("container attention Error (exit code 1): "
                                "PeerLostError: rank 0 (attention): AFD rendezvous failed")
    assert failed(None) == failed("  \n") == "container attention Error (exit code 1)"
    # An engine refusing its checkpoint: the plugin's line, not what vLLM's traceback ends with.
    refused = ("ERROR 12-03 10:00:00 [compat.py:113] afd: refused: model.path: model_type 'mixtral' is not "
               "served by the plugin\nTraceback (most recent call last):\n  ...\npydantic_core."
               "ValidationError: 1 validation error for VllmConfig\n    For further information visit "
               "https://errors.pydantic.dev/2.12/v/value_error\n")
    assert failed(refused) == ("container attention Error (exit code 1): afd: refused: model.path: model_type "
                               "'mixtral' is not served by the plugin")
    long_line = failed("E" * 1000)
    assert long_line.endswith("...") and len(long_line.split(": ", 1)[1]) == TERMINATION_LINE_CHARS


def test_backoff_doubles_and_budget_exhausts_into_degraded() -> None:
    spec = spec_of()
    failed = [replace(p, phase="Failed") for p in pods_of(spec, 0, "running")]
    d = run(spec, failed, [record(spec, 0, "Starting", consecutive_failures=1, restarts=1)])
    assert d.instances[0].retry_after == NOW + 20  # 10 * 2^(2-1)
    d = run(spec, failed, [record(spec, 0, "Starting", consecutive_failures=2, restarts=2)])
    (rec,) = d.instances
    assert rec.phase == "Failed" and rec.retry_after is None and rec.consecutive_failures == 3
    assert any(e.reason == "RestartBudgetExhausted" for e in d.events)
    later = run(spec, [], d.instances, now=NOW + 3600)
    assert later.actions == [] and later.degraded and "stays down" in later.degraded[0]


def test_consecutive_failures_reset_only_after_stable_readiness() -> None:
    spec = spec_of(recovery={"stableSeconds": 300})
    pods = pods_of(spec, 0, "ready", serving=True)
    d = run(spec, pods, [record(spec, 0, "Starting", consecutive_failures=2, restarts=2)])
    assert d.instances[0].consecutive_failures == 2 and d.next_wakeup == NOW + 300
    d = run(spec, pods, d.instances, now=NOW + 301)
    assert d.instances[0].consecutive_failures == 0 and d.instances[0].restarts == 2


def test_policy_none_leaves_failed_instance() -> None:
    spec = spec_of(recovery={"policy": "None"})
    failed = [replace(p, phase="Failed") for p in pods_of(spec, 0, "running")]
    d = run(spec, failed, [record(spec, 0, "Starting")])
    assert [type(a) for a in d.actions] == [] and d.instances[0].phase == "Failed"
    again = run(spec, failed, d.instances)
    assert again.actions == [] and again.degraded


def test_missing_pod_and_unready_past_grace_fail_the_instance() -> None:
    spec = spec_of()
    pods = pods_of(spec, 0, "ready", serving=True)
    was_ready = [record(spec, 0, "Ready", first_ready=NOW - 150)]
    assert "disappeared" in run(spec, pods[:-1], was_ready).instances[0].last_failure
    unready = list(pods)
    unready[0] = replace(unready[0], ready=False, ready_changed_at=NOW - 10)
    d = run(spec, unready, was_ready)
    assert d.instances[0].phase != "Failed" and d.next_wakeup == NOW + 20  # grace 30 - 10 elapsed
    assert [(type(a), a.serving) for a in d.actions] == [(SetServing, False)]  # stop serving at once
    # Still unready on the next pass (phase is no longer Ready): the grace keeps counting.
    assert run(spec, unready, d.instances).instances[0].phase == "Starting"
    unready[0] = replace(unready[0], ready_changed_at=NOW - 31)
    assert run(spec, unready, d.instances).instances[0].phase == "Failed"


def test_startup_timeout_and_unschedulable_reason() -> None:
    spec = spec_of(startup={"timeoutSeconds": 100})
    stuck = pods_of(spec, 0, "pending", roles=("ffn",), unschedulable="0/3 nodes have free huawei.com/Ascend910")
    d = run(spec, stuck, [record(spec, 0, "Pending")])
    assert d.instances[0].phase == "Failed" and d.instances[0].last_failure.startswith("Unschedulable")


def test_a_pod_that_cannot_start_fails_its_instance_at_once_naming_the_cause() -> None:
    """ImagePullBackOff and the like say why a pod will never start: the instance fails with that
    cause now (and is recreated on the recovery backoff), not with a StartupTimeout much later."""
    def waiting(reason: str, message: str = "") -> Optional[str]:
        body = {"metadata": {"name": "x-abc-0-ffn-0", "labels": {
                    "afd.inference.dev/instance": "x-abc-0", "afd.inference.dev/revision": "abc",
                    "afd.inference.dev/role": "ffn", "afd.inference.dev/pod-ordinal": "0"}},
                "status": {"phase": "Pending", "containerStatuses": [
                    {"name": "ffn", "state": {"waiting": {"reason": reason, "message": message}}}]}}
        return summarize_pod(body).cannot_start

    pulled = waiting("ImagePullBackOff", 'Back-off pulling image "runtime:v9"')
    assert pulled == 'container ffn ImagePullBackOff: Back-off pulling image "runtime:v9"'
    assert waiting("CreateContainerConfigError", 'secret "hf" not found') == (
        'container ffn CreateContainerConfigError: secret "hf" not found')
    # A first pull error may pass (kubelet retries it), and so does an ordinary start.
    assert waiting("ErrImagePull", "i/o timeout") is None and waiting("ContainerCreating") is None

    spec = spec_of(startup={"timeoutSeconds": 1800})
    pods = pods_of(spec, 0, "pending")
    pods[0] = replace(pods[0], scheduled=True, cannot_start=pulled)
    d = run(spec, pods, [record(spec, 0, "Pending")])
    assert d.instances[0].phase == "Failed"
    assert d.instances[0].last_failure == f"pod {pods[0].name} cannot start: {pulled}"


def test_scale_down_drains_highest_index_in_order() -> None:
    spec = spec_of(replicas=1)
    pods = pods_of(spec, 0, "ready", serving=True) + pods_of(spec, 1, "ready", serving=True)
    recs = [record(spec, 0, "Ready"), record(spec, 1, "Ready")]
    d = run(spec, pods, recs)
    assert [(type(a), a.pods) for a in d.actions] == [(StartDrain, (f"d-{revision_of(spec)}-1-attn-0",))]
    # Drain started: wait drainSeconds, then the head alone, then the other Attention pods once
    # it is gone (the head's engine steps with its DP peers until it has drained), then FFN
    # pods, then gone.
    started = [replace(p, drain_started_at=NOW, serving=False) if p.index == 1 and p.head else p for p in pods]
    recs = d.instances
    assert [r.phase for r in recs] == ["Ready", "Draining"]
    assert [a for a in run(spec, started, recs, now=NOW + 5).actions if not isinstance(a, SetServing)] == []
    d = run(spec, started, recs, now=NOW + 21)
    assert [(type(a), a.pods) for a in d.actions] == [(DeletePods, (f"d-{revision_of(spec)}-1-attn-0",))]
    head_terminating = [replace(p, deleting=True) if p.index == 1 and p.head else p for p in started]
    assert run(spec, head_terminating, d.instances, now=NOW + 22).actions == []
    no_head = [p for p in started if not (p.index == 1 and p.head)]
    d = run(spec, no_head, d.instances, now=NOW + 22)
    assert [(type(a), a.pods) for a in d.actions] == [(DeletePods, (f"d-{revision_of(spec)}-1-attn-1",))]
    no_attention = [p for p in started if not (p.index == 1 and p.role == "attention")]
    d = run(spec, no_attention, d.instances, now=NOW + 22)
    assert [(type(a), a.pods) for a in d.actions] == [(DeletePods, (f"d-{revision_of(spec)}-1-ffn-0",))]
    d = run(spec, [p for p in no_attention if p.index == 0], d.instances, now=NOW + 23)
    assert [r.index for r in d.instances] == [0] and "d-" in next(iter(d.gone))


def rolled(spec: AFDDeploymentSpec, **change: Any) -> AFDDeploymentSpec:
    return spec_of(**change)


def test_rolling_update_surges_then_drains_old() -> None:
    old = spec_of()
    new = rolled(old, image="img:v2")
    r_old, r_new = revision_of(old), revision_of(new)
    pods = pods_of(old, 0, "ready", serving=True)
    recs = [record(old, 0, "Ready")]
    d = run(new, pods, recs)
    assert [(type(a), a.role, a.revision, a.index) for a in d.actions] == [(CreatePods, "ffn", r_new, 1)]
    assert d.rollout_in_progress
    # New instance starting: the old one keeps serving.
    new_pods = pods_of(new, 1, "running")
    d = run(new, pods + new_pods, d.instances)
    assert not any(isinstance(a, (StartDrain, DeletePods)) for a in d.actions)
    # New Ready: old drains; the floor (replicas - maxUnavailable = 1) holds.
    d = run(new, pods + pods_of(new, 1, "ready", serving=True), d.instances)
    assert [(type(a), a.pods) for a in d.actions] == [(StartDrain, (f"d-{r_old}-0-attn-0",))]


def test_max_surge_zero_drains_first() -> None:
    old = spec_of(updateStrategy={"maxSurge": 0, "maxUnavailable": 1})
    new = rolled(old, image="img:v2", updateStrategy={"maxSurge": 0, "maxUnavailable": 1})
    d = run(new, pods_of(old, 0, "ready", serving=True), [record(old, 0, "Ready")])
    assert [type(a) for a in d.actions] == [StartDrain]


def test_partition_keeps_old_instances() -> None:
    old = spec_of(replicas=2, updateStrategy={"partition": 1})
    new = rolled(old, replicas=2, image="img:v2", updateStrategy={"partition": 1})
    pods = pods_of(old, 0, "ready", serving=True) + pods_of(old, 1, "ready", serving=True) + \
        pods_of(new, 2, "ready", serving=True)
    recs = [record(old, 0, "Ready"), record(old, 1, "Ready"), record(new, 2, "Ready")]
    d = run(new, pods, recs)
    assert [(type(a), a.pods) for a in d.actions] == [(StartDrain, (f"d-{revision_of(old)}-1-attn-0",))]
    after = [p for p in pods if p.index != 1]
    d = run(new, after, [r for r in d.instances if r.index != 1])
    assert d.actions == []  # one old instance kept


def test_paused_freezes_rollout() -> None:
    old = spec_of()
    new = rolled(old, image="img:v2", updateStrategy={"paused": True})
    d = run(new, pods_of(old, 0, "ready", serving=True), [record(old, 0, "Ready")])
    assert d.actions == [] and d.progress_reason == "Paused"


def test_revert_mid_rollout_keeps_serving_old_and_deletes_unready_new() -> None:
    old = spec_of()
    new = rolled(old, image="img:v2")
    pods = pods_of(old, 0, "ready", serving=True) + pods_of(new, 1, "running")
    recs = [record(old, 0, "Ready"), record(new, 1, "Starting")]
    d = run(old, pods, recs)  # the spec went back to the old revision
    deleted = [p for a in d.actions if isinstance(a, DeletePods) for p in a.pods]
    # Ordered drain of the never-Ready instance: its Attention head goes first.
    assert deleted == [p.name for p in pods if p.index == 1 and p.head]
    assert not any(isinstance(a, StartDrain) for a in d.actions)


def test_quick_updates_skip_intermediate_revisions() -> None:
    v1, v2, v3 = spec_of(), spec_of(image="img:v2"), spec_of(image="img:v3")
    pods = pods_of(v1, 0, "ready", serving=True) + pods_of(v2, 1, "running", roles=("ffn",))
    recs = [record(v1, 0, "Ready"), record(v2, 1, "Pending")]
    d = run(v3, pods, recs)
    assert [(type(a), a.pods) for a in d.actions if isinstance(a, DeletePods)] == [
        (DeletePods, (f"d-{revision_of(v2)}-1-ffn-0",))]
    # The v2 slot is still in use until its pod is gone: v3 takes index 2 within the surge
    # budget only after v2 stops counting.
    assert not any(isinstance(a, CreatePods) and a.index == 1 for a in d.actions)


def test_recreate_drains_all_then_creates() -> None:
    old = spec_of(replicas=2, updateStrategy={"type": "Recreate"})
    new = rolled(old, replicas=2, image="img:v2", updateStrategy={"type": "Recreate"})
    pods = pods_of(old, 0, "ready", serving=True) + pods_of(old, 1, "ready", serving=True)
    d = run(new, pods, [record(old, 0, "Ready"), record(old, 1, "Ready")])
    assert [type(a) for a in d.actions] == [StartDrain, StartDrain]
    assert isinstance(run(new, [], []).actions[0], CreatePods)


def test_deletion_drains_everything() -> None:
    spec = spec_of(replicas=2)
    pods = pods_of(spec, 0, "ready", serving=True) + pods_of(spec, 1, "running")
    d = run(spec, pods, [record(spec, 0, "Ready"), record(spec, 1, "Starting")], deleting=True)
    assert sorted(type(a).__name__ for a in d.actions) == ["DeletePods", "StartDrain"]
    done = run(spec, [], d.instances, deleting=True)
    assert done.instances == [] and len(done.gone) == 2


def test_old_revision_judged_by_its_own_layout() -> None:
    old = spec_of()
    new = spec_of(attention={"dataParallel": 4}, ffn={"ranks": 2})  # another topology
    pods = pods_of(old, 0, "ready", serving=True)
    layouts = {revision_of(old): {"ffn": 1, "attention": 2}}
    d = decide(new, "d", revision_of(new), pods, [record(old, 0, "Ready")], NOW, layouts=layouts)
    # The complete, Ready old world keeps serving while the new one is created.
    assert [(type(a), a.role, a.index) for a in d.actions] == [(CreatePods, "ffn", 1)]
    assert [r.phase for r in d.instances] == ["Ready", "Pending"]


def test_drain_ends_early_when_head_reports_idle() -> None:
    spec = spec_of(replicas=0, termination={"drainSeconds": 600})
    pods = [replace(p, drain_started_at=NOW - 1, serving=False) if p.head else p
            for p in pods_of(spec, 0, "ready")]
    rec = [record(spec, 0, "Draining")]
    assert run(spec, pods, rec).actions == []  # busy (or unknown): wait the window
    head = next(p.name for p in pods if p.head)
    d = decide(spec, "d", revision_of(spec), pods, rec, NOW, idle_heads=frozenset({head}))
    assert [(type(a), a.pods) for a in d.actions] == [(DeletePods, (head,))]


def test_rollout_budget_rounds_surge_up_and_unavailable_down() -> None:
    spec = spec_of(replicas=3, updateStrategy={"maxSurge": "50%", "maxUnavailable": "50%"})
    assert rollout_budget(spec) == RolloutBudget(surge=2, unavailable=1, floor=2)
    assert rollout_budget(spec_of(replicas=0)) == RolloutBudget(surge=1, unavailable=0, floor=0)
