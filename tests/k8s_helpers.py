"""Helpers shared by the tests that drive the real kube-apiserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from kubernetes_validate.utils import all_versions

from afd_devcluster.tools import Helm, wait_for  # noqa: F401  (re-exported for the tests)

# Rendered objects must be what every supported Kubernetes accepts: 1.28 to the newest release
# whose schemas kubernetes-validate ships (the test bed's API server is 1.20).
SCHEMA_VERSIONS = tuple(sorted({v for v in all_versions() if tuple(map(int, v.split(".")[:2])) >= (1, 28)},
                               key=lambda v: tuple(map(int, v.split(".")))))


def validate_built_in(obj: dict[str, Any]) -> None:
    """`obj` against the upstream OpenAPI schema of every version in SCHEMA_VERSIONS (strict:
    unknown fields too)."""
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# The chart values the examples need from a cluster admin (docs/install.md, "Host access", shows
# them; tests/test_host_access.py checks the two agree).
EXAMPLES_HOST_ACCESS = {"hostAccess": {"hostPathPrefixes": ["/srv/models", "/data/models"], "hostNetwork": True,
                                        "priorityClassNames": ["high-priority-inference"],
                                        "tolerationKeys": ["huawei.com/Ascend910"]}}


class _Delete:
    """A value for set_path that removes the key; one repr in every process (test ids under xdist)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Set (or, with DELETE, remove) one dotted path of a nested mapping in place; returns obj."""
    node = obj
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return obj


def delete_afddeployments(cluster: Any, namespace: str, timeout_seconds: int = 90) -> None:
    """Delete every AFDDeployment of a test namespace and wait until they are gone.

    Tests share one apiserver: an object left behind keeps its finalizer once no operator
    runs, and then blocks any later deletion of the CRD (Kubernetes has no namespace
    controller here to clean up either)."""
    cluster.kubectl("delete", "afddeployments", "--all", "-n", namespace, f"--timeout={timeout_seconds}s")


def service_account_kubeconfig(cluster: Any, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a token from the TokenRequest
    API (what a pod of that ServiceAccount gets mounted)."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    user = f"system:serviceaccount:{namespace}:{service_account}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "dev", "cluster": {"server": cluster.server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "dev", "user": user}}],
    }))
    return path
