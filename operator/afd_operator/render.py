"""Renderer: (spec, plan) -> Kubernetes objects. Pure: no I/O.

The operator manages Pods directly (not StatefulSets/LWS) so that an instance is created,
ordered, recreated and rolled as one unit. Objects per deployment: a ConfigMap per
revision (the plan summary, pods per role: how the reconciler knows the layout of an
older revision's instances while they are still running; only the current revision's
instances are ever created), a headless Service per instance (stable pod DNS for the
connector rendezvous), a PodDisruptionBudget and a NetworkPolicy per instance, the OpenAI API
Service (serving Attention heads only), a Volcano PodGroup per instance when gang scheduling is
on, a PodMonitor when asked, and one Pod per planned pod, restricted by default (seccomp,
no capabilities, no privilege escalation, no service-account token; on platform cpu a
non-root user and a read-only root filesystem).

Each pod's `afd` block is the planner's `AFDConfig`, serialized by the plugin's own
`as_additional_config()` into `--additional-config`: one schema, which `parse_afd_config`
in the pod reads back unchanged.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from . import naming
from .api import API_VERSION, KIND, AFDDeploymentSpec, PodTemplateOverrides
from .planner import (ASCEND_HOST_VOLUME, HCCN_VOLUME, METRICS_VOLUME, MODEL_VOLUME, SCRATCH_VOLUME, SHM_VOLUME,
                      InstancePlan, Plan, PodPlan, operator_mounts, prestop_seconds, read_only_root,
                      uses_host_network)
from .kube_types import wire
from .policy import DNS_PORTS, ClusterPolicy, NetworkIsolation

Obj = dict[str, Any]

# Startup and readiness are polled often: a pod serves (and a recreated instance returns) within
# a couple of seconds of its server answering, not half a 10 s period later on average. An HTTP
# GET every 2 s is nothing beside an engine. Readiness still tolerates a 16 s stall before the
# pod leaves the Service, as 3 misses 5 s apart did; liveness keeps a minute.
STARTUP_PROBE_PERIOD_SECONDS = 2
READINESS_PROBE = {"period": 2, "failures": 8}
LIVENESS_PROBE = {"period": 10, "failures": 6}
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")
# Device nodes of the NPU driver belong to its own user on the host and keep that owner in the
# container; root (ascend.runAsRoot, as the vLLM-Ascend images run) opens them only with this
# capability.
ASCEND_CAPABILITIES = ["DAC_OVERRIDE"]


def owner_reference(name: str, uid: str) -> Obj:
    return {
        "apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
        "controller": True, "blockOwnerDeletion": True,
    }


def _meta(name: str, namespace: str, labels: dict[str, str], owner: Optional[Obj],
          annotations: Optional[dict[str, str]] = None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def image_version_label(image: str) -> Optional[str]:
    """app.kubernetes.io/version from the image tag, when there is a usable one."""
    ref = image.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    tag = _LABEL_VALUE.sub("-", last.split(":", 1)[1])[:63].strip("-._")
    return tag or None


@dataclass(frozen=True)
class RolePieces:
    """A role's pieces of the spec as every one of its pods carries them, put in wire form once
    (an instance may have a thousand pods of a role)."""

    env: list[Obj]
    volumes: list[Obj]
    volume_mounts: list[Obj]
    tolerations: list[Obj]
    affinity: Optional[Obj]
    topology_spread_constraints: list[Obj]


def role_pieces(spec: AFDDeploymentSpec, role: str) -> RolePieces:
    role_spec = spec.attention if role == "attention" else spec.ffn
    overrides = role_spec.pod_template
    return RolePieces(
        env=[u.model_dump(by_alias=True, exclude_none=True) for u in role_spec.env],
        volumes=[wire(v) for v in overrides.volumes], volume_mounts=[wire(m) for m in overrides.volume_mounts],
        tolerations=[wire(t) for t in overrides.tolerations],
        affinity=wire(overrides.affinity) if overrides.affinity else None,
        topology_spread_constraints=[wire(t) for t in overrides.topology_spread_constraints])


def _env(plan_env: tuple[tuple[str, str], ...], spec: AFDDeploymentSpec, pod: PodPlan,
         revision: str, instance: InstancePlan, user: list[Obj]) -> list[Obj]:
    def field(path: str) -> Obj:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[Obj] = [
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
    ]
    if spec.platform == "ascend":
        env.append({"name": "HCCL_IF_IP", **field("status.podIP")})
    env += [
        {"name": "AFD_INSTANCE", "value": instance.name},
        {"name": "AFD_ROLE", "value": pod.role},
        {"name": "AFD_REVISION", "value": revision},
    ]
    env += [{"name": k, "value": v} for k, v in plan_env]
    # User variables win over the operator's defaults of the same name.
    overridden = {u["name"] for u in user}
    env = [e for e in env if e["name"] not in overridden]
    return env + user


def _resources(spec: AFDDeploymentSpec, pod: PodPlan, overrides: PodTemplateOverrides) -> Obj:
    requests: dict[str, Any] = dict(overrides.resources.requests)
    limits: dict[str, Any] = dict(overrides.resources.limits)
    if spec.platform == "ascend":
        # Extended resources must have requests == limits.
        requests[spec.ascend.resource_name] = pod.ranks
        limits[spec.ascend.resource_name] = pod.ranks
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _operator_volume(spec: AFDDeploymentSpec, name: str, path: str) -> Obj:
    if name == SHM_VOLUME:
        shm: Obj = {"medium": "Memory"}
        if spec.platform == "ascend":
            shm["sizeLimit"] = spec.ascend.shm_size
        return {"name": name, "emptyDir": shm}
    if name in (METRICS_VOLUME, SCRATCH_VOLUME):
        return {"name": name, "emptyDir": {}}
    if name == MODEL_VOLUME:
        vol = spec.model.volume
        if vol.claim_name is not None:
            return {"name": name, "persistentVolumeClaim": {"claimName": vol.claim_name, "readOnly": True}}
        return {"name": name, "hostPath": {"path": vol.host_path, "type": "Directory"}}
    if name == HCCN_VOLUME:
        return {"name": name, "hostPath": {"path": path, "type": "File"}}
    assert name.startswith(ASCEND_HOST_VOLUME), name
    return {"name": name, "hostPath": {"path": path}}


def _volumes(spec: AFDDeploymentSpec, pod: PodPlan, pieces: RolePieces) -> tuple[list[Obj], list[Obj]]:
    volumes, mounts = [], []
    for name, path in operator_mounts(spec, head=pod.head).items():
        volumes.append(_operator_volume(spec, name, path))
        mount: Obj = {"name": name, "mountPath": path}
        if volumes[-1].keys() & {"hostPath", "persistentVolumeClaim"}:
            mount["readOnly"] = True
        mounts.append(mount)
    return volumes + pieces.volumes, mounts + pieces.volume_mounts


def _security_contexts(spec: AFDDeploymentSpec) -> tuple[Obj, Obj]:
    """(pod, container) security contexts: the restricted profile, less what Ascend needs."""
    pod: Obj = {"seccompProfile": {"type": "RuntimeDefault"}}
    container: Obj = {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]}}
    if read_only_root(spec):
        # On cpu the image's numeric USER (images/runtime-cpu) runs the processes; kubelet checks
        # it is not root.
        pod["runAsNonRoot"] = True
        container["readOnlyRootFilesystem"] = True
        if spec.platform == "ascend":
            # The device nodes keep their host owner and mode (group-readable by the driver's
            # group): membership of that group opens them without root or a capability.
            pod.update(runAsUser=spec.ascend.run_as_user, supplementalGroups=[spec.ascend.driver_group])
    else:
        container["capabilities"]["add"] = list(ASCEND_CAPABILITIES)
    return pod, container


def _http_probe(path: str, port: str, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _probes(spec: AFDDeploymentSpec, pod: PodPlan) -> Obj:
    # The startup probe covers model loading up to startup.timeoutSeconds; afterwards the
    # liveness probe takes over. Headless Attention pods serve no HTTP: their engines are
    # supervised through the head's /health.
    if pod.role == "attention" and pod.head:
        port, ready_path = "api", "/health"
    elif pod.role == "ffn":
        port, ready_path = "health", "/ready"
    else:
        return {}
    startup_failures = max(1, math.ceil(spec.startup.timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS))
    return {
        "startupProbe": _http_probe("/health", port, STARTUP_PROBE_PERIOD_SECONDS, startup_failures),
        "readinessProbe": _http_probe(ready_path, port, **READINESS_PROBE),
        "livenessProbe": _http_probe("/health", port, **LIVENESS_PROBE),
    }


def _merge_labels(*parts: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in parts:
        out.update(p)
    return out


def additional_config_json(pod: PodPlan) -> str:
    """The `--additional-config` value of a pod: its AFDConfig as the plugin serializes it."""
    return json.dumps(pod.afd_config.as_additional_config(), sort_keys=True, separators=(",", ":"))


def render_pod(spec: AFDDeploymentSpec, plan: Plan, instance: InstancePlan, pod: PodPlan,
               owner: Optional[Obj] = None, pieces: Optional[RolePieces] = None) -> Obj:
    """One pod; `pieces` (role_pieces of its role) saves putting them in wire form per pod."""
    overrides = (spec.attention if pod.role == "attention" else spec.ffn).pod_template
    pieces = pieces or role_pieces(spec, pod.role)
    host_net = uses_host_network(spec)
    labels = _merge_labels(
        overrides.labels,
        naming.base_labels(plan.name, pod.role),
        naming.instance_labels(plan.name, plan.revision, instance.index),
        {naming.LABEL_ROLE: pod.role, naming.LABEL_POD_ORDINAL: str(pod.ordinal),
         naming.LABEL_HEAD: "true" if pod.head else "false"},
    )
    version = image_version_label(spec.image)
    if version:
        labels[naming.LABEL_VERSION] = version
    annotations = dict(overrides.annotations)
    if spec.scheduling.gang.provider == "volcano":
        annotations["scheduling.k8s.io/group-name"] = instance.name
    volumes, mounts = _volumes(spec, pod, pieces)
    ports = []
    for port_name, number in pod.ports:
        entry: Obj = {"name": port_name, "containerPort": number, "protocol": "TCP"}
        if host_net:
            entry["hostPort"] = number
        ports.append(entry)
    pod_security, container_security = _security_contexts(spec)
    container: Obj = {
        "name": pod.role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": [*pod.command, "--additional-config", additional_config_json(pod)],
        "env": _env(pod.env, spec, pod, plan.revision, instance, pieces.env),
        "ports": ports,
        "resources": _resources(spec, pod, overrides),
        "volumeMounts": mounts,
        "securityContext": container_security,
        # A rank that fails leaves its log's tail in its status; the operator's failure event
        # quotes its last line after the pod is gone.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(spec, pod),
    }
    if pod.head:
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(prestop_seconds(spec))]}}}
    pod_spec: Obj = {
        "hostname": pod.name,
        "subdomain": instance.name,
        # A rank that exits cannot rejoin its connector world: the pod fails and the
        # operator recreates the whole instance instead of the kubelet restarting one rank.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.termination.grace_period_seconds,
        "enableServiceLinks": False,
        # The runtime never calls the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": pod_security,
        "containers": [container],
        "volumes": volumes,
    }
    if host_net:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.scheduling.gang.provider == "volcano":
        pod_spec["schedulerName"] = "volcano"
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    if overrides.node_selector:
        pod_spec["nodeSelector"] = dict(overrides.node_selector)
    if pieces.tolerations:
        pod_spec["tolerations"] = pieces.tolerations
    if pieces.affinity:
        pod_spec["affinity"] = pieces.affinity
    if pieces.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = pieces.topology_spread_constraints
    if overrides.service_account_name:
        pod_spec["serviceAccountName"] = overrides.service_account_name
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": _meta(pod.name, plan.namespace, labels, owner, annotations),
        "spec": pod_spec,
    }


def render_instance_service(spec: AFDDeploymentSpec, plan: Plan, instance: InstancePlan,
                            owner: Optional[Obj] = None) -> Obj:
    labels = _merge_labels(naming.base_labels(plan.name, "instance"),
                           naming.instance_labels(plan.name, plan.revision, instance.index))
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(instance.name, plan.namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            # Ranks rendezvous before they are Ready: their DNS names must resolve early.
            "publishNotReadyAddresses": True,
            "selector": {naming.LABEL_AFD_INSTANCE: instance.name},
            "ports": [{"name": "connector", "port": instance.ports.connector, "protocol": "TCP"}],
        },
    }


def render_api_service(spec: AFDDeploymentSpec, plan: Plan, owner: Optional[Obj] = None) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(naming.api_service_name(plan.name), plan.namespace,
                          naming.base_labels(plan.name, "api"), owner),
        "spec": {
            "type": spec.service.type,
            "selector": {
                naming.LABEL_DEPLOYMENT: plan.name,
                naming.LABEL_ROLE: "attention",
                naming.LABEL_HEAD: "true",
                naming.LABEL_SERVING: "true",
            },
            # Named target port: under host networking every instance's head has its own port.
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "api", "protocol": "TCP"}],
        },
    }


def render_runtime_configmap(plan: Plan, owner: Optional[Obj] = None) -> Obj:
    labels = _merge_labels(naming.base_labels(plan.name, "runtime-config"), {naming.LABEL_REVISION: plan.revision})
    summary = {
        "revision": plan.revision,
        "topology": plan.topology,
        "attentionRanks": plan.attention.ranks,
        "attentionPods": plan.attention.pods,
        "ffnRanks": plan.ffn.ranks,
        "ffnPods": plan.ffn.pods,
    }
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(naming.runtime_configmap_name(plan.name, plan.revision), plan.namespace, labels, owner),
        "data": {"plan.json": json.dumps(summary, sort_keys=True)},
        # One revision's facts: written once, never changed (a tenant who may edit ConfigMaps
        # cannot rewrite it in place; observe.read_plan_summary reads a recreated one strictly).
        "immutable": True,
    }


def render_pdb(plan: Plan, instance: InstancePlan, owner: Optional[Obj] = None,
               unhealthy_eviction_policy: bool = True) -> Obj:
    """At most one pod of the instance disrupted at a time: losing a pod loses the instance.
    An integer minAvailable makes the disruption controller count the pods the selector finds
    (with maxUnavailable it would take the expected count from the AFDDeployment's scale,
    which counts instances, not pods). Pods not Ready yet (an instance still loading) may always
    be evicted: the budget guards serving worlds, and a drain must not wait on a starting one
    (unhealthyPodEvictionPolicy, kept by API servers from 1.27 on; left out for older ones)."""
    labels = _merge_labels(naming.base_labels(plan.name, "disruption-budget"),
                           naming.instance_labels(plan.name, plan.revision, instance.index))
    spec: Obj = {"minAvailable": plan.pods_per_instance - 1,
                 "selector": {"matchLabels": {naming.LABEL_AFD_INSTANCE: instance.name}}}
    if unhealthy_eviction_policy:
        spec["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(instance.name, plan.namespace, labels, owner),
        "spec": spec,
    }


def render_network_policy(spec: AFDDeploymentSpec, plan: Plan, instance: InstancePlan, network: NetworkIsolation,
                          owner: Optional[Obj] = None) -> Obj:
    """Traffic of the instance's pods. In: anything from pods of the same instance (the
    connector rendezvous, DP RPC and FFN ports, and the ports the engines and the AFD process
    group pick at run time), the API port from `service.allowedClients` (anyone when empty) and
    the chart's `networkPolicy.metricsFrom`, the FFN metrics port from `metricsFrom`. Out: the
    same instance, the cluster DNS (`dnsTo`) and the admin's `egressTo` grants only (no cloud
    metadata endpoint, no other tenant). Probes come from the node, which NetworkPolicy always
    admits. Membership (the instance label) is the operator's alone: membership.py."""
    def own() -> Obj:
        return {"matchLabels": {naming.LABEL_AFD_INSTANCE: instance.name}}

    api_rule: Obj = {"ports": [{"protocol": "TCP", "port": "api"}]}
    if spec.service.allowed_clients:
        # The head serves its metrics on the API port: scrapers keep their way in.
        api_rule["from"] = [wire(p) for p in spec.service.allowed_clients] + [dict(p) for p in network.metrics_from]
    ingress = [{"from": [{"podSelector": own()}]}, api_rule]
    if spec.metrics.enabled and network.metrics_from:
        ingress.append({"from": [dict(p) for p in network.metrics_from],
                        "ports": [{"protocol": "TCP", "port": "metrics"}]})
    egress: list[Obj] = [{"to": [{"podSelector": own()}]}]
    if network.dns_to:
        egress.append({"to": [dict(p) for p in network.dns_to], "ports": [dict(p) for p in DNS_PORTS]})
    egress += [copy.deepcopy(rule) for rule in network.egress_to]
    labels = _merge_labels(naming.base_labels(plan.name, "network-policy"),
                           naming.instance_labels(plan.name, plan.revision, instance.index))
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(instance.name, plan.namespace, labels, owner),
        "spec": {"podSelector": own(), "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress},
    }


