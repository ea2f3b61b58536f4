"""The `AFDDeployment` API (afd.inference.dev/v1alpha1) as pydantic v2 models.

These models are the single source of truth: the CRD in `crds/` is generated from them,
the planner reads them, and admission/`afdctl validate` parse user input through them.
Field names are camelCase on the wire (the only spelling accepted, as the API server reads
them); unknown fields are rejected everywhere: even the core/v1 pieces passed through to the
pods are typed (kube_types.py), so nothing reaches a pod unchecked.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from afd_shared_experts.config import DEFAULT_MIN_SPLIT_DECODE_TOKENS, DEFAULT_MIN_SPLIT_PREFILL_TOKENS, MAX_STAGES

from . import kube_rules
from .kube_types import (MAX_LIST_ITEMS, MAX_MAP_ENTRIES, MAX_STRING, AbsolutePath, Affinity, DNSLabel,
                         DNSSubdomain, EnvVarSource, Labels, LabelValue, NetworkPolicyPeer, QualifiedName, Quantity,
                         Strict, Toleration, TopologySpreadConstraint, Volume, VolumeMount, follows)

GROUP = "afd.inference.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AFDDeployment"
PLURAL = "afddeployments"
SINGULAR = "afddeployment"
SHORT_NAMES = ["afd"]

# The plugin's async point-to-point connector (plugin/afd_shared_experts): what `ffn` placement needs.
DEFAULT_CONNECTOR = "p2p"
DEFAULT_RESOURCE_NAME = "huawei.com/Ascend910"
DEFAULT_DRIVER_HOST_PATHS = ["/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"]
HCCN_CONF = "/etc/hccn.conf"  # the NIC configuration HCCL reads (ascend.mountHccnConf)

# The documented maxima (docs/api.md): enforced by the CRD schema and the validator, so the work
# one AFDDeployment asks of the operator stays bounded.
MAX_REPLICAS = 512
MAX_ROLE_RANKS = 1024  # Attention DP x TP, and FFN ranks, per instance
MAX_TENSOR_PARALLEL = 64
MAX_DEVICES_PER_POD = 64
MAX_SECONDS = 7 * 24 * 3600
MAX_RESTARTS = 1000
MAX_TOKENS = 1 << 24
MAX_ENGINE_ARGS = 128
MAX_ENV = 128
MAX_ENV_VALUE = 32768
MAX_EXTRA_CONFIG_KEYS = 16

INT_OR_STRING = {"x-kubernetes-int-or-string": True}


def _port(default: int, description: str) -> Any:
    return Field(default, ge=1, le=65535, description=description)


def _seconds(default: int, minimum: int, description: str = "") -> Any:
    return Field(default, ge=minimum, le=MAX_SECONDS, description=description or None)


def _image_reference(value: str) -> str:
    """An image reference is one token: a newline or space in it would make a pod the kubelet
    cannot pull (InvalidImageName), found only after the pods were created."""
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ValueError("must be one image reference, without whitespace or control characters")
    return value


def _int_or_string(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be an integer or a string")
    if isinstance(value, str) and len(value) > MAX_STRING:
        raise ValueError(f"must be at most {MAX_STRING} characters")
    return value


IntOrString = Annotated[Any, BeforeValidator(_int_or_string), WithJsonSchema(INT_OR_STRING)]


class EnvVar(Strict):
    """A container environment variable, as in core/v1 EnvVar."""

    name: Annotated[str, Field(min_length=1, max_length=kube_rules.DNS_SUBDOMAIN_MAX),
                    follows(kube_rules.env_name)] = Field(description="Variable name.")
    value: Optional[Annotated[str, Field(max_length=MAX_ENV_VALUE)]] = Field(None, description="Literal value.")
    value_from: Optional[EnvVarSource] = Field(
        None, description="core/v1 EnvVarSource: fieldRef, resourceFieldRef, configMapKeyRef or secretKeyRef.")

    @model_validator(mode="after")
    def _one_source(self) -> "EnvVar":
        if self.value is not None and self.value_from is not None:
            raise ValueError("set either value or valueFrom, not both")
        return self


RESOURCE_NAMES = ("cpu", "memory", "ephemeral-storage")


def _resource_name(value: str) -> Optional[str]:
    if value in RESOURCE_NAMES:
        return None
    problem = kube_rules.extended_resource_name(value)
    return problem and f"must be {', '.join(RESOURCE_NAMES)} or an extended resource name like 'vendor.example/device'"


ResourceList = Annotated[dict[Annotated[str, follows(_resource_name)], Quantity], Field(max_length=16)]


class ResourceRequirements(Strict):
    """core/v1 ResourceRequirements of the main container (device resources are the operator's)."""

    requests: ResourceList = Field(default_factory=dict, description="Requested quantities.")
    limits: ResourceList = Field(default_factory=dict, description="Limits.")


def _annotations_size(value: dict[str, str]) -> dict[str, str]:
    size = sum(len(k) + len(v) for k, v in value.items())
    if size > kube_rules.ANNOTATIONS_TOTAL_MAX:
        raise ValueError(f"keys and values may total at most {kube_rules.ANNOTATIONS_TOTAL_MAX} bytes (got {size})")
    return value


def _operator_labels_reserved(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        if key.startswith(f"{GROUP}/"):
            # e.g. the serving label, which routes the API Service to a head.
            raise ValueError(f"'{key}': labels under {GROUP}/ are set by the operator")
    return value


class PodTemplateOverrides(Strict):
    """Pieces merged into every generated pod of a role."""

    labels: Annotated[Labels, AfterValidator(_operator_labels_reserved)] = Field(
        default_factory=dict, description="Extra pod labels (not under afd.inference.dev/).")
    annotations: Annotated[dict[QualifiedName, Annotated[str, Field(max_length=kube_rules.ANNOTATIONS_TOTAL_MAX)]],
                           Field(max_length=MAX_MAP_ENTRIES), AfterValidator(_annotations_size)] = Field(
        default_factory=dict, description="Extra pod annotations.")
    node_selector: Labels = Field(default_factory=dict, description="Merged into pod nodeSelector.")
    tolerations: Annotated[list[Toleration], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=list, description="core/v1 Tolerations.")
    affinity: Optional[Affinity] = Field(None, description="core/v1 Affinity.")
    topology_spread_constraints: Annotated[list[TopologySpreadConstraint], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=list, description="core/v1 TopologySpreadConstraints.")
    volumes: Annotated[list[Volume], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=list, description="Extra core/v1 Volumes (emptyDir, hostPath, persistentVolumeClaim, "
                                          "configMap, secret); hostPath only under the prefixes the cluster allows.")
    volume_mounts: Annotated[list[VolumeMount], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=list, description="Extra core/v1 VolumeMounts for the main container.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Extra requests/limits (cpu, memory, ...) merged into the main container; "
        "device resources are set by the operator.")
    service_account_name: Optional[DNSSubdomain] = Field(
        None, description="Pod service account: only one the cluster allows (its token is never mounted).")


class ModelVolume(Strict):
    """Where the model files come from: a PVC or a host path, mounted read-only."""

    claim_name: Optional[DNSSubdomain] = Field(None, description="PersistentVolumeClaim name.")
    host_path: Optional[AbsolutePath] = Field(None, description="Host directory (under a prefix the cluster allows).")
    mount_path: AbsolutePath = Field("/models", description="Mount point inside the pods.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelVolume":
        if (self.claim_name is None) == (self.host_path is None):
            raise ValueError("set exactly one of claimName or hostPath")
        return self


class ModelSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=kube_rules.DNS_SUBDOMAIN_MAX)] = Field(
        description="Served model name (OpenAI `model`).")
    path: Annotated[AbsolutePath, Field(min_length=1)] = Field(description="Model directory inside the pods.")
    volume: Optional[ModelVolume] = Field(None, description="Volume that holds the model.")
    routed_experts: Optional[int] = Field(
        None, ge=1, le=65536,
        description="Routed experts per MoE layer; enables the divisibility check with ffn.ranks.")
    max_model_len: Optional[int] = Field(None, ge=1, le=MAX_TOKENS, description="--max-model-len.")
    max_num_batched_tokens: int = Field(
        8192, ge=1, le=MAX_TOKENS, description="--max-num-batched-tokens, the same on both roles by construction.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="--dtype.")
    quantization: Optional[Annotated[str, Field(min_length=1, max_length=64)]] = Field(None,
                                                                                      description="--quantization.")


class SharedExpertsSpec(Strict):
    placement: Literal["ffn", "attention"] = Field(
        "ffn", description="Where MoE shared experts are loaded and run."
    )
    partition: Literal["affinity", "contiguous"] = Field(
        "affinity", description="How shared-expert tokens are split across FFN ranks (placement ffn)."
    )


class ConnectorSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)] = Field(DEFAULT_CONNECTOR, description="AFD connector name.")
    port: int = _port(1239, "Rendezvous port on the Attention head.")
    extra_config: Annotated[dict[Annotated[str, Field(min_length=1, max_length=kube_rules.DNS_SUBDOMAIN_MAX)],
                                 IntOrString], Field(max_length=MAX_EXTRA_CONFIG_KEYS)] = Field(
        default_factory=dict, description="Laid over the operator's connector_extra_config "
        "(attn_ranks_per_dp = attention.tensorParallel); integers or strings; the plugin's parser refuses keys it "
        "does not know.")


