"""Validation of AFDDeployment objects: every problem at once, each with its field path, and
an answer for any input: a problem list, never an exception.

First the shape of the raw object (problems.py: depth, size, JSON types: what the API server
could store); then the schema rules of the pydantic models (with the API server's own rules for
what passes through to pods, kube_types.py); then cross-field rules (which a Kubernetes 1.20 CRD cannot
express without CEL) and the cluster's host-access policy (policy.py); last, the plugin's own
parser judges the `afd` block the spec plans, so what the pods would refuse is refused here,
with the plugin's message under the spec field it came from. All of it is shared by `afdctl
validate`, the admission webhook and the operator's ConfigValid condition. The work does not
grow with `replicas`: per-instance rules are checked on the instances where they bind.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from afd_shared_experts.config import AFDConfigError
from pydantic import ValidationError

from . import kube_rules, naming
from .api import (GROUP, MAX_REPLICAS, MAX_ROLE_RANKS, RESOURCE_NAMES, AFDDeployment, AFDDeploymentSpec, EnvVar,
                  PodTemplateOverrides, ResourceRequirements)
from .kube_rules import quantity_value
from .engine_args import engine_flag, expands_to
from .planner import (ASCEND_HOST_VOLUME, HCCN_VOLUME, MODEL_VOLUME, attention_layout, attention_pipeline_parallel,
                      ffn_layout, instance_frame, instance_ports, operator_mounts, role_configs, rollout_budget,
                      spec_stage_limit, uses_host_network)
from .access import host_access_problems
from .policy import UNCHECKED_HOST_ACCESS, ClusterPolicy
from .problems import Problem, check_shape, pydantic_problems
from .revision import REVISION_LENGTH

log = logging.getLogger(__name__)

PORT_MAX = 65535
# Instances that may exist at once: replicas plus a surge of at most as many again. Every
# generated name is checked at the largest index one of them can take.
MAX_INDEX = 2 * MAX_REPLICAS - 1
# Pods one deployment may ask for (replicas x pods per instance).
MAX_DEPLOYMENT_PODS = 8192
# Stands in for the spec's revision in the names and hosts checked here: a revision is always
# REVISION_LENGTH characters that DNS names allow, so every rule below, the plugin's included,
# answers the same for any of them, and validating never hashes the spec.
ANY_REVISION = "x" * REVISION_LENGTH

# Engine flags the operator derives from the spec; setting them by hand would break a world.
OPERATOR_OWNED_FLAGS = {
    "--tensor-parallel-size": "attention.tensorParallel",
    "--data-parallel-size": "attention.dataParallel",
    "--data-parallel-size-local": "attention.dataParallel",
    "--data-parallel-start-rank": "attention.dataParallel",
    "--data-parallel-rank": "attention.dataParallel",
    "--data-parallel-backend": "the pod layout",
    "--data-parallel-hybrid-lb": "the pod layout",
    "--data-parallel-external-lb": "the pod layout",
    "--data-parallel-multi-port-external-lb": "the pod layout",
    "--nnodes": "the pod layout",
    "--node-rank": "the pod layout",
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
# Refused whatever their value: a config file's keys are engine flags, so it could set any of the above.
REFUSED_FLAGS = {"--config": "a config file could set the operator's flags; give its flags in engineArgs"}
# vLLM refuses these on headless pods (it starts no API server there) and exits at start.
HEAD_ONLY_FLAGS = ("--api-server-count",)


def _check_env(path: str, env: list[EnvVar]) -> list[Problem]:
    seen: dict[str, int] = {}
    problems = []
    for i, var in enumerate(env):
        if var.name in seen:
            problems.append(Problem(f"{path}[{i}].name", f"duplicate of {path}[{seen[var.name]}].name '{var.name}'"))
        seen.setdefault(var.name, i)
    return problems


def _spec_field_of_mount(volume: str) -> str:
    """The spec field that puts one of the operator's volumes into the pods."""
    if volume.startswith(f"{ASCEND_HOST_VOLUME}-"):
        return f"spec.ascend.driverHostPaths[{volume.rsplit('-', 1)[1]}]"
    return {MODEL_VOLUME: "spec.model.volume.mountPath", HCCN_VOLUME: "spec.ascend.mountHccnConf"}.get(volume, "spec")


def _check_operator_mounts(spec: AFDDeploymentSpec) -> list[Problem]:
    """The operator's own mounts at distinct paths: the model's mount path and the Ascend driver
    paths come from the spec and must not land on /tmp, /dev/shm or one another."""
    problems, owner = [], {}
    for volume, path in operator_mounts(spec).items():
        key = path.rstrip("/") or "/"
        if key in owner:
            problems.append(Problem(_spec_field_of_mount(volume), f"'{path}' is already mounted by the operator "
                                                                   f"(volume '{owner[key]}')"))
        owner.setdefault(key, volume)
    return problems