def covers_pods(spec: AFDDeploymentSpec, network: NetworkIsolation) -> bool:
    """Whether NetworkPolicies are rendered: on unless the chart turns them off; host-network
    pods cannot be selected by one (the NetworkIsolated condition says so)."""
    return network.enabled and not uses_host_network(spec)


def render_pod_group(spec: AFDDeploymentSpec, plan: Plan, instance: InstancePlan, owner: Optional[Obj] = None) -> Obj:
    labels = _merge_labels(naming.base_labels(plan.name, "instance"),
                           naming.instance_labels(plan.name, plan.revision, instance.index))
    group_spec: Obj = {"minMember": plan.pods_per_instance}
    if spec.scheduling.gang.queue:
        group_spec["queue"] = spec.scheduling.gang.queue
    if spec.scheduling.priority_class_name:
        group_spec["priorityClassName"] = spec.scheduling.priority_class_name
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
        "metadata": _meta(instance.name, plan.namespace, labels, owner),
        "spec": group_spec,
    }


def render_pod_monitor(spec: AFDDeploymentSpec, plan: Plan, owner: Optional[Obj] = None) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": _meta(naming.pod_monitor_name(plan.name), plan.namespace,
                          naming.base_labels(plan.name, "metrics"), owner),
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(plan.name)},
            "podMetricsEndpoints": [{"port": "api", "path": "/metrics"}, {"port": "metrics", "path": "/metrics"}],
        },
    }


