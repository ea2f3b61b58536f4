"""Validation of AFDDeployment objects: every problem at once, each with its field path.

Schema rules come from the pydantic models; cross-field rules (which a Kubernetes 1.20
CRD cannot express without CEL) live here; last, the plugin's own parser judges the `afd`
block of every pod the spec plans, so what the pods would refuse is refused here, with the
plugin's message under the spec field it came from. All three are shared by `afdctl
validate`, the admission webhook and the operator's ConfigValid condition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Optional, Union

from afd_shared_experts.config import AFDConfigError
from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from . import naming
from .api import AFDDeployment, AFDDeploymentSpec, EnvVar
from .planner import (attention_layout, ffn_layout, instance_ports, role_configs, rollout_budget, spec_stage_limit,
                      uses_host_network)
from .revision import REVISION_LENGTH, revision_of

PORT_MAX = 65535
MAX_INDEX_DIGITS = 4  # names are checked for instance indices up to 9999
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

# Engine flags the operator derives from the spec; setting them by hand would break a world.
OPERATOR_OWNED_FLAGS = {
    "--tensor-parallel-size": "attention.tensorParallel",
    "-tp": "attention.tensorParallel",
    "--data-parallel-size": "attention.dataParallel",
    "-dp": "attention.dataParallel",
    "--data-parallel-size-local": "attention.dataParallel",
    "--data-parallel-start-rank": "attention.dataParallel",
    "--data-parallel-address": "connector",
    "--data-parallel-rpc-port": "attention.dataParallelRpcPort",
    "--headless": "the pod layout",
    "--port": "service.port",
    "--host": "the pod layout",
    "--served-model-name": "model.name",
    "--model": "model.path",
    "--additional-config": "connector and sharedExperts",
    "--max-num-batched-tokens": "model.maxNumBatchedTokens",
    "--max-model-len": "model.maxModelLen",
    "--dtype": "model.dtype",
    "--quantization": "model.quantization",
    "--shutdown-timeout": "termination.gracePeriodSeconds",
}
# vLLM refuses these on headless pods (it starts no API server there) and exits at start.
HEAD_ONLY_FLAGS = ("--api-server-count", "-asc")


@dataclass(frozen=True, order=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _loc_to_path(prefix: str, loc: tuple[Union[str, int], ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith("function-") or part in {"int", "str"}:
            continue  # union branch / validator markers, not fields
        else:
            path += ("." if path else "") + part
    return path


def _pydantic_problems(err: ValidationError, prefix: str) -> list[Problem]:
    problems = []
    for e in err.errors():
        path = _loc_to_path(prefix, e["loc"])
        if e["type"] == "extra_forbidden":
            msg = "unknown field (not part of the AFDDeployment API)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
        problems.append(Problem(path, msg))
    # A union (int | percent) reports once per branch: keep one message per path and text.
    return sorted(set(problems), key=problems.index)


def _check_env(path: str, env: list[EnvVar]) -> list[Problem]:
    seen: dict[str, int] = {}
    problems = []
    for i, var in enumerate(env):
        if var.name in seen:
            problems.append(Problem(f"{path}[{i}].name", f"duplicate of {path}[{seen[var.name]}].name '{var.name}'"))
        seen.setdefault(var.name, i)
    return problems


def _check_resources(path: str, resources: Optional[dict[str, Any]]) -> list[Problem]:
    """requests and limits as the API server checks a container's: quantities, not negative, no
    request above its limit. Refused here, not by the API server while it creates an instance's
    pods one by one (and by the planner, which reads the CPU)."""
    problems = []
    # kind -> resource -> (the quantity as written, its value)
    amounts: dict[str, dict[str, tuple[Union[str, int, float], Decimal]]] = {}
    for kind in ("requests", "limits"):
        given = (resources or {}).get(kind)
        if given is None:
            continue
        if not isinstance(given, dict):
            problems.append(Problem(f"{path}.{kind}", "must be a map of resource name to quantity"))
            continue
        for resource, value in given.items():
            field = f"{path}.{kind}.{resource}"
            try:
                amount = parse_quantity(value)
            except ValueError:
                problems.append(Problem(field, f"'{value}' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"))
                continue
            if amount < 0:
                problems.append(Problem(field, f"must not be negative (got {value})"))
            amounts.setdefault(kind, {})[resource] = (value, amount)
    for resource, (value, amount) in amounts.get("requests", {}).items():
        limit = amounts.get("limits", {}).get(resource)
        if limit is not None and amount > limit[1]:
            problems.append(Problem(f"{path}.requests.{resource}", f"must be <= limits.{resource} ({limit[0]}), "
                                                                     f"got {value}"))
    return problems


def _check_engine_args(spec: AFDDeploymentSpec) -> list[Problem]:
    problems = []
    attention_pods = attention_layout(spec).pods
    for i, arg in enumerate(spec.attention.engine_args):
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_OWNED_FLAGS:
            problems.append(Problem(
                f"spec.attention.engineArgs[{i}]",
                f"'{flag}' is set by the operator from {OPERATOR_OWNED_FLAGS[flag]}",
            ))
        elif flag in HEAD_ONLY_FLAGS and attention_pods > 1:
            problems.append(Problem(
                f"spec.attention.engineArgs[{i}]",
                f"'{flag}' is refused by vLLM on headless Attention pods (these ranks span {attention_pods} "
                "pods and engineArgs go to every one); allowed only when all Attention ranks fit in one pod",
            ))
    return problems


def _check_stages(spec: AFDDeploymentSpec) -> list[Problem]:
    stages = spec.async_.stages
    if stages is None:
        return []
    limit, why = spec_stage_limit(spec)
    if stages > limit:
        return [Problem("spec.async.stages", f"must be 1 here: {why} (got {stages})")]
    if stages > spec.model.max_num_batched_tokens:
        return [Problem("spec.async.stages", f"must be <= model.maxNumBatchedTokens ({spec.model.max_num_batched_tokens}"
                                             f"): a step cannot hold more requests than tokens (got {stages})")]
    return []


def _check_layout(spec: AFDDeploymentSpec) -> list[Problem]:
    problems = []
    att = spec.attention
    att_ranks = att.data_parallel * att.tensor_parallel
    if att_ranks > att.devices_per_pod:
        if att.devices_per_pod % att.tensor_parallel:
            problems.append(Problem(
                "spec.attention.tensorParallel",
                f"must divide attention.devicesPerPod ({att.devices_per_pod}); got {att.tensor_parallel}",
            ))
        if att_ranks % att.devices_per_pod:
            problems.append(Problem(
                "spec.attention.devicesPerPod",
                f"attention.dataParallel * tensorParallel ({att_ranks}) must be a multiple of "
                f"devicesPerPod ({att.devices_per_pod}) or fit in one pod",
            ))
    ffn = spec.ffn
    if ffn.ranks > ffn.devices_per_pod and ffn.ranks % ffn.devices_per_pod:
        problems.append(Problem(
            "spec.ffn.devicesPerPod",
            f"ffn.ranks ({ffn.ranks}) must be a multiple of devicesPerPod ({ffn.devices_per_pod}) or fit in one pod",
        ))
    experts = spec.model.routed_experts
    if experts is not None and experts % ffn.ranks:
        problems.append(Problem(
            "spec.ffn.ranks",
            f"must divide model.routedExperts ({experts}) so every FFN rank holds the same number of experts; "
            f"got {ffn.ranks}",
        ))
    return problems


_PORT_FIELDS = {
    "api": "spec.service.port",
    "dp_rpc": "spec.attention.dataParallelRpcPort",
    "connector": "spec.connector.port",
    "ffn_metrics": "spec.metrics.port",
    "ffn_health": "spec.ffn.healthPort",
}


def _check_ports(spec: AFDDeploymentSpec, max_index: int) -> list[Problem]:
    """Every port a pod opens is distinct; with host networking, instances that may share a
    node must not collide either, and shifted ports stay <= 65535."""
    host_net = uses_host_network(spec)
    problems: list[Problem] = []
    reported: set[str] = set()
    owner: dict[int, tuple[str, int]] = {}
    for index in range(max_index + 1 if host_net else 1):
        ports = instance_ports(spec, index)
        used = {"api": ports.api, "dp_rpc": ports.dp_rpc, "connector": ports.connector,
                "ffn_metrics": ports.ffn_metrics, "ffn_health": ports.ffn_health}
        for kind, port in used.items():
            path = _PORT_FIELDS[kind]
            if path in reported:
                continue
            if port > PORT_MAX:
                problems.append(Problem(
                    path, f"instance {index} would use host port {port}, above {PORT_MAX}; "
                    "lower the port or ascend.hostPortStride",
                ))
                reported.add(path)
            elif port in owner:
                other, other_index = owner[port]
                where = f" of instance {other_index} (instance {index})" if host_net else ""
                problems.append(Problem(path, f"port {port} collides with {other}{where}; ports must be distinct"))
                reported.add(path)
            else:
                owner[port] = (path, index)
    return problems


def _check_names(name: str, spec: AFDDeploymentSpec) -> list[Problem]:
    if not naming.is_dns_1035_label(name):
        return [Problem(
            "metadata.name",
            "must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter)",
        )]
    longest_ordinal = max(attention_layout(spec).pods, ffn_layout(spec).pods) - 1
    longest = naming.pod_name(name, "x" * REVISION_LENGTH, 10 ** MAX_INDEX_DIGITS - 1, "attention", longest_ordinal)
    if len(longest) > naming.DNS_LABEL_MAX:
        allowed = len(name) - (len(longest) - naming.DNS_LABEL_MAX)
        return [Problem(
            "metadata.name",
            f"must be at most {allowed} characters: pod names such as '{longest}' are DNS labels "
            f"(at most {naming.DNS_LABEL_MAX} characters)",
        )]
    return []


# Where each piece of the afd block comes from in the spec (block path -> spec path; a
# deeper block path keeps its tail, e.g. afd.connector_extra_config.foo ->
# spec.connector.extraConfig.foo). Pieces the operator derives itself are checked above.
_PLUGIN_FIELDS = {
    "afd.connector": "spec.connector.name",
    "afd.connector_extra_config": "spec.connector.extraConfig",
    "afd.port": "spec.connector.port",
    "afd.host": "spec.clusterDomain",
    "afd.shared_experts": "spec.sharedExperts",
    "afd.num_stages": "spec.async.stages",
}


def _spec_path(block_path: str) -> str:
    for block_prefix, spec_prefix in _PLUGIN_FIELDS.items():
        if block_path == block_prefix or block_path.startswith(block_prefix + "."):
            return spec_prefix + block_path[len(block_prefix):]
    return "spec"


def _check_plugin_config(spec: AFDDeploymentSpec, name: str, namespace: str, max_index: int) -> list[Problem]:
    """The configs the planner gives the pods of every instance that may exist at once
    (ports and host differ per instance). It builds them with the plugin's own parser
    (`AFDConfig.build`), and the rendered block is exactly what that parser reads back in
    the pod, so a spec refused here is one the pods would refuse, and no other."""
    revision = revision_of(spec)
    for index in range(max_index + 1):
        try:
            role_configs(spec, name, namespace, revision, index)
        except AFDConfigError as err:
            return [Problem(_spec_path(err.path), f"the plugin refuses it: {err}")]
    return []


def check_spec(spec: AFDDeploymentSpec, name: str, namespace: str = "default") -> list[Problem]:
    """Cross-field rules of a schema-valid spec, then the plugin's verdict on its pods."""
    problems = _check_names(name, spec)
    problems += _check_layout(spec)
    budget = rollout_budget(spec)
    if spec.update_strategy.type == "RollingUpdate" and budget.surge == 0 and budget.unavailable == 0:
        problems.append(Problem(
            "spec.updateStrategy.maxUnavailable",
            "maxSurge and maxUnavailable must not both be 0 (the rollout could never make progress)",
        ))
    max_index = max(spec.replicas + budget.surge - 1, 0)
    problems += _check_ports(spec, max_index)
    problems += _check_engine_args(spec)
    problems += _check_stages(spec)
    problems += _check_env("spec.attention.env", spec.attention.env)
    problems += _check_env("spec.ffn.env", spec.ffn.env)
    problems += _check_resources("spec.attention.podTemplate.resources", spec.attention.pod_template.resources)
    problems += _check_resources("spec.ffn.podTemplate.resources", spec.ffn.pod_template.resources)
    if spec.recovery.max_backoff_seconds < spec.recovery.backoff_seconds:
        problems.append(Problem(
            "spec.recovery.maxBackoffSeconds",
            f"must be >= recovery.backoffSeconds ({spec.recovery.backoff_seconds})",
        ))
    gang = spec.scheduling.gang
    if gang.queue is not None and gang.provider != "volcano":
        problems.append(Problem("spec.scheduling.gang.queue", "is only used with gang.provider 'volcano'"))
    for i, secret in enumerate(spec.image_pull_secrets):
        if not _DNS_1123_SUBDOMAIN.match(secret) or len(secret) > 253:
            problems.append(Problem(f"spec.imagePullSecrets[{i}]", f"'{secret}' is not a valid Secret name"))
    if spec.model.volume is not None:
        vol = spec.model.volume
        if not vol.mount_path.startswith("/"):
            problems.append(Problem("spec.model.volume.mountPath", "must be an absolute path"))
        elif not (spec.model.path + "/").startswith(vol.mount_path.rstrip("/") + "/"):
            problems.append(Problem(
                "spec.model.path", f"must be inside model.volume.mountPath ({vol.mount_path})"
            ))
    reported = {p.path for p in problems}
    # A port shifted past 65535 is refused by the plugin too: one report per field is enough.
    problems += [p for p in _check_plugin_config(spec, name, namespace, max_index) if p.path not in reported]
    return problems