# Two stages are the ping-pong pipeline of async AFD (MegaScale-Infer, afd-plugin): the FFN computes one half
# of a step while the Attention side computes the other.
DEFAULT_STAGES = 2


class MinSplitTokensSpec(Strict):
    decode: int = Field(
        DEFAULT_MIN_SPLIT_DECODE_TOKENS, ge=1, le=MAX_TOKENS,
        description="The fewest tokens a decode step (every request one token) needs before it is split into "
        "stages; smaller decode steps run as one stage (a micro-batch's fixed costs would outweigh the overlap).")
    prefill: int = Field(
        DEFAULT_MIN_SPLIT_PREFILL_TOKENS, ge=1, le=MAX_TOKENS,
        description="The same for any other step (prefill, chunked prefill, mixed).")


class AsyncSpec(Strict):
    stages: Optional[int] = Field(
        None, ge=1, le=MAX_STAGES,
        description="Micro-batch stages of each Attention step, ping-pong with the FFN side (the FFN computes one "
        "micro-batch while the Attention side computes the next); more than 1 on platform cpu only. Default: "
        f"{DEFAULT_STAGES} where allowed (platform cpu, no engine argument that refuses stages, shared experts on the "
        "FFN side: under sharedExperts.placement 'attention' the FFN side holds too little to overlap), else 1.")
    min_split_tokens: MinSplitTokensSpec = Field(
        default_factory=MinSplitTokensSpec, description="Steps below these sizes run unsplit whatever `stages` says.")


