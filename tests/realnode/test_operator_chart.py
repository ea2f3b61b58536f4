"""The chart on the real node: `helm install` with the operator image built from images/, the
operator running as a pod under the chart's ServiceAccount, its webhook reached through its
Service (the API server dials the Service, kube-proxy routes to the pod)."""

from __future__ import annotations

import json

from afd_devcluster.realnode import RealNode


def test_operator_runs_as_a_pod_under_the_charts_service_account(real_node: RealNode,
                                                                 operator_release: tuple[str, str]) -> None:
    release, namespace = operator_release
    pods = json.loads(real_node.kubectl("get", "pods", "-n", namespace, "-l",
                                        f"app.kubernetes.io/instance={release}", "-o", "json").stdout)["items"]
    (pod,) = pods
    assert pod["spec"]["serviceAccountName"] == release
    assert pod["status"]["phase"] == "Running"
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert ready["Ready"] == "True", pod["status"]
    (status,) = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and status["imageID"], status
    # The token the operator uses is the chart's ServiceAccount's, mounted by kubelet.
    mounts = [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]]
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts


def test_webhook_is_reached_through_its_service(real_node: RealNode, operator_release: tuple[str, str]) -> None:
    release, namespace = operator_release
    hooks = json.loads(real_node.kubectl("get", "validatingwebhookconfigurations", "-o", "json").stdout)["items"]
    (client_config,) = [w["clientConfig"] for h in hooks for w in h["webhooks"]
                        if h["metadata"]["name"].startswith(release)]
    assert "url" not in client_config and client_config["service"]["namespace"] == namespace
    bad = {"apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
           "metadata": {"name": "bad", "namespace": "default"},
           "spec": {"image": "x:1", "platform": "cpu",
                    "model": {"name": "m", "path": "/m", "routedExperts": 8},
                    "attention": {"dataParallel": 2, "tensorParallel": 1},
                    "ffn": {"ranks": 3}}}
    result = real_node.kubectl("apply", "-f", "-", input_text=json.dumps(bad), check=False)
    assert result.returncode != 0
    assert "denied the request" in result.stderr, result.stderr
    assert real_node.kubectl("get", "afd", "bad", "-n", "default", check=False).returncode != 0
