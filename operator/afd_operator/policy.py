"""What the cluster admin lets AFDDeployments ask of the nodes, and how their pods are isolated:
the chart's `hostAccess` and `networkPolicy` values. The operator reads them from the file the
chart mounts (`--policy FILE`), `afdctl --policy VALUES.yaml` from the admin's values file; the
webhook and the operator refuse a spec that asks for more, naming the field and the chart value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import ConfigDict, Field, ValidationError

from .api import DEFAULT_DRIVER_HOST_PATHS, HCCN_CONF
from .documents import MAX_FILE_BYTES, read_documents
from .kube_types import (MAX_LIST_ITEMS, AbsolutePath, DNSSubdomain, NetworkPolicyEgressRule, NetworkPolicyPeer,
                         QualifiedName, Strict, wire)

# The host paths the operator mounts read-only on platform ascend: the driver, dcmi, npu-smi
# (ascend.driverHostPaths) and the NIC configuration (ascend.mountHccnConf).
DEFAULT_ASCEND_HOST_PATHS = (*DEFAULT_DRIVER_HOST_PATHS, HCCN_CONF)
# The label every namespace carries with its own name (Kubernetes 1.21 and later).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# Prometheus pods, as the usual charts label them, of the namespace `monitoring` may scrape
# metrics (the API port serves vLLM's /metrics too: a scraper peer reaches the OpenAI API). Not
# any namespace: there any tenant could label a pod so.
DEFAULT_METRICS_FROM: tuple[dict[str, Any], ...] = (
    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "monitoring"}},
     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},)
# The cluster DNS, as kubeadm and most distributions label CoreDNS: the only egress outside the
# instance that its pods need by default.
DEFAULT_DNS_TO: tuple[dict[str, Any], ...] = (
    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "kube-system"}},
     "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}},)
DNS_PORTS: tuple[dict[str, Any], ...] = ({"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53})


@dataclass(frozen=True)
class HostAccess:
    """chart value hostAccess: what pods may use of their node (secure defaults)."""

    host_path_prefixes: tuple[str, ...] = ()
    ascend_host_paths: tuple[str, ...] = DEFAULT_ASCEND_HOST_PATHS
    ascend_run_as_root: bool = False
    host_network: bool = False
    service_accounts: tuple[str, ...] = ()
    # What a pod may ask of the cluster beyond its node: how its API is exposed, which priority
    # (system-node-critical preempts everything), which taints it tolerates, which Secrets it
    # reads (a namespace's Secrets include other workloads' and legacy token Secrets).
    service_types: tuple[str, ...] = ("ClusterIP",)
    priority_class_names: tuple[str, ...] = ()
    toleration_keys: tuple[str, ...] = ()
    secret_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class NetworkIsolation:
    """chart value networkPolicy: one NetworkPolicy per instance; who may scrape metrics; where
    the pods may connect besides their own instance (the cluster DNS, and the admin's grants)."""

    enabled: bool = True
    metrics_from: tuple[dict[str, Any], ...] = DEFAULT_METRICS_FROM
    dns_to: tuple[dict[str, Any], ...] = DEFAULT_DNS_TO
    egress_to: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ClusterPolicy:
    # None: not checked (afdctl without --policy, which cannot know a cluster's values).
    host_access: Optional[HostAccess] = field(default_factory=HostAccess)
    network: NetworkIsolation = field(default_factory=NetworkIsolation)


UNCHECKED_HOST_ACCESS = ClusterPolicy(host_access=None)


class PolicyError(ValueError):
    pass


class _HostAccessValues(Strict):
    host_path_prefixes: Annotated[list[AbsolutePath], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)
    ascend_host_paths: Annotated[list[AbsolutePath], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=lambda: list(DEFAULT_ASCEND_HOST_PATHS))
    ascend_run_as_root: bool = False
    host_network: bool = False
    service_accounts: Annotated[list[DNSSubdomain], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)
    service_types: Annotated[list[Literal["ClusterIP", "NodePort", "LoadBalancer"]], Field(max_length=3)] = Field(
        default_factory=lambda: ["ClusterIP"])
    priority_class_names: Annotated[list[DNSSubdomain], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)
    toleration_keys: Annotated[list[QualifiedName], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)
    secret_names: Annotated[list[DNSSubdomain], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)


class _NetworkPolicyValues(Strict):
    enabled: bool = True
    metrics_from: Annotated[list[NetworkPolicyPeer], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=lambda: [NetworkPolicyPeer.model_validate(p) for p in DEFAULT_METRICS_FROM])
    dns_to: Annotated[list[NetworkPolicyPeer], Field(max_length=MAX_LIST_ITEMS)] = Field(
        default_factory=lambda: [NetworkPolicyPeer.model_validate(p) for p in DEFAULT_DNS_TO])
    egress_to: Annotated[list[NetworkPolicyEgressRule], Field(max_length=MAX_LIST_ITEMS)] = Field(default_factory=list)


class _ChartValues(Strict):
    model_config = ConfigDict(**{**Strict.model_config, "extra": "ignore"})  # the chart's other values
    host_access: _HostAccessValues = Field(default_factory=_HostAccessValues)
    network_policy: _NetworkPolicyValues = Field(default_factory=_NetworkPolicyValues)


def policy_from_values(values: Any) -> ClusterPolicy:
    """The policy of chart values (a mapping holding `hostAccess` and `networkPolicy`; missing
    keys take the chart's defaults). Raises PolicyError naming the value and its rule."""
    try:
        parsed = _ChartValues.model_validate(values if values is not None else {})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise PolicyError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
    host, net = parsed.host_access, parsed.network_policy
    return ClusterPolicy(
        host_access=HostAccess(host_path_prefixes=tuple(host.host_path_prefixes),
                               ascend_host_paths=tuple(host.ascend_host_paths),
                               ascend_run_as_root=host.ascend_run_as_root,
                               host_network=host.host_network, service_accounts=tuple(host.service_accounts),
                               service_types=tuple(host.service_types),
                               priority_class_names=tuple(host.priority_class_names),
                               toleration_keys=tuple(host.toleration_keys), secret_names=tuple(host.secret_names)),
        network=NetworkIsolation(enabled=net.enabled, metrics_from=tuple(wire(p) for p in net.metrics_from),
                                 dns_to=tuple(wire(p) for p in net.dns_to),
                                 egress_to=tuple(wire(rule) for rule in net.egress_to)))


def load_policy(path: str) -> ClusterPolicy:
    """The policy of a chart values file (YAML), read as strictly as AFDDeployment files (one
    line per problem: bounded size, UTF-8, no duplicate key). Raises PolicyError or OSError."""
    with open(path, "rb") as stream:
        data = stream.read(MAX_FILE_BYTES + 1)  # a device like /dev/zero never ends
    documents, problems = read_documents(data)
    if problems:
        raise PolicyError("; ".join(str(problem) for problem in problems))
    if len(documents) > 1:
        raise PolicyError(f"holds {len(documents)} YAML documents; chart values are one")
    values = documents[0] if documents else None
    if values is not None and not isinstance(values, Mapping):
        raise PolicyError("must be a mapping of chart values")
    return policy_from_values(values)


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or inside it, component by component ('/data' holds
    '/data/models', not '/database')."""
    root = prefix.rstrip("/")
    return path == prefix or path.rstrip("/") == root or path.startswith(root + "/")
