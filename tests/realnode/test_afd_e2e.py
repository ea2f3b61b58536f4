"""An AFDDeployment served for real on the real node (docs/testbed.md, "Real node"). In order:

1. a tiny DeepSeek-V2 checkpoint on a hostPath; `kubectl apply` of an AFDDeployment with Attention DP 2
   over two pods and 2 FFN ranks in one pod (shared experts on the FFN side, the operator's default of 2
   micro-batch stages): the operator (a pod, installed by the chart) creates the pods, kubelet runs them
   in the built runtime image, they turn Ready through their own probes, and a completion sent to the API
   Service's ClusterIP (kube-proxy) equals plain vLLM's (same image, checkpoint), alone and four at once;
   a second AFDDeployment whose name extends the first's serves a tiny Qwen3-MoE (no shared expert: its
   FFN pod reports the placement as not applicable) beside it in the namespace, answering like plain vLLM
   on that checkpoint, each Service routing only to its own head, and deleting it leaves the first
   untouched;
2. a bounded load generator (a completion every 5 s, model-list requests 4 times a second between them)
   runs against the Service while the AFDDeployment rolls to a new topology (Attention DP 2 -> 1, FFN 2
   ranks in one pod -> 4 over two pods), then to a new image tag with the operator pod deleted
   mid-rollout: no request fails, no connector world mixes revisions;
3. faults under load: an FFN container killed, an Attention pod deleted: the instance is recreated and
   serving returns; every failed request is counted and reported;
4. Prometheus (Debian's), discovering targets from the real API, scrapes the operator, the FFN pods and
   the Attention head; the chart's dashboard queries return data (last before the teardown: its
   scrapes would load the 2 cores during the rolls);
5. `kubectl delete`: the operator drains and tears down; no pod, container or Service rule is left.
"""
from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from afd_devcluster.prometheus import prometheus_server, query
from afd_devcluster.realnode import RealNode
from afd_devcluster.realnode.images import RUNTIME_CPU_IMAGE, retag
from afd_devcluster.realnode.prometheus_sd import TargetFeed, scrape_jobs
from afd_devcluster.realnode.scenario import (DEPLOYMENT_LABEL, NODE_DNS_PEERS, RELEASE, RELEASE_NAMESPACE, afd_pods,
                                              apply, complete, delete_afd, get_afd, is_ready, models_dir, pods,
                                              wait_serving, write_tiny_checkpoint)
from afd_devcluster.tools import wait_for
from afd_shared_experts.vllm.cpu_patches import CPU_PATCHES_ENV
from serving_watch import (LABEL, NAME, NAMESPACE, READY_TIMEOUT_SECONDS, BackgroundLoop, Load, WorldWatch,
                           mem_available_bytes, meminfo_bytes, namespace_events, survive)

# A second deployment in the same namespace, its name extending the first's: nothing the
# operator selects, names or remembers may match by prefix.
SECOND = NAME + "-b"
MOUNT = "/models"
MODEL_DIR = "tiny-deepseek-v2"
# The second deployment's model: a family without shared experts.
SECOND_MODEL_DIR = "tiny-qwen3-moe"
API_PORT = 8000
# TORCHDYNAMO_DISABLE: vLLM 0.23's CPU sampler torch.compiles its random-sampling kernel at every
# engine start (10-15 s of CPU here, more on a node busy with a roll); the requests are greedy.
VLLM_ENV = [{"name": "VLLM_MLA_DISABLE", "value": "1"}, {"name": "TORCHDYNAMO_DISABLE", "value": "1"}]
# Two revisions run side by side during a roll; on these 2-core, 23 GB machines that must fit
# in 16 GB. vLLM's CPU KV cache defaults to 4 GiB per engine; the tiny model needs a few MiB.
KV_CACHE_ARGS = ["--kv-cache-memory-bytes", "64M"]
ENGINE_ARGS = ["--enforce-eager", *KV_CACHE_ARGS]
# What the whole scenario (node, operator, both revisions) may use of the host (the 16 GB above).
MEMORY_LIMIT_GIB = 16
# The roll's target: both role counts change, FFN pods of several ranks over two pods. A wider
# target (DP 3, FFN 4) peaked above 20 GB with the old revision still serving: the node then
# evicted page cache, stalled and probes timed out (measured; docs/history/testbed-runs.md).
ROLLED_TOPOLOGY = {"data_parallel": 1, "ffn_ranks": 4}
ROLLED_IMAGE = RUNTIME_CPU_IMAGE.rsplit(":", 1)[0] + ":rolled"
# The faults fail the instance three times within recovery.stableSeconds: the default backoff
# (10 s, doubling) would add 70 s of waiting. Doubling and budget are test_controller's concern.
RECOVERY = {"backoffSeconds": 1, "maxBackoffSeconds": 4}
SMALL = {"resources": {"requests": {"cpu": "100m", "memory": "512Mi"}}}
DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "afd-operator" / "dashboards" / "afd.json"