def _check_pod_template(path: str, spec: AFDDeploymentSpec, overrides: PodTemplateOverrides) -> list[Problem]:
    """The user's volumes and mounts beside the operator's, as the API server checks a pod:
    unique volume names, mounts of existing volumes at distinct paths; device resources are
    the operator's."""
    problems = []
    ours = operator_mounts(spec)
    names: dict[str, int] = {}
    for i, volume in enumerate(overrides.volumes):
        if volume.name in ours:
            problems.append(Problem(f"{path}.volumes[{i}].name", f"'{volume.name}' is a volume of the operator"))
        elif volume.name in names:
            problems.append(Problem(f"{path}.volumes[{i}].name", f"duplicate of volumes[{names[volume.name]}]"))
        names.setdefault(volume.name, i)
    paths = {mount_path: f"the operator's volume '{name}'" for name, mount_path in ours.items()}
    for i, mount in enumerate(overrides.volume_mounts):
        where = f"{path}.volumeMounts[{i}]"
        if mount.name not in names and mount.name not in ours:
            problems.append(Problem(f"{where}.name", f"'{mount.name}' is not a volume of the pod"))
        if mount.mount_path.rstrip("/") in {p.rstrip("/") for p in paths}:
            other = next(v for p, v in paths.items() if p.rstrip("/") == mount.mount_path.rstrip("/"))
            problems.append(Problem(f"{where}.mountPath", f"'{mount.mount_path}' is already used by {other}"))
        paths.setdefault(mount.mount_path, f"volumeMounts[{i}]")
        volume = overrides.volumes[names[mount.name]] if mount.name in names else None
        if volume is not None and volume.host_path is not None and not mount.read_only:
            problems.append(Problem(f"{where}.readOnly", "must be true: host paths are mounted read-only"))
    return problems + _check_resources(f"{path}.resources", spec, overrides.resources)


def _check_resources(path: str, spec: AFDDeploymentSpec, resources: ResourceRequirements) -> list[Problem]:
    """The API server's rules for a container's resources: no request above its limit; extended
    resources are whole numbers, never overcommitted (request == limit, limit set); the device
    resource is the operator's."""
    problems = []
    for name, request in resources.requests.items():
        limit = resources.limits.get(name)
        if limit is not None and quantity_value(request) > quantity_value(limit):
            problems.append(Problem(f"{path}.requests.{name}", f"must be <= limits.{name} ({limit}), got {request}"))
    for kind, amounts in (("requests", resources.requests), ("limits", resources.limits)):
        for name, amount in amounts.items():
            where = f"{path}.{kind}.{name}"
            if spec.platform == "ascend" and name == spec.ascend.resource_name:
                problems.append(Problem(where, "is set by the operator from ascend.resourceName and the pod's ranks"))
            elif name not in RESOURCE_NAMES and quantity_value(amount) % 1:
                problems.append(Problem(where, "must be a whole number (an extended resource)"))
            elif name not in RESOURCE_NAMES and kind == "requests" and (
                    name not in resources.limits or quantity_value(amount) != quantity_value(resources.limits[name])):
                problems.append(Problem(where, f"must equal limits.{name}: an extended resource is never "
                                               "overcommitted"))
    return problems