EngineArgs = Annotated[list[Annotated[str, Field(max_length=MAX_STRING)]], Field(max_length=MAX_ENGINE_ARGS)]
EnvList = Annotated[list[EnvVar], Field(max_length=MAX_ENV)]


class AttentionSpec(Strict):
    data_parallel: int = Field(1, ge=1, le=MAX_ROLE_RANKS, description="Attention data-parallel size per instance.")
    tensor_parallel: int = Field(1, ge=1, le=MAX_TENSOR_PARALLEL, description="Attention tensor-parallel size.")
    devices_per_pod: int = Field(1, ge=1, le=MAX_DEVICES_PER_POD, description="Devices (ranks) per Attention pod.")
    data_parallel_rpc_port: int = _port(13345, "--data-parallel-rpc-port on the Attention head.")
    engine_args: EngineArgs = Field(default_factory=list, description="Extra vLLM engine arguments.")
    env: EnvList = Field(default_factory=list, description="Extra environment variables.")
    pod_template: PodTemplateOverrides = Field(default_factory=PodTemplateOverrides)


class FFNSpec(Strict):
    ranks: int = Field(1, ge=1, le=MAX_ROLE_RANKS, description="FFN ranks (expert-parallel size) per instance.")
    devices_per_pod: int = Field(1, ge=1, le=MAX_DEVICES_PER_POD, description="Devices (ranks) per FFN pod.")
    health_port: int = _port(9401, "FFN server /health and /ready port.")
    env: EnvList = Field(default_factory=list, description="Extra environment variables.")
    pod_template: PodTemplateOverrides = Field(default_factory=PodTemplateOverrides)


