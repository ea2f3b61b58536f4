"""The `AFDDeployment` API (afd.inference.dev/v1alpha1) as pydantic v2 models.

These models are the single source of truth: the CRD in `crds/` is generated from them,
the planner reads them, and admission/`afdctl validate` parse user input through them.
Field names are camelCase on the wire; unknown fields are rejected everywhere except the
few places that are free-form by design (pod template pieces, connector extraConfig).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal, Optional, Union

from kubernetes.utils.quantity import parse_quantity
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from afd_shared_experts.config import MAX_STAGES

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

# Free-form JSON objects (pod template pieces, extraConfig). Marked so the CRD generator
# emits `x-kubernetes-preserve-unknown-fields` for exactly these and nothing else.
FREE_FORM = {"x-kubernetes-preserve-unknown-fields": True}
INT_OR_STRING = {"x-kubernetes-int-or-string": True}

_PERCENT = re.compile(r"^(0|[1-9][0-9]*)%$")
# <prefix>/<name> as Kubernetes accepts for extended resource names.
_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class Strict(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
    )


def _port(default: int, description: str) -> Any:
    return Field(default, ge=1, le=65535, description=description)


class EnvVar(Strict):
    """A container environment variable, as in core/v1 EnvVar."""

    name: str = Field(min_length=1, description="Variable name.")
    value: Optional[str] = Field(None, description="Literal value.")
    value_from: Optional[dict[str, Any]] = Field(
        None, description="core/v1 EnvVarSource (fieldRef, configMapKeyRef, secretKeyRef, ...).",
        json_schema_extra=FREE_FORM,
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise ValueError("must consist of letters, digits, '_', '-' or '.', and not start with a digit")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "EnvVar":
        if self.value is not None and self.value_from is not None:
            raise ValueError("set either value or valueFrom, not both")
        return self


class PodTemplateOverrides(Strict):
    """Pieces merged into every generated pod of a role."""

    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Merged into pod nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="core/v1 Tolerations.", json_schema_extra={"items": FREE_FORM}
    )
    affinity: Optional[dict[str, Any]] = Field(None, description="core/v1 Affinity.", json_schema_extra=FREE_FORM)
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, description="core/v1 TopologySpreadConstraints.",
        json_schema_extra={"items": FREE_FORM},
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra core/v1 Volumes.", json_schema_extra={"items": FREE_FORM}
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra core/v1 VolumeMounts for the main container.",
        json_schema_extra={"items": FREE_FORM},
    )
    resources: Optional[dict[str, Any]] = Field(
        None,
        description="Extra requests/limits (cpu, memory, ...) merged into the main container; "
        "device resources are set by the operator.",
        json_schema_extra=FREE_FORM,
    )
    service_account_name: Optional[str] = Field(None, description="Pod service account.")


class ModelVolume(Strict):
    """Where the model files come from: a PVC or a host path, mounted read-only."""

    claim_name: Optional[str] = Field(None, description="PersistentVolumeClaim name.")
    host_path: Optional[str] = Field(None, description="Host directory.")
    mount_path: str = Field("/models", description="Mount point inside the pods.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelVolume":
        if (self.claim_name is None) == (self.host_path is None):
            raise ValueError("set exactly one of claimName or hostPath")
        return self


class ModelSpec(Strict):
    name: str = Field(min_length=1, description="Served model name (OpenAI `model`).")
    path: str = Field(min_length=1, description="Model directory inside the pods.")
    volume: Optional[ModelVolume] = Field(None, description="Volume that holds the model.")
    routed_experts: Optional[int] = Field(
        None, ge=1, description="Routed experts per MoE layer; enables the divisibility check with ffn.ranks."
    )
    max_model_len: Optional[int] = Field(None, ge=1, description="--max-model-len.")
    max_num_batched_tokens: int = Field(
        8192, ge=1, description="--max-num-batched-tokens, the same on both roles by construction."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="--dtype.")
    quantization: Optional[str] = Field(None, min_length=1, description="--quantization.")


class SharedExpertsSpec(Strict):
    placement: Literal["ffn", "attention"] = Field(
        "ffn", description="Where MoE shared experts are loaded and run."
    )
    partition: Literal["affinity", "contiguous"] = Field(
        "affinity", description="How shared-expert tokens are split across FFN ranks (placement ffn)."
    )


class ConnectorSpec(Strict):
    name: str = Field(DEFAULT_CONNECTOR, min_length=1, description="AFD connector name.")
    port: int = _port(1239, "Rendezvous port on the Attention head.")
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="Laid over the operator's connector_extra_config "
        "(attn_ranks_per_dp = attention.tensorParallel); the plugin's parser refuses keys it does not know.",
        json_schema_extra=FREE_FORM
    )


# Two stages are the ping-pong pipeline of async AFD (MegaScale-Infer, afd-plugin): the FFN computes one half
# of a step while the Attention side computes the other.
DEFAULT_STAGES = 2


class AsyncSpec(Strict):
    stages: Optional[int] = Field(
        None, ge=1, le=MAX_STAGES,
        description="Micro-batch stages of each Attention step, ping-pong with the FFN side (the FFN computes one "
        "micro-batch while the Attention side computes the next); more than 1 on platform cpu only. Default: "
        f"{DEFAULT_STAGES} where allowed (platform cpu, no engine argument that refuses stages), else 1.")


class AttentionSpec(Strict):
    data_parallel: int = Field(1, ge=1, description="Attention data-parallel size per instance.")
    tensor_parallel: int = Field(1, ge=1, description="Attention tensor-parallel size.")
    devices_per_pod: int = Field(1, ge=1, description="Devices (ranks) per Attention pod.")
    data_parallel_rpc_port: int = _port(13345, "--data-parallel-rpc-port on the Attention head.")
    engine_args: list[str] = Field(default_factory=list, description="Extra vLLM engine arguments.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    pod_template: PodTemplateOverrides = Field(default_factory=PodTemplateOverrides)


class FFNSpec(Strict):
    ranks: int = Field(1, ge=1, description="FFN ranks (expert-parallel size) per instance.")
    devices_per_pod: int = Field(1, ge=1, description="Devices (ranks) per FFN pod.")
    health_port: int = _port(9401, "FFN server /health and /ready port.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    pod_template: PodTemplateOverrides = Field(default_factory=PodTemplateOverrides)


class HcclBufferSizes(Strict):
    attention: Optional[int] = Field(None, ge=1, description="HCCL_BUFFSIZE (MB) on Attention pods.")
    ffn: Optional[int] = Field(None, ge=1, description="HCCL_BUFFSIZE (MB) on FFN pods.")


class AscendSpec(Strict):
    resource_name: str = Field(DEFAULT_RESOURCE_NAME, description="Extended resource of the NPU device plugin.")
    host_network: bool = Field(True, description="Use host networking (needed for same-node HCCS).")
    host_port_stride: int = Field(
        16, ge=1, le=1024,
        description="With hostNetwork, instance i uses ports base + i*stride so instances sharing a "
        "node never collide. Pods of one instance and role use the same ports (declared as host "
        "ports, so the scheduler puts them on different nodes).",
    )
    shm_size: str = Field("16Gi", description="Size of the memory-backed /dev/shm.")
    socket_interface: Optional[str] = Field(
        None, min_length=1, description="NIC name for HCCL/GLOO/TP_SOCKET_IFNAME."
    )
    hccl_buffer_size_mb: HcclBufferSizes = Field(default_factory=HcclBufferSizes, alias="hcclBufferSizeMB")
    driver_host_paths: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DRIVER_HOST_PATHS), description="Host paths mounted read-only."
    )
    mount_hccn_conf: bool = Field(True, description="Mount /etc/hccn.conf from the host.")

    @field_validator("resource_name")
    @classmethod
    def _valid_resource(cls, v: str) -> str:
        if not _RESOURCE_NAME.match(v) or len(v) > 253:
            raise ValueError("must be an extended resource name like 'vendor.example/device'")
        return v

    @field_validator("shm_size")
    @classmethod
    def _valid_quantity(cls, v: str) -> str:
        try:
            if parse_quantity(v) > 0:
                return v
        except ValueError:
            pass
        raise ValueError("must be a positive Kubernetes quantity such as '16Gi'")

    @field_validator("driver_host_paths")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/"):
                raise ValueError(f"'{p}' must be an absolute path")
        return v


class GangSpec(Strict):
    provider: Literal["none", "volcano"] = Field("none", description="Gang scheduler.")
    queue: Optional[str] = Field(None, min_length=1, description="Volcano queue.")


class SchedulingSpec(Strict):
    gang: GangSpec = Field(default_factory=GangSpec)
    priority_class_name: Optional[str] = Field(None, min_length=1)


class StartupSpec(Strict):
    order: Literal["FFNFirst", "Parallel"] = Field(
        "FFNFirst", description="FFNFirst starts Attention pods once FFN pods run."
    )
    timeout_seconds: int = Field(1800, ge=1, description=(
        "An instance not Ready by then is Failed. Also how long its Attention ranks wait at the "
        "rendezvous for FFN servers still loading their experts, and vLLM for its engines."))


class RecoverySpec(Strict):
    policy: Literal["RecreateInstance", "None"] = Field("RecreateInstance")
    backoff_seconds: int = Field(10, ge=0)
    max_backoff_seconds: int = Field(600, ge=0)
    max_restarts: int = Field(5, ge=0, description="Consecutive failures before an instance stays down.")
    unready_grace_seconds: int = Field(
        60, ge=0, description="A pod of a Ready instance that stays not Ready this long fails the instance."
    )
    stable_seconds: int = Field(
        600, ge=0,
        description="An instance Ready this long after a restart has recovered: its consecutive failures reset.",
    )


IntOrPercent = Union[int, str]


def _int_or_percent(v: IntOrPercent) -> IntOrPercent:
    if isinstance(v, bool):
        raise ValueError("must be an integer or a percentage like '25%'")
    if isinstance(v, int):
        if v < 0:
            raise ValueError("must be >= 0")
        return v
    if not _PERCENT.match(v):
        raise ValueError("must be an integer or a percentage like '25%'")
    return v


class UpdateStrategySpec(Strict):
    type: Literal["RollingUpdate", "Recreate"] = Field("RollingUpdate")
    max_surge: IntOrPercent = Field(1, json_schema_extra=INT_OR_STRING, description="Instances or percent.")
    max_unavailable: IntOrPercent = Field(0, json_schema_extra=INT_OR_STRING, description="Instances or percent.")
    partition: int = Field(0, ge=0, description="Old-revision instances kept.")
    paused: bool = Field(False, description="Freeze the rollout.")

    @field_validator("max_surge", "max_unavailable", mode="before")
    @classmethod
    def _check(cls, v: Any) -> Any:
        return _int_or_percent(v) if isinstance(v, (int, str)) else v


class TerminationSpec(Strict):
    grace_period_seconds: int = Field(120, ge=0)
    drain_seconds: int = Field(30, ge=0, description="Wait after leaving the Service before deleting pods.")


class ServiceSpec(Strict):
    port: int = _port(8000, "OpenAI API port.")
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP")


class MetricsSpec(Strict):
    enabled: bool = Field(True, description="Serve Prometheus metrics from FFN pods (Attention heads serve them on the API port).")
    port: int = _port(9400, "FFN server metrics port.")
    pod_monitor: bool = Field(False, description="Render a prometheus-operator PodMonitor.")


class AFDDeploymentSpec(Strict):
    replicas: int = Field(1, ge=0, description="AFD instances; one instance is one connector world.")
    image: str = Field(min_length=1, description="Runtime image (vLLM-Ascend + plugin).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names.")
    platform: Literal["ascend", "cpu"] = Field("ascend")
    cluster_domain: str = Field("cluster.local", min_length=1, description="Cluster DNS domain.")
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


class Condition(Strict):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
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


class InstanceStatus(Strict):
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


class AFDDeploymentStatus(Strict):
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
    """The part of metadata the planner needs; the rest passes through untouched."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    namespace: str = "default"


class AFDDeployment(Strict):
    api_version: Literal["afd.inference.dev/v1alpha1"]
    kind: Literal["AFDDeployment"]
    metadata: ObjectMeta
    spec: AFDDeploymentSpec
    status: Optional[AFDDeploymentStatus] = None