def _check_engine_args(spec: AFDDeploymentSpec) -> list[Problem]:
    problems = []
    attention_pods = attention_layout(spec).pods
    for i, arg in enumerate(spec.attention.engine_args):
        flag = engine_flag(arg)
        if flag is None:
            continue
        owned = expands_to(flag, [*OPERATOR_OWNED_FLAGS, *REFUSED_FLAGS])
        if owned is not None:
            given = arg.partition("=")[0]
            as_read = "" if given == owned else f" ('{given}' is read by vLLM as '{owned}')"
            rule = f"is set by the operator from {OPERATOR_OWNED_FLAGS[owned]}" if owned in OPERATOR_OWNED_FLAGS \
                else f"is refused: {REFUSED_FLAGS[owned]}"
            problems.append(Problem(f"spec.attention.engineArgs[{i}]", f"'{owned}' {rule}{as_read}"))
        elif expands_to(flag, HEAD_ONLY_FLAGS) and attention_pods > 1:
            problems.append(Problem(
                f"spec.attention.engineArgs[{i}]",
                f"'{flag}' is refused by vLLM on headless Attention pods (these ranks span {attention_pods} "
                "pods and engineArgs go to every one); allowed only when all Attention ranks fit in one pod",
            ))
    pipeline = attention_pipeline_parallel(spec)
    if pipeline > 1:
        problems.append(Problem("spec.attention.engineArgs", f"pipeline parallel is not supported (--pipeline-parallel-"
                                f"size {pipeline}): the AFD world's Attention ranks are data x tensor parallel, with no "
                                "pipeline axis"))
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
    if att_ranks > MAX_ROLE_RANKS:
        return [Problem("spec.attention.dataParallel", f"dataParallel x tensorParallel ({att_ranks}) must be at most "
                                                       f"{MAX_ROLE_RANKS} Attention ranks per instance")]
    pods = spec.replicas * (attention_layout(spec).pods + ffn_layout(spec).pods)
    if pods > MAX_DEPLOYMENT_PODS:
        problems.append(Problem("spec.replicas", f"replicas x pods per instance ({pods}) must be at most "
                                                 f"{MAX_DEPLOYMENT_PODS} pods"))
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
    """Every port a pod opens is distinct; with host networking, instance i uses every port +
    i * stride, so instances that may share a node must not collide either, and shifted ports
    stay <= 65535. Port arithmetic, not a loop over the instances."""
    host_net = uses_host_network(spec)
    stride = spec.ascend.host_port_stride if host_net else 0
    last = max_index if host_net else 0
    base = instance_ports(spec, 0)
    ports = {path: getattr(base, kind) for kind, path in _PORT_FIELDS.items()}
    problems: list[Problem] = []
    for path, port in ports.items():
        if port + last * stride > PORT_MAX:
            index = (PORT_MAX - port) // stride + 1
            problems.append(Problem(path, f"instance {index} would use host port {port + index * stride}, above "
                                          f"{PORT_MAX}; lower the port or ascend.hostPortStride"))
    reported = {p.path for p in problems}
    fields = list(ports)
    for later, path in enumerate(fields):
        for other in fields[:later] + fields[later + 1:]:
            if path in reported:
                break
            # path's port at instance j meets other's at instance i when port + j*s == port' + i*s.
            gap = ports[other] - ports[path]
            if gap == 0 and fields.index(other) < later:
                problems.append(Problem(path, f"port {ports[path]} collides with {other}; ports must be distinct"))
                reported.add(path)
            elif gap > 0 and stride and gap % stride == 0 and gap // stride <= last:
                index = gap // stride
                problems.append(Problem(path, f"port {ports[other]} collides with {other} of instance 0 (instance "
                                              f"{index}); ports must be distinct"))
                reported.add(path)
    return problems


def _check_names(name: str, spec: AFDDeploymentSpec, namespace: str) -> list[Problem]:
    problem = kube_rules.dns_1035_label(name)
    if problem:
        return [Problem("metadata.name", problem)]
    longest_ordinal = max(attention_layout(spec).pods, ffn_layout(spec).pods) - 1
    longest = naming.pod_name(name, ANY_REVISION, MAX_INDEX, "attention", longest_ordinal)
    if len(longest) > naming.DNS_LABEL_MAX:
        allowed = len(name) - (len(longest) - naming.DNS_LABEL_MAX)
        return [Problem(
            "metadata.name",
            f"must be at most {allowed} characters: pod names such as '{longest}' (instance {MAX_INDEX}, the "
            f"largest index {MAX_REPLICAS} replicas and their surge can take) are DNS labels "
            f"(at most {naming.DNS_LABEL_MAX} characters)",
        )]
    # Ranks reach each other by these names (the connector host, the DP address): a name DNS
    # cannot carry would pass every check here and fail in every pod.
    dns_name = naming.pod_dns_name(longest, naming.instance_name(name, ANY_REVISION, MAX_INDEX), namespace,
                                   spec.cluster_domain)
    if len(dns_name) > kube_rules.DNS_SUBDOMAIN_MAX:
        return [Problem("spec.clusterDomain", f"makes pod DNS names such as '{dns_name[:80]}...' "
                                              f"{len(dns_name)} characters long (a DNS name holds at most "
                                              f"{kube_rules.DNS_SUBDOMAIN_MAX})")]
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
    """The configs the planner gives the pods (the plugin's own parser builds them, and the
    rendered block is exactly what that parser reads back in the pod, so a spec refused here is
    one the pods would refuse, and no other). Instances differ only in the head's host name (its
    revision part is ANY_REVISION here) and the ports, both largest at the last index: the first
    and the last instance that may exist at once stand for all of them."""
    for index in sorted({0, max_index}):
        try:
            role_configs(spec, instance_frame(spec, name, namespace, ANY_REVISION, index))
        except AFDConfigError as err:
            return [Problem(_spec_path(err.path), f"the plugin refuses it: {err}")]
    return []


# kopf stores the spec it last handled in an annotation (main.AFDDiffBaseStorage): a spec must fit
# there with room for the object's other annotations. This also bounds what a role's engineArgs,
# env and podTemplate add to each pod (one etcd object, at most 1.5 MiB).
MAX_SPEC_BYTES = 192 * 1024


