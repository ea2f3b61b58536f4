"""The development cluster: the operator's identity in the audit log, and the node stand-in
(FakeKubelet) against the real kube-apiserver."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator, Optional

import pytest
from kubernetes import client, config

from k8s_helpers import wait_for
from afd_devcluster import ADMIN_USER, OPERATOR_USER, ControlPlane, FakeKubelet

ASCEND = "huawei.com/Ascend910"


@pytest.fixture()
def core(api_client) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


@pytest.fixture()
def namespace(core: client.CoreV1Api) -> str:
    name = f"dev-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    return name


@pytest.fixture()
def kubelet(api_client, namespace: str) -> Iterator[FakeKubelet]:
    with FakeKubelet(api_client, [f"{namespace}-a", f"{namespace}-b"], namespace=namespace,
                     extended_resources={ASCEND: 16}) as fake:
        yield fake


def create_pod(core: client.CoreV1Api, namespace: str, name: str, labels: Optional[dict[str, str]] = None) -> None:
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "image": "app:1"}, {"name": "sidecar", "image": "side:1"}]},
    })


def read_pod(core: client.CoreV1Api, namespace: str, name: str) -> Optional[dict[str, Any]]:
    try:
        return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj["status"].get("conditions") or []}


def ready_status(pod: Optional[dict[str, Any]]) -> Optional[str]:
    return None if pod is None else conditions(pod).get("Ready", {}).get("status")


def wait_ready(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, Any]:
    return wait_for(lambda: (p := read_pod(core, namespace, name)) and p["status"].get("phase") == "Running"
                    and ready_status(p) == "True" and p, f"{namespace}/{name} Running and Ready")


def read_node(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    return json.loads(core.read_node(name, _preload_content=False).data)


def api_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def test_nodes_are_registered_ready_with_capacity_and_own_pod_networks(core, kubelet: FakeKubelet) -> None:
    nodes = [read_node(core, name) for name in kubelet.node_names]
    networks = {node["spec"]["podCIDR"] for node in nodes}
    assert len(networks) == len(nodes)
    for node in nodes:
        assert conditions(node)["Ready"]["status"] == "True"
        assert node["status"]["allocatable"][ASCEND] == "16"
        assert node["status"]["capacity"]["pods"] == "110"
        assert {"cpu", "memory"} <= node["status"]["capacity"].keys()
        internal_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        assert ipaddress.ip_address(internal_ip) in ipaddress.ip_network(node["spec"]["podCIDR"])
        assert ipaddress.ip_address(internal_ip).is_loopback


def test_pods_are_bound_round_robin_and_run_ready_with_unique_ips(core, kubelet: FakeKubelet,
                                                                  namespace: str) -> None:
    names = [f"p{i}" for i in range(4)]
    for name in names:
        create_pod(core, namespace, name)
    pods = [wait_ready(core, namespace, name) for name in names]
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(kubelet.node_names * 2)
    assert len({p["status"]["podIP"] for p in pods}) == len(pods)
    for pod in pods:
        node = read_node(core, pod["spec"]["nodeName"])
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(node["spec"]["podCIDR"])
        assert pod["status"]["podIP"] != pod["status"]["hostIP"]
        assert pod["status"]["hostIP"] in {a["address"] for a in node["status"]["addresses"]}
        assert pod["status"]["startTime"]
        conds = conditions(pod)
        for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
            assert conds[kind]["status"] == "True" and conds[kind]["lastTransitionTime"], kind
        statuses = pod["status"]["containerStatuses"]
        assert sorted(s["name"] for s in statuses) == ["main", "sidecar"]
        assert all(s["ready"] and "running" in s["state"] for s in statuses)


def test_graceful_delete_is_finished_by_the_kubelet(core, kubelet: FakeKubelet, namespace: str) -> None:
    create_pod(core, namespace, "doomed")
    create_pod(core, namespace, "also-doomed")
    wait_ready(core, namespace, "doomed")
    wait_ready(core, namespace, "also-doomed")
    core.delete_namespaced_pod("doomed", namespace)  # the default 30 s grace period
    kubelet.delete_pod(namespace, "also-doomed")
    wait_for(lambda: read_pod(core, namespace, "doomed") is None, "doomed deleted before its grace period")
    wait_for(lambda: read_pod(core, namespace, "also-doomed") is None, "also-doomed deleted")


def test_fault_injection_writes_failed_and_readiness_states(core, kubelet: FakeKubelet, namespace: str) -> None:
    create_pod(core, namespace, "crash")
    create_pod(core, namespace, "flaky")
    wait_ready(core, namespace, "crash")
    ready_since = api_time(conditions(wait_ready(core, namespace, "flaky"))["Ready"]["lastTransitionTime"])

    kubelet.fail_pod(namespace, "crash", exit_code=137, reason="OOMKilled")
    crashed = read_pod(core, namespace, "crash")
    assert crashed["status"]["phase"] == "Failed"
    assert ready_status(crashed) == "False"
    terminated = [s["state"]["terminated"] for s in crashed["status"]["containerStatuses"]]
    assert [(t["exitCode"], t["reason"]) for t in terminated] == [(137, "OOMKilled")] * 2

    before = time.time()
    kubelet.set_not_ready(namespace, "flaky")
    flaky = read_pod(core, namespace, "flaky")
    assert flaky["status"]["phase"] == "Running"
    assert ready_status(flaky) == "False"
    assert conditions(flaky)["ContainersReady"]["status"] == "False"
    assert api_time(conditions(flaky)["Ready"]["lastTransitionTime"]) >= max(ready_since, int(before))
    assert not any(s["ready"] for s in flaky["status"]["containerStatuses"])

    kubelet.set_ready(namespace, "flaky")
    flaky = read_pod(core, namespace, "flaky")
    assert ready_status(flaky) == "True" and flaky["status"]["phase"] == "Running"
    assert all(s["ready"] for s in flaky["status"]["containerStatuses"])


def test_lose_node_marks_node_and_its_pods_and_stops_serving_them(core, kubelet: FakeKubelet,
                                                                  namespace: str) -> None:
    for name in ("p0", "p1"):
        create_pod(core, namespace, name)
    pods = {name: wait_ready(core, namespace, name) for name in ("p0", "p1")}
    lost = pods["p0"]["spec"]["nodeName"]
    kubelet.lose_node(lost)

    node = read_node(core, lost)
    assert conditions(node)["Ready"]["status"] == "Unknown"
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} == {
        ("node.kubernetes.io/unreachable", "NoSchedule"), ("node.kubernetes.io/unreachable", "NoExecute")}
    stranded = read_pod(core, namespace, "p0")
    assert ready_status(stranded) == "False" and conditions(stranded)["Ready"]["reason"] == "NodeLost"
    assert ready_status(read_pod(core, namespace, "p1")) == "True"

    create_pod(core, namespace, "p2")
    assert wait_ready(core, namespace, "p2")["spec"]["nodeName"] != lost
    # Nobody finishes a deletion on a lost node; the healthy node does (events are handled in order).
    core.delete_namespaced_pod("p0", namespace)
    core.delete_namespaced_pod("p1", namespace)
    wait_for(lambda: read_pod(core, namespace, "p1") is None, "p1 deleted")
    assert read_pod(core, namespace, "p0")["metadata"]["deletionTimestamp"]


def test_hold_pending_keeps_pods_unbound_until_release(core, kubelet: FakeKubelet, namespace: str) -> None:
    kubelet.hold_pending(lambda pod: pod["metadata"].get("labels", {}).get("surge") == "yes")
    create_pod(core, namespace, "surge", labels={"surge": "yes"})
    create_pod(core, namespace, "normal")
    wait_ready(core, namespace, "normal")
    wait_for(lambda: kubelet.held_pods() == [(namespace, "surge")], "surge held")
    held = read_pod(core, namespace, "surge")
    assert not held["spec"].get("nodeName") and held["status"]["phase"] == "Pending"

    kubelet.release()
    assert kubelet.held_pods() == []
    assert wait_ready(core, namespace, "surge")["spec"]["nodeName"] in kubelet.node_names


def test_selector_and_ready_delay(api_client, core, namespace: str) -> None:
    node = f"{namespace}-sel"
    with FakeKubelet(api_client, [node], namespace=namespace, label_selector="app=mine",
                     ready_delay_seconds=1) as fake:
        create_pod(core, namespace, "foreign")
        create_pod(core, namespace, "mine", labels={"app": "mine"})
        pod = wait_ready(core, namespace, "mine")
        started = min(api_time(s["state"]["running"]["startedAt"]) for s in pod["status"]["containerStatuses"])
        assert api_time(conditions(pod)["Ready"]["lastTransitionTime"]) - started >= 1
        with pytest.raises(ValueError):
            fake.fail_pod(namespace, "foreign")
    foreign = read_pod(core, namespace, "foreign")
    assert not foreign["spec"].get("nodeName") and not foreign["status"].get("conditions")


def test_stop_ends_the_watch_promptly(api_client, core, namespace: str) -> None:
    fake = FakeKubelet(api_client, [f"{namespace}-stop"], namespace=namespace, watch_timeout_seconds=60).start()
    try:
        create_pod(core, namespace, "p")
        wait_ready(core, namespace, "p")  # the watch is open and serving
    finally:
        started = time.monotonic()
        fake.stop()
    assert time.monotonic() - started < 5


def test_audit_log_attributes_operator_writes(cluster: ControlPlane, core, namespace: str) -> None:
    since = time.time()
    operator = config.new_client_from_config(config_file=str(cluster.operator_kubeconfig))
    try:
        client.CoreV1Api(operator).create_namespaced_config_map(
            namespace, {"metadata": {"name": "from-operator"}})
        client.CoreV1Api(operator).read_namespaced_config_map("from-operator", namespace)
    finally:
        operator.close()
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "from-admin"}})

    writes = wait_for(lambda: cluster.write_requests(OPERATOR_USER, since), "the operator's create in the audit log")
    assert [(w["verb"], w["objectRef"]["resource"], w["objectRef"]["name"]) for w in writes] == [
        ("create", "configmaps", "from-operator")]
    assert any(e["verb"] == "get" and e["objectRef"].get("name") == "from-operator"
               for e in cluster.audit_events(OPERATOR_USER, since))
    admin_writes = wait_for(lambda: [w for w in cluster.write_requests(ADMIN_USER, since)
                                     if w["objectRef"].get("name") == "from-admin"], "the admin's create")
    assert len(admin_writes) == 1
    assert cluster.write_requests(OPERATOR_USER, time.time()) == []