def validate_spec(data: Any, name: str, prefix: str = "spec",
                  namespace: str = "default") -> tuple[Optional[AFDDeploymentSpec], list[Problem]]:
    """Parse and check a raw spec mapping. Returns the spec only when there is no problem.
    The namespace only appears in the pods' DNS names, which the plugin checks as a host."""
    try:
        spec = AFDDeploymentSpec.model_validate(data)
    except ValidationError as err:
        problems = _pydantic_problems(err, prefix)
        if not naming.is_dns_1035_label(name):
            problems.insert(0, Problem("metadata.name", "must be a DNS-1035 label"))
        return None, problems
    problems = check_spec(spec, name, namespace)
    return (None, problems) if problems else (spec, [])


def validate_object(obj: Any) -> tuple[Optional[AFDDeployment], list[Problem]]:
    """Parse and check a whole AFDDeployment object (as `kubectl apply` would send it)."""
    if not isinstance(obj, dict):
        return None, [Problem("<document>", "must be a mapping (an AFDDeployment object)")]
    try:
        parsed = AFDDeployment.model_validate(obj)
    except ValidationError as err:
        return None, _pydantic_problems(err, "")
    problems = check_spec(parsed.spec, parsed.metadata.name, parsed.metadata.namespace)
    return (None, problems) if problems else (parsed, [])
