"""The reconciler against a recording writer (unit tier, in process): per-deployment memory
with names that are prefixes of each other, teardown dropping that memory, refused writes
surfacing in status and events, and one plan per reconciliation."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import pytest
from kubernetes.client.exceptions import ApiException

from afd_operator import naming, planner, revision as revision_module
from afd_operator.api import AFDDeploymentSpec, ConditionType
from afd_operator.metrics import OperatorMetrics
from afd_operator.reconciler import Reconciler
from afd_operator.revision import revision_of
from afd_operator.status import write_failure_reason
from afd_operator.writer import ApiWriteError
from recording_writer import Call, RecordingWriter

NS = "team"
PREFIX_NAMES = ("a", "a-b", "a-b-c")


def spec(image: str = "runtime:v1", replicas: int = 1) -> dict[str, Any]:
    return {
        "replicas": replicas, "image": image, "platform": "cpu",
        "model": {"name": "tiny", "path": "/models/tiny", "routedExperts": 8},
        "attention": {"dataParallel": 2, "tensorParallel": 1, "devicesPerPod": 1},
        "ffn": {"ranks": 1, "devicesPerPod": 1},
        "termination": {"gracePeriodSeconds": 5, "drainSeconds": 1},
        "updateStrategy": {"maxSurge": 1, "maxUnavailable": 0},
    }


def revision(data: dict[str, Any]) -> str:
    return revision_of(AFDDeploymentSpec.model_validate(data))


class Namespace:
    """Deployments of one namespace reconciled in rounds. Each round hands every reconcile
    the watch caches as they were when the round began, so writes made earlier in the round
    (by this deployment or another) are not visible yet: the lag the intents must cover."""

    def __init__(self, specs: dict[str, dict[str, Any]]):
        self.writer = RecordingWriter()
        self.reconciler = Reconciler(self.writer, OperatorMetrics())  # type: ignore[arg-type]
        self.specs = dict(specs)
        self.deleting: set[str] = set()
        self.gone: set[str] = set()
        self.calls_by: list[tuple[str, Call]] = []  # (deployment reconciled, the write it made)

    def reconcile(self, name: str, cache: Any = None) -> None:
        cache = self.writer.observed(NS, name) if cache is None else cache
        before = len(self.writer.calls)
        deleting = name in self.deleting
        result = self.reconciler.reconcile(self.writer.body(NS, name, self.specs[name], deleting), cache,
                                           now=self.writer.now, deleting=deleting)
        self.calls_by += [(name, c) for c in self.writer.calls[before:]]
        if result.finished:
            self.gone.add(name)

    def round(self) -> None:
        caches = {name: self.writer.observed(NS, name) for name in self.specs}
        for name in self.specs:
            if name not in self.gone:
                self.reconcile(name, caches[name])
        self.writer.run_pods()
        self.writer.now += 1

    def until(self, done: Callable[[], bool], what: str, rounds: int = 40) -> None:
        for _ in range(rounds):
            if done():
                return
            self.round()
        raise AssertionError(f"not {what} after {rounds} rounds; statuses {self.writer.statuses}")

    def status(self, name: str) -> dict[str, Any]:
        return self.writer.statuses.get((NS, name), {})

    def condition(self, name: str, kind: str) -> Optional[dict[str, Any]]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == kind), None)

    def ready(self, name: str) -> bool:
        status = self.status(name)
        instances = status.get("instances", [])
        return ((self.condition(name, "Ready") or {}).get("status") == "True" and bool(instances)
                and all(i["revision"] == revision(self.specs[name]) for i in instances)
                and all(p.revision == revision(self.specs[name]) for p in self.writer.observed(NS, name).pods))

    def foreign_writes(self) -> list[tuple[str, Call]]:
        """Writes a reconcile made to an object of another deployment (or an unlabelled pod)."""
        return [(name, c) for name, c in self.calls_by
                if c.deployment != name and (c.deployment is not None or c.kind == "Pod")]


def test_prefix_names_created_rolled_and_deleted_together_stay_apart() -> None:
    ns = Namespace({name: spec() for name in PREFIX_NAMES})
    ns.until(lambda: all(ns.ready(n) for n in PREFIX_NAMES), "all Ready")
    assert ns.foreign_writes() == []
    assert [c for _, c in ns.calls_by if c.verb == "delete"] == [], "creation deletes nothing"
    for name in PREFIX_NAMES:
        (instance,) = ns.status(name)["instances"]
        assert instance["name"] == f"{name}-{revision(ns.specs[name])}-0" and instance["restarts"] == 0
        assert instance["podsReady"] == instance["podsTotal"] == 3

    old = {name: revision(ns.specs[name]) for name in PREFIX_NAMES}
    ns.specs = {name: spec(image="runtime:v2") for name in PREFIX_NAMES}
    ns.until(lambda: all(ns.ready(n) for n in PREFIX_NAMES), "all rolled")
    assert ns.foreign_writes() == []
    deleted = [(name, c.name) for name, c in ns.calls_by if c.verb == "delete" and c.kind == "Pod"]
    assert sorted(pod for _, pod in deleted) == sorted(
        f"{name}-{old[name]}-0-{role}" for name in PREFIX_NAMES for role in ("attn-0", "attn-1", "ffn-0"))
    assert all(pod.startswith(f"{name}-{old[name]}-") for name, pod in deleted), "only a deployment's old pods"
    assert all(ns.status(n)["instances"][0]["restarts"] == 0 for n in PREFIX_NAMES)

    ns.deleting = set(PREFIX_NAMES)
    ns.until(lambda: ns.gone == set(PREFIX_NAMES), "all torn down")
    assert ns.foreign_writes() == []
    assert ns.writer.objects == {}
    assert not any((NS, name) in ns.reconciler.memory for name in PREFIX_NAMES)


def test_a_delete_intent_outlives_another_deployments_reconcile() -> None:
    ns = Namespace({"a": spec(), "a-b": spec()})
    ns.until(lambda: ns.ready("a") and ns.ready("a-b"), "both Ready")
    ns.specs["a"] = spec(replicas=0)
    head = ns.writer.objects[("Pod", NS, f"a-{revision(spec())}-0-attn-0")]
    ns.until(lambda: naming.ANNOTATION_DRAIN_STARTED in head["metadata"].get("annotations", {}), "a's drain")
    ns.writer.now += 5  # past drainSeconds
    stale = ns.writer.observed(NS, "a")  # still shows a's Attention pods, as a lagging cache would
    ns.reconcile("a", stale)
    deleted = [c.name for n, c in ns.calls_by if n == "a" and c.verb == "delete"]
    assert deleted == [f"a-{revision(spec())}-0-attn-0"]  # the head first, alone
    ns.reconcile("a-b")
    ns.reconcile("a", stale)  # the cache still lags: the deletion must not be made again
    assert [c.name for n, c in ns.calls_by if n == "a" and c.verb == "delete"] == deleted
    ns.until(lambda: not ns.writer.observed(NS, "a").pods, "a scaled to zero")
    assert ns.ready("a-b") and ns.foreign_writes() == []


def test_teardown_drops_only_that_deployments_memory() -> None:
    ns = Namespace({"a": spec(), "a-b": spec()})
    ns.until(lambda: ns.ready("a") and ns.ready("a-b"), "both Ready")
    ns.deleting = {"a"}
    ns.round()
    # The teardown shows in the status while it runs (rounds start from the last status).
    assert [i["phase"] for i in ns.status("a")["instances"]] == ["Draining"]
    ns.until(lambda: "a" in ns.gone, "a torn down")
    # Each phase change announced once, however many rounds the drain took.
    phase_events = [m for n, _, reason, m in ns.writer.events if n == "a" and reason == "InstancePhase"]
    assert len(phase_events) == len(set(phase_events)), phase_events
    assert (NS, "a") not in ns.reconciler.memory and (NS, "a-b") in ns.reconciler.memory
    assert ns.foreign_writes() == [] and not [c for n, c in ns.calls_by if n == "a-b" and c.verb == "delete"]
    assert ns.writer.pods(NS) == sorted(p.name for p in ns.writer.observed(NS, "a-b").pods)
    assert ns.ready("a-b")


def refuse_pod_creates(verb: str, kind: str, name: str) -> Optional[ApiWriteError]:
    if (verb, kind) == ("create", "Pod"):
        return ApiWriteError(verb, kind, name, 403, "Forbidden",
                             f'pods "{name}" is forbidden: exceeded quota: no-pods, requested: pods=1')
    return None


def test_refused_write_sets_condition_and_event_until_a_write_succeeds() -> None:
    ns = Namespace({"a": spec()})
    ns.writer.refuse = refuse_pod_creates
    ns.round()
    cond = ns.condition("a", ConditionType.API_WRITE_FAILED)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "CreatePodForbidden"
    pod = f"a-{revision(spec())}-0-ffn-0"
    assert cond["message"].startswith(f"create Pod {pod}: 403 Forbidden") and "exceeded quota" in cond["message"]
    assert [(t, r) for _, t, r, _ in ns.writer.events] == [("Warning", "CreatePodForbidden")]
    # Nothing after the refused write was attempted, and the decision was not recorded.
    assert [c.kind for _, c in ns.calls_by if c.kind == "Pod"] == [] and "instances" not in ns.status("a")
    writes = len(ns.writer.calls)
    ns.round()  # refused again: the condition stands, no new status write and no new event
    assert len(ns.writer.events) == 1 and not [c for c in ns.writer.calls[writes:] if c.verb == "patch_status"]

    ns.writer.refuse = lambda verb, kind, name: None
    ns.until(lambda: ns.ready("a"), "Ready once creates are accepted")
    assert ns.condition("a", ConditionType.API_WRITE_FAILED) is None


def test_api_error_names_the_verb_kind_and_the_apis_own_reason() -> None:
    invalid = ApiException(status=422, reason="Unprocessable Entity")
    invalid.body = json.dumps({"kind": "Status", "reason": "Invalid",
                               "message": 'Pod "x" is invalid: spec.containers[0].image: Required value'})
    refused = ApiWriteError.from_api("create", "Pod", "x", invalid)
    assert write_failure_reason(refused) == "CreatePodInvalid"
    assert str(refused) == 'create Pod x: 422 Invalid: Pod "x" is invalid: spec.containers[0].image: Required value'
    bare = ApiWriteError.from_api("delete", "Service", "y", ApiException(status=500, reason="Internal Server Error"))
    assert write_failure_reason(bare) == "DeleteServiceInternalServerError" and bare.code == 500


def test_the_deployment_wide_budget_of_earlier_versions_gives_way_to_one_per_instance() -> None:
    ns = Namespace({"a": spec(replicas=2)})
    old_budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {
        "name": "a", "namespace": NS, "labels": naming.base_labels("a", "pdb")},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": naming.selector_labels("a")}}}
    ns.writer.create(old_budget)
    ns.until(lambda: ns.status("a").get("readyReplicas") == 2, "2 instances Ready")
    budgets = {name: body for (kind, _, name), body in ns.writer.objects.items() if kind == "PodDisruptionBudget"}
    instances = {i["name"] for i in ns.status("a")["instances"]}
    assert set(budgets) == instances
    assert all(b["spec"]["minAvailable"] == 2 for b in budgets.values())  # 3 pods per instance
    # Each instance's budget goes with its instance.
    ns.specs["a"] = spec(replicas=1)
    ns.until(lambda: len(ns.status("a").get("instances", [])) == 1 and len(ns.writer.pods(NS)) == 3, "scaled to 1")
    ns.round()
    budgets = {name for (kind, _, name) in ns.writer.objects if kind == "PodDisruptionBudget"}
    assert budgets == {i["name"] for i in ns.status("a")["instances"]}


def test_a_spec_that_breaks_the_validator_is_reported_and_still_torn_down(monkeypatch) -> None:
    import afd_operator.validation as validation

    ns = Namespace({"a": spec()})
    ns.until(lambda: ns.status("a").get("readyReplicas") == 1, "Ready")

    def broken(*_: Any, **__: Any) -> list:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(validation, "check_spec", broken)
    ns.round()
    condition = next(c for c in ns.status("a")["conditions"] if c["type"] == "ConfigValid")
    assert (condition["status"], condition["message"]) == (
        "False", "spec: could not be validated (RecursionError: maximum recursion depth exceeded)")
    assert len(ns.writer.pods(NS)) == 3  # nothing is changed for a spec that cannot be judged
    ns.deleting.add("a")
    ns.until(lambda: "a" in ns.gone, "torn down")
    assert ns.writer.pods(NS) == [] and not [k for k in ns.writer.objects if k[0] != "Event"]


def calls_of(monkeypatch: pytest.MonkeyPatch, function: Callable[..., Any]) -> list[tuple[Any, ...]]:
    """The arguments of every call of `function` made through any operator module that imported it."""
    calls: list[tuple[Any, ...]] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return function(*args, **kwargs)

    for module in list(sys.modules.values()):
        if module.__name__.split(".")[0] == "afd_operator" and getattr(module, function.__name__, None) is function:
            monkeypatch.setattr(module, function.__name__, counted)
    return calls


def test_one_reconciliation_hashes_the_spec_and_plans_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The revision and the plan are computed once per reconciliation and shared by the decision,
    every manager and the status; each instance is framed once, whichever managers need it."""
    hashed = calls_of(monkeypatch, revision_module.revision_of)
    planned = calls_of(monkeypatch, planner.plan)
    framed = calls_of(monkeypatch, planner.instance_frame)
    ns = Namespace({"a": spec(replicas=2)})
    reconciles = 0

    def one_round() -> None:
        nonlocal reconciles
        for calls in (hashed, planned, framed):
            calls.clear()
        ns.round()
        reconciles += 1
        instances = [args[1:] for args in framed]  # (name, namespace, revision, index)
        assert (len(hashed), len(planned)) == (1, 1), f"round {reconciles}"
        assert len(instances) == len(set(instances)), f"round {reconciles}: an instance framed twice"

    for _ in range(6):
        one_round()
    assert ns.ready("a") and len(ns.status("a")["instances"]) == 2
    ns.specs["a"] = spec(image="runtime:v2", replicas=2)  # a roll: creates, drains and deletions
    while not ns.ready("a"):
        assert reconciles < 60, "not rolled"
        one_round()
    ns.deleting = {"a"}
    while "a" not in ns.gone:
        assert reconciles < 100, "not torn down"
        one_round()


