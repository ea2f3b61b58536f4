"""Topology planner: spec -> Plan. Pure: no I/O, no clock, no randomness.

An *instance* is one complete connector world: A = DP x TP Attention ranks (world ranks
0..A-1) and F FFN ranks (world ranks A..A+F-1). The plan lists, per instance, every pod
with the ranks and devices it holds, its DP start rank, whether it is the Attention head,
its command line, environment, ports and the plugin's own `AFDConfig` it is started with
(the renderer serializes it into `--additional-config`). The config is built through the
plugin's parser, so a spec the pods would refuse raises `AFDConfigError` here; validation
turns that into a problem before anything is planned for real.

Endpoints are DNS names of pods behind the instance's headless Service, so the plan can
be wired before any pod IP exists. With host networking, instances that share a node
must not share ports: instance i uses base + i*stride for every port. Pods of one
instance and role use the same ports (no per-pod offset); since they are declared as
host ports, the scheduler never puts two of them on one node. Only the head and the FFN
pods declare ports: headless Attention pods may share a node with any pod.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Iterable, Literal, Optional, Union

from afd_shared_experts.config import AFDConfig, MinSplitTokens, SharedExpertsConfig, stage_limit

from . import naming
from .engine_args import flag_values
from .api import DEFAULT_STAGES, HCCN_CONF, AFDDeploymentSpec, ResourceRequirements
from .kube_rules import quantity_value
from .revision import revision_of

Role = Literal["attention", "ffn"]

PLUGIN_NAME = "afd_shared_experts"
FFN_SERVER_MODULE = "afd_shared_experts.ffn_server"



def resolve_int_or_percent(value: Union[int, str], total: int, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    scaled = int(value[:-1]) * total / 100
    return math.ceil(scaled) if round_up else math.floor(scaled)


@dataclass(frozen=True)
class RolloutBudget:
    """updateStrategy resolved against replicas: how far a rollout may go above and below."""

    surge: int  # instances above replicas
    unavailable: int  # instances below replicas
    floor: int  # Ready instances a rollout keeps: replicas - unavailable


def rollout_budget(spec: AFDDeploymentSpec) -> RolloutBudget:
    """The one resolution of maxSurge/maxUnavailable (controller, status, PDB and validation)."""
    total = max(spec.replicas, 1)
    us = spec.update_strategy
    unavailable = resolve_int_or_percent(us.max_unavailable, total, round_up=False)
    return RolloutBudget(surge=resolve_int_or_percent(us.max_surge, total, round_up=True),
                         unavailable=unavailable, floor=max(spec.replicas - unavailable, 0))

@dataclass(frozen=True)
class RoleLayout:
    """How one role's ranks are packed into pods."""

    ranks: int
    pods: int
    ranks_per_pod: int

    def ranks_of(self, ordinal: int) -> tuple[int, int]:
        """(first role rank, rank count) of pod `ordinal`."""
        start = ordinal * self.ranks_per_pod
        return start, min(self.ranks_per_pod, self.ranks - start)


def attention_layout(spec: AFDDeploymentSpec) -> RoleLayout:
    ranks = spec.attention.data_parallel * spec.attention.tensor_parallel
    per_pod = min(spec.attention.devices_per_pod, ranks)
    return RoleLayout(ranks=ranks, pods=math.ceil(ranks / per_pod), ranks_per_pod=per_pod)


def ffn_layout(spec: AFDDeploymentSpec) -> RoleLayout:
    ranks = spec.ffn.ranks
    per_pod = min(spec.ffn.devices_per_pod, ranks)
    return RoleLayout(ranks=ranks, pods=math.ceil(ranks / per_pod), ranks_per_pod=per_pod)


def topology_string(spec: AFDDeploymentSpec) -> str:
    a = spec.attention
    return f"DP{a.data_parallel}xTP{a.tensor_parallel}+EP{spec.ffn.ranks}"


def uses_host_network(spec: AFDDeploymentSpec) -> bool:
    return spec.platform == "ascend" and spec.ascend.host_network


def port_offset(spec: AFDDeploymentSpec, index: int) -> int:
    return index * spec.ascend.host_port_stride if uses_host_network(spec) else 0


@dataclass(frozen=True)
class InstancePorts:
    """Ports of one instance: Attention ports on the head, FFN ports on every FFN pod."""

    api: int
    dp_rpc: int
    connector: int
    ffn_metrics: int
    ffn_health: int


