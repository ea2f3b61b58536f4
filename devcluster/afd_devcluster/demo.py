"""The main job's live part: a local control plane, the operator, and an AFDDeployment
converging, scaling, rolling to a new topology and tearing down. Everything is real except
the kubelet, played by FakeKubelet (no container runtime here).

Run: python -m afd_devcluster.demo [--example FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import urllib3
import yaml
from kubernetes import config as kube_config

from afd_operator.crd import crd_yaml
from afd_devcluster.controlplane import ControlPlane, control_plane
from afd_devcluster.fake_kubelet import FakeKubelet
from afd_devcluster.operator_process import OperatorProcess
from afd_operator.naming import LABEL_MANAGED_BY, MANAGER

STEP_TIMEOUT_SECONDS = 120


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def show(cp: ControlPlane, *args: str) -> None:
    print(f"$ kubectl {' '.join(args)}")
    print(cp.kubectl(*args).stdout.rstrip(), flush=True)


def wait(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.5)


def status(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    result = cp.kubectl("get", "afd", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout).get("status", {}) if result.returncode == 0 else {}


def converged(cp: ControlPlane, namespace: str, name: str, replicas: int, topology: Optional[str] = None) -> bool:
    s = status(cp, namespace, name)
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", []))
    return ready and s.get("readyReplicas") == replicas and len(s.get("instances", [])) == replicas and (
        topology is None or s.get("topology") == topology)


def host_access_for(doc: dict) -> dict:
    """The chart values a cluster admin would set for this example: its model's host path, and
    host networking on Ascend (docs/install.md, "Host access")."""
    spec = doc["spec"]
    host_path = ((spec.get("model") or {}).get("volume") or {}).get("hostPath")
    return {"hostAccess": {"hostPathPrefixes": [host_path] if host_path else [],
                           "hostNetwork": spec.get("platform", "ascend") == "ascend"}}


def run(example: Path, workdir: Path) -> None:
    # The dev control plane's kubeconfig skips TLS verification (a throwaway self-signed server).
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    doc = yaml.safe_load(example.read_text())
    name = doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace", "default")
    say("starting etcd + kube-apiserver 1.20.2 on loopback")
    with control_plane(workdir / "control-plane") as cp:
        crd = workdir / "crd.yaml"
        crd.write_text(crd_yaml())
        show(cp, "apply", "-f", str(crd))
        cp.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=60s")
        if namespace != "default":
            cp.kubectl("create", "namespace", namespace)
        api = kube_config.new_client_from_config(config_file=str(cp.kubeconfig))
        say("starting the node stand-in (plays kubelet: binds pods, reports them Running/Ready)")
        policy = workdir / "policy.yaml"
        policy.write_text(yaml.safe_dump(host_access_for(doc)))
        with FakeKubelet(api, [f"demo-node-{i}" for i in range(4)],
                         label_selector=f"{LABEL_MANAGED_BY}={MANAGER}", deletion_delay_seconds=0.5), \
                OperatorProcess(cp.operator_kubeconfig, workdir / "operator.log", resync_seconds=1.0,
                                extra_args=("--policy", str(policy))) as op:
            say(f"afd-operator running (metrics {op.metrics_url}, log {workdir / 'operator.log'})")
            show(cp, "apply", "-f", str(example))
            wait("the first instance to be Ready", lambda: converged(cp, namespace, name, 1))
            show(cp, "get", "afd", "-n", namespace)
            show(cp, "get", "pods", "-n", namespace, "-L", "afd.inference.dev/role,afd.inference.dev/serving")

            say("scaling to 2 instances")
            show(cp, "scale", "afd", name, "-n", namespace, "--replicas=2")
            wait("2 Ready instances", lambda: converged(cp, namespace, name, 2))
            show(cp, "get", "afd", "-n", namespace)

            attention = doc["spec"].get("attention", {})
            ffn = doc["spec"].get("ffn", {})
            bigger = {"attention": {"dataParallel": 2 * attention.get("dataParallel", 1)},
                      "ffn": {"ranks": 2 * ffn.get("ranks", 1)}}
            dp, tp, ep = 2 * attention.get("dataParallel", 1), attention.get("tensorParallel", 1), 2 * ffn.get("ranks", 1)
            say(f"rolling to a new topology (DP{dp}xTP{tp}+EP{ep}), instance by instance")
            show(cp, "patch", "afd", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": bigger}))
            wait("the rollout", lambda: converged(cp, namespace, name, 2, f"DP{dp}xTP{tp}+EP{ep}"))
            show(cp, "get", "afd", "-n", namespace)
            show(cp, "get", "afd", name, "-n", namespace, "-o",
                 "jsonpath={range .status.conditions[*]}{.type}={.status} ({.reason}){'\\n'}{end}")
            show(cp, "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                 "--sort-by=.metadata.creationTimestamp", "-o", "custom-columns=REASON:.reason,MESSAGE:.message")

            say("deleting: ordered drain of every instance, then nothing left")
            show(cp, "delete", "afd", name, "-n", namespace, "--wait=true", "--timeout=120s")
            wait("all children gone", lambda: not cp.kubectl(
                "get", "pods,services,configmaps", "-n", namespace, "-l", f"{LABEL_MANAGED_BY}={MANAGER}",
                "-o", "name").stdout.strip())
            show(cp, "get", "pods,services,configmaps", "-n", namespace, "-l", f"{LABEL_MANAGED_BY}={MANAGER}")
            reconciles = [line for line in op.metrics().splitlines() if line.startswith("afd_operator_reconciles_total")]
            print("\n".join(reconciles))
    say("done: control plane, node stand-in and operator stopped")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", type=Path, required=True, help="AFDDeployment file to apply")
    parser.add_argument("--workdir", type=Path, help="where logs and state go (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        run(args.example, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="afd-demo-") as tmp:
            run(args.example, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
