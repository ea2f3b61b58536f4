"""What a user does with the real node, as the steps the tests and the main job share: install
the chart with the built operator image, put a tiny checkpoint on a hostPath, apply an
AFDDeployment, wait until it serves, send completions through its Service, roll it, delete it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from afd_devcluster.checkpoints import write_vllm_checkpoint
from afd_devcluster.realnode.images import OPERATOR_IMAGE
from afd_devcluster.realnode.node import NODE_IP, REPO_ROOT, RealNode
from afd_devcluster.tools import Helm, wait_for

RELEASE, RELEASE_NAMESPACE = "afd-operator", "afd-system"
CHART = REPO_ROOT / "charts" / "afd-operator"
DEPLOYMENT_LABEL = "afd.inference.dev/deployment"
# Token ids (the tiny checkpoint's word-level vocabulary has 128): a prefill and several decode steps.
PROMPT = [5, 17, 33, 9, 64, 21]
MAX_TOKENS = 12
# The chart's networkPolicy.dnsTo here: dnsmasq answers on the node address, not in a kube-system pod.
NODE_DNS_PEERS = ({"ipBlock": {"cidr": f"{NODE_IP}/32"}},)


def node_helm(node: RealNode, home: Path) -> Helm:
    return Helm(REPO_ROOT, "4", home, kubeconfig=node.kubeconfig)


def models_dir(node: RealNode) -> Path:
    """The host folder of the checkpoints pods mount by hostPath: the one the chart allows."""
    return node.state / "models"


def install_operator(node: RealNode, helm: Helm) -> None:
    """`helm install` of the chart with the operator image built from images/operator, host
    paths allowed under models_dir only, the cluster DNS where this node serves it, then wait until
    the API server reaches the webhook:
    `--wait` ends when the pod is Ready, a moment before kube-proxy routes the webhook Service
    to it, and until then every AFDDeployment write is refused (failurePolicy Fail)."""
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
    helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
         "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
         "--set", f"hostAccess.hostPathPrefixes={{{models_dir(node)}}}",
         "--set-json", f"networkPolicy.dnsTo={json.dumps(list(NODE_DNS_PEERS))}",
         "--wait", "--timeout", "5m")
    invalid = {"apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
               "metadata": {"name": "webhook-probe", "namespace": RELEASE_NAMESPACE},
               "spec": {"image": "probe:1", "platform": "cpu", "model": {"name": "m", "path": "/m", "routedExperts": 8},
                        "attention": {"dataParallel": 1, "tensorParallel": 1}, "ffn": {"ranks": 3}}}

    def webhook_answers() -> bool:
        probe = node.kubectl("create", "--dry-run=server", "-f", "-", input_text=json.dumps(invalid), check=False)
        return "denied the request" in probe.stderr
    wait_for(webhook_answers, "the API server reaching the operator's webhook through its Service", 120, interval=1)


def uninstall_operator(node: RealNode, helm: Helm) -> None:
    helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "2m", check=False)
    node.kubectl("delete", "namespace", RELEASE_NAMESPACE, "--timeout=120s", check=False)


def write_tiny_checkpoint(folder: Path, model_type: str = "deepseek_v2") -> Path:
    """A tiny checkpoint the vLLM tests serve too (DeepSeek-V2 unless told), written to `folder`;
    pods mount it by hostPath."""
    return write_vllm_checkpoint(folder, model_type)


def complete(host: str, port: int, model: str, prompt: list[int] = PROMPT, max_tokens: int = MAX_TOKENS,
             timeout: float = 120) -> dict:
    """A greedy completion from an OpenAI-compatible server: its text and its tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}
    req = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def pods(node: RealNode, namespace: str, selector: str) -> list[dict]:
    return json.loads(node.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]


def afd_pods(node: RealNode, namespace: str, name: str) -> list[dict]:
    return pods(node, namespace, f"{DEPLOYMENT_LABEL}={name}")


def is_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def get_afd(node: RealNode, namespace: str, name: str) -> dict:
    return json.loads(node.kubectl("get", "afd", name, "-n", namespace, "-o", "json").stdout)


def rolled_out(afd: dict) -> bool:
    """Every instance of the current spec Ready and nothing of an older revision left."""
    status = afd.get("status") or {}
    instances = status.get("instances", [])
    return (status.get("observedGeneration") == afd["metadata"]["generation"]
            and status.get("currentRevision") == status.get("updateRevision") is not None
            and len(instances) == afd["spec"].get("replicas", 1)
            and all(i["phase"] == "Ready" and i["revision"] == status["updateRevision"] for i in instances))


def describe(node: RealNode, namespace: str) -> str:
    """Pods, events and the last log lines of every AFD container: what a failed wait shows."""
    out = [node.kubectl("get", "pods,svc,afd", "-n", namespace, "-o", "wide", check=False).stdout,
           node.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
    for pod in pods(node, namespace, "app.kubernetes.io/managed-by=afd-operator"):
        name = pod["metadata"]["name"]
        out.append(f"--- {name}\n" + node.kubectl("logs", "-n", namespace, name, "--tail=30", check=False).stdout)
    return "\n".join(out)


def service_address(node: RealNode, namespace: str, name: str) -> tuple[str, int]:
    """The ClusterIP and port of an AFDDeployment's API Service (reached only through kube-proxy)."""
    spec = json.loads(node.kubectl("get", "svc", name, "-n", namespace, "-o", "json").stdout)["spec"]
    (port,) = [p["port"] for p in spec["ports"]]
    return spec["clusterIP"], port


def wait_serving(node: RealNode, namespace: str, name: str, timeout: float) -> tuple[str, int]:
    """Until the AFDDeployment is rolled out and its Service has endpoints; its address."""
    try:
        wait_for(lambda: rolled_out(get_afd(node, namespace, name)), f"AFDDeployment {namespace}/{name} rolled out",
                 timeout, interval=2)
        wait_for(lambda: node.kubectl("get", "endpoints", name, "-n", namespace, "-o",
                                      "jsonpath={.subsets[*].addresses[*].ip}").stdout.strip(),
                 f"Service {namespace}/{name} endpoints", 120, interval=1)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{describe(node, namespace)}") from None
    return service_address(node, namespace, name)


def apply(node: RealNode, manifest: dict) -> None:
    node.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))


def delete_afd(node: RealNode, namespace: str, name: str, timeout: float = 300) -> None:
    """`kubectl delete` and wait until every pod of it is gone (the operator drains first)."""
    node.kubectl("delete", "afd", name, "-n", namespace, f"--timeout={int(timeout)}s", timeout=timeout + 20)
    wait_for(lambda: not afd_pods(node, namespace, name), f"every pod of {namespace}/{name} gone", timeout, interval=1)


def with_hostpath(manifest: dict, host_folder: Path) -> dict:
    """The manifest with its model volume's hostPath pointing at `host_folder`."""
    copy = json.loads(json.dumps(manifest))
    copy["spec"]["model"]["volume"]["hostPath"] = str(host_folder)
    return copy