def instance_ports(spec: AFDDeploymentSpec, index: int) -> InstancePorts:
    off = port_offset(spec, index)
    return InstancePorts(
        api=spec.service.port + off,
        dp_rpc=spec.attention.data_parallel_rpc_port + off,
        connector=spec.connector.port + off,
        ffn_metrics=spec.metrics.port + off,
        ffn_health=spec.ffn.health_port + off,
    )


@dataclass(frozen=True)
class PodPlan:
    role: Role
    ordinal: int
    name: str
    rank_start: int  # first role rank held (Attention: (dp*pcp+pcp_rank)*tp+tp_rank)
    ranks: int  # role ranks held; equals the devices requested on device platforms
    world_rank_start: int  # first rank in the AFD connector world
    head: bool
    dp_start_rank: Optional[int]  # Attention only
    dp_local: Optional[int]  # Attention only
    command: tuple[str, ...]  # without --additional-config: the renderer adds it from afd_config
    env: tuple[tuple[str, str], ...]  # literal env the runtime needs, in order
    ports: tuple[tuple[str, int], ...]  # (name, containerPort)
    afd_config: AFDConfig


@dataclass(frozen=True)
class InstancePlan:
    index: int
    name: str  # also the headless Service name
    head_host: str  # DNS name of the Attention head: connector host and DP address
    ports: InstancePorts
    pods: tuple[PodPlan, ...]

    def pods_of(self, role: Role) -> tuple[PodPlan, ...]:
        return tuple(p for p in self.pods if p.role == role)


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    revision: str
    topology: str
    attention: RoleLayout
    ffn: RoleLayout
    instances: tuple[InstancePlan, ...]

    @property
    def pods_per_instance(self) -> int:
        return self.attention.pods + self.ffn.pods


def _int_flag(values: dict[str, Optional[str]], *flags: str, default: int) -> int:
    for flag in flags:
        if flag in values:
            try:
                return int(values[flag] or default)
            except ValueError:
                return default + 1  # unreadable: treated as set, so the stage rule refuses it
    return default


def attention_pipeline_parallel(spec: AFDDeploymentSpec) -> int:
    """The Attention engines' --pipeline-parallel-size (1 unless engineArgs set it)."""
    return _int_flag(flag_values(spec.attention.engine_args), "--pipeline-parallel-size", default=1)


def spec_stage_limit(spec: AFDDeploymentSpec) -> tuple[int, str]:
    """The plugin's stage rule (`stage_limit`) for the Attention engines this spec renders."""
    values = flag_values(spec.attention.engine_args)
    worker_cls = values.get("--worker-cls", "auto")
    return stage_limit(
        platform=spec.platform,
        worker_cls=None if worker_cls in ("auto", None) else worker_cls,
        speculative="--speculative-config" in values,
        pipeline_parallel=attention_pipeline_parallel(spec),
        vllm_micro_batching="--enable-dbo" in values or _int_flag(values, "--ubatch-size", default=0) > 1)


def resolve_stages(spec: AFDDeploymentSpec) -> int:
    """Micro-batch stages per Attention step: spec.async.stages, else DEFAULT_STAGES where the
    plugin's stage rule and the step's token budget allow it and the shared experts run on the
    FFN side, 1 otherwise. Under placement 'attention' the FFN side holds too little of a step
    to overlap: 2 stages never paid there (docs/benchmarks.md: 1.00x and 0.62x of one stage,
    against perfect-overlap bounds of 1.21x and 1.16x)."""
    if spec.async_.stages is not None:
        return spec.async_.stages
    if spec.shared_experts.placement == "attention":
        return 1
    limit, _ = spec_stage_limit(spec)
    return min(DEFAULT_STAGES, limit, spec.model.max_num_batched_tokens)


def afd_config(spec: AFDDeploymentSpec, role: Role, host: str, port: int) -> AFDConfig:
    """The plugin's config of one pod. Raises the plugin's `AFDConfigError` (a block path
    and the rule) when the spec's connector name or extraConfig is one the pods refuse."""
    return AFDConfig.build(
        role=role,
        connector=spec.connector.name,
        host=host,
        port=port,
        num_attention_ranks=spec.attention.data_parallel * spec.attention.tensor_parallel,
        num_ffn_ranks=spec.ffn.ranks,
        num_stages=resolve_stages(spec),
        min_split_tokens=MinSplitTokens(decode=spec.async_.min_split_tokens.decode,
                                        prefill=spec.async_.min_split_tokens.prefill),
        attn_ranks_per_dp=spec.attention.tensor_parallel,
        connector_extra_config=spec.connector.extra_config,
        shared_experts=SharedExpertsConfig(placement=spec.shared_experts.placement,
                                           partition=spec.shared_experts.partition),
        # Rank 0 waits for FFN servers still loading their experts as long as the instance
        # may take to become Ready; past that the operator fails the instance anyway.
        rendezvous_timeout_seconds=float(spec.startup.timeout_seconds),
    )


