"""The test bed of the operator's real-API tests: the real `afd-operator` process, the node
stand-in, a fresh namespace per test and helpers to read what the operator did. Test modules
import the fixtures by name (module-scoped: one operator and kubelet per module)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from kubernetes import client, watch

from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from afd_devcluster import ControlPlane, FakeKubelet
from afd_devcluster.operator_process import OperatorProcess
from k8s_helpers import delete_afddeployments, wait_for

CONVERGE_SECONDS = 45


def base_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 1,
        "image": "runtime:v1",
        "platform": "cpu",
        "model": {"name": "tiny", "path": "/models/tiny", "routedExperts": 8},
        "attention": {"dataParallel": 2, "tensorParallel": 1, "devicesPerPod": 1},
        "ffn": {"ranks": 1, "devicesPerPod": 1},
        "startup": {"order": "FFNFirst", "timeoutSeconds": 60},
        "recovery": {"backoffSeconds": 1, "maxBackoffSeconds": 4, "maxRestarts": 2, "unreadyGraceSeconds": 2},
        "termination": {"gracePeriodSeconds": 5, "drainSeconds": 1},
        "updateStrategy": {"maxSurge": 1, "maxUnavailable": 0},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    return spec


class Env:
    """One test's view: a namespace, API helpers, the shared operator and kubelet."""

    def __init__(self, cluster: ControlPlane, api_client, kubelet: FakeKubelet, operator: OperatorProcess,
                 namespace: str):
        self.cluster, self.kubelet, self.operator, self.ns = cluster, kubelet, operator, namespace
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    # -- the custom resource ----------------------------------------------------------------
    def create(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "AFDDeployment",
            "metadata": {"name": name}, "spec": spec})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def get(self, name: str) -> Optional[dict[str, Any]]:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def condition(self, name: str, kind: str) -> Optional[dict[str, Any]]:
        obj = self.get(name) or {}
        return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)

    def wait_ready(self, name: str, replicas: int, timeout: float = CONVERGE_SECONDS) -> dict[str, Any]:
        def ready() -> Optional[dict[str, Any]]:
            obj = self.get(name) or {}
            status = obj.get("status", {})
            cond = self.condition(name, "Ready") or {}
            rev = status.get("updateRevision")
            instances = status.get("instances", [])
            done = (cond.get("status") == "True" and status.get("readyReplicas") == replicas
                    and status.get("observedGeneration") == obj["metadata"]["generation"]
                    and len(instances) == replicas and all(i["revision"] == rev for i in instances))
            return obj if done else None
        try:
            return wait_for(ready, f"{name} Ready with {replicas} instance(s)", timeout, interval=0.2)
        except AssertionError as err:
            raise AssertionError(f"{err}; last status: {(self.get(name) or {}).get('status')}") from None

    # -- children -----------------------------------------------------------------------------
    def pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns).items

    def owned(self) -> dict[str, list[str]]:
        """Every object the operator made in the namespace, by kind."""
        sel = f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}"
        return {
            "pods": sorted(p.metadata.name for p in self.pods()),
            "services": sorted(s.metadata.name for s in self.core.list_namespaced_service(self.ns, label_selector=sel).items),
            "configmaps": sorted(c.metadata.name for c in self.core.list_namespaced_config_map(self.ns, label_selector=sel).items),
            "guards": sorted(self.cluster.kubectl("get", "poddisruptionbudgets,networkpolicies", "-n", self.ns, "-l", sel,
                                                  "-o", "name").stdout.split()),
        }

    def instances(self) -> dict[str, list[Any]]:
        groups: dict[str, list[Any]] = {}
        for pod in self.pods():
            groups.setdefault(pod.metadata.labels[naming.LABEL_AFD_INSTANCE], []).append(pod)
        return groups

    def events(self, name: str) -> list[str]:
        items = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items
        return [f"{e.reason}: {e.message}" for e in items]


@pytest.fixture(scope="module")
def kubelet(api_client) -> Iterator[FakeKubelet]:
    with FakeKubelet(api_client, [f"node-{i}" for i in range(4)],
                     label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}",
                     deletion_delay_seconds=0.2) as fake:
        yield fake


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, repo_root: Path, tmp_path_factory) -> Iterator[OperatorProcess]:
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / "afd.inference.dev_afddeployments.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=30s")
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(cluster.operator_kubeconfig, log, resync_seconds=0.5).start()
    yield proc
    proc.stop()


@pytest.fixture()
def env(cluster: ControlPlane, api_client, kubelet: FakeKubelet, operator: OperatorProcess) -> Iterator[Env]:
    ns = f"op-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api_client).create_namespace({"metadata": {"name": ns}})
    yield Env(cluster, api_client, kubelet, operator, ns)
    kubelet.release()
    delete_afddeployments(cluster, ns)  # while the operator runs, so finalizers are honoured


class PodWatch:
    """Every pod event of a test's namespace, in order and without gaps: the pods that exist
    when it starts arrive as ADDED, and each watch resumes from the last resourceVersion
    seen. Subclasses handle the events in `on_event` (on the watch's thread)."""

    def __init__(self, env: Env):
        self.env = env
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._resource_version = ""

    def on_event(self, kind: str, pod: Any) -> None:
        raise NotImplementedError

    def __enter__(self):
        listing = self.env.core.list_namespaced_pod(self.env.ns)
        for pod in listing.items:
            self.on_event("ADDED", pod)
        self._resource_version = listing.metadata.resource_version
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        w = watch.Watch()
        while not self._stop.is_set():
            for event in w.stream(self.env.core.list_namespaced_pod, self.env.ns,
                                  resource_version=self._resource_version, timeout_seconds=2):
                self._resource_version = event["object"].metadata.resource_version
                self.on_event(event["type"], event["object"])