class HcclBufferSizes(Strict):
    attention: Optional[int] = Field(None, ge=1, le=65536, description="HCCL_BUFFSIZE (MB) on Attention pods.")
    ffn: Optional[int] = Field(None, ge=1, le=65536, description="HCCL_BUFFSIZE (MB) on FFN pods.")


def _positive_quantity(value: Any) -> Any:
    problem = kube_rules.quantity(value, positive=True)
    if problem:
        raise ValueError(problem)
    return value


class AscendSpec(Strict):
    resource_name: Annotated[str, follows(kube_rules.extended_resource_name)] = Field(
        DEFAULT_RESOURCE_NAME, description="Extended resource of the NPU device plugin.")
    host_network: bool = Field(True, description="Use host networking (needed for same-node HCCS); the cluster "
                                                 "must allow it (chart value hostAccess.hostNetwork).")
    host_port_stride: int = Field(
        16, ge=1, le=1024,
        description="With hostNetwork, instance i uses ports base + i*stride so instances sharing a "
        "node never collide. Pods of one instance and role use the same ports (declared as host "
        "ports, so the scheduler puts them on different nodes).",
    )
    shm_size: Annotated[Any, BeforeValidator(_positive_quantity), WithJsonSchema(INT_OR_STRING)] = Field(
        "16Gi", description="Size of the memory-backed /dev/shm.")
    socket_interface: Optional[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^\S+$")]] = Field(
        None, description="NIC name for HCCL/GLOO/TP_SOCKET_IFNAME.")
    hccl_buffer_size_mb: HcclBufferSizes = Field(default_factory=HcclBufferSizes, alias="hcclBufferSizeMB")
    driver_host_paths: Annotated[list[AbsolutePath], Field(max_length=16)] = Field(
        default_factory=lambda: list(DEFAULT_DRIVER_HOST_PATHS),
        description="Host paths mounted read-only (each under a path the cluster allows on ascend).")
    mount_hccn_conf: bool = Field(True, description="Mount /etc/hccn.conf from the host.")
    run_as_root: bool = Field(
        False, description="Run as root with the capability DAC_OVERRIDE (what the stock vLLM-Ascend images do) "
        "on a writable root filesystem; the cluster must allow it (chart value hostAccess.ascendRunAsRoot). "
        "Otherwise runAsUser with driverGroup on a read-only root.")
    run_as_user: int = Field(1000, ge=1, le=kube_rules.INT32_MAX,
                             description="The containers' user when not runAsRoot (HwHiAiUser on a default "
                                         "driver install).")
    driver_group: int = Field(1000, ge=0, le=kube_rules.INT32_MAX,
                              description="The group owning the NPU device nodes on the nodes (ls -n "
                                          "/dev/davinci0; HwHiAiUser's on a default driver install): a supplemental "
                                          "group of the containers, which opens them without root.")


