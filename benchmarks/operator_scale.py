"""Operator at scale on the local control plane (real kube-apiserver + the node stand-in).

For 1, 10 and 50 AFDDeployments of one small instance each, and for one deployment whose
instance has 16 to 256 pods: seconds from apply to every pod created and to Ready, API
writes per converged deployment (from the apiserver's audit log), and the operator's CPU
seconds. Prints one table.

Run: AFD_KUBE_APISERVER=$(scripts/build-kube-apiserver.sh) $(scripts/dev-env.sh)/bin/python benchmarks/operator_scale.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import urllib3
from kubernetes import client, config

from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from afd_operator.crd import crd_yaml
from afd_devcluster import OPERATOR_USER, FakeKubelet, control_plane
from afd_devcluster.operator_process import OperatorProcess

TIMEOUT_SECONDS = 600


def spec(attention_ranks: int, ffn_ranks: int) -> dict:
    return {
        "replicas": 1, "image": "runtime:v1", "platform": "cpu",
        "model": {"name": "m", "path": "/models/m"},
        "attention": {"dataParallel": attention_ranks, "devicesPerPod": 1},
        "ffn": {"ranks": ffn_ranks, "devicesPerPod": 1},
        "startup": {"order": "Parallel", "timeoutSeconds": TIMEOUT_SECONDS},
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(cp, custom: client.CustomObjectsApi, core: client.CoreV1Api, op: OperatorProcess,
            deployments: int, attention_ranks: int, ffn_ranks: int) -> tuple[int, float, float, float, float]:
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    pods_wanted = deployments * (attention_ranks + ffn_ranks)
    cpu_before, since = cpu_seconds(op.proc.pid), time.time()
    start = time.monotonic()
    for i in range(deployments):
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "AFDDeployment",
            "metadata": {"name": f"d{i}"}, "spec": spec(attention_ranks, ffn_ranks)})
    created_at = ready_at = None
    while ready_at is None:
        if time.monotonic() - start > TIMEOUT_SECONDS:
            raise SystemExit(f"not converged after {TIMEOUT_SECONDS}s")
        if created_at is None and len(core.list_namespaced_pod(ns).items) >= pods_wanted:
            created_at = time.monotonic() - start
        items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        if all(any(c["type"] == "Ready" and c["status"] == "True" for c in o.get("status", {}).get("conditions", []))
               for o in items):
            ready_at = time.monotonic() - start
            created_at = created_at or ready_at
        time.sleep(0.2)
    time.sleep(2)  # let the last status writes land in the audit log
    writes = [w for w in cp.write_requests(OPERATOR_USER, since=since) if w["objectRef"].get("namespace") == ns]
    cpu = cpu_seconds(op.proc.pid) - cpu_before
    for i in range(deployments):
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, f"d{i}")
    return pods_wanted, created_at, ready_at, len(writes) / deployments, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller cases only (1 and 10 deployments, <=64 pods)")
    args = parser.parse_args()
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    cases = [(1, 2, 1), (10, 2, 1), (50, 2, 1), (1, 8, 8), (1, 32, 32), (1, 128, 128)]
    if args.quick:
        cases = [c for c in cases if c[0] <= 10 and c[1] + c[2] <= 64]
    with tempfile.TemporaryDirectory(prefix="afd-bench-") as tmp, control_plane(Path(tmp) / "cp") as cp:
        crd = Path(tmp) / "crd.yaml"
        crd.write_text(crd_yaml())
        cp.kubectl("apply", "-f", str(crd))
        cp.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=60s")
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        with FakeKubelet(api, [f"bench-node-{i}" for i in range(8)], max_pods=250,
                         label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}"), \
                OperatorProcess(cp.operator_kubeconfig, Path(tmp) / "operator.log", resync_seconds=10.0) as op:
            print(f"{'deployments':>11} {'pods/inst':>9} {'pods':>5} {'all created s':>13} {'all Ready s':>11} "
                  f"{'writes/deploy':>13} {'writes/pod':>10} {'operator CPU s':>14}", flush=True)
            for deployments, attention, ffn in cases:
                pods, created, ready, writes, cpu = measure(cp, custom, core, op, deployments, attention, ffn)
                print(f"{deployments:>11} {attention + ffn:>9} {pods:>5} {created:>13.2f} {ready:>11.2f} "
                      f"{writes:>13.1f} {writes * deployments / pods:>10.2f} {cpu:>14.2f}", flush=True)
            print(json.dumps({"reconciles": [line for line in op.metrics().splitlines()
                                             if line.startswith("afd_operator_reconciles_total")]}))


if __name__ == "__main__":
    main()
