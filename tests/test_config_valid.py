"""A spec the plugin would refuse, without the admission webhook: the operator process itself
sets ConfigValid=False with the plugin's message and creates nothing until it is fixed."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from kubernetes import client

from afd_devcluster import ControlPlane
from afd_devcluster.operator_process import OperatorProcess
from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from k8s_helpers import delete_afddeployments, wait_for

CONVERGE_SECONDS = 45
NAME = "refused"
SPEC: dict[str, Any] = {
    "image": "runtime:v1",
    "platform": "cpu",
    "model": {"name": "tiny", "path": "/models/tiny", "routedExperts": 8},
    "attention": {"dataParallel": 2},
    "ffn": {"ranks": 2},
    # Schema-valid (extraConfig is free-form in the CRD), but no key the plugin knows.
    "connector": {"extraConfig": {"dynamicQuant": 0, "ringBuffers": 4}},
}
PLUGIN_MESSAGE = ("spec.connector.extraConfig.ringBuffers: the plugin refuses it: "
                  "afd.connector_extra_config.ringBuffers: unknown key; allowed: attn_ranks_per_dp, dynamicQuant, "
                  "data_plane (got 4)")


@pytest.fixture()
def namespace(cluster: ControlPlane, api_client, repo_root: Path, tmp_path: Path) -> Iterator[str]:
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / "afd.inference.dev_afddeployments.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=30s")
    ns = f"cv-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api_client).create_namespace({"metadata": {"name": ns}})
    proc = OperatorProcess(cluster.operator_kubeconfig, tmp_path / "operator.log", namespaces=(ns,),
                           resync_seconds=0.5).start()
    try:
        yield ns
        delete_afddeployments(cluster, ns)  # before the operator stops: it holds the finalizer
    finally:
        proc.stop()


def config_valid(custom: client.CustomObjectsApi, ns: str) -> Optional[dict[str, Any]]:
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME)
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "ConfigValid"), None)


def test_plugin_refusal_sets_config_valid_false_until_fixed(api_client, namespace: str) -> None:
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AFDDeployment", "metadata": {"name": NAME}, "spec": SPEC})

    cond = wait_for(lambda: (c := config_valid(custom, namespace)) and c["status"] == "False" and c,
                    "ConfigValid=False", CONVERGE_SECONDS)
    assert (cond["reason"], cond["message"]) == ("InvalidSpec", PLUGIN_MESSAGE)
    wait_for(lambda: ("InvalidSpec", PLUGIN_MESSAGE) in {
        (e.reason, e.message)
        for e in core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={NAME}").items
    }, "an InvalidSpec event with the plugin's message", CONVERGE_SECONDS)
    owned = f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}"
    assert core.list_namespaced_pod(namespace).items == []
    assert core.list_namespaced_service(namespace, label_selector=owned).items == []

    # Dropping the unknown key is all it takes: the same deployment is accepted and planned.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME,
                                          {"spec": {"connector": {"extraConfig": {"ringBuffers": None}}}})
    wait_for(lambda: (c := config_valid(custom, namespace)) and c["status"] == "True", "ConfigValid=True",
             CONVERGE_SECONDS)
    wait_for(lambda: core.list_namespaced_pod(namespace).items, "the deployment's first pods", CONVERGE_SECONDS)