@pytest.fixture(scope="module")
def checkpoint(real_node: RealNode) -> Path:
    """The tiny DeepSeek-V2 and Qwen3-MoE checkpoints the vLLM tests use, on a host folder pods
    mount by hostPath."""
    host_dir = models_dir(real_node)
    write_tiny_checkpoint(host_dir / MODEL_DIR)
    write_tiny_checkpoint(host_dir / SECOND_MODEL_DIR, "qwen3_moe")
    return host_dir


@pytest.fixture(scope="module")
def namespace(real_node: RealNode) -> Iterator[str]:
    real_node.kubectl("create", "namespace", NAMESPACE)
    yield NAMESPACE
    real_node.kubectl("delete", "afd", "--all", "-n", NAMESPACE, "--timeout=300s", check=False)
    real_node.kubectl("delete", "namespace", NAMESPACE, "--timeout=300s", check=False)


def plain_completion(real_node: RealNode, checkpoint: Path, namespace: str, model_dir: str) -> dict:
    """Plain `vllm serve` (no afd block) of `model_dir` in the runtime image, as a pod: the reference completion."""
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain-vllm", "namespace": namespace},
        "spec": {
            "containers": [{
                "name": "vllm", "image": RUNTIME_CPU_IMAGE,
                "command": ["vllm", "serve", f"{MOUNT}/{model_dir}", "--served-model-name", NAME,
                            "--port", str(API_PORT), "--dtype", "float32", "--enforce-eager",
                            "--max-model-len", "512", "--max-num-batched-tokens", "512", *KV_CACHE_ARGS],
                # What the operator renders for a rank of a pod given 100m (planner._cpu_threads_env), and
                # the plugin's CPU kernel fixes, which AFD engines run by default (docs/compat.md).
                "env": VLLM_ENV + [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
                                   {"name": "OMP_NUM_THREADS", "value": "1"},
                                   {"name": CPU_PATCHES_ENV, "value": "all"}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": API_PORT}, "periodSeconds": 2},
                "volumeMounts": [{"name": "model", "mountPath": MOUNT, "readOnly": True}],
                **SMALL}],
            "volumes": [{"name": "model", "hostPath": {"path": str(checkpoint), "type": "Directory"}}]},
    }
    apply(real_node, pod)
    try:
        real_node.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/plain-vllm", "--timeout=600s",
                          timeout=620)
        ip = real_node.kubectl("get", "-n", namespace, "pod", "plain-vllm", "-o",
                               "jsonpath={.status.podIP}").stdout.strip()
        return complete(ip, API_PORT, NAME)
    except Exception:
        print(real_node.kubectl("logs", "-n", namespace, "plain-vllm", "--tail=400", check=False).stdout)
        raise
    finally:
        real_node.kubectl("delete", "-n", namespace, "pod", "plain-vllm", "--timeout=120s", check=False)


@pytest.fixture(scope="module")
def plain_vllm(real_node: RealNode, project_images: dict, checkpoint: Path, namespace: str) -> dict:
    return plain_completion(real_node, checkpoint, namespace, MODEL_DIR)


