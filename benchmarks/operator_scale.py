"""Operator at scale on the local control plane (real kube-apiserver; the node stand-in for the
convergence table).

First, side by side in one run against the same API server: seconds until every pod of one
256-pod instance exists, created by the operator (from the AFDDeployment's creation; startup
order Parallel, so one reconciliation creates them all) and by a plain client (the typed
CoreV1Api) creating the same rendered pods, less the label the operator watches (one after
another, and CREATE_CONCURRENCY at a time as the operator does); the operator/raw-client
ratios. Rounds alternate, medians are printed.

With --table, also: for 1, 10 and 50 AFDDeployments of one small instance each, and for one
deployment whose instance has 16 to 256 pods, seconds from apply to every pod created and to
Ready, API writes per converged deployment (from the apiserver's audit log), and the operator's
CPU seconds.

Run: AFD_KUBE_APISERVER=$(scripts/build-kube-apiserver.sh) $(scripts/dev-env.sh)/bin/python benchmarks/operator_scale.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import urllib3
from kubernetes import client, config, watch

from afd_operator import naming
from afd_operator.api import GROUP, PLURAL, VERSION
from afd_operator.crd import crd_yaml
from afd_operator.planner import plan
from afd_operator.render import render_instance
from afd_operator.validation import validate_spec
from afd_operator.writer import CREATE_CONCURRENCY
from afd_devcluster import OPERATOR_USER, FakeKubelet, control_plane
from afd_devcluster.operator_process import OperatorProcess

TIMEOUT_SECONDS = 600
INSTANCE_PODS = 256


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


class PodCounter:
    """Pods added to a namespace, from a watch started before anything is created: the time
    the `count`-th one appeared."""

    def __init__(self, core: client.CoreV1Api, namespace: str, count: int):
        self.core, self.namespace, self.count = core, namespace, count
        self.done = threading.Event()
        self.finished_at = 0.0
        listing = core.list_namespaced_pod(namespace)
        self._version = listing.metadata.resource_version
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen: set[str] = set()
        for event in watch.Watch().stream(self.core.list_namespaced_pod, self.namespace,
                                          resource_version=self._version, timeout_seconds=TIMEOUT_SECONDS):
            if event["type"] == "ADDED":
                seen.add(event["object"].metadata.name)
                if len(seen) >= self.count:
                    self.finished_at = time.monotonic()
                    self.done.set()
                    return

    def wait(self) -> float:
        assert self.done.wait(TIMEOUT_SECONDS), f"fewer than {self.count} pods after {TIMEOUT_SECONDS}s"
        return self.finished_at


def fresh_namespace(core: client.CoreV1Api, prefix: str) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    return ns


def rendered_pods(namespace: str) -> list[dict]:
    half = INSTANCE_PODS // 2
    parsed, problems = validate_spec(spec(half, half), "raw", namespace=namespace)
    assert not problems, problems
    p = plan(parsed, "raw", namespace)
    pods = [o for o in render_instance(parsed, p, p.instances[0]) if o["kind"] == "Pod"]
    for pod in pods:  # else the running operator would index them too, and slow the raw client down
        del pod["metadata"]["labels"][naming.LABEL_MANAGED_BY]
    return pods


def by_operator(custom: client.CustomObjectsApi, core: client.CoreV1Api) -> float:
    ns = fresh_namespace(core, "op")
    counter = PodCounter(core, ns, INSTANCE_PODS)
    start = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "AFDDeployment", "metadata": {"name": "d"},
        "spec": spec(INSTANCE_PODS // 2, INSTANCE_PODS // 2)})
    elapsed = counter.wait() - start
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "d")
    return elapsed


def by_raw_client(core: client.CoreV1Api, workers: int) -> float:
    ns = fresh_namespace(core, f"raw{workers}")
    pods = rendered_pods(ns)  # rendered before the clock starts: the client only sends them
    counter = PodCounter(core, ns, len(pods))
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda body: core.create_namespaced_pod(ns, body), pods))
    elapsed = counter.wait() - start
    core.delete_collection_namespaced_pod(ns)
    return elapsed


def compare_creation(custom: client.CustomObjectsApi, core: client.CoreV1Api, rounds: int) -> None:
    results: dict[str, list[float]] = {"operator": [], "raw, 1 at a time": [],
                                       f"raw, {CREATE_CONCURRENCY} at a time": []}
    for _ in range(rounds):
        results["operator"].append(by_operator(custom, core))
        results["raw, 1 at a time"].append(by_raw_client(core, 1))
        results[f"raw, {CREATE_CONCURRENCY} at a time"].append(by_raw_client(core, CREATE_CONCURRENCY))
    medians = {k: statistics.median(v) for k, v in results.items()}
    print(f"{INSTANCE_PODS} pods of one instance, seconds until all exist (median of {rounds} alternating rounds):")
    for name, seconds in medians.items():
        ratio = medians["operator"] / seconds
        print(f"  {name:<24} {seconds:6.2f} s   operator/this {ratio:5.2f}x   rounds: "
              + " ".join(f"{s:.2f}" for s in results[name]), flush=True)


def measure(cp, custom: client.CustomObjectsApi, core: client.CoreV1Api, op: OperatorProcess,
            deployments: int, attention_ranks: int, ffn_ranks: int) -> tuple[int, float, float, float, float]:
    ns = fresh_namespace(core, "bench")
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


def convergence_table(cp, custom: client.CustomObjectsApi, core: client.CoreV1Api, op: OperatorProcess) -> None:
    print(f"{'deployments':>11} {'pods/inst':>9} {'pods':>5} {'all created s':>13} {'all Ready s':>11} "
          f"{'writes/deploy':>13} {'writes/pod':>10} {'operator CPU s':>14}", flush=True)
    for deployments, attention, ffn in [(1, 2, 1), (10, 2, 1), (50, 2, 1), (1, 8, 8), (1, 32, 32), (1, 128, 128)]:
        pods, created, ready, writes, cpu = measure(cp, custom, core, op, deployments, attention, ffn)
        print(f"{deployments:>11} {attention + ffn:>9} {pods:>5} {created:>13.2f} {ready:>11.2f} "
              f"{writes:>13.1f} {writes * deployments / pods:>10.2f} {cpu:>14.2f}", flush=True)
    print(json.dumps({"reconciles": [line for line in op.metrics().splitlines()
                                     if line.startswith("afd_operator_reconciles_total")]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the side-by-side creation (default 3)")
    parser.add_argument("--table", action="store_true", help="also the convergence table (minutes)")
    args = parser.parse_args()
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    with tempfile.TemporaryDirectory(prefix="afd-bench-") as tmp, control_plane(Path(tmp) / "cp") as cp:
        crd = Path(tmp) / "crd.yaml"
        crd.write_text(crd_yaml())
        cp.kubectl("apply", "-f", str(crd))
        cp.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=60s")
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        with OperatorProcess(cp.operator_kubeconfig, Path(tmp) / "operator.log", resync_seconds=10.0) as op:
            compare_creation(custom, core, args.rounds)
            if args.table:
                with FakeKubelet(api, [f"bench-node-{i}" for i in range(8)], max_pods=250,
                                 label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}"):
                    convergence_table(cp, custom, core, op)


if __name__ == "__main__":
    main()
