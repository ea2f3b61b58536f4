"""The chart on the real node: `helm install` with the operator image built from images/, the
operator running as a pod under the chart's ServiceAccount, its webhooks reached through its
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
    configs = {w["name"]: w["clientConfig"] for h in hooks for w in h["webhooks"]
               if h["metadata"]["name"].startswith(release)}
    assert sorted(configs) == ["pod-membership-deployment.afd.inference.dev",
                               "pod-membership-instance.afd.inference.dev", "scale-validation.afd.inference.dev",
                               "validation.afd.inference.dev"]
    assert all("url" not in c and c["service"]["namespace"] == namespace for c in configs.values()), configs
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


def test_no_pod_joins_an_instance_but_the_operators(real_node: RealNode, operator_release: tuple[str, str]) -> None:
    """What a NetworkPolicy selector trusts is enforced by the API server whatever the CNI: a pod
    labelled into an instance by anyone but the operator's ServiceAccount is refused."""
    forged = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "forged", "namespace": "default",
                           "labels": {"afd.inference.dev/instance": "tiny-cpu-0123456789-0"}},
              "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}}
    result = real_node.kubectl("create", "--dry-run=server", "-f", "-", input_text=json.dumps(forged), check=False)
    assert result.returncode != 0 and "pod-membership-instance.afd.inference.dev" in result.stderr, result.stderr
    assert "are set by the afd-operator alone" in result.stderr, result.stderr
    forged["metadata"]["labels"] = {"app": "other"}
    assert real_node.kubectl("create", "--dry-run=server", "-f", "-", input_text=json.dumps(forged)).returncode == 0