def afd_deployment(checkpoint: Path, namespace: str, data_parallel: int = 2, ffn_ranks: int = 2,
                   image: str = RUNTIME_CPU_IMAGE, name: str = NAME, model_dir: str = MODEL_DIR) -> dict:
    return {
        "apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1, "image": image, "platform": "cpu",
            "model": {"name": NAME, "path": f"{MOUNT}/{model_dir}",
                      "volume": {"hostPath": str(checkpoint), "mountPath": MOUNT},
                      "routedExperts": 8, "maxModelLen": 512, "maxNumBatchedTokens": 512, "dtype": "float32"},
            "sharedExperts": {"placement": "ffn"},
            "attention": {"dataParallel": data_parallel, "tensorParallel": 1, "devicesPerPod": 1,
                          "engineArgs": ENGINE_ARGS, "env": VLLM_ENV, "podTemplate": SMALL},
            "ffn": {"ranks": ffn_ranks, "devicesPerPod": min(2, ffn_ranks), "env": VLLM_ENV, "podTemplate": SMALL},
            "startup": {"timeoutSeconds": READY_TIMEOUT_SECONDS},
            "recovery": RECOVERY,
            "termination": {"gracePeriodSeconds": 30, "drainSeconds": 5},
        },
    }


@pytest.fixture(scope="module")
def served(real_node: RealNode, operator_release, plain_vllm: dict, checkpoint: Path, namespace: str) -> dict:
    apply(real_node, afd_deployment(checkpoint, namespace))
    address = wait_serving(real_node, namespace, NAME, READY_TIMEOUT_SECONDS)
    return {"address": address, "pods": afd_pods(real_node, namespace, NAME)}


def afd_block_of(pod: dict) -> dict:
    """The `afd` block the pod's container was started with (its --additional-config)."""
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    return json.loads(command[command.index("--additional-config") + 1])["afd"]


def test_pods_run_the_planned_topology(served: dict) -> None:
    roles = sorted(p["metadata"]["labels"]["afd.inference.dev/role"] for p in served["pods"])
    assert roles == ["attention", "attention", "ffn"]
    for pod in served["pods"]:
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, status
    # The spec leaves async.stages unset: both roles run the default on platform cpu.
    assert [afd_block_of(pod)["num_stages"] for pod in served["pods"]] == [2, 2, 2]


def instance_guard(real_node: RealNode, kind: str, instance: str) -> dict:
    return json.loads(real_node.kubectl("get", kind, instance, "-n", NAMESPACE, "-o", "json").stdout)


def test_pods_run_restricted_behind_their_instances_guards(real_node: RealNode, served: dict) -> None:
    """The operator's defaults on platform cpu, as kubelet ran them: the image's unprivileged
    user on a read-only root with no capability and no service-account token; a PDB the
    disruption controller counts in pods of the instance; a NetworkPolicy in and out (stored: the
    bridge CNI here enforces none, docs/testbed.md; membership is enforced: test_operator_chart)."""
    pods = afd_pods(real_node, NAMESPACE, NAME)
    for pod in pods:
        spec, (container,) = pod["spec"], pod["spec"]["containers"]
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                                "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
        assert spec["automountServiceAccountToken"] is False
        assert not any("serviceaccount" in m["mountPath"] for m in container["volumeMounts"])
        probe = ("import os; print(os.getuid(), os.access('/', os.W_OK), os.access('/tmp', os.W_OK), "
                 "open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
        seen = real_node.kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "python3", "-c",
                                 probe).stdout.split()
        assert seen == ["65532", "False", "True", "0000000000000000"], (pod["metadata"]["name"], seen)
    (instance,) = {p["metadata"]["labels"][LABEL + "instance"] for p in pods}
    budget = wait_for(lambda: (b := instance_guard(real_node, "pdb", instance)).get("status", {}).get(
        "expectedPods") == len(pods) and b, "the disruption controller counting the instance's pods", 60, interval=1)
    assert budget["spec"]["minAvailable"] == len(pods) - 1 and budget["status"]["disruptionsAllowed"] == 1, budget
    policy = instance_guard(real_node, "networkpolicy", instance)
    own = {"matchLabels": {LABEL + "instance": instance}}
    assert policy["spec"]["podSelector"] == own and policy["spec"]["ingress"][0] == {"from": [{"podSelector": own}]}
    assert [rule["to"] for rule in policy["spec"]["egress"]] == [[{"podSelector": own}], list(NODE_DNS_PEERS)]
    isolated = next(c for c in get_afd(real_node, NAMESPACE, NAME)["status"]["conditions"]
                    if c["type"] == "NetworkIsolated")
    assert isolated["status"] == "True", isolated


