"""Server-side dry runs of what the operator renders, against the session's real API server:
the CRDs it needs served, the kinds it writes created with `dryRun=All`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from afd_devcluster import ControlPlane
from afd_operator.crd import CRD_FILE, CRD_NAME

THIRD_PARTY_CRDS = Path(__file__).parent / "fixtures" / "third-party-crds.yaml"
# The 1.20 test server predates policy/v1 PodDisruptionBudget (1.21); the v1beta1 schema of
# the fields rendered (minAvailable, selector) is the same.
SERVED_AS = {("policy/v1", "PodDisruptionBudget"): "policy/v1beta1"}


def wait_established(dyn, name: str) -> dict[str, Any]:
    crds = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        obj = crds.get(name=name).to_dict()
        conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
        if conds.get("Established") == "True":
            return obj
        time.sleep(0.2)
    raise AssertionError(f"CRD {name} not Established: {conds}")


def serving_client(api_client, cluster: ControlPlane, repo_root: Path):
    """A dynamic client once the AFDDeployment CRD and the third-party kinds' test CRDs are served."""
    from kubernetes.dynamic import DynamicClient

    for path in (repo_root / "crds" / CRD_FILE, THIRD_PARTY_CRDS):
        cluster.kubectl("apply", "-f", str(path))
    client = DynamicClient(api_client)
    for name in (CRD_NAME, "podgroups.scheduling.volcano.sh", "podmonitors.monitoring.coreos.com"):
        wait_established(client, name)
    # Discovery is cached by the client: a new one sees the CRDs served.
    return DynamicClient(api_client)


def ensure_priority_class(dyn, name: str) -> None:
    """Pods naming a missing PriorityClass are refused: create the one a spec names."""
    from kubernetes.dynamic.exceptions import ConflictError

    classes = dyn.resources.get(api_version="scheduling.k8s.io/v1", kind="PriorityClass")
    try:
        classes.create(body={"metadata": {"name": name}, "value": 1000})
    except ConflictError:
        pass


def dry_run_create(dyn, obj: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """What the API server answers to creating `obj` (dryRun=All); raises its refusal."""
    api_version = SERVED_AS.get((obj["apiVersion"], obj["kind"]), obj["apiVersion"])
    resource = dyn.resources.get(api_version=api_version, kind=obj["kind"])
    return resource.create(body={**obj, "apiVersion": api_version}, namespace=namespace, dry_run="All").to_dict()