def test_a_tampered_snapshot_is_reported_once_and_written_anew() -> None:
    """Someone who may write ConfigMaps recreates the current revision's snapshot (it is immutable)
    with a plan summary the operator did not write: a condition and one event name it, the
    operator replaces it, and nothing else is disturbed."""
    ns = Namespace({"a": spec()})
    ns.until(lambda: ns.ready("a"), "Ready")
    key = ("ConfigMap", NS, naming.runtime_configmap_name("a", revision(spec())))
    pods = {p.name for p in ns.writer.observed(NS, "a").pods}
    ns.writer.objects[key]["data"] = {"plan.json": json.dumps({"ffnPods": 10**12, "attentionPods": 1})}
    events = len(ns.writer.events)
    ns.round()
    cond = ns.condition("a", ConditionType.SNAPSHOT_UNREADABLE)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "PlanSummaryUnreadable"
    assert cond["message"].startswith(f"ConfigMap {key[2]}: plan.json ffnPods must be an integer in [1, "), cond
    assert [(t, r) for _, t, r, _ in ns.writer.events[events:]] == [("Warning", "SnapshotUnreadable")]
    ns.until(lambda: ns.condition("a", ConditionType.SNAPSHOT_UNREADABLE) is None, "the snapshot written anew")
    assert json.loads(ns.writer.objects[key]["data"]["plan.json"])["ffnPods"] == 1
    assert len(ns.writer.events) == events + 1
    assert ns.ready("a") and {p.name for p in ns.writer.observed(NS, "a").pods} == pods


