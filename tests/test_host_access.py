"""Host access is the cluster admin's decision: the chart's hostAccess values (secure defaults)
decide which host paths, host networking, service accounts, service types, priority classes,
tolerations and Secrets AFDDeployments may use; the webhook and the operator refuse anything
else, naming the field and the chart value."""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from afd_operator.cli import main
from afd_operator.policy import ClusterPolicy, HostAccess, PolicyError, policy_from_values, under
from afd_operator.run import build_parser, config_from_args
from afd_operator.validation import validate_object
from k8s_helpers import EXAMPLES_HOST_ACCESS, Helm
from test_validation import base as ascend_base

CHART = "charts/afd-operator"


def cpu_base() -> dict[str, Any]:
    obj = ascend_base()
    obj["spec"]["platform"] = "cpu"
    return obj


def problems(obj: dict[str, Any], access: HostAccess = HostAccess()) -> list[str]:
    return [str(p) for p in validate_object(obj, ClusterPolicy(host_access=access))[1]]


def test_chart_defaults_are_the_operators_defaults(repo_root: Path) -> None:
    values = yaml.safe_load((repo_root / CHART / "values.yaml").read_text())
    assert policy_from_values(values) == ClusterPolicy()
    assert ClusterPolicy().host_access == HostAccess(host_path_prefixes=(), host_network=False, service_accounts=())


def test_the_chart_hands_its_values_to_the_operator(repo_root: Path, tmp_path: Path) -> None:
    helm = Helm(repo_root, "4", tmp_path / "helm-home")
    rendered = [d for d in yaml.safe_load_all(helm(
        "template", "afd-operator", str(repo_root / CHART), "--set", "hostAccess.hostPathPrefixes={/srv/models}",
        "--set", "hostAccess.serviceAccounts={reader}", "--set", "networkPolicy.enabled=false").stdout) if d]
    (config_map,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policy")]
    policy = policy_from_values(yaml.safe_load(config_map["data"]["values.yaml"]))
    assert policy.host_access.host_path_prefixes == ("/srv/models",)
    assert policy.host_access.service_accounts == ("reader",) and not policy.network.enabled
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert "--policy=/etc/afd-operator/policy/values.yaml" in pod["spec"]["containers"][0]["args"]
    assert {"name": "policy", "configMap": {"name": config_map["metadata"]["name"]}} in pod["spec"]["volumes"]
    # The operator reads the file at start: another policy is another pod template.
    other = helm("template", "afd-operator", str(repo_root / CHART)).stdout
    checksum = re.compile(r"afd.inference.dev/policy-checksum: (\w+)")
    assert checksum.search(other).group(1) != pod["metadata"]["annotations"]["afd.inference.dev/policy-checksum"]


@pytest.mark.parametrize("value, field", [
    ("hostAccess.hostPathPrefixes={relative/path}", "hostPathPrefixes"),
    ("hostAccess.serviceAccounts={Not_A_Name}", "serviceAccounts"),
    ("hostAccess.hostNetwork=maybe", "hostNetwork"),
    ("hostAccess.serviceTypes={ExternalName}", "serviceTypes"),
    ("hostAccess.secretNames={Bad_Name}", "secretNames"),
])
def test_chart_schema_refuses_bad_host_access_values(repo_root: Path, tmp_path: Path, value: str, field: str) -> None:
    helm = Helm(repo_root, "4", tmp_path / "helm-home")
    result = helm("template", "afd-operator", str(repo_root / CHART), "--set", value, check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_host_paths_only_under_the_allowed_prefixes_component_by_component() -> None:
    obj = cpu_base()
    obj["spec"]["model"]["volume"] = {"hostPath": "/database/models", "mountPath": "/models"}
    assert problems(obj, HostAccess(host_path_prefixes=("/data",))) == [
        "spec.model.volume.hostPath: host path '/database/models' is not allowed in this cluster (chart value "
        "hostAccess.hostPathPrefixes: /data)"]
    assert problems(obj, HostAccess(host_path_prefixes=("/database/",))) == []
    assert under("/data", "/data") and under("/data/x", "/data/") and under("/x", "/") and not under("/datax", "/data")
    obj["spec"]["model"]["volume"]["hostPath"] = "/data/../etc"
    assert problems(obj, HostAccess(host_path_prefixes=("/data",))) == [
        "spec.model.volume.hostPath: must not contain '..'"]


def test_pod_template_host_paths_and_service_accounts_are_checked_per_role() -> None:
    obj = cpu_base()
    obj["spec"]["attention"]["podTemplate"] = {
        "volumes": [{"name": "cache", "hostPath": {"path": "/var/cache/afd", "type": "Directory"}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache", "readOnly": True}],
        "serviceAccountName": "builder"}
    obj["spec"]["ffn"]["podTemplate"] = {"serviceAccountName": "default"}  # always allowed (no token is mounted)
    assert problems(obj) == [
        "spec.attention.podTemplate.volumes[0].hostPath.path: host path '/var/cache/afd' is not allowed in this "
        "cluster (chart value hostAccess.hostPathPrefixes: none)",
        "spec.attention.podTemplate.serviceAccountName: 'builder' is not allowed in this cluster (chart value "
        "hostAccess.serviceAccounts: none besides 'default')"]
    assert problems(obj, HostAccess(host_path_prefixes=("/var/cache",), service_accounts=("builder",))) == []


def test_service_type_priority_tolerations_and_secrets_need_the_admins_grant() -> None:
    obj = cpu_base()
    obj["spec"]["service"] = {"type": "LoadBalancer"}
    obj["spec"]["scheduling"] = {"priorityClassName": "system-node-critical"}
    obj["spec"]["attention"]["podTemplate"] = {
        "tolerations": [{"key": "gpu", "operator": "Exists"}, {"operator": "Exists"}],
        "volumes": [{"name": "creds", "secret": {"secretName": "default-token-x7k2p"}}],
        "volumeMounts": [{"name": "creds", "mountPath": "/creds", "readOnly": True}]}
    obj["spec"]["ffn"]["env"] = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}},
                                 {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "l"}}}]
    assert problems(obj) == [
        "spec.service.type: 'LoadBalancer' is not allowed in this cluster (chart value hostAccess.serviceTypes: "
        "ClusterIP)",
        "spec.scheduling.priorityClassName: 'system-node-critical' is not allowed in this cluster (chart value "
        "hostAccess.priorityClassNames: none)",
        "spec.attention.podTemplate.tolerations[0].key: tolerating 'gpu' is not allowed in this cluster (chart "
        "value hostAccess.tolerationKeys: none)",
        "spec.attention.podTemplate.tolerations[1].key: tolerating every taint (no key) is not allowed in this "
        "cluster (chart value hostAccess.tolerationKeys: none)",
        "spec.attention.podTemplate.volumes[0].secret.secretName: Secret 'default-token-x7k2p' is not allowed in "
        "this cluster (chart value hostAccess.secretNames: none)",
        "spec.ffn.env[0].valueFrom.secretKeyRef.name: Secret 'db' is not allowed in this cluster (chart value "
        "hostAccess.secretNames: none)"]
    granted = HostAccess(service_types=("ClusterIP", "LoadBalancer"), priority_class_names=("system-node-critical",),
                         toleration_keys=("gpu",), secret_names=("default-token-x7k2p", "db"))
    assert problems(obj, granted) == [
        "spec.attention.podTemplate.tolerations[1].key: tolerating every taint (no key) is not allowed in this "
        "cluster (chart value hostAccess.tolerationKeys: gpu)"]
    del obj["spec"]["attention"]["podTemplate"]["tolerations"][1]
    assert problems(obj, granted) == []