def _spec_size_problems(data: Any, prefix: str) -> list[Problem]:
    size = len(json.dumps(data, separators=(",", ":")))
    if size <= MAX_SPEC_BYTES:
        return []
    return [Problem(prefix, f"is {size} bytes as JSON; at most {MAX_SPEC_BYTES}: the operator keeps a copy in the "
                            f"annotation {GROUP}/last-handled-configuration, and the API server holds at most "
                            f"{kube_rules.ANNOTATIONS_TOTAL_MAX} bytes of annotations per object")]


def check_spec(spec: AFDDeploymentSpec, name: str, namespace: str = "default",
               policy: ClusterPolicy = UNCHECKED_HOST_ACCESS) -> list[Problem]:
    """Cross-field rules of a schema-valid spec, the cluster's host-access policy (the operator
    and its webhook pass the one they run with), then the plugin's verdict on its pods."""
    problems = _check_names(name, spec, namespace)
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
    problems += _check_operator_mounts(spec)
    for role in ("attention", "ffn"):
        role_spec = getattr(spec, role)
        problems += _check_env(f"spec.{role}.env", role_spec.env)
        problems += _check_pod_template(f"spec.{role}.podTemplate", spec, role_spec.pod_template)
    if policy.host_access is not None:
        problems += host_access_problems(spec, policy.host_access)
    if spec.recovery.max_backoff_seconds < spec.recovery.backoff_seconds:
        problems.append(Problem(
            "spec.recovery.maxBackoffSeconds",
            f"must be >= recovery.backoffSeconds ({spec.recovery.backoff_seconds})",
        ))
    gang = spec.scheduling.gang
    if gang.queue is not None and gang.provider != "volcano":
        problems.append(Problem("spec.scheduling.gang.queue", "is only used with gang.provider 'volcano'"))
    volume = spec.model.volume
    if volume is not None and not (spec.model.path + "/").startswith(volume.mount_path.rstrip("/") + "/"):
        problems.append(Problem("spec.model.path", f"must be inside model.volume.mountPath ({volume.mount_path})"))
    reported = {p.path for p in problems}
    # A port shifted past 65535 is refused by the plugin too: one report per field is enough.
    problems += [p for p in _check_plugin_config(spec, name, namespace, max_index) if p.path not in reported]
    return problems


def _answer(root: str, check: Any) -> tuple[Any, list[Problem]]:
    """`check()`'s answer, or the one line a failure of the validator itself gives: whatever
    the input, the caller gets a verdict, never an exception (the fuzz test holds it to that)."""
    try:
        return check()
    except Exception as err:  # noqa: BLE001 - a bug in a rule must not become a traceback or a stuck reconcile
        log.exception("validating %s failed", root)
        return None, [Problem(root, f"could not be validated ({type(err).__name__}: {err})")]


def validate_spec(data: Any, name: str, prefix: str = "spec", namespace: str = "default",
                  policy: ClusterPolicy = UNCHECKED_HOST_ACCESS) -> tuple[Optional[AFDDeploymentSpec], list[Problem]]:
    """Parse and check a raw spec mapping. Returns the spec only when there is no problem.
    The namespace only appears in the pods' DNS names, which the plugin checks as a host."""

    def check() -> tuple[Optional[AFDDeploymentSpec], list[Problem]]:
        problems = check_shape(data, prefix)
        if problems:
            return None, problems
        problems = _spec_size_problems(data, prefix)
        if problems:
            return None, problems
        try:
            spec = AFDDeploymentSpec.model_validate(data)
        except ValidationError as err:
            problems = pydantic_problems(err, prefix)
            name_problem = kube_rules.dns_1035_label(name)
            if name_problem:
                problems.insert(0, Problem("metadata.name", name_problem))
            return None, problems
        problems = check_spec(spec, name, namespace, policy)
        return (None, problems) if problems else (spec, [])

    return _answer(prefix, check)


def validate_object(obj: Any, policy: ClusterPolicy = UNCHECKED_HOST_ACCESS) -> tuple[Optional[AFDDeployment],
                                                                                        list[Problem]]:
    """Parse and check a whole AFDDeployment object (as `kubectl apply` would send it)."""

    def check() -> tuple[Optional[AFDDeployment], list[Problem]]:
        if not isinstance(obj, dict):
            return None, [Problem("<document>", "must be a mapping (an AFDDeployment object)")]
        problems = check_shape(obj, "") or _spec_size_problems(obj.get("spec"), "spec")
        if problems:
            return None, problems
        try:
            parsed = AFDDeployment.model_validate(obj)
        except ValidationError as err:
            return None, pydantic_problems(err, "")
        problems = check_spec(parsed.spec, parsed.metadata.name, parsed.metadata.namespace, policy)
        return (None, problems) if problems else (parsed, [])

    return _answer("<document>", check)