def test_completion_through_the_service_equals_plain_vllm(real_node: RealNode, served: dict,
                                                          plain_vllm: dict) -> None:
    host, port = served["address"]
    svc = json.loads(real_node.kubectl("get", "svc", NAME, "-n", NAMESPACE, "-o", "json").stdout)["spec"]
    assert svc["type"] == "ClusterIP" and svc["clusterIP"] == host
    # The ClusterIP exists only in kube-proxy's rules: this request goes through them.
    assert complete(host, port, NAME) == plain_vllm
    # Four at once: steps hold more than one request (the default 2 stages split only steps of at
    # least spec.async.minSplitTokens tokens, so these run whole).
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: complete(host, port, NAME), range(4))) == [plain_vllm] * 4


def heads(real_node: RealNode, name: str) -> set[str]:
    return {p["metadata"]["name"] for p in afd_pods(real_node, NAMESPACE, name)
            if p["metadata"]["labels"][LABEL + "head"] == "true"}


def api_endpoint_pods(real_node: RealNode, name: str) -> set[str]:
    """The pods the API Service's EndpointSlices list, found as the operator's drain does: by
    the Service's own labels, which the EndpointSlice controller copies onto its slices."""
    selector = f"{DEPLOYMENT_LABEL}={name},kubernetes.io/service-name={name}"
    slices = json.loads(real_node.kubectl("get", "endpointslices", "-n", NAMESPACE, "-l", selector,
                                          "-o", "json").stdout)["items"]
    return {ep["targetRef"]["name"] for s in slices for ep in s.get("endpoints") or []}


def test_a_second_deployment_whose_name_extends_the_first_serves_beside_it(real_node: RealNode, served: dict,
                                                                           checkpoint: Path,
                                                                           plain_vllm: dict) -> None:
    """The second serves Qwen3-MoE (no shared expert; placement 'ffn' asked for): like plain vLLM
    on that checkpoint, its FFN pod saying the placement does not apply."""
    first = {p["metadata"]["uid"] for p in afd_pods(real_node, NAMESPACE, NAME)}
    plain_qwen3 = plain_completion(real_node, checkpoint, NAMESPACE, SECOND_MODEL_DIR)
    apply(real_node, afd_deployment(checkpoint, NAMESPACE, data_parallel=1, ffn_ranks=1, name=SECOND,
                                    model_dir=SECOND_MODEL_DIR))
    try:
        second_host, second_port = wait_serving(real_node, NAMESPACE, SECOND, READY_TIMEOUT_SECONDS)
        for name in (NAME, SECOND):
            own = heads(real_node, name)
            assert len(own) == 1, own
            wait_for(lambda: api_endpoint_pods(real_node, name) == own, f"{name}'s Service routing to its head only",
                     60, interval=1)
        assert complete(second_host, second_port, NAME) == plain_qwen3
        assert complete(*served["address"], NAME) == plain_vllm
        (ffn_pod,) = of_role(real_node, "ffn", SECOND)
        log = real_node.kubectl("logs", "-n", NAMESPACE, ffn_pod["metadata"]["name"], check=False).stdout
        assert "qwen3_moe has no shared experts: shared_experts.placement 'ffn' does not apply" in log
    finally:
        delete_afd(real_node, NAMESPACE, SECOND)
    after = afd_pods(real_node, NAMESPACE, NAME)
    assert {p["metadata"]["uid"] for p in after} == first
    assert all(s["restartCount"] == 0 for p in after for s in p["status"]["containerStatuses"])
    assert complete(*served["address"], NAME) == plain_vllm


# ---- 2. rolling under load ----------------------------------------------------------------------

def delete_operator_pod(real_node: RealNode) -> None:
    real_node.kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=afd-operator",
                      "--wait=false")


