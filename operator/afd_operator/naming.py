"""Deterministic names and labels of everything the operator creates.

Names are a pure function of (deployment, revision, instance index, role, ordinal), so a
restarted operator finds and adopts what exists instead of creating duplicates. Pod names
double as DNS hostnames, so every generated name must stay a DNS-1123 label (63 chars).
"""

from __future__ import annotations

from . import kube_rules
from .api import GROUP

DNS_LABEL_MAX = kube_rules.DNS_LABEL_MAX

ROLE_SHORT = {"attention": "attn", "ffn": "ffn"}

# Recommended labels (app.kubernetes.io/*) plus the operator's own.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_VERSION = "app.kubernetes.io/version"
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_AFD_INSTANCE = f"{GROUP}/instance"
LABEL_ROLE = f"{GROUP}/role"
LABEL_REVISION = f"{GROUP}/revision"
LABEL_POD_ORDINAL = f"{GROUP}/pod-ordinal"
LABEL_HEAD = f"{GROUP}/head"
# Set by the operator on an instance's Attention head while the instance is Ready; the
# API Service selects it, so only complete, Ready worlds receive requests.
LABEL_SERVING = f"{GROUP}/serving"
# Kubernetes' label naming the Service an EndpointSlice belongs to.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
# Set on an instance's Attention head when its drain starts; the wait is measured from it.
ANNOTATION_DRAIN_STARTED = f"{GROUP}/drain-started"

APP_NAME = "afd"
MANAGER = "afd-operator"


def is_dns_1035_label(name: str) -> bool:
    return kube_rules.dns_1035_label(name) is None


def instance_name(deployment: str, revision: str, index: int) -> str:
    return f"{deployment}-{revision}-{index}"


def pod_name(deployment: str, revision: str, index: int, role: str, ordinal: int) -> str:
    return f"{instance_name(deployment, revision, index)}-{ROLE_SHORT[role]}-{ordinal}"


def runtime_configmap_name(deployment: str, revision: str) -> str:
    return f"{deployment}-{revision}-runtime"


def api_service_name(deployment: str) -> str:
    return deployment


def pod_monitor_name(deployment: str) -> str:
    return deployment


def base_labels(deployment: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_DEPLOYMENT: deployment,
    }


def selector_labels(deployment: str) -> dict[str, str]:
    """Labels that select every pod of a deployment (status.selector, PDB)."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_MANAGED_BY: MANAGER}


def instance_labels(deployment: str, revision: str, index: int) -> dict[str, str]:
    return {
        LABEL_DEPLOYMENT: deployment,
        LABEL_AFD_INSTANCE: instance_name(deployment, revision, index),
        LABEL_REVISION: revision,
    }


def pod_dns_name(pod: str, instance: str, namespace: str, cluster_domain: str) -> str:
    """Stable DNS name of a pod through its instance's headless Service (exists before any IP)."""
    return f"{pod}.{instance}.{namespace}.svc.{cluster_domain}"