@pytest.mark.parametrize("server, policy", [((1, 30), "AlwaysAllow"), ((1, 20), None)])
def test_budgets_let_unready_pods_go_where_the_server_keeps_that_field(server: tuple[int, int],
                                                                       policy: Optional[str]) -> None:
    """A server older than 1.27 drops unhealthyPodEvictionPolicy: the operator leaves it out there,
    or it would patch every budget again every round."""
    ns = Namespace({"a": spec()})
    ns.writer.kubernetes_version = server
    ns.until(lambda: ns.ready("a"), "Ready")
    writes = len(ns.writer.calls)
    for _ in range(3):
        ns.round()
    (budget,) = [body for (kind, _, _), body in ns.writer.objects.items() if kind == "PodDisruptionBudget"]
    assert budget["spec"].get("unhealthyPodEvictionPolicy") == policy
    assert [c for c in ns.writer.calls[writes:] if c.kind == "PodDisruptionBudget"] == []


@pytest.mark.parametrize("kind", ["PodMonitor", "PodGroup"])
def test_a_squatted_pod_monitor_or_pod_group_is_a_name_conflict_never_patched_or_deleted(kind: str) -> None:
    """Kinds no watch cache holds are read before they are written: one of the wanted name that
    another owner (or nobody) controls is a NameConflict; it is left as it is, also when the
    deployment stops wanting that kind or is deleted."""
    data = {**spec(), "metrics": {"podMonitor": True}} if kind == "PodMonitor" else \
        {**spec(), "scheduling": {"gang": {"provider": "volcano"}}}
    ns = Namespace({"a": data})
    ns.writer.served |= {"PodMonitor", "PodGroup"}
    name = "a" if kind == "PodMonitor" else naming.instance_name("a", revision(data), 0)
    api_version = "monitoring.coreos.com/v1" if kind == "PodMonitor" else "scheduling.volcano.sh/v1beta1"
    squatted = {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": NS},
                "spec": {"selector": {"matchLabels": {"app": "elsewhere"}}}}
    ns.writer.objects[(kind, NS, name)] = json.loads(json.dumps(squatted))
    ns.round()
    cond = ns.condition("a", ConditionType.NAME_CONFLICT)
    assert cond is not None and cond["message"].startswith(
        f"{kind} {name} exists and is controlled by nothing (no controller reference)"), cond
    assert ns.writer.objects[(kind, NS, name)] == squatted
    ns.specs["a"] = spec()  # neither a PodMonitor nor gang scheduling wanted any more
    ns.until(lambda: ns.ready("a"), "Ready without the squatted kind")
    ns.deleting.add("a")
    ns.until(lambda: "a" in ns.gone, "torn down")
    assert ns.writer.objects[(kind, NS, name)] == squatted