# Lets kube-proxy drop a deleted head from the API Service before vLLM gets SIGTERM.
PRESTOP_ENDPOINT_GRACE_SECONDS = 5
# Kept back from the termination grace period for vLLM to stop its processes after draining.
ENGINE_EXIT_MARGIN_SECONDS = 10


def prestop_seconds(spec: AFDDeploymentSpec) -> int:
    """The head's preStop wait (it counts against terminationGracePeriodSeconds)."""
    return min(PRESTOP_ENDPOINT_GRACE_SECONDS, spec.termination.grace_period_seconds)


def engine_shutdown_timeout(spec: AFDDeploymentSpec, head: bool) -> int:
    """vLLM's --shutdown-timeout for an Attention pod. At vLLM's default (0) SIGTERM aborts
    running requests and force-kills the engine and worker processes at once, so no Attention
    rank sends its AFD shutdown notice and the FFN pods fail on every teardown. Sized so the
    engine drains and every process exits before the kubelet's SIGKILL."""
    left = spec.termination.grace_period_seconds - (prestop_seconds(spec) if head else 0)
    return max(1, left - ENGINE_EXIT_MARGIN_SECONDS)


def _model_args(spec: AFDDeploymentSpec) -> list[str]:
    m = spec.model
    args = ["--max-num-batched-tokens", str(m.max_num_batched_tokens), "--dtype", m.dtype]
    if m.max_model_len is not None:
        args += ["--max-model-len", str(m.max_model_len)]
    if m.quantization is not None:
        args += ["--quantization", m.quantization]
    return args