def roll(real_node: RealNode, manifest: dict, host: str, port: int,
         mid_rollout=None) -> tuple[Load, WorldWatch, tuple[str, int]]:
    """Apply `manifest` under load and wait until it serves; `mid_rollout(node)` runs once the
    first pod of the new revision exists."""
    with WorldWatch(real_node) as watch, Load(host, port) as load:
        started = time.monotonic()
        apply(real_node, manifest)
        revision = wait_for(lambda: (afd := get_afd(real_node, NAMESPACE, NAME))["status"].get("observedGeneration")
                            == afd["metadata"]["generation"] and afd["status"]["updateRevision"],
                            "the roll observed", 60)
        if mid_rollout is not None:
            wait_for(lambda: any(p["metadata"]["labels"][LABEL + "revision"] == revision
                                 for p in afd_pods(real_node, NAMESPACE, NAME)),
                     "the first pod of the new revision", 120, interval=1)
            mid_rollout(real_node)
        try:
            address = wait_serving(real_node, NAMESPACE, NAME, READY_TIMEOUT_SECONDS)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{watch.failures()}") from None
        print(f"roll: rolled out {time.monotonic() - started:.0f} s after the apply")
        time.sleep(10)  # requests keep flowing after the old world is gone
    return load, watch, address


def assert_rolled_cleanly(real_node: RealNode, load: Load, watch: WorldWatch) -> None:
    peak = (meminfo_bytes("MemTotal") - watch.lowest_available) / 2**30
    after = (meminfo_bytes("MemTotal") - mem_available_bytes()) / 2**30
    print(f"roll: {load.ok} requests served ({load.completions} completions), {len(load.failures)} failed; host "
          f"memory in use (MemTotal - MemAvailable): {peak:.1f} GiB at the peak, {after:.1f} GiB after the roll")
    assert peak < MEMORY_LIMIT_GIB, f"the scenario used {peak:.1f} GiB of host memory (limit {MEMORY_LIMIT_GIB})"
    if load.failures:
        print("events of the failed roll:\n" + namespace_events(real_node))
    assert load.completions > 0 and not load.failures, (load.ok, len(load.failures), load.failures[:3], load.failures[-3:],
                                               watch.timeline, watch.failures())
    assert all(len(revisions) == 1 for revisions in watch.worlds.values()) and not watch.cross_wired, \
        (watch.worlds, watch.cross_wired)


def test_rolls_under_load_to_a_new_topology_then_a_new_image(real_node: RealNode, served: dict, checkpoint: Path,
                                                            plain_vllm: dict) -> None:
    host, port = served["address"]
    before = {p["metadata"]["labels"][LABEL + "revision"] for p in served["pods"]}

    load, watch, (host, port) = roll(real_node, afd_deployment(checkpoint, NAMESPACE, **ROLLED_TOPOLOGY), host, port)
    assert_rolled_cleanly(real_node, load, watch)
    now = afd_pods(real_node, NAMESPACE, NAME)
    assert sorted(p["metadata"]["labels"][LABEL + "role"] for p in now) == ["attention", "ffn", "ffn"]
    assert {p["metadata"]["labels"][LABEL + "revision"] for p in now}.isdisjoint(before)
    assert complete(host, port, NAME) == plain_vllm  # same model, new topology: same greedy text

    retag(real_node, RUNTIME_CPU_IMAGE, ROLLED_IMAGE)
    operator_before = pods(real_node, RELEASE_NAMESPACE, "app.kubernetes.io/name=afd-operator")
    load, watch, (host, port) = roll(real_node, afd_deployment(checkpoint, NAMESPACE, **ROLLED_TOPOLOGY,
                                                              image=ROLLED_IMAGE),
                                     host, port, mid_rollout=delete_operator_pod)
    assert_rolled_cleanly(real_node, load, watch)
    operator_after = pods(real_node, RELEASE_NAMESPACE, "app.kubernetes.io/name=afd-operator")
    assert {p["metadata"]["uid"] for p in operator_after}.isdisjoint(p["metadata"]["uid"] for p in operator_before)
    assert {c["image"] for p in afd_pods(real_node, NAMESPACE, NAME) for c in p["spec"]["containers"]} == {ROLLED_IMAGE}
    assert complete(host, port, NAME) == plain_vllm


# ---- 3. faults ----------------------------------------------------------------------------------

