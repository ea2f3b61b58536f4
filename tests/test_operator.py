"""The operator, as a real process, against the real kube-apiserver with a node stand-in."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any, Optional

from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from afd_devcluster import OPERATOR_USER
from afd_devcluster.operator_process import OperatorProcess
from k8s_helpers import wait_for
from vllm_metrics import FakeVllmMetrics
from operator_env import CONVERGE_SECONDS, Env, PodWatch, base_spec, env, kubelet, operator  # noqa: F401 (fixtures)


class ServingWatch(PodWatch):
    """Follows every pod event of a namespace and records the invariants a rollout must keep."""

    def __init__(self, env: Env):
        super().__init__(env)
        self.min_serving_after_ready: Optional[int] = None
        self.mixed: list[str] = []
        self.history: list[tuple[str, str, int]] = []  # (event, pod, serving count) for failure messages
        self._pods: dict[str, Any] = {}
        self._ready_once = False

    def on_event(self, kind: str, pod: Any) -> None:
        if kind == "DELETED":
            self._pods.pop(pod.metadata.name, None)
        else:
            self._pods[pod.metadata.name] = pod
        self._check()
        self.history.append((kind, pod.metadata.name, self._serving_count()))

    def _serving_count(self) -> int:
        return sum(1 for p in self._pods.values() if (p.metadata.labels or {}).get(naming.LABEL_SERVING) == "true")

    def _check(self) -> None:
        n = self._serving_count()
        if n:
            self._ready_once = True
        if self._ready_once:
            self.min_serving_after_ready = n if self.min_serving_after_ready is None else min(
                self.min_serving_after_ready, n)
        for pod in self._pods.values():
            labels = pod.metadata.labels
            instance = labels[naming.LABEL_AFD_INSTANCE]
            command = pod.spec.containers[0].command
            config = json.loads(command[command.index("--additional-config") + 1])["afd"]
            if labels[naming.LABEL_REVISION] not in instance or f".{instance}." not in config["host"]:
                self.mixed.append(pod.metadata.name)


def test_create_starts_ffn_first_and_becomes_ready(env: Env) -> None:
    env.create("svc", base_spec())
    obj = env.wait_ready("svc", 1)
    pods = {p.metadata.name: p for p in env.pods()}
    ffn = [p for p in pods.values() if p.metadata.labels[naming.LABEL_ROLE] == "ffn"]
    attention = [p for p in pods.values() if p.metadata.labels[naming.LABEL_ROLE] == "attention"]
    assert len(ffn) == 1 and len(attention) == 2
    # FFNFirst: no Attention pod exists before the FFN pod ran.
    assert max(p.metadata.creation_timestamp for p in ffn) <= min(p.metadata.creation_timestamp for p in attention)
    heads = [p for p in attention if p.metadata.labels.get(naming.LABEL_SERVING) == "true"]
    assert len(heads) == 1 and heads[0].metadata.labels[naming.LABEL_HEAD] == "true"
    status = obj["status"]
    assert status["topology"] == "DP2xTP1+EP1" and status["currentRevision"] == status["updateRevision"]
    assert status["instances"][0]["phase"] == "Ready" and status["instances"][0]["podsReady"] == 3
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Ready": "True", "Available": "True", "Progressing": "False", "Degraded": "False",
                          "ConfigValid": "True", "NetworkIsolated": "True"}
    assert any(e.startswith("CreatingInstance") for e in env.events("svc"))
    assert any("-> Ready" in e for e in env.events("svc"))
    instance = status["instances"][0]["name"]
    assert env.owned()["services"] == sorted(["svc", instance])
    # The instance's guards, as the API server stored them: a budget of one pod, a NetworkPolicy.
    assert env.owned()["guards"] == [f"networkpolicy.networking.k8s.io/{instance}",
                                     f"poddisruptionbudget.policy/{instance}"]


def test_no_op_reconcile_makes_zero_writes(env: Env) -> None:
    env.create("quiet", base_spec())
    env.wait_ready("quiet", 1)
    time.sleep(1.5)  # let the last status write and its echo events settle
    since = time.time()
    time.sleep(4)  # several resync periods (0.5 s) of reconciles with nothing to do
    writes = env.cluster.write_requests(OPERATOR_USER, since=since)
    mine = [w for w in writes if w.get("objectRef", {}).get("namespace") == env.ns]
    assert mine == [], [(w["verb"], w["objectRef"]) for w in mine]
    metrics = env.operator.metrics()
    assert 'afd_operator_reconciles_total{result="success"}' in metrics


def test_scale_up_and_down_highest_index_first(env: Env) -> None:
    env.create("scaled", base_spec())
    env.wait_ready("scaled", 1)
    env.cluster.kubectl("scale", "afd", "scaled", "-n", env.ns, "--replicas=3")
    status = env.wait_ready("scaled", 3)["status"]
    assert sorted(i["index"] for i in status["instances"]) == [0, 1, 2]
    env.cluster.kubectl("scale", "afd", "scaled", "-n", env.ns, "--replicas=1")
    status = env.wait_ready("scaled", 1)["status"]
    assert [i["index"] for i in status["instances"]] == [0]
    wait_for(lambda: len(env.instances()) == 1, "scaled-down instances gone", CONVERGE_SECONDS)


def test_topology_rollout_never_drops_serving_or_mixes_revisions(env: Env) -> None:
    env.create("roll", base_spec())
    before = env.wait_ready("roll", 1)["status"]["updateRevision"]
    with ServingWatch(env) as seen:
        env.patch_spec("roll", {"attention": {"dataParallel": 4}, "ffn": {"ranks": 2}})
        after = env.wait_ready("roll", 1)
        wait_for(lambda: len(env.instances()) == 1, "old instance gone", CONVERGE_SECONDS)
    status = after["status"]
    assert status["updateRevision"] != before and status["topology"] == "DP4xTP1+EP2"
    (pods,) = env.instances().values()
    assert sorted(p.metadata.labels[naming.LABEL_ROLE] for p in pods) == ["attention"] * 4 + ["ffn"] * 2
    assert seen.min_serving_after_ready == 1, f"serving instances dropped below the floor: {seen.history}"
    assert seen.mixed == []
    assert any("rolling update" in e for e in env.events("roll"))


def test_revert_mid_rollout_keeps_serving_instance(env: Env) -> None:
    env.create("rev", base_spec())
    old = env.wait_ready("rev", 1)["status"]
    old_instance = old["instances"][0]["name"]
    env.kubelet.hold_pending(lambda pod: "runtime:v2" in json.dumps(pod["spec"]["containers"][0]["image"]))
    try:
        env.patch_spec("rev", {"image": "runtime:v2"})
        wait_for(lambda: len(env.instances()) == 2, "surge instance created", CONVERGE_SECONDS)
        env.patch_spec("rev", {"image": "runtime:v1"})  # revert while the new instance is not Ready
        status = env.wait_ready("rev", 1)["status"]
        wait_for(lambda: list(env.instances()) == [old_instance], "surge instance removed", CONVERGE_SECONDS)
    finally:
        env.kubelet.release()
    assert status["instances"][0]["name"] == old_instance and status["instances"][0]["restarts"] == 0
    head = next(p for p in env.pods() if p.metadata.labels[naming.LABEL_HEAD] == "true")
    assert head.metadata.labels.get(naming.LABEL_SERVING) == "true"


def test_three_quick_updates_roll_only_to_the_newest(env: Env) -> None:
    env.create("quick", base_spec())
    env.wait_ready("quick", 1)
    for tag in ("v2", "v3", "v4"):
        env.patch_spec("quick", {"image": f"runtime:{tag}"})
        time.sleep(0.3)
    status = env.wait_ready("quick", 1)["status"]
    wait_for(lambda: len(env.instances()) == 1, "intermediate instances gone", CONVERGE_SECONDS)
    (pods,) = env.instances().values()
    assert {p.spec.containers[0].image for p in pods} == {"runtime:v4"}
    assert status["instances"][0]["revision"] == status["updateRevision"]


def test_pod_failure_recreates_whole_instance(env: Env) -> None:
    env.create("heal", base_spec())
    status = env.wait_ready("heal", 1)["status"]
    first_uids = {p.metadata.uid for p in env.pods()}
    victim = next(p.metadata.name for p in env.pods() if p.metadata.labels[naming.LABEL_ROLE] == "ffn")
    env.kubelet.fail_pod(env.ns, victim, exit_code=137, reason="OOMKilled")
    wait_for(lambda: (env.get("heal")["status"]["instances"][0].get("restarts") == 1), "restart recorded",
             CONVERGE_SECONDS)
    status = env.wait_ready("heal", 1)["status"]
    assert status["instances"][0]["restarts"] == 1
    assert "OOMKilled" in status["instances"][0]["lastFailure"]
    new_uids = {p.metadata.uid for p in env.pods()}
    assert len(new_uids) == 3 and not (new_uids & first_uids), "every pod of the world must be new"
    assert any(e.startswith("InstanceFailed") for e in env.events("heal"))
    # A deleted rank fails its world just the same.
    victim = next(p.metadata.name for p in env.pods() if p.metadata.labels[naming.LABEL_HEAD] == "false"
                  and p.metadata.labels[naming.LABEL_ROLE] == "attention")
    env.kubelet.delete_pod(env.ns, victim)
    wait_for(lambda: env.get("heal")["status"]["instances"][0].get("restarts") == 2, "second restart",
             CONVERGE_SECONDS)
    status = env.wait_ready("heal", 1)["status"]
    assert "was deleted" in status["instances"][0]["lastFailure"] or "disappeared" in status["instances"][0]["lastFailure"]
    assert not ({p.metadata.uid for p in env.pods()} & new_uids)


def test_restart_budget_exhausted_marks_degraded(env: Env) -> None:
    env.create("doomed", base_spec(recovery={"backoffSeconds": 0, "maxBackoffSeconds": 0, "maxRestarts": 1,
                                             "unreadyGraceSeconds": 2}))
    env.wait_ready("doomed", 1)
    for _ in range(2):
        wait_for(lambda: len([p for p in env.pods() if p.status.phase == "Running"]) == 3, "instance running",
                 CONVERGE_SECONDS)
        victim = next(p.metadata.name for p in env.pods() if p.metadata.labels[naming.LABEL_HEAD] == "true")
        env.kubelet.fail_pod(env.ns, victim)
        time.sleep(0.5)
    degraded = wait_for(lambda: (c := env.condition("doomed", "Degraded")) and c["status"] == "True" and c,
                        "Degraded condition", CONVERGE_SECONDS)
    assert "stays down" in degraded["message"]
    wait_for(lambda: not env.pods(), "the failed instance's pods removed", CONVERGE_SECONDS)
    time.sleep(2)
    assert not env.pods(), "an instance past its restart budget must stay down"
    assert (env.condition("doomed", "Ready") or {}).get("status") == "False"


class Deletions(PodWatch):
    """When each pod of the namespace was deleted."""

    def __init__(self, env: Env):
        super().__init__(env)
        self.deleted_at: dict[str, float] = {}

    def on_event(self, kind: str, pod: Any) -> None:
        if kind == "DELETED":
            self.deleted_at[pod.metadata.name] = time.monotonic()


def test_delete_tears_down_in_order_and_leaves_nothing(env: Env) -> None:
    env.create("gone", base_spec(replicas=2))
    env.wait_ready("gone", 2)
    deletions = Deletions(env)
    with deletions:
        env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "gone")
        wait_for(lambda: env.get("gone") is None, "finalizer removed", CONVERGE_SECONDS)
    deleted_at = deletions.deleted_at
    assert env.owned() == {"pods": [], "services": [], "configmaps": [], "guards": []}
    for instance in {n.rsplit("-", 2)[0] for n in deleted_at}:
        attention = [t for n, t in deleted_at.items() if n.startswith(instance) and "-attn-" in n]
        ffn = [t for n, t in deleted_at.items() if n.startswith(instance) and "-ffn-" in n]
        assert attention and ffn and max(attention) <= min(ffn), "Attention pods must go before FFN pods"
        # The DP group's head goes alone first: a peer that exits while the head still serves
        # fails the head's engine (controller.drain).
        head = f"{instance}-attn-0"
        peers = [t for n, t in deleted_at.items() if n.startswith(f"{instance}-attn-") and n != head]
        assert peers and deleted_at[head] < min(peers), deleted_at


def test_operator_killed_mid_rollout_converges_without_duplicates(env: Env, operator: OperatorProcess) -> None:
    env.create("crash", base_spec(replicas=2))
    env.wait_ready("crash", 2)
    env.patch_spec("crash", {"image": "runtime:v2"})
    for delay in (0.3, 1.0, 2.0):
        time.sleep(delay)
        operator.kill()
        operator.start()
    status = env.wait_ready("crash", 2, timeout=60)["status"]
    wait_for(lambda: len(env.instances()) == 2, "old instances gone", CONVERGE_SECONDS)
    names = [i["name"] for i in status["instances"]]
    assert len(names) == len(set(names)) == 2
    pods = env.pods()
    assert {p.spec.containers[0].image for p in pods} == {"runtime:v2"}
    assert len(pods) == 6 and len({p.metadata.name for p in pods}) == 6
    owned = env.owned()
    assert owned["services"] == sorted(["crash", *names])
    assert len(owned["configmaps"]) == 1


def test_invalid_spec_reported_in_config_valid(env: Env) -> None:
    bad = base_spec()
    bad["ffn"] = {"ranks": 3, "devicesPerPod": 1}  # 8 routed experts are not divisible by 3
    env.create("wrong", bad)
    cond = wait_for(lambda: (c := env.condition("wrong", "ConfigValid")) and c["status"] == "False" and c,
                    "ConfigValid=False", CONVERGE_SECONDS)
    assert "spec.ffn.ranks: must divide model.routedExperts (8)" in cond["message"]
    assert env.pods() == []


def test_metrics_are_promtool_clean(env: Env, operator: OperatorProcess) -> None:
    env.create("metered", base_spec())
    env.wait_ready("metered", 1)
    text = operator.metrics()
    for name in ("afd_operator_reconciles_total", "afd_operator_reconcile_duration_seconds_bucket",
                 "afd_operator_api_writes_total", "afd_operator_instances", "afd_operator_rollout_in_progress",
                 "afd_operator_instance_time_to_ready_seconds_bucket"):
        assert name in text, name
    assert f'afd_operator_instances{{deployment="metered",namespace="{env.ns}",phase="Ready"}} 1.0' in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unschedulable_surge_is_reported_not_awaited(env: Env) -> None:
    env.create("stuck", base_spec(recovery={"backoffSeconds": 30, "maxBackoffSeconds": 60}))
    env.wait_ready("stuck", 1)
    env.kubelet.hold_pending(lambda pod: pod["spec"]["containers"][0]["image"] == "runtime:v2")
    try:  # a short startup timeout from now on: it is not part of the revision
        env.patch_spec("stuck", {"image": "runtime:v2", "startup": {"timeoutSeconds": 2}})
        cond = wait_for(lambda: (c := env.condition("stuck", "Progressing")) and
                        c.get("reason") == "SurgeUnschedulable" and c, "SurgeUnschedulable reason", CONVERGE_SECONDS)
    finally:
        env.kubelet.release()
    assert "Pending after 2s" in cond["message"]
    # The old instance kept serving the whole time.
    head = next(p for p in env.pods() if p.metadata.labels.get(naming.LABEL_SERVING) == "true")
    assert head.spec.containers[0].image == "runtime:v1"


def api_endpoint_slice(env: Env, deployment: str, head: Any) -> dict[str, Any]:
    """The API Service's EndpointSlice listing `head`, as the EndpointSlice controller writes it
    (the control-plane tier runs no controller-manager): the Service's labels copied, plus
    kubernetes.io/service-name, and the Service as its controller."""
    service = env.core.read_namespaced_service(naming.api_service_name(deployment), env.ns)
    served = env.cluster.kubectl("api-versions").stdout.split()
    version = "discovery.k8s.io/v1" if "discovery.k8s.io/v1" in served else "discovery.k8s.io/v1beta1"
    return {"apiVersion": version, "kind": "EndpointSlice",
            "metadata": {"name": f"{service.metadata.name}-slice", "namespace": env.ns,
                         "labels": {**service.metadata.labels, naming.LABEL_SERVICE_NAME: service.metadata.name},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service.metadata.name,
                                              "uid": service.metadata.uid, "controller": True}]},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [head.status.pod_ip], "conditions": {"ready": False},
                           "targetRef": {"kind": "Pod", "name": head.metadata.name, "namespace": env.ns}}],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}


def test_drain_waits_for_endpoints_and_running_requests_not_the_full_window(env: Env) -> None:
    env.create("busy", base_spec(termination={"gracePeriodSeconds": 5, "drainSeconds": 300}))
    env.wait_ready("busy", 1)
    head = next(p for p in env.pods() if p.metadata.labels[naming.LABEL_HEAD] == "true")
    api_port = next(p.container_port for p in head.spec.containers[0].ports if p.name == "api")
    metrics = FakeVllmMetrics(head.status.pod_ip, api_port)
    endpoints = api_endpoint_slice(env, "busy", head)
    env.cluster.kubectl("apply", "-f", "-", input_text=json.dumps(endpoints))
    try:
        env.cluster.kubectl("scale", "afd", "busy", "-n", env.ns, "--replicas=0")
        wait_for(lambda: naming.LABEL_SERVING not in (env.core.read_namespaced_pod(
            head.metadata.name, env.ns).metadata.labels or {}), "head left the Service", CONVERGE_SECONDS)
        time.sleep(2)
        assert len(env.pods()) == 3, "a head still running requests must not be deleted"
        metrics.running = 0
        time.sleep(3)
        assert len(env.pods()) == 3, "an idle head that an endpoint still lists must not be deleted"
        env.cluster.kubectl("apply", "-f", "-", input_text=json.dumps({**endpoints, "endpoints": []}))
        wait_for(lambda: not env.pods(), "drain finished once the head is unlisted and idle", 20)
    finally:
        metrics.close()
        env.cluster.kubectl("delete", "endpointslice", endpoints["metadata"]["name"], "-n", env.ns,
                            "--ignore-not-found")