def _common_env(spec: AFDDeploymentSpec, role: Role) -> list[tuple[str, str]]:
    plugins = f"ascend,{PLUGIN_NAME}" if spec.platform == "ascend" else PLUGIN_NAME
    env = [("VLLM_PLUGINS", plugins)]
    if spec.platform == "ascend":
        asc = spec.ascend
        if asc.socket_interface:
            env += [
                ("HCCL_SOCKET_IFNAME", asc.socket_interface),
                ("GLOO_SOCKET_IFNAME", asc.socket_interface),
                ("TP_SOCKET_IFNAME", asc.socket_interface),
            ]
        buffer_mb = asc.hccl_buffer_size_mb.attention if role == "attention" else asc.hccl_buffer_size_mb.ffn
        if buffer_mb is not None:
            env.append(("HCCL_BUFFSIZE", str(buffer_mb)))
        env += [
            ("HCCL_OP_EXPANSION_MODE", "AIV"),
            ("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True"),
        ]
    else:
        # vLLM's CPU backend binds OpenMP threads per NUMA node and asserts with DP > 1.
        env.append(("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
    return env


def _container_cores(resources: ResourceRequirements) -> Optional[Decimal]:
    """The cores a container may use: its CPU limit, else its request; None when neither is set."""
    for amounts in (resources.limits, resources.requests):
        if "cpu" in amounts:
            return quantity_value(amounts["cpu"])
    return None


def _cpu_threads_env(spec: AFDDeploymentSpec, role: Role, rank_processes: int) -> list[tuple[str, str]]:
    """OMP_NUM_THREADS of each rank process on CPU nodes. With the binding off (above) every
    process's OpenMP pool spans all the host's cores whatever its pod was given, so pods sharing
    a node oversubscribe it and spin on each other's cores: on the 2-core test bed an Attention
    DP 2 instance served 1.9x more requests per CPU second at one thread per process than at two
    (benchmarks/cpu_threads.py). Each rank gets its share of the container's cores, at least one
    thread; nothing is set when the pod names no CPU."""
    if spec.platform != "cpu":
        return []
    role_spec = spec.attention if role == "attention" else spec.ffn
    cores = _container_cores(role_spec.pod_template.resources)
    if cores is None:
        return []
    return [("OMP_NUM_THREADS", str(max(1, math.floor(cores / rank_processes))))]


def _engine_ready_env(spec: AFDDeploymentSpec) -> list[tuple[str, str]]:
    """vLLM gives up on an engine that is not up within VLLM_ENGINE_READY_TIMEOUT_S (600 s by
    default); an AFD engine's model load includes the rendezvous with FFN servers that may
    still be loading, so the bound is the instance's startup timeout, like the probes'."""
    return [("VLLM_ENGINE_READY_TIMEOUT_S", str(spec.startup.timeout_seconds))]


# The head's vLLM API server serves /metrics from a prometheus_client multiprocess directory
# when this is set, so counters of its engine-core and worker processes (the plugin's afd_*
# metrics of each Attention rank) appear there beside vLLM's own. An emptyDir: fresh per pod.
PROMETHEUS_MULTIPROC_DIR = "/var/run/afd-prometheus"
# Where processes may write in pods with a read-only root filesystem: an emptyDir, also HOME, so
# vLLM's, torch's and Python's caches and temporary files land there, and on Ascend CANN's
# (ASCEND_CACHE_PATH, ASCEND_WORK_PATH) and its logs (ASCEND_PROCESS_LOG_PATH).
SCRATCH_DIR = "/tmp"
ASCEND_SCRATCH_ENV = (("ASCEND_CACHE_PATH", f"{SCRATCH_DIR}/ascend/cache"),
                      ("ASCEND_WORK_PATH", f"{SCRATCH_DIR}/ascend/work"),
                      ("ASCEND_PROCESS_LOG_PATH", f"{SCRATCH_DIR}/ascend/log"))
SHM_VOLUME, SCRATCH_VOLUME, METRICS_VOLUME = "dshm", "scratch", "prometheus-multiproc"
MODEL_VOLUME, HCCN_VOLUME, ASCEND_HOST_VOLUME = "model", "hccn-conf", "ascend-host"


def read_only_root(spec: AFDDeploymentSpec) -> bool:
    """Pods run with a read-only root filesystem as a non-root user: always on platform cpu, on
    ascend unless ascend.runAsRoot (docs/install.md)."""
    return spec.platform == "cpu" or not spec.ascend.run_as_root


def operator_mounts(spec: AFDDeploymentSpec, head: bool = True) -> dict[str, str]:
    """Volume name -> mount path of the volumes the operator gives a pod (the head's metrics
    directory included unless `head` is False). Users' volumes may use neither."""
    mounts = {SHM_VOLUME: "/dev/shm"}
    if head:
        mounts[METRICS_VOLUME] = PROMETHEUS_MULTIPROC_DIR
    if read_only_root(spec):
        mounts[SCRATCH_VOLUME] = SCRATCH_DIR
    if spec.model.volume is not None:
        mounts[MODEL_VOLUME] = spec.model.volume.mount_path
    if spec.platform == "ascend":
        for i, path in enumerate(spec.ascend.driver_host_paths):
            mounts[f"{ASCEND_HOST_VOLUME}-{i}"] = path
        if spec.ascend.mount_hccn_conf:
            mounts[HCCN_VOLUME] = HCCN_CONF
    return mounts


def _scratch_env(spec: AFDDeploymentSpec) -> list[tuple[str, str]]:
    if not read_only_root(spec):
        return []
    return [("HOME", SCRATCH_DIR), ("TMPDIR", SCRATCH_DIR),
            *(ASCEND_SCRATCH_ENV if spec.platform == "ascend" else ())]


def _attention_pod(
    spec: AFDDeploymentSpec, plan_name: str, revision: str, index: int, ordinal: int,
    layout: RoleLayout, head_host: str, ports: InstancePorts, config: AFDConfig,
) -> PodPlan:
    att = spec.attention
    rank_start, ranks = layout.ranks_of(ordinal)
    dp_local = ranks // att.tensor_parallel
    dp_start = rank_start // att.tensor_parallel
    head = ordinal == 0
    command = [
        "vllm", "serve", spec.model.path,
        "--served-model-name", spec.model.name,
        "--tensor-parallel-size", str(att.tensor_parallel),
        "--data-parallel-size", str(att.data_parallel),
        "--data-parallel-size-local", str(dp_local),
        "--data-parallel-address", head_host,
        "--data-parallel-rpc-port", str(ports.dp_rpc),
    ]
    if head:
        command += ["--host", "0.0.0.0", "--port", str(ports.api)]
    else:
        command += ["--headless", "--data-parallel-start-rank", str(dp_start)]
    command += ["--shutdown-timeout", str(engine_shutdown_timeout(spec, head))]
    command += _model_args(spec)
    # The plugin's load format: vLLM's loader without reading any routed-expert weight from
    # disk (docs/plugin.md). Before engineArgs, so a user's --load-format wins.
    command += ["--load-format", "afd", *att.engine_args]
    pod_ports = [("api", ports.api), ("dp-rpc", ports.dp_rpc), ("connector", ports.connector)] if head else []
    return PodPlan(
        role="attention", ordinal=ordinal,
        name=naming.pod_name(plan_name, revision, index, "attention", ordinal),
        rank_start=rank_start, ranks=ranks, world_rank_start=rank_start, head=head,
        dp_start_rank=dp_start, dp_local=dp_local, command=tuple(command),
        env=tuple(_common_env(spec, "attention") + _scratch_env(spec) + _cpu_threads_env(spec, "attention", ranks)
                  + _engine_ready_env(spec)
                  + ([("PROMETHEUS_MULTIPROC_DIR", PROMETHEUS_MULTIPROC_DIR)] if head else [])),
        ports=tuple(pod_ports), afd_config=config,
    )


def _ffn_pod(
    spec: AFDDeploymentSpec, plan_name: str, revision: str, index: int, ordinal: int,
    layout: RoleLayout, attention_ranks: int, ports: InstancePorts, config: AFDConfig,
) -> PodPlan:
    rank_start, ranks = layout.ranks_of(ordinal)
    metrics_port, health_port = ports.ffn_metrics, ports.ffn_health
    command = [
        "python3", "-m", FFN_SERVER_MODULE,
        "--model", spec.model.path,
        "--ffn-rank-start", str(rank_start),
        "--ffn-local-ranks", str(ranks),
        "--health-port", str(health_port),
    ]
    pod_ports = [("health", health_port)]
    if spec.metrics.enabled:
        command += ["--metrics-port", str(metrics_port)]
        pod_ports.append(("metrics", metrics_port))
    command += _model_args(spec)
    return PodPlan(
        role="ffn", ordinal=ordinal,
        name=naming.pod_name(plan_name, revision, index, "ffn", ordinal),
        rank_start=rank_start, ranks=ranks, world_rank_start=attention_ranks + rank_start, head=False,
        dp_start_rank=None, dp_local=None, command=tuple(command),
        env=tuple(_common_env(spec, "ffn") + _scratch_env(spec) + _cpu_threads_env(spec, "ffn", ranks)),
        ports=tuple(pod_ports), afd_config=config,
    )


def head_host(spec: AFDDeploymentSpec, name: str, namespace: str, revision: str, index: int) -> str:
    """DNS name of instance `index`'s Attention head: connector host and DP address."""
    inst = naming.instance_name(name, revision, index)
    return naming.pod_dns_name(naming.pod_name(name, revision, index, "attention", 0), inst, namespace,
                               spec.cluster_domain)


def role_configs(spec: AFDDeploymentSpec, frame: InstancePlan) -> dict[Role, AFDConfig]:
    """The AFDConfig of each role in the instance `frame` (`instance_frame`). Every pod of a
    role is started with the same one: its ranks find their place in the world from the
    command line."""
    return {role: afd_config(spec, role, frame.head_host, frame.ports.connector) for role in ("attention", "ffn")}


def instance_frame(spec: AFDDeploymentSpec, name: str, namespace: str, revision: str, index: int) -> InstancePlan:
    """Instance `index` without its pods: what its Service, PDB, NetworkPolicy and PodGroup need."""
    return InstancePlan(index=index, name=naming.instance_name(name, revision, index),
                        head_host=head_host(spec, name, namespace, revision, index),
                        ports=instance_ports(spec, index), pods=())


def plan_pods(spec: AFDDeploymentSpec, name: str, revision: str, frame: InstancePlan) -> InstancePlan:
    """The instance `frame` with its pods."""
    att, ffn = attention_layout(spec), ffn_layout(spec)
    configs = role_configs(spec, frame)
    index = frame.index
    # FFN pods first: with startup order FFNFirst they are created first.
    pods = [_ffn_pod(spec, name, revision, index, k, ffn, att.ranks, frame.ports, configs["ffn"])
            for k in range(ffn.pods)]
    pods += [_attention_pod(spec, name, revision, index, k, att, frame.head_host, frame.ports, configs["attention"])
             for k in range(att.pods)]
    return replace(frame, pods=tuple(pods))


def plan_instance(spec: AFDDeploymentSpec, name: str, namespace: str, revision: str, index: int) -> InstancePlan:
    return plan_pods(spec, name, revision, instance_frame(spec, name, namespace, revision, index))


def plan(
    spec: AFDDeploymentSpec, name: str, namespace: str, indices: Optional[Iterable[int]] = None
) -> Plan:
    """Plan instances `indices` (default 0..replicas-1) of a validated spec (`validate_spec`)."""
    revision = revision_of(spec)
    wanted = range(spec.replicas) if indices is None else sorted(set(indices))
    return Plan(
        name=name, namespace=namespace, revision=revision, topology=topology_string(spec),
        attention=attention_layout(spec), ffn=ffn_layout(spec),
        instances=tuple(plan_instance(spec, name, namespace, revision, i) for i in wanted),
    )