def evict(real_node: RealNode, pod: str) -> subprocess.CompletedProcess:
    """An eviction through the API (policy/v1beta1 on Kubernetes 1.20), as `kubectl drain` sends it."""
    eviction = {"apiVersion": "policy/v1beta1", "kind": "Eviction", "metadata": {"name": pod, "namespace": NAMESPACE}}
    return real_node.kubectl("create", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/eviction", "-f", "-",
                             input_text=json.dumps(eviction), check=False)


def scale_operator(real_node: RealNode, replicas: int) -> None:
    real_node.kubectl("scale", "deployment", RELEASE, "-n", RELEASE_NAMESPACE, f"--replicas={replicas}")
    wait_for(lambda: len(pods(real_node, RELEASE_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}")) == replicas,
             f"{replicas} operator pod(s)", 120, interval=1)


def of_role(real_node: RealNode, role: str, name: str = NAME) -> list[dict]:
    return [p for p in afd_pods(real_node, NAMESPACE, name) if p["metadata"]["labels"][LABEL + "role"] == role]


def test_faults_recreate_the_instance_and_serving_returns(real_node: RealNode, served: dict,
                                                          plain_vllm: dict) -> None:
    host, port = served["address"]

    def kill_an_ffn_container() -> None:
        (status,) = of_role(real_node, "ffn")[0]["status"]["containerStatuses"]
        real_node.ctr("tasks", "kill", "--signal", "SIGKILL", status["containerID"].split("://", 1)[1])

    def delete_an_attention_pod() -> None:
        pod = of_role(real_node, "attention")[-1]["metadata"]["name"]
        real_node.kubectl("delete", "pod", "-n", NAMESPACE, pod, "--wait=false")

    evictions: list[subprocess.CompletedProcess] = []

    def evict_two_pods_of_the_instance() -> None:
        """What a node drain asks: the budget lets one pod of the instance go, not a second.
        Two running pods of one instance: the API server evicts a pod that is terminating or
        not yet running without asking its budget. So the operator is stopped meanwhile: once
        one pod goes it deletes the rest of the instance, and the second eviction would find
        its pod terminating (seen here: allowed)."""
        def running() -> list[dict]:
            return [p["metadata"] for p in afd_pods(real_node, NAMESPACE, NAME)
                    if is_ready(p) and not p["metadata"].get("deletionTimestamp")]

        instance = running()[0]["labels"][LABEL + "instance"]
        wait_for(lambda: instance_guard(real_node, "pdb", instance).get("status", {}).get(
            "disruptionsAllowed") == 1, "the budget allowing one disruption", 60, interval=1)
        first, second = [pod for pod in running() if pod["labels"][LABEL + "instance"] == instance][:2]
        scale_operator(real_node, 0)
        try:
            evictions.extend(evict(real_node, pod["name"]) for pod in (first, second))
        finally:
            scale_operator(real_node, 1)

    outages = [survive(real_node, "FFN container killed", kill_an_ffn_container, host, port),
               survive(real_node, "Attention pod deleted", delete_an_attention_pod, host, port),
               survive(real_node, "two pods of the instance evicted", evict_two_pods_of_the_instance, host, port)]
    print("\n".join(outage.report() for outage in outages))
    allowed, refused = evictions
    assert allowed.returncode == 0, allowed.stderr
    assert refused.returncode != 0 and "disruption budget" in refused.stderr, refused.stderr
    for outage in outages:
        # One instance: the fault is an outage. Each request in it failed visibly (an error
        # status or a refused connection) rather than hanging past the client's timeout.
        assert outage.failures and outage.ok > 0, outage.report()
        assert not [f for f in outage.failures if "timed out" in f], outage.report()
    assert complete(host, port, NAME) == plain_vllm


# ---- 4. Prometheus with Kubernetes service discovery ------------------------------------------

@pytest.fixture(scope="module")
def prometheus(real_node: RealNode, served: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's Prometheus, its targets discovered from the real API (prometheus_sd.py: Debian
    builds it without kubernetes_sd)."""
    workdir = tmp_path_factory.mktemp("prometheus")
    with TargetFeed(real_node) as feed, prometheus_server(
            {"global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
             "scrape_configs": scrape_jobs(feed, NAMESPACE, NAME, RELEASE_NAMESPACE)}, workdir) as base:
        wait_for(lambda: query(base, "up"), "Prometheus with discovered targets", 60, interval=1)
        yield base


def test_prometheus_scrapes_operator_ffn_pod_and_attention_head(prometheus: str, served: dict) -> None:
    host, port = served["address"]
    complete(host, port, NAME)  # traffic, so the runtime counters move
    wanted = {("afd-operator", ""), ("afd-pods", "ffn"), ("afd-pods", "attention")}

    def scraped_up() -> set[tuple[str, str]]:
        return {(s["metric"]["job"], s["metric"].get("role", "")) for s in query(prometheus, "up == 1") or []}

    # Waits for each kind of target, not for a count: after the faults two FFN pods alone made
    # three series while the head's first scrape had not succeeded yet (a CI run).
    try:
        wait_for(lambda: wanted <= scraped_up(), "the operator, the FFN pods and the Attention head up", 120,
                 interval=2)
    except AssertionError as err:
        raise AssertionError(f"{err}; up: {query(prometheus, 'up')}") from None
    # The runtime's own series, from each side, through the pods' real ports.
    wait_for(lambda: query(prometheus, 'afd_tokens_received_total{job="afd-pods",role="ffn"} > 0'),
             "FFN tokens received", 60, interval=2)
    wait_for(lambda: query(prometheus, 'afd_tokens_dispatched_total{job="afd-pods",role="attention"} > 0'),
             "Attention tokens dispatched", 60, interval=2)
    wait_for(lambda: query(prometheus, 'afd_operator_instances{job="afd-operator",phase="Ready"} > 0'),
             "the operator's Ready instance gauge", 60, interval=2)


def dashboard_queries() -> list[str]:
    return [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel.get("targets", [])]


def test_dashboard_queries_return_data(prometheus: str, served: dict) -> None:
    host, port = served["address"]
    for _ in range(3):
        complete(host, port, NAME)
    # Series that only exist once something went wrong (errors, instance restarts) may be
    # absent on a healthy deployment; every other query must return data.
    event_only = ("afd_errors_total", "afd_operator_instance_restarts_total")
    expected = [q for q in dashboard_queries() if not any(m in q for m in event_only)]
    assert expected
    deadline = time.monotonic() + 90
    missing = expected
    while missing and time.monotonic() < deadline:
        time.sleep(3)
        missing = [q for q in expected if not query(prometheus, q)]
    assert not missing, f"dashboard queries without data: {missing}"
    for q in dashboard_queries():
        query(prometheus, q)  # the event-only ones still evaluate


# ---- 5. teardown --------------------------------------------------------------------------------

@dataclass
class FFNExits(BackgroundLoop):
    """Exit codes of the FFN containers that end while it runs, by pod."""

    node: RealNode
    codes: dict[str, int] = field(default_factory=dict)

    def step(self) -> bool:
        for pod in of_role(self.node, "ffn"):
            for status in pod["status"].get("containerStatuses", []):
                if "terminated" in status.get("state", {}):
                    self.codes[pod["metadata"]["name"]] = status["state"]["terminated"]["exitCode"]
        time.sleep(0.5)
        return True


def test_delete_drains_and_leaves_nothing(real_node: RealNode, served: dict, namespace: str) -> None:
    cluster_ip, _ = served["address"]
    ffn_pods = {p["metadata"]["name"] for p in of_role(real_node, "ffn")}
    with FFNExits(real_node) as exits:
        delete_afd(real_node, namespace, NAME)
    # Attention goes first; vLLM drains (--shutdown-timeout) and each Attention rank sends its
    # shutdown notice, so the FFN servers end by themselves with exit 0 before their own SIGTERM.
    assert exits.codes and set(exits.codes) <= ffn_pods and set(exits.codes.values()) == {0}, exits.codes
    # kubelet labels every CRI container (sandboxes too) with its pod's namespace.
    wait_for(lambda: not real_node.ctr("containers", "ls", "-q",
                                       f'labels."io.kubernetes.pod.namespace"=={namespace}').stdout.split(),
             "the deployment's containers removed from containerd", 120, interval=1)
    wait_for(lambda: cluster_ip not in subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                                                      check=True).stdout,
             "the Service's kube-proxy rules removed", 60, interval=1)
    assert not pods(real_node, namespace, "app.kubernetes.io/managed-by=afd-operator")