def render_instance(spec: AFDDeploymentSpec, plan: Plan, instance: InstancePlan, owner: Optional[Obj] = None,
                    network: NetworkIsolation = NetworkIsolation()) -> list[Obj]:
    """Objects of one instance: headless Service, PDB, NetworkPolicy, PodGroup (gang) and its
    pods (FFN first)."""
    objs = [render_instance_service(spec, plan, instance, owner), render_pdb(plan, instance, owner)]
    if covers_pods(spec, network):
        objs.append(render_network_policy(spec, plan, instance, network, owner))
    if spec.scheduling.gang.provider == "volcano":
        objs.append(render_pod_group(spec, plan, instance, owner))
    pieces = {role: role_pieces(spec, role) for role in ("attention", "ffn")}
    objs += [render_pod(spec, plan, instance, pod, owner, pieces[pod.role]) for pod in instance.pods]
    return objs


def render_shared(spec: AFDDeploymentSpec, plan: Plan, owner: Optional[Obj] = None) -> list[Obj]:
    """Objects shared by all instances of the plan's revision."""
    objs = [render_runtime_configmap(plan, owner), render_api_service(spec, plan, owner)]
    if spec.metrics.enabled and spec.metrics.pod_monitor:
        objs.append(render_pod_monitor(spec, plan, owner))
    return objs


def render(spec: AFDDeploymentSpec, plan: Plan, owner_uid: Optional[str] = None,
           policy: ClusterPolicy = ClusterPolicy()) -> list[Obj]:
    """Every object of a deployment at the plan's revision, in a stable order."""
    owner = owner_reference(plan.name, owner_uid) if owner_uid else None
    objs = render_shared(spec, plan, owner)
    for instance in plan.instances:
        objs += render_instance(spec, plan, instance, owner, policy.network)
    return objs
