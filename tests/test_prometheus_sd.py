"""The real node's Prometheus target feed (afd_devcluster.realnode.prometheus_sd): which pods
and Service endpoints become targets, with the meta labels Kubernetes discovery would give."""

from __future__ import annotations

from afd_devcluster.realnode.prometheus_sd import annotated_endpoint_targets, pod_targets


def pod(name: str, labels: dict, ip: str | None, ports: list[tuple[str, int]]) -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {"containers": [{"name": "main", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]},
            "status": {"podIP": ip} if ip else {}}


def test_pod_targets_keep_the_selected_pods_named_ports() -> None:
    pods = [
        pod("head", {"afd.inference.dev/deployment": "a", "afd.inference.dev/role": "attention"}, "10.0.0.1",
            [("api", 8000), ("connector", 1239)]),
        pod("ffn", {"afd.inference.dev/deployment": "a", "afd.inference.dev/role": "ffn"}, "10.0.0.2",
            [("metrics", 9401)]),
        pod("other", {"afd.inference.dev/deployment": "a-b"}, "10.0.0.3", [("api", 8000)]),  # a name prefix
        pod("pending", {"afd.inference.dev/deployment": "a"}, None, [("api", 8000)]),  # no IP yet
    ]
    groups = pod_targets(pods, {"afd.inference.dev/deployment": "a"}, {"api", "metrics"})
    assert [g["targets"] for g in groups] == [["10.0.0.1:8000"], ["10.0.0.2:9401"]]
    head = groups[0]["labels"]
    assert head["__meta_kubernetes_pod_name"] == "head"
    assert head["__meta_kubernetes_pod_container_port_name"] == "api"
    assert head["__meta_kubernetes_pod_label_afd_inference_dev_role"] == "attention"


def test_endpoint_targets_only_of_annotated_services_on_their_port() -> None:
    services = [
        {"metadata": {"name": "op-metrics", "namespace": "sys",
                      "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8080"}}},
        {"metadata": {"name": "op-webhook", "namespace": "sys", "annotations": {}}},
    ]
    endpoints = [
        {"metadata": {"name": "op-metrics", "namespace": "sys"},
         "subsets": [{"addresses": [{"ip": "10.0.0.9", "targetRef": {"name": "op-0"}}], "ports": [{"port": 80}]}]},
        {"metadata": {"name": "op-webhook", "namespace": "sys"},
         "subsets": [{"addresses": [{"ip": "10.0.0.9"}], "ports": [{"port": 443}]}]},
    ]
    (group,) = annotated_endpoint_targets(services, endpoints)
    assert group["targets"] == ["10.0.0.9:8080"]
    assert group["labels"]["__meta_kubernetes_pod_name"] == "op-0"
