"""Deployments whose names are prefixes of each other (`a`, `a-b`, `a-b-c`), created, rolled
and deleted together by the real operator against the real API: a pod watch proves that no
pod of one is ever drained, taken out of service or deleted but by its own deployment's
spec change or deletion."""

from __future__ import annotations

from typing import Any, Callable

from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from k8s_helpers import wait_for
from operator_env import CONVERGE_SECONDS, Env, PodWatch, base_spec, env, kubelet, operator  # noqa: F401 (fixtures)

NAMES = ("a", "a-b", "a-b-c")


class PodLedger(PodWatch):
    """Notes each pod event that takes a pod down or out of service — deleted, deleting,
    drain started, serving label removed — unless `explained(deployment, revision)` says
    its own deployment's spec change or deletion accounts for it."""

    def __init__(self, env: Env):
        super().__init__(env)
        self.explained: Callable[[str, str], bool] = lambda deployment, revision: False
        self.unexplained: list[str] = []
        self.events = 0
        self._serving: dict[str, bool] = {}

    def on_event(self, kind: str, pod: Any) -> None:
        self.events += 1
        meta = pod.metadata
        labels = meta.labels or {}
        serving = labels.get(naming.LABEL_SERVING) == "true"
        what = []
        if kind == "DELETED":
            what.append("deleted")
        elif meta.deletion_timestamp:
            what.append("deleting")
        if naming.ANNOTATION_DRAIN_STARTED in (meta.annotations or {}):
            what.append("draining")
        if self._serving.get(meta.name) and not serving:
            what.append("left the Service")
        self._serving[meta.name] = serving
        deployment, revision = labels.get(naming.LABEL_DEPLOYMENT, ""), labels.get(naming.LABEL_REVISION, "")
        if what and not self.explained(deployment, revision):
            self.unexplained.append(f"{kind} {meta.name} ({deployment}, {revision}): {', '.join(what)}")


def test_prefix_named_deployments_never_touch_each_others_pods(env: Env) -> None:
    with PodLedger(env) as ledger:
        for name in NAMES:
            env.create(name, base_spec(replicas=2))
        old = {name: env.wait_ready(name, 2)["status"]["updateRevision"] for name in NAMES}
        assert ledger.unexplained == [], "creation took pods down"
        assert all(i["restarts"] == 0 for name in NAMES for i in env.get(name)["status"]["instances"])

        # A rollout explains its own old-revision pods going away, nothing else.
        ledger.explained = lambda deployment, revision: old.get(deployment) == revision
        for name in NAMES:
            env.patch_spec(name, {"image": "runtime:v2"})
        for name in NAMES:
            status = env.wait_ready(name, 2)["status"]
            assert status["updateRevision"] != old[name]
            assert all(i["restarts"] == 0 for i in status["instances"]), status["instances"]
        wait_for(lambda: len(env.instances()) == 2 * len(NAMES), "old instances gone", CONVERGE_SECONDS)
        assert ledger.unexplained == [], "a rollout took down pods it does not own"
        for pods in env.instances().values():
            deployment = pods[0].metadata.labels[naming.LABEL_DEPLOYMENT]
            assert {p.metadata.labels[naming.LABEL_DEPLOYMENT] for p in pods} == {deployment}
            assert {p.spec.containers[0].image for p in pods} == {"runtime:v2"}

        ledger.explained = lambda deployment, revision: True
        for name in NAMES:
            env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
        for name in NAMES:
            wait_for(lambda: env.get(name) is None, f"{name} torn down", CONVERGE_SECONDS)
    assert env.owned() == {"pods": [], "services": [], "configmaps": [], "guards": []}
    assert ledger.events > 0


def test_a_name_held_by_another_owner_is_a_name_conflict_never_adopted_or_deleted(env: Env) -> None:
    """A deployment named like another's instance renders its API Service under that instance
    Service's name; a Service made in advance under a deployment's API Service name, with the
    operator's labels copied onto it. Neither is adopted, changed or deleted: the deployment
    that wants the name gets a NameConflict condition naming the holder."""
    env.create("tc", base_spec())
    revision = env.wait_ready("tc", 1)["status"]["updateRevision"]
    instance = naming.instance_name("tc", revision, 0)
    held = env.core.read_namespaced_service(instance, env.ns)
    tc_uid = env.get("tc")["metadata"]["uid"]
    env.create(instance, base_spec())
    conflict = wait_for(lambda: env.condition(instance, "NameConflict"), f"{instance} NameConflict", CONVERGE_SECONDS)
    assert conflict["status"] == "True" and conflict["reason"] == "NameConflict"
    assert conflict["message"].startswith(f"Service {instance} exists and is controlled by AFDDeployment tc "
                                          f"(uid {tc_uid}), not by this AFDDeployment")
    after = env.core.read_namespaced_service(instance, env.ns)
    assert after.metadata.owner_references[0].uid == tc_uid and after.spec.selector == held.spec.selector
    # The event is written after the condition, by another API call: wait for it like the condition.
    wait_for(lambda: any(event.startswith("NameConflict: ") for event in env.events(instance)),
             f"{instance} NameConflict event", CONVERGE_SECONDS)

    squatter = "sq"
    env.core.create_namespaced_service(env.ns, {
        "metadata": {"name": naming.api_service_name(squatter),
                     "labels": {naming.LABEL_MANAGED_BY: naming.MANAGER, naming.LABEL_DEPLOYMENT: squatter}},
        "spec": {"ports": [{"port": 80}], "selector": {"app": "elsewhere"}}})
    env.create(squatter, base_spec())
    conflict = wait_for(lambda: env.condition(squatter, "NameConflict"), "sq NameConflict", CONVERGE_SECONDS)
    assert conflict["message"].startswith(f"Service {squatter} exists and is controlled by nothing (no controller "
                                          "reference)")
    assert env.core.read_namespaced_service(squatter, env.ns).spec.selector == {"app": "elsewhere"}
    env.cluster.kubectl("delete", "service", squatter, "-n", env.ns)
    env.wait_ready(squatter, 1)  # the name is free: the deployment makes its own Service
    assert env.condition(squatter, "NameConflict") is None

    for name in ("tc", instance, squatter):
        env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name)
    for name in ("tc", instance, squatter):
        wait_for(lambda: env.get(name) is None, f"{name} torn down", CONVERGE_SECONDS)