def test_the_chart_grants_reach_the_policy(repo_root: Path, tmp_path: Path) -> None:
    values = {"hostAccess": {"serviceTypes": ["ClusterIP", "NodePort"], "priorityClassNames": ["batch"],
                             "tolerationKeys": ["huawei.com/Ascend910"], "secretNames": ["hf"]}}
    access = policy_from_values(values).host_access
    assert (access.service_types, access.priority_class_names, access.toleration_keys, access.secret_names) == (
        ("ClusterIP", "NodePort"), ("batch",), ("huawei.com/Ascend910",), ("hf",))
    with pytest.raises(PolicyError, match=r"^hostAccess.serviceTypes.0: Input should be 'ClusterIP'"):
        policy_from_values({"hostAccess": {"serviceTypes": ["ExternalName"]}})
    with pytest.raises(PolicyError, match=r"^hostAccess.tolerationKeys.0: "):
        policy_from_values({"hostAccess": {"tolerationKeys": [""]}})


def test_host_network_and_ascend_driver_paths() -> None:
    obj = ascend_base()
    assert problems(obj) == ["spec.ascend.hostNetwork: host networking is not allowed in this cluster (chart value "
                             "hostAccess.hostNetwork: false); set it to false"]
    obj["spec"]["ascend"] = {"hostNetwork": False, "driverHostPaths": ["/usr/local/Ascend/driver", "/opt/tools"]}
    assert problems(obj) == ["spec.ascend.driverHostPaths[1]: host path '/opt/tools' is not allowed in this cluster "
                             "(chart value hostAccess.ascendHostPaths: /usr/local/Ascend/driver, /usr/local/dcmi, "
                             "/usr/local/bin/npu-smi, /etc/hccn.conf)"]
    obj["spec"]["ascend"]["driverHostPaths"] = ["/usr/local/Ascend/driver"]
    assert problems(obj, HostAccess(ascend_host_paths=("/usr/local/Ascend",))) == [
        "spec.ascend.mountHccnConf: host path '/etc/hccn.conf' is not allowed in this cluster (chart value "
        "hostAccess.ascendHostPaths: /usr/local/Ascend)"]
    # Root on Ascend is the admin's grant.
    obj["spec"]["ascend"] = {"hostNetwork": False, "runAsRoot": True}
    assert problems(obj) == ["spec.ascend.runAsRoot: root with DAC_OVERRIDE on a writable root filesystem is not "
                             "allowed in this cluster (chart value hostAccess.ascendRunAsRoot: false); set it to false"]
    assert problems(obj, HostAccess(ascend_run_as_root=True)) == []
    # The Ascend allowances mean nothing on the cpu platform, where nothing of the driver is mounted.
    cpu = cpu_base()
    cpu["spec"]["model"]["volume"] = {"hostPath": "/usr/local/Ascend/driver", "mountPath": "/models"}
    assert problems(cpu)[0].startswith("spec.model.volume.hostPath: host path '/usr/local/Ascend/driver' is not")


