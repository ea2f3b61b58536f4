"""Validating admission for real: the apiserver calls the operator's webhook over TLS, for
AFDDeployments and for pods carrying AFD membership labels."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from afd_devcluster import ADMIN_USER, OPERATOR_USER, ControlPlane, free_port
from afd_devcluster.certs import self_signed_certificate
from afd_devcluster.operator_process import OperatorProcess
from k8s_helpers import delete_afddeployments, wait_for

CONFIGURATION = "afd-test.validation.afd.inference.dev"  # webhook names must be fully qualified


@pytest.fixture(scope="module")
def webhook_operator(cluster: ControlPlane, repo_root: Path, tmp_path_factory,
                     examples_policy_file: Path) -> Iterator[OperatorProcess]:
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / "afd.inference.dev_afddeployments.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=30s")
    workdir = tmp_path_factory.mktemp("webhook")
    cert, key = self_signed_certificate(workdir, ["127.0.0.1"])
    port = free_port()
    proc = OperatorProcess(cluster.operator_kubeconfig, workdir / "operator.log", extra_args=(
        "--webhook-port", str(port), "--webhook-host", "127.0.0.1", "--webhook-listen", "127.0.0.1",
        "--webhook-cert", str(cert), "--webhook-key", str(key), "--webhook-configuration", CONFIGURATION,
        "--policy", str(examples_policy_file), "--operator-username", OPERATOR_USER,
    )).start()
    wait_for(lambda: cluster.kubectl("get", "validatingwebhookconfiguration", CONFIGURATION,
                                     check=False).returncode == 0, "webhook configuration registered", 30)
    yield proc
    proc.stop()
    cluster.kubectl("delete", "validatingwebhookconfiguration", CONFIGURATION, "--ignore-not-found")


@pytest.fixture()
def namespace(cluster: ControlPlane, webhook_operator: OperatorProcess) -> Iterator[str]:
    name = f"wh-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    delete_afddeployments(cluster, name)  # before the operator stops: it holds their finalizers


def test_invalid_cr_rejected_with_every_problem(cluster: ControlPlane, webhook_operator: OperatorProcess,
                                                namespace: str, examples: list[Path]) -> None:
    doc = yaml.safe_load(next(p for p in examples if p.name == "small-ascend.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["ffn"]["ranks"] = 3  # 64 routed experts are not divisible by 3
    doc["spec"]["attention"]["tensorParallel"] = 3
    doc["spec"]["recovery"] = {"backoffSeconds": 10, "maxBackoffSeconds": 1}
    result = cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert "admission webhook" in result.stderr and "denied the request" in result.stderr
    for expected in ("spec.ffn.ranks: must divide model.routedExperts (64)",
                     "spec.attention.tensorParallel: must divide attention.devicesPerPod (2)",
                     "spec.recovery.maxBackoffSeconds: must be >= recovery.backoffSeconds (10)"):
        assert expected in result.stderr, result.stderr
    assert cluster.kubectl("get", "afd", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_valid_cr_admitted_and_updates_checked(cluster: ControlPlane, webhook_operator: OperatorProcess,
                                               namespace: str, examples: list[Path]) -> None:
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    bad = cluster.kubectl("patch", "afd", doc["metadata"]["name"], "-n", namespace, "--type=merge",
                          "-p", '{"spec": {"ffn": {"ranks": 3}}}', check=False)
    assert bad.returncode != 0 and "spec.ffn.ranks" in bad.stderr
    scaled = cluster.kubectl("scale", "afd", doc["metadata"]["name"], "-n", namespace, "--replicas=2")
    assert scaled.returncode == 0


def test_host_access_beyond_the_chart_values_is_rejected_naming_both(cluster: ControlPlane,
                                                                     webhook_operator: OperatorProcess,
                                                                     namespace: str, examples: list[Path]) -> None:
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["model"]["volume"]["hostPath"] = "/srv/modelsx"  # beside /srv/models, not under it
    doc["spec"]["ffn"]["podTemplate"]["serviceAccountName"] = "builder"
    result = cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0 and "denied the request" in result.stderr
    for expected in ("spec.model.volume.hostPath: host path '/srv/modelsx' is not allowed in this cluster (chart value "
                     "hostAccess.hostPathPrefixes: /srv/models, /data/models)",
                     "spec.ffn.podTemplate.serviceAccountName: 'builder' is not allowed in this cluster (chart value "
                     "hostAccess.serviceAccounts: none besides 'default')"):
        assert expected in result.stderr, result.stderr


def test_spec_the_plugin_would_refuse_is_rejected_with_its_message(cluster: ControlPlane,
                                                                  webhook_operator: OperatorProcess,
                                                                  namespace: str, examples: list[Path]) -> None:
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["connector"] = {"extraConfig": {"dynamicQuant": "often"}}  # the CRD lets any value through
    result = cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0 and "denied the request" in result.stderr
    assert ("spec.connector.extraConfig.dynamicQuant: the plugin refuses it: "
            "afd.connector_extra_config.dynamicQuant: must be an integer (got 'often')") in result.stderr, result.stderr
    assert cluster.kubectl("get", "afd", "-n", namespace, "-o", "name").stdout.strip() == ""
    # An update is judged the same way: a connector name the plugin does not know.
    cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump({**doc, "spec": {**doc["spec"], "connector": {}}}))
    renamed = cluster.kubectl("patch", "afd", doc["metadata"]["name"], "-n", namespace, "--type=merge",
                              "-p", '{"spec": {"connector": {"name": "nixl"}}}', check=False)
    assert renamed.returncode != 0
    assert "spec.connector.name: the plugin refuses it: afd.connector: unknown connector" in renamed.stderr


def forged_pod(namespace: str, labels: dict[str, str]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"forged-{uuid.uuid4().hex[:6]}",
                       "namespace": namespace, "labels": labels},
                       "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}})


def test_only_the_operator_makes_a_pod_an_instance_member(cluster: ControlPlane, webhook_operator: OperatorProcess,
                                                          namespace: str, examples: list[Path]) -> None:
    """The operator creates its pods through the pod-membership webhooks; nobody else may create a
    pod with an instance's or a deployment's label (it would join the instance's DNS, budget and
    NetworkPolicy, or the API Service), or change those labels on the operator's pods. Other pods,
    and other edits of the operator's pods, pass."""
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc))
    name = doc["metadata"]["name"]

    def operator_pods() -> list[dict]:
        return json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", f"afd.inference.dev/deployment={name}",
                                          "-o", "json").stdout)["items"]
    pods = wait_for(lambda: len(p := operator_pods()) >= 2 and p, "the operator's pods created through the webhook", 60)
    member = pods[0]["metadata"]
    instance = member["labels"]["afd.inference.dev/instance"]
    for labels in ({"afd.inference.dev/instance": instance},
                   {"afd.inference.dev/deployment": name, "afd.inference.dev/role": "attention",
                    "afd.inference.dev/head": "true", "afd.inference.dev/serving": "true"}):
        refused = cluster.kubectl("create", "-f", "-", input_text=forged_pod(namespace, labels), check=False)
        assert refused.returncode != 0 and "denied the request" in refused.stderr, refused.stderr
        assert (f"are set by the afd-operator alone (they make a pod a member of an AFD instance); {ADMIN_USER} "
                "may not create such a pod") in refused.stderr, refused.stderr
    serving = "false" if member["labels"].get("afd.inference.dev/serving") == "true" else "true"
    relabelled = cluster.kubectl("label", "pod", member["name"], "-n", namespace, "--overwrite",
                                 f"afd.inference.dev/serving={serving}", check=False)
    assert relabelled.returncode != 0 and "afd.inference.dev/serving" in relabelled.stderr, relabelled.stderr
    moved = cluster.kubectl("label", "pod", member["name"], "-n", namespace, "--overwrite",
                            f"afd.inference.dev/instance={instance}x", check=False)
    assert moved.returncode != 0 and "may not change them" in moved.stderr, moved.stderr
    # Other edits pass, and so do pods that claim no membership.
    assert cluster.kubectl("annotate", "pod", member["name"], "-n", namespace, "team=search").returncode == 0
    assert cluster.kubectl("label", "pod", member["name"], "-n", namespace, "team=search").returncode == 0
    assert cluster.kubectl("create", "-f", "-",
                           input_text=forged_pod(namespace, {"app": "other"})).returncode == 0
    stored = json.loads(cluster.kubectl("get", "pod", member["name"], "-n", namespace, "-o", "json").stdout)
    assert {k: v for k, v in stored["metadata"]["labels"].items() if k.startswith("afd.inference.dev/")} == \
        {k: v for k, v in member["labels"].items() if k.startswith("afd.inference.dev/")}
