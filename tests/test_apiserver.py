"""The CRD, the examples and every rendered object against the real kube-apiserver 1.20."""

from __future__ import annotations

import copy
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from afd_operator.api import GROUP, MAX_REPLICAS, VERSION
from afd_operator.crd import CRD_NAME
from afd_operator.planner import plan
from afd_operator.render import render
from afd_operator.validation import validate_object
from afd_devcluster import ControlPlane
from dry_run import dry_run_create, ensure_priority_class, serving_client, wait_established
from k8s_helpers import DELETE, delete_afddeployments, set_path


@pytest.fixture(scope="module")
def dyn(api_client, cluster: ControlPlane, repo_root: Path):
    return serving_client(api_client, cluster, repo_root)


@pytest.fixture()
def namespace(dyn, cluster: ControlPlane) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    dyn.resources.get(api_version="v1", kind="Namespace").create(body={"metadata": {"name": name}})
    yield name
    delete_afddeployments(cluster, name)


def _afd(dyn):
    return dyn.resources.get(api_version=f"{GROUP}/{VERSION}", kind="AFDDeployment")


def _example_docs(examples: list[Path]) -> list[dict[str, Any]]:
    return [d for p in examples for d in yaml.safe_load_all(p.read_text()) if d]


def test_crd_is_established_structural_and_has_subresources(dyn) -> None:
    crd = wait_established(dyn, CRD_NAME)
    conds = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conds.get("NonStructuralSchema", {}).get("status") != "True"
    version = crd["spec"]["versions"][0]
    assert set(version["subresources"]) == {"status", "scale"}
    assert crd["spec"]["names"]["shortNames"] == ["afd"]


def test_examples_are_accepted_and_listed_with_printer_columns(dyn, cluster: ControlPlane,
                                                                 namespace: str, examples: list[Path]) -> None:
    created = []
    for doc in _example_docs(examples):
        body = copy.deepcopy(doc)
        body["metadata"]["namespace"] = namespace
        created.append(_afd(dyn).create(body=body, namespace=namespace).to_dict())
    for obj, doc in zip(created, _example_docs(examples)):
        assert obj["spec"] == doc["spec"], "the server pruned or changed fields of an example"
    out = cluster.kubectl("get", "afd", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "READY", "TOPOLOGY", "INSTANCES", "DESIRED", "UP-TO-DATE", "REVISION", "AGE"]
    assert len(out.splitlines()) == 1 + len(created)


def test_scale_subresource(dyn, cluster: ControlPlane, namespace: str, examples: list[Path]) -> None:
    doc = _example_docs(examples)[0]
    doc["metadata"]["namespace"] = namespace
    _afd(dyn).create(body=doc, namespace=namespace)
    name = doc["metadata"]["name"]
    cluster.kubectl("scale", "afd", name, "-n", namespace, "--replicas=5")
    assert _afd(dyn).get(name=name, namespace=namespace).spec.replicas == 5
    # The scale subresource passes no webhook: the schema's maximum holds it.
    beyond = cluster.kubectl("scale", "afd", name, "-n", namespace, f"--replicas={MAX_REPLICAS + 1}", check=False)
    assert beyond.returncode != 0 and f"less than or equal to {MAX_REPLICAS}" in beyond.stderr, beyond.stderr
    assert _afd(dyn).get(name=name, namespace=namespace).spec.replicas == 5


SCHEMA_INVALID = [
    ("spec.replicas", -1, "spec.replicas"),
    ("spec.replicas", "two", "spec.replicas"),
    ("spec.platform", "gpu", "spec.platform"),
    ("spec.sharedExperts.placement", "both", "spec.sharedExperts.placement"),
    ("spec.connector.port", 70000, "spec.connector.port"),
    ("spec.attention.dataParallel", 0, "spec.attention.dataParallel"),
    ("spec.model", DELETE, "spec.model"),
    ("spec.image", "", "spec.image"),
    ("spec.updateStrategy.type", "BlueGreen", "spec.updateStrategy.type"),
]


@pytest.mark.parametrize("path,value,field", SCHEMA_INVALID,
                         ids=[f"{p}={'<deleted>' if v is DELETE else repr(v)}" for p, v, _ in SCHEMA_INVALID])
def test_server_rejects_schema_invalid(dyn, namespace: str, examples: list[Path], path: str, value: Any,
                                       field: str) -> None:
    from kubernetes.dynamic.exceptions import UnprocessibleEntityError

    doc = copy.deepcopy(_example_docs(examples)[0])
    doc["metadata"]["namespace"] = namespace
    set_path(doc, path, value)
    with pytest.raises(UnprocessibleEntityError) as err:
        _afd(dyn).create(body=doc, namespace=namespace)
    assert field in err.value.body


def _wait_openapi_published(cluster: ControlPlane) -> None:
    """The apiserver publishes a new CRD's schema to /openapi/v2 a few seconds after it is
    Established; kubectl validates against that document."""
    deadline = time.monotonic() + 60
    while cluster.kubectl("explain", "afd.spec.attention.tensorParallel", check=False).returncode != 0:
        assert time.monotonic() < deadline, "AFDDeployment schema never appeared in /openapi/v2"
        time.sleep(0.5)


def test_kubectl_rejects_unknown_fields(cluster: ControlPlane, dyn, namespace: str, examples: list[Path]) -> None:
    _wait_openapi_published(cluster)
    doc = copy.deepcopy(_example_docs(examples)[0])
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["attention"]["tensorParalel"] = 4  # a typo must not be silently dropped
    result = cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert "tensorParalel" in result.stderr


def test_every_rendered_object_is_accepted(dyn, namespace: str, examples: list[Path]) -> None:
    created = 0
    for doc in _example_docs(examples):
        obj, problems = validate_object(doc)
        assert problems == []
        if obj.spec.scheduling.priority_class_name:
            ensure_priority_class(dyn, obj.spec.scheduling.priority_class_name)
        p = plan(obj.spec, obj.metadata.name, namespace)
        for o in render(obj.spec, p, owner_uid=str(uuid.uuid4())):
            assert dry_run_create(dyn, o, namespace)["metadata"]["name"] == o["metadata"]["name"]
            created += 1
    assert created >= 15
