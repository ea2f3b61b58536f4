"""Bad AFDDeployment input: every problem reported at once, each naming field path and rule."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest

from afd_operator.validation import validate_object, validate_spec
from afd_shared_experts.config import AFDConfigError, parse_afd_config
from k8s_helpers import DELETE, set_path


def base() -> dict[str, Any]:
    return {
        "apiVersion": "afd.inference.dev/v1alpha1",
        "kind": "AFDDeployment",
        "metadata": {"name": "ds", "namespace": "ns"},
        "spec": {
            "replicas": 2,
            "image": "runtime:v1",
            "model": {"name": "m", "path": "/models/m", "routedExperts": 64},
            "attention": {"dataParallel": 2, "tensorParallel": 2, "devicesPerPod": 4},
            "ffn": {"ranks": 4, "devicesPerPod": 4},
        },
    }


def with_change(path: str, value: Any) -> dict[str, Any]:
    """base() with one dotted path set (a value of DELETE removes the key)."""
    return set_path(copy.deepcopy(base()), path, value)

# (change path, value, expected problem path, fragment of the rule in the message)
MALFORMED = [
    ("spec.replicas", -1, "spec.replicas", "greater than or equal to 0"),
    ("spec.replicas", "two", "spec.replicas", "integer"),
    ("spec.image", DELETE, "spec.image", "required"),
    ("spec.image", "", "spec.image", "at least 1 character"),
    ("spec.image", "runtime:v1\nruntime:v2", "spec.image", "must be one image reference, without whitespace or control"),
    ("spec.image", " runtime:v1", "spec.image", "must be one image reference"),
    ("spec.imagePullPolicy", "Sometimes", "spec.imagePullPolicy", "'Always', 'IfNotPresent' or 'Never'"),
    ("spec.platform", "gpu", "spec.platform", "'ascend' or 'cpu'"),
    ("spec.model.path", DELETE, "spec.model.path", "required"),
    ("spec.model.routedExperts", 0, "spec.model.routedExperts", "greater than or equal to 1"),
    ("spec.model.dtype", "fp8", "spec.model.dtype", "bfloat16"),
    ("spec.model.volume", {"claimName": "pvc", "hostPath": "/x"}, "spec.model.volume", "exactly one of claimName or hostPath"),
    ("spec.model.volume", {"hostPath": "/data", "mountPath": "/data"}, "spec.model.path", "inside model.volume.mountPath"),
    ("spec.model.maxNumBatchedTokens", 0, "spec.model.maxNumBatchedTokens", "greater than or equal to 1"),
    ("spec.model.colour", "red", "spec.model.colour", "unknown field"),
    ("spec.sharedExperts.placement", "both", "spec.sharedExperts.placement", "'ffn' or 'attention'"),
    ("spec.sharedExperts.partition", "random", "spec.sharedExperts.partition", "'affinity' or 'contiguous'"),
    ("spec.connector.port", 0, "spec.connector.port", "greater than or equal to 1"),
    ("spec.connector.port", 70000, "spec.connector.port", "less than or equal to 65535"),
    ("spec.connector.port", 8000, "spec.connector.port", "collides with spec.service.port"),
    ("spec.async.stages", 0, "spec.async.stages", "greater than or equal to 1"),
    ("spec.async.stages", 9, "spec.async.stages", "less than or equal to 8"),
    ("spec.async.stages", 2, "spec.async.stages", "must be 1 here: micro-batch stages run on vLLM's CPU model runner "
     "only in this version (platform ascend: untested) (got 2)"),
    ("spec.async.steps", 2, "spec.async.steps", "unknown field"),
    ("spec.attention.dataParallel", 0, "spec.attention.dataParallel", "greater than or equal to 1"),
    ("spec.attention.tensorParallel", 3, "spec.attention.tensorParallel", "must divide attention.devicesPerPod"),
    ("spec.attention.devicesPerPod", 3, "spec.attention.devicesPerPod", "multiple of devicesPerPod (3) or fit in one pod"),
    ("spec.attention.engineArgs", ["--tensor-parallel-size=8"], "spec.attention.engineArgs[0]", "set by the operator"),
    ("spec.attention.engineArgs", ["--enforce-eager", "--shutdown-timeout", "0"], "spec.attention.engineArgs[1]",
     "'--shutdown-timeout' is set by the operator from termination.gracePeriodSeconds"),
    # Every spelling vLLM's parser reads as an operator-owned flag: `_` for `-`, a prefix, a dotted
    # key of a JSON flag, a config file.
    ("spec.attention.engineArgs", ["--tensor_parallel_size=8"], "spec.attention.engineArgs[0]",
     "'--tensor-parallel-size' is set by the operator from attention.tensorParallel ('--tensor_parallel_size' is read "
     "by vLLM as '--tensor-parallel-size')"),
    ("spec.attention.engineArgs", ["--enforce-eager", "--data_parallel_address", "10.0.0.1"],
     "spec.attention.engineArgs[1]", "'--data-parallel-address' is set by the operator from connector"),
    ("spec.attention.engineArgs", ["--additional-config.afd.host=10.0.0.1"], "spec.attention.engineArgs[0]",
     "'--additional-config' is set by the operator from connector and sharedExperts ('--additional-config.afd.host' "
     "is read by vLLM as '--additional-config')"),
    ("spec.attention.engineArgs", ["--config", "x.yaml"], "spec.attention.engineArgs[0]",
     "'--config' is refused: a config file could set the operator's flags; give its flags in engineArgs"),
    ("spec.attention.engineArgs", ["--tensor-parallel", "8"], "spec.attention.engineArgs[0]",
     "('--tensor-parallel' is read by vLLM as '--tensor-parallel-size')"),
    ("spec.attention.engineArgs", ["-dpa", "10.9.9.9"], "spec.attention.engineArgs[0]",
     "'--data-parallel-address' is set by the operator from connector ('-dpa' is read by vLLM as "
     "'--data-parallel-address')"),
    ("spec.attention.engineArgs", ["-qfp8"], "spec.attention.engineArgs[0]",
     "'--quantization' is set by the operator from model.quantization ('-qfp8' is read by vLLM as '--quantization')"),
    ("spec.attention.engineArgs", ["-t", "4"], "spec.attention.engineArgs[0]",
     "('-t' is read by vLLM as '--tensor-parallel-size')"),
    ("spec.attention.engineArgs", ["-r=1"], "spec.attention.engineArgs[0]", "'--node-rank' is set by the operator"),
    ("spec.attention.engineArgs", ["--pipeline-parallel", "2"], "spec.attention.engineArgs",
     "pipeline parallel is not supported (--pipeline-parallel-size 2)"),
    ("spec.attention.engineArgs", ["--pipeline-parallel-size", "1", "-pp", "2"], "spec.attention.engineArgs",
     "pipeline parallel is not supported (--pipeline-parallel-size 2)"),
    ("spec.attention.engineArgs", ["--max_model_len=4096"], "spec.attention.engineArgs[0]",
     "'--max-model-len' is set by the operator from model.maxModelLen"),
    ("spec.attention.engineArgs", ["--pipeline-parallel-size", "2"], "spec.attention.engineArgs",
     "pipeline parallel is not supported (--pipeline-parallel-size 2): the AFD world's Attention ranks are data x "
     "tensor parallel, with no pipeline axis"),
    ("spec.attention.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "spec.attention.env[1].name", "duplicate"),
    ("spec.attention.env", [{"name": "1BAD", "value": "1"}], "spec.attention.env[0].name", "not start with a digit"),
    ("spec.attention.env", [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
     "spec.attention.env[0]", "either value or valueFrom"),
    ("spec.attention.env", [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
     "spec.attention.env[0].valueFrom.fieldRef.fieldPath", "must be one of metadata.name"),
    ("spec.attention.podTemplate.nodeSelector", {"a": 1}, "spec.attention.podTemplate.nodeSelector.a", "valid string"),
    ("spec.attention.podTemplate.hostPID", True, "spec.attention.podTemplate.hostPID", "unknown field"),
    ("spec.ffn.ranks", 3, "spec.ffn.ranks", "must divide model.routedExperts (64)"),
    ("spec.ffn.devicesPerPod", 3, "spec.ffn.devicesPerPod", "multiple of devicesPerPod (3)"),
    ("spec.ffn.healthPort", 13345, "spec.ffn.healthPort", "collides with spec.attention.dataParallelRpcPort"),
    ("spec.ascend.resourceName", "Ascend910", "spec.ascend.resourceName", "extended resource name"),
    ("spec.ascend.shmSize", "lots", "spec.ascend.shmSize", "Kubernetes quantity"),
    ("spec.ascend.shmSize", "0", "spec.ascend.shmSize", "must be positive"),
    ("spec.attention.podTemplate.resources", {"limits": {"cpu": "two"}}, "spec.attention.podTemplate.resources.limits.cpu",
     "'two' is not a Kubernetes quantity"),
    ("spec.attention.podTemplate.resources", {"limits": "4"}, "spec.attention.podTemplate.resources.limits",
     "valid dictionary"),
    ("spec.ffn.podTemplate.resources", {"requests": {"memory": "-1Gi"}}, "spec.ffn.podTemplate.resources.requests.memory",
     "must be at least 0"),
    ("spec.ffn.podTemplate.resources", {"requests": {"cpu": "2"}, "limits": {"cpu": "500m"}},
     "spec.ffn.podTemplate.resources.requests.cpu", "must be <= limits.cpu (500m), got 2"),
    ("spec.ascend.driverHostPaths", ["usr/local/dcmi"], "spec.ascend.driverHostPaths[0]", "absolute path"),
    ("spec.ascend.hcclBufferSizeMB", {"attention": 0}, "spec.ascend.hcclBufferSizeMB.attention", "greater than or equal to 1"),
    ("spec.ascend.hostPortStride", 1, "spec.metrics.port", "collides with spec.ffn.healthPort of instance 0 (instance 1)"),
    ("spec.service.port", 65530, "spec.service.port", "above 65535"),
    ("spec.scheduling.gang.provider", "kueue", "spec.scheduling.gang.provider", "'none' or 'volcano'"),
    ("spec.scheduling.gang.queue", "q", "spec.scheduling.gang.queue", "only used with gang.provider 'volcano'"),
    ("spec.startup.order", "AttentionFirst", "spec.startup.order", "'FFNFirst' or 'Parallel'"),
    ("spec.startup.timeoutSeconds", 0, "spec.startup.timeoutSeconds", "greater than or equal to 1"),
    ("spec.recovery.policy", "Restart", "spec.recovery.policy", "'RecreateInstance' or 'None'"),
    ("spec.recovery.maxBackoffSeconds", 1, "spec.recovery.maxBackoffSeconds", "must be >= recovery.backoffSeconds"),
    ("spec.updateStrategy.maxSurge", "150", "spec.updateStrategy.maxSurge", "percentage like '25%'"),
    ("spec.updateStrategy.maxUnavailable", -1, "spec.updateStrategy.maxUnavailable", "must be in [0, 512]"),
    ("spec.updateStrategy", {"maxSurge": 0, "maxUnavailable": "0%"}, "spec.updateStrategy.maxUnavailable", "must not both be 0"),
    ("spec.updateStrategy.type", "BlueGreen", "spec.updateStrategy.type", "'RollingUpdate' or 'Recreate'"),
    ("spec.termination.gracePeriodSeconds", -5, "spec.termination.gracePeriodSeconds", "greater than or equal to 0"),
    ("spec.service.type", "ExternalName", "spec.service.type", "'ClusterIP', 'NodePort' or 'LoadBalancer'"),
    ("spec.imagePullSecrets", ["Not_A_Name"], "spec.imagePullSecrets[0]", "must be a DNS subdomain"),
    ("spec.clusterDomain", "cluster local", "spec.clusterDomain", "must be a DNS subdomain"),
    ("spec.metrics.podMonitor", "yes please", "spec.metrics.podMonitor", "valid boolean"),
    ("metadata.name", "DS", "metadata.name", "DNS-1035 label"),
    ("metadata.name", "a" * 45, "metadata.name", "at most 40 characters"),
    ("kind", "Deployment", "kind", "'AFDDeployment'"),
    ("spec.topology", "DP2", "spec.topology", "unknown field"),
]


def test_base_is_valid() -> None:
    obj, problems = validate_object(base())
    assert problems == []
    assert obj is not None and obj.spec.replicas == 2


def test_enough_malformed_cases() -> None:
    assert len(MALFORMED) >= 30


@pytest.mark.parametrize("change,value,path,rule", MALFORMED, ids=[f"{c[0]}={c[1]!r}"[:60] for c in MALFORMED])
def test_malformed_spec_names_field_and_rule(change: str, value: Any, path: str, rule: str) -> None:
    obj, problems = validate_object(with_change(change, value))
    assert obj is None
    matching = [p for p in problems if p.path == path]
    assert matching, f"no problem at {path}; got {[str(p) for p in problems]}"
    assert any(rule in p.message for p in matching), [str(p) for p in matching]


@pytest.mark.parametrize("change, value, rule", [
    ("spec.attention.engineArgs", ["--enable-dbo"], "must be 1 here: vLLM's own micro-batching"),
    ("spec.attention.engineArgs", ["--enable_db"], "must be 1 here: vLLM's own micro-batching"),  # a prefix
    ("spec.attention.engineArgs", ["-sc", "{}"], "must be 1 here: speculative decoding"),
    ("spec.attention.engineArgs", ["--ubatch", "2"], "must be 1 here: vLLM's own micro-batching"),
    ("spec.attention.engineArgs", ["--worker-cls=my.Worker"], "must be 1 here: micro-batch stages need the plugin's worker"),
    ("spec.model.maxNumBatchedTokens", 2, "must be <= model.maxNumBatchedTokens (2): a step cannot hold more requests "
                                          "than tokens (got 3)"),
])
def test_stages_refused_where_they_cannot_run_on_cpu(change: str, value: Any, rule: str) -> None:
    obj = with_change("spec.platform", "cpu")
    obj["spec"]["async"] = {"stages": 3}
    obj = set_path(obj, change, value)
    assert validate_object(obj)[0] is None
    problems = [str(p) for p in validate_object(obj)[1]]
    assert any(p.startswith("spec.async.stages: " + rule) for p in problems), problems
    obj["spec"]["async"] = {}  # the default runs one stage
    assert validate_object(obj)[1] == []


def test_a_bad_cpu_quantity_on_the_cpu_platform_is_a_problem_not_a_crash() -> None:
    # The planner reads the CPU there (OpenMP threads per rank): validation reports the field first.
    obj = set_path(with_change("spec.platform", "cpu"), "spec.ffn.podTemplate.resources", {"limits": {"cpu": "1.5.0"}})
    _, problems = validate_object(obj)
    assert [str(p) for p in problems] == [
        "spec.ffn.podTemplate.resources.limits.cpu: '1.5.0' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"]


def test_all_problems_reported_at_once() -> None:
    obj = base()
    obj["spec"]["replicas"] = -1
    obj["spec"]["platform"] = "gpu"
    obj["spec"]["unknownThing"] = 1
    obj["spec"]["attention"]["dataParallel"] = 0
    _, problems = validate_object(obj)
    paths = {p.path for p in problems}
    assert {"spec.replicas", "spec.platform", "spec.unknownThing", "spec.attention.dataParallel"} <= paths


def test_head_only_engine_flags_only_when_all_attention_ranks_share_one_pod() -> None:
    # base(): DP 2 x TP 2 in one pod of 4 devices: no headless pod, vLLM takes the flag.
    obj, problems = validate_object(with_change("spec.attention.engineArgs", ["--api-server-count", "2"]))
    assert obj is not None and not problems
    spread = with_change("spec.attention.engineArgs", ["--enforce-eager", "--api-server-count=1"])
    spread["spec"]["attention"]["devicesPerPod"] = 2
    obj, problems = validate_object(spread)
    assert obj is None
    assert [str(p) for p in problems] == [
        "spec.attention.engineArgs[1]: '--api-server-count' is refused by vLLM on headless Attention pods (these "
        "ranks span 2 pods and engineArgs go to every one); allowed only when all Attention ranks fit in one pod"]


def test_engine_flags_the_operator_does_not_own_pass_in_any_spelling() -> None:
    args = ["--enforce-eager", "--max_num_seqs=8", "--model-impl", "vllm", "--compilation-config.level=0",
            "--gpu-memory-utilization", "0.9", "--seed", "-1", "--api_server_count=1", "-O3", "-cc", "{}",
            "--load-format", "auto"]
    obj, problems = validate_object(with_change("spec.attention.engineArgs", args))
    assert obj is not None and problems == []


def test_cross_field_problems_reported_together() -> None:
    obj = base()
    obj["spec"]["ffn"]["ranks"] = 3
    obj["spec"]["attention"]["tensorParallel"] = 3
    obj["spec"]["recovery"] = {"backoffSeconds": 10, "maxBackoffSeconds": 5}
    _, problems = validate_object(obj)
    paths = {p.path for p in problems}
    assert {"spec.ffn.ranks", "spec.attention.tensorParallel", "spec.recovery.maxBackoffSeconds"} <= paths


def test_percentages_resolve_against_replicas() -> None:
    obj = base()
    obj["spec"]["replicas"] = 4
    obj["spec"]["updateStrategy"] = {"maxSurge": "25%", "maxUnavailable": "10%"}
    _, problems = validate_object(obj)
    assert problems == []  # surge rounds up to 1 instance


def test_host_port_ranges_checked_for_every_instance() -> None:
    obj = base()
    obj["spec"]["replicas"] = 5
    obj["spec"]["service"] = {"port": 1239 + 3 * 16}  # instance 3's connector port
    _, problems = validate_object(obj)
    assert [str(p) for p in problems] == [
        "spec.connector.port: port 1287 collides with spec.service.port of instance 0 (instance 3); "
        "ports must be distinct"
    ]
    obj["spec"]["platform"] = "cpu"  # pod networking: no per-instance shift, no collision
    assert validate_object(obj)[1] == []


def test_cpu_platform_ignores_host_ports() -> None:
    obj = with_change("spec.platform", "cpu")
    obj["spec"]["ascend"] = {"hostPortStride": 1}
    assert validate_object(obj)[1] == []


# What the plugin's own parser refuses in a pod's afd block, refused up front:
# (change path, value, expected problem path, the plugin's field path, its rule).
PLUGIN_REFUSALS = [
    ("spec.connector.extraConfig", {"foo": 1}, "spec.connector.extraConfig.foo",
     "afd.connector_extra_config.foo", "unknown key; allowed: attn_ranks_per_dp, dynamicQuant, data_plane"),
    ("spec.connector.name", "camconnector", "spec.connector.name", "afd.connector", "unknown connector"),
    ("spec.connector.extraConfig", {"dynamicQuant": "yes"}, "spec.connector.extraConfig.dynamicQuant",
     "afd.connector_extra_config.dynamicQuant", "must be an integer"),
    ("spec.connector.extraConfig", {"dynamicQuant": 2}, "spec.connector.extraConfig.dynamicQuant",
     "afd.connector_extra_config.dynamicQuant", "must be in [0, 1]"),
    ("spec.connector.extraConfig", {"attn_ranks_per_dp": 3}, "spec.connector.extraConfig.attn_ranks_per_dp",
     "afd.connector_extra_config.attn_ranks_per_dp", "must divide afd.num_attention_ranks (4 = DP x TP)"),
    ("spec.connector.extraConfig", {"dynamicQuant": 1}, "spec.connector.extraConfig.dynamicQuant",
     "afd.connector_extra_config.dynamicQuant", "not supported with shared_experts.placement 'ffn'"),
]


@pytest.mark.parametrize("change,value,path,plugin_path,rule", PLUGIN_REFUSALS,
                         ids=[f"{c[0]}={c[1]!r}"[:60] for c in PLUGIN_REFUSALS])
def test_what_the_plugin_refuses_is_refused_with_its_message(change: str, value: Any, path: str, plugin_path: str,
                                                             rule: str) -> None:
    obj = with_change(change, value)
    for spec, problems in (validate_object(obj), validate_spec(obj["spec"], obj["metadata"]["name"])):
        assert spec is None
        (problem,) = problems
        assert problem.path == path
        assert problem.message.startswith(f"the plugin refuses it: {plugin_path}: ") and rule in problem.message


def test_the_message_is_the_plugins_own() -> None:
    obj = with_change("spec.connector.extraConfig", {"foo": 1})
    (problem,) = validate_object(obj)[1]
    with pytest.raises(AFDConfigError) as plugin:
        parse_afd_config({"afd": {"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 4,
                                  "connector_extra_config": {"foo": 1}}})
    assert problem.message == f"the plugin refuses it: {plugin.value}"


@pytest.mark.parametrize("change,value", [
    ("spec.connector.name", "P2PConnector"),  # an alias the plugin accepts
    ("spec.connector.extraConfig", {"dynamicQuant": "0", "attn_ranks_per_dp": 4}),
    ("spec.sharedExperts", {"placement": "attention"}),
])
def test_what_the_plugin_accepts_is_accepted(change: str, value: Any) -> None:
    assert validate_object(with_change(change, value))[1] == []


def test_quantized_dispatch_is_accepted_with_shared_experts_on_attention() -> None:
    obj = with_change("spec.connector.extraConfig", {"dynamicQuant": 1})
    obj["spec"]["sharedExperts"] = {"placement": "attention"}
    assert validate_object(obj)[1] == []


def test_a_port_refused_by_both_the_operator_and_the_plugin_is_reported_once() -> None:
    obj = with_change("spec.connector.port", 65530)  # instance 1 would use 65546
    assert [p.path for p in validate_object(obj)[1]] == ["spec.connector.port"]
    assert "above 65535" in validate_object(obj)[1][0].message


def test_the_operator_imports_the_plugins_parser_without_torch() -> None:
    """The operator image has no torch: the plugin's config module must stay importable alone."""
    check = ("import sys, afd_operator.validation, afd_operator.render; "
             "assert 'afd_shared_experts.config' in sys.modules; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'safetensors')))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_cluster_domain_too_long_for_the_pods_dns_names_is_refused() -> None:
    """Each subdomain label of a long clusterDomain is valid, and so is the whole domain; the
    pods' names under it are not (253 characters at most), and ranks dial each other by them."""
    obj = base()
    obj["spec"]["clusterDomain"] = ".".join(["a" * 60] * 4)  # 243 characters
    _, problems = validate_object(obj)
    (problem,) = [str(p) for p in problems]
    assert problem.startswith("spec.clusterDomain: makes pod DNS names such as '"), problem
    assert problem.endswith(" characters long (a DNS name holds at most 253)"), problem
    length = int(problem.rsplit("...' ", 1)[1].split()[0])
    assert length > 253
    obj["spec"]["clusterDomain"] = "cluster.local"
    assert validate_object(obj)[1] == []


def test_a_spec_too_large_for_the_operators_bookkeeping_is_refused() -> None:
    """Ten env values of 30 KB each pass every per-field bound; their sum would not fit the
    annotation kopf keeps the spec in (the API server's 256 KiB for all annotations)."""
    obj = base()
    obj["spec"]["ffn"]["env"] = [{"name": f"BLOB_{i}", "value": "x" * 30_000} for i in range(10)]
    _, problems = validate_object(obj)
    (problem,) = [str(p) for p in problems]
    assert problem.startswith("spec: is 30") and "at most 196608: the operator keeps a copy in the annotation " \
        "afd.inference.dev/last-handled-configuration" in problem, problem
    obj["spec"]["ffn"]["env"] = obj["spec"]["ffn"]["env"][:5]
    assert validate_object(obj)[1] == []