class GangSpec(Strict):
    provider: Literal["none", "volcano"] = Field("none", description="Gang scheduler.")
    queue: Optional[Annotated[str, Field(min_length=1, max_length=kube_rules.DNS_SUBDOMAIN_MAX)]] = Field(
        None, description="Volcano queue.")


class SchedulingSpec(Strict):
    gang: GangSpec = Field(default_factory=GangSpec)
    priority_class_name: Optional[DNSSubdomain] = Field(None)


class StartupSpec(Strict):
    order: Literal["FFNFirst", "Parallel"] = Field(
        "FFNFirst", description="FFNFirst starts Attention pods once FFN pods run."
    )
    timeout_seconds: int = _seconds(1800, 1, (
        "An instance not Ready by then is Failed. Also how long its Attention ranks wait at the "
        "rendezvous for FFN servers still loading their experts, and vLLM for its engines."))


class RecoverySpec(Strict):
    policy: Literal["RecreateInstance", "None"] = Field("RecreateInstance")
    backoff_seconds: int = _seconds(10, 0)
    max_backoff_seconds: int = _seconds(600, 0)
    max_restarts: int = Field(5, ge=0, le=MAX_RESTARTS, description="Consecutive failures before an instance stays down.")
    unready_grace_seconds: int = _seconds(
        60, 0, "A pod of a Ready instance that stays not Ready this long fails the instance.")
    stable_seconds: int = _seconds(
        600, 0, "An instance Ready this long after a restart has recovered: its consecutive failures reset.")


_PERCENT = re.compile(r"(0|[1-9][0-9]*)%")