def test_the_examples_need_what_the_docs_grant(repo_root: Path, examples: list[Path]) -> None:
    install = (repo_root / "docs" / "install.md").read_text()
    (block,) = re.findall(r"```yaml\n(hostAccess:.*?)```", install, re.S)
    assert yaml.safe_load(block) == EXAMPLES_HOST_ACCESS
    granted = policy_from_values(EXAMPLES_HOST_ACCESS)
    for path in examples:
        doc = yaml.safe_load(path.read_text())
        assert validate_object(doc, granted)[1] == [], path.name
        assert validate_object(doc, ClusterPolicy())[1], f"{path.name} needs nothing the defaults refuse"


def test_afdctl_checks_host_access_against_a_values_file(tmp_path: Path, examples: list[Path]) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"hostAccess": {"hostPathPrefixes": ["/srv"]}, "replicaCount": 3}))
    cpu_tiny = str(next(p for p in examples if p.name == "cpu-tiny.yaml"))
    out, err = io.StringIO(), io.StringIO()
    assert main(["validate", "-f", cpu_tiny, "--policy", str(values)], out=out, err=err) == 0
    values.write_text(yaml.safe_dump({"hostAccess": {"hostPathPrefixes": ["/data"]}}))
    assert main(["validate", "-f", cpu_tiny, "--policy", str(values)], out=out, err=err) == 1
    assert "chart value hostAccess.hostPathPrefixes: /data" in err.getvalue()
    values.write_text(yaml.safe_dump({"hostAccess": {"hostNetwork": "yes"}}))
    err = io.StringIO()
    assert main(["validate", "-f", cpu_tiny, "--policy", str(values)], out=out, err=err) == 2
    assert "hostAccess.hostNetwork: Input should be a valid boolean" in err.getvalue()


@pytest.mark.parametrize("content, line", [
    (b"hostAccess:\n  hostNetwork: false\n  hostNetwork: true\n",
     "hostAccess.hostNetwork: duplicate key (lines 2 and 3); each key may be given once"),
    (b"\x00" * 16, "<yaml>: unacceptable character #x0000: special characters are not allowed in \"<unicode string>\", "
                    "position 0"),
    (b"a: 1\n---\nb: 2\n", "holds 2 YAML documents; chart values are one"),
])
def test_a_policy_file_is_read_as_strictly_as_a_spec_with_one_line(tmp_path: Path, examples: list[Path],
                                                                   content: bytes, line: str) -> None:
    values = tmp_path / "values.yaml"
    values.write_bytes(content)
    cpu_tiny = str(next(p for p in examples if p.name == "cpu-tiny.yaml"))
    out, err = io.StringIO(), io.StringIO()
    assert main(["validate", "-f", cpu_tiny, "--policy", str(values)], out=out, err=err) == 2
    assert err.getvalue() == f"afdctl: --policy {values}: {line}\n"


def test_a_policy_path_that_never_ends_is_refused_by_size(examples: list[Path]) -> None:
    cpu_tiny = str(next(p for p in examples if p.name == "cpu-tiny.yaml"))
    out, err = io.StringIO(), io.StringIO()
    assert main(["validate", "-f", cpu_tiny, "--policy", "/dev/zero"], out=out, err=err) == 2
    assert err.getvalue() == ("afdctl: --policy /dev/zero: <file>: larger than 3145728 bytes (the API server's "
                              "request limit)\n")


def test_the_operator_refuses_to_start_on_a_bad_policy(tmp_path: Path) -> None:
    bad = tmp_path / "values.yaml"
    bad.write_text(json.dumps({"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"a b": "x"}}}]}}))
    with pytest.raises(SystemExit, match="networkPolicy.metricsFrom.0.podSelector.matchLabels.a b"):
        config_from_args(build_parser().parse_args(["--policy", str(bad)]))
    with pytest.raises(PolicyError, match="hostAccess.hostPathPrefixes.0: must be an absolute path"):
        policy_from_values({"hostAccess": {"hostPathPrefixes": ["models"]}})
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(copy.deepcopy(EXAMPLES_HOST_ACCESS)))
    assert config_from_args(build_parser().parse_args(["--policy", str(good)])).policy == policy_from_values(
        EXAMPLES_HOST_ACCESS)
