"""Faults of the control plane, against the real API server: restarted in the middle of a
rollout while the operator's watches are forced past their resource versions (410 Gone), and an
object stored under laxer rules than today's, whose deletion (its finalizer's removal) must not
be blocked. Each converges."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from kubernetes import watch
from kubernetes.client import ApiException

from afd_devcluster import OPERATOR_USER, ControlPlane, free_port
from afd_devcluster.certs import self_signed_certificate
from afd_devcluster.operator_process import OperatorProcess
from afd_operator import naming
from operator_env import Env, base_spec, env, kubelet  # noqa: F401  (fixtures)
from k8s_helpers import wait_for

@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, repo_root: Path, tmp_path_factory) -> Iterator[OperatorProcess]:
    """The operator with debug logs: kopf says there when a watch met 410 Gone."""
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / "afd.inference.dev_afddeployments.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=30s")
    proc = OperatorProcess(cluster.operator_kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log",
                           resync_seconds=0.5, extra_args=("--verbose",)).start()
    yield proc
    proc.stop()


def etcd_revision(cluster: ControlPlane) -> int:
    return json.loads(cluster.etcdctl("endpoint", "status", "-w", "json").stdout)[0]["Status"]["header"]["revision"]


def test_api_server_restarted_mid_rollout_with_expired_watches_converges(env: Env, cluster: ControlPlane,
                                                                         operator: OperatorProcess) -> None:
    env.create("restart", base_spec(replicas=2))
    env.wait_ready("restart", 2)
    env.patch_spec("restart", {"image": "runtime:v2"})
    wait_for(lambda: any(p.spec.containers[0].image == "runtime:v2" for p in env.pods()), "the rollout under way", 45)
    seen = env.core.list_namespaced_pod(env.ns).metadata.resource_version  # where every watcher stands
    log_mark = operator.log_path.stat().st_size

    def expire_watches() -> None:
        # A write none of them saw, then compaction: a watch resuming from before it is 410 Gone.
        cluster.etcdctl("put", "/afd-test/bump", str(time.time()))
        cluster.etcdctl("compact", str(etcd_revision(cluster)))
        time.sleep(3)  # long enough for every client to meet refused connections

    cluster.restart_apiserver(while_down=expire_watches)
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(env.core.list_namespaced_pod, env.ns, resource_version=seen, timeout_seconds=5):
            pass
    assert gone.value.status == 410

    status = env.wait_ready("restart", 2, timeout=120)["status"]
    pods = env.pods()
    assert {p.spec.containers[0].image for p in pods} == {"runtime:v2"}
    assert len(pods) == 6 and len({p.metadata.name for p in pods}) == 6
    assert sorted(env.instances()) == sorted(i["name"] for i in status["instances"])
    with open(operator.log_path, encoding="utf-8", errors="replace") as log:
        log.seek(log_mark)
        restarted = [line for line in log if "Restarting the watch-stream" in line]
    assert any("pods" in line for line in restarted), "the operator's pod watch never met 410 Gone"


def test_an_object_stored_under_laxer_rules_is_still_deleted(env: Env, cluster: ControlPlane,
                                                              operator: OperatorProcess, tmp_path: Path) -> None:
    """Created while the operator allowed its host path, then the cluster's rules tighten (a new
    policy, the webhook installed): the spec is reported invalid, metadata changes and the
    finalizer's removal still pass the webhook, and deletion tears everything down."""
    spec = base_spec(model={"volume": {"hostPath": "/srv/models", "mountPath": "/models"}})
    operator.stop()
    lax = tmp_path / "lax.yaml"
    lax.write_text(yaml.safe_dump({"hostAccess": {"hostPathPrefixes": ["/srv"]}}))
    laxer = OperatorProcess(cluster.operator_kubeconfig, tmp_path / "lax.log", resync_seconds=0.5,
                            extra_args=("--policy", str(lax))).start()
    try:
        env.create("stored", spec)
        env.wait_ready("stored", 1)
    finally:
        laxer.stop()
    pods = {p.metadata.name for p in env.pods()}

    cert, key = self_signed_certificate(tmp_path, ["127.0.0.1"])
    configuration = "afd-faults.validation.afd.inference.dev"
    strict = OperatorProcess(cluster.operator_kubeconfig, tmp_path / "strict.log", resync_seconds=0.5, extra_args=(
        "--webhook-port", str(free_port()), "--webhook-host", "127.0.0.1", "--webhook-listen", "127.0.0.1",
        "--webhook-cert", str(cert), "--webhook-key", str(key), "--webhook-configuration", configuration,
        "--operator-username", OPERATOR_USER)).start()
    try:
        cond = wait_for(lambda: (c := env.condition("stored", "ConfigValid")) and c["status"] == "False" and c,
                        "ConfigValid=False under today's rules", 45)
        assert "chart value hostAccess.hostPathPrefixes: none" in cond["message"]
        assert {p.metadata.name for p in env.pods()} == pods  # an invalid spec changes nothing
        wait_for(lambda: cluster.kubectl("get", "validatingwebhookconfiguration", configuration,
                                         check=False).returncode == 0, "the webhook registered", 30)
        changed = cluster.kubectl("patch", "afd", "stored", "-n", env.ns, "--type=merge",
                                  "-p", '{"spec": {"replicas": 2}}', check=False)
        assert changed.returncode != 0 and "hostAccess.hostPathPrefixes" in changed.stderr
        labelled = cluster.kubectl("label", "afd", "stored", "-n", env.ns, "team=search", check=False)
        assert labelled.returncode == 0, labelled.stderr

        deleted = cluster.kubectl("delete", "afd", "stored", "-n", env.ns, "--timeout=60s", check=False)
        assert deleted.returncode == 0, deleted.stderr
        assert env.get("stored") is None
        assert env.pods() == [] and env.owned() == {"pods": [], "services": [], "configmaps": [], "guards": []}
    finally:
        strict.stop()
        cluster.kubectl("delete", "validatingwebhookconfiguration", configuration, "--ignore-not-found")
        operator.start()