def _int_or_percent(value: Any) -> Any:
    """Instances (0..MAX_REPLICAS) or a percentage of replicas (0%..100%)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= MAX_REPLICAS:
            raise ValueError(f"must be in [0, {MAX_REPLICAS}]")
        return value
    if isinstance(value, str) and _PERCENT.fullmatch(value):
        if int(value[:-1]) > 100:
            raise ValueError("must be at most 100%")
        return value
    raise ValueError("must be an integer or a percentage like '25%'")


IntOrPercent = Annotated[Any, BeforeValidator(_int_or_percent), WithJsonSchema(INT_OR_STRING)]


class UpdateStrategySpec(Strict):
    type: Literal["RollingUpdate", "Recreate"] = Field("RollingUpdate")
    max_surge: IntOrPercent = Field(1, description=f"Instances (at most {MAX_REPLICAS}) or percent (at most 100%).")
    max_unavailable: IntOrPercent = Field(
        0, description=f"Instances (at most {MAX_REPLICAS}) or percent (at most 100%).")
    partition: int = Field(0, ge=0, le=MAX_REPLICAS, description="Old-revision instances kept.")
    paused: bool = Field(False, description="Freeze the rollout.")


class TerminationSpec(Strict):
    grace_period_seconds: int = _seconds(120, 0)
    drain_seconds: int = _seconds(30, 0, "Wait after leaving the Service before deleting pods.")


class ServiceSpec(Strict):
    port: int = _port(8000, "OpenAI API port.")
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP")
    allowed_clients: Annotated[list[NetworkPolicyPeer], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=list, description="Who may reach the API port through the instances' NetworkPolicies "
        "(networking.k8s.io/v1 peers); empty: any client.")


class MetricsSpec(Strict):
    enabled: bool = Field(True, description="Serve Prometheus metrics from FFN pods (Attention heads serve them on the API port).")
    port: int = _port(9400, "FFN server metrics port.")
    pod_monitor: bool = Field(False, description="Render a prometheus-operator PodMonitor.")


class AFDDeploymentSpec(Strict):
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS, description="AFD instances; one instance is one connector world.")
    image: Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(_image_reference)] = Field(
        description="Runtime image (vLLM-Ascend + plugin).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent")
    image_pull_secrets: Annotated[list[DNSSubdomain], Field(max_length=16)] = Field(
        default_factory=list, description="Secret names.")
    platform: Literal["ascend", "cpu"] = Field("ascend")
    cluster_domain: DNSSubdomain = Field("cluster.local", description="Cluster DNS domain.")
    model: ModelSpec
    shared_experts: SharedExpertsSpec = Field(default_factory=SharedExpertsSpec)
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec)
    # `async` is a Python keyword: the field keeps a trailing underscore, the API name is `async`.
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async")
    attention: AttentionSpec = Field(default_factory=AttentionSpec)
    ffn: FFNSpec = Field(default_factory=FFNSpec)
    ascend: AscendSpec = Field(default_factory=AscendSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    startup: StartupSpec = Field(default_factory=StartupSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    update_strategy: UpdateStrategySpec = Field(default_factory=UpdateStrategySpec)
    termination: TerminationSpec = Field(default_factory=TerminationSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)


# ---- status -------------------------------------------------------------------------------


class StatusModel(Strict):
    """Status is written by the operator, not by users: read leniently (its phases are strings)."""

    # Built by field name in status.py, read by wire name from the API.
    model_config = ConfigDict(**{**Strict.model_config, "strict": False, "validate_by_name": True})


# Every condition type the operator writes: any other fails validation, so it never reaches
# the API. A str Enum, so it travels as the plain string; no docstring (it would land in the CRD).
class ConditionType(str, Enum):
    READY = "Ready"
    AVAILABLE = "Available"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    CONFIG_VALID = "ConfigValid"
    NETWORK_ISOLATED = "NetworkIsolated"
    API_WRITE_FAILED = "ApiWriteFailed"  # present only while the API refuses a write
    NAME_CONFLICT = "NameConflict"  # present only while a child's name is held by an object it does not control
    SNAPSHOT_UNREADABLE = "SnapshotUnreadable"  # present only while a revision snapshot's plan summary is unreadable


class Condition(StatusModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: Optional[str] = None
    last_transition_time: Optional[str] = None
    observed_generation: Optional[int] = None


# An instance's phase, the one definition used by the controller, status and metrics. A
# str Enum, so it travels as the plain string; no docstring, which would land in the CRD.
class Phase(str, Enum):
    PENDING = "Pending"
    STARTING = "Starting"
    READY = "Ready"
    DRAINING = "Draining"
    FAILED = "Failed"

    def __str__(self) -> str:
        return self.value


class InstanceStatus(StatusModel):
    name: str = Field(description="Instance name (also its headless Service).")
    index: int
    revision: str
    phase: Phase
    pods_ready: int = 0
    pods_total: int = 0
    restarts: int = Field(0, description="Times the instance was recreated after a failure.")
    consecutive_failures: int = Field(0, description="Failures since the instance was last Ready.")
    last_failure: Optional[str] = None
    retry_after: Optional[str] = Field(None, description="When a failed instance is recreated (RFC 3339).")
    first_ready_time: Optional[str] = Field(
        None, description="When this world first had every pod Ready (RFC 3339); unset until then.")


class AFDDeploymentStatus(StatusModel):
    observed_generation: Optional[int] = None
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    current_revision: Optional[str] = None
    update_revision: Optional[str] = None
    topology: Optional[str] = None
    instances: list[InstanceStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    selector: Optional[str] = None


class ObjectMeta(BaseModel):
    """The part of metadata the planner needs, and the labels and annotations the API server
    would refuse; the rest passes through untouched."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=kube_rules.DNS_SUBDOMAIN_MAX)]
    namespace: DNSLabel = "default"
    labels: dict[QualifiedName, LabelValue] = Field(default_factory=dict)
    annotations: Annotated[dict[QualifiedName, str], AfterValidator(_annotations_size)] = Field(default_factory=dict)


class AFDDeployment(Strict):
    api_version: Literal["afd.inference.dev/v1alpha1"]
    kind: Literal["AFDDeployment"]
    metadata: ObjectMeta
    spec: AFDDeploymentSpec
    status: Optional[AFDDeploymentStatus] = None
