"""The main job on the real node: start it (or find it up), build the operator and CPU runtime
images, `helm install` the chart, apply an example AFDDeployment with a tiny checkpoint on a
hostPath, print a completion served through its Service, roll it to a new topology, print a
completion again, delete it and uninstall. A node started here is stopped at the end.

Run: python -m afd_devcluster.realnode.demo [--example FILE] [--namespace NS]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path, PurePosixPath

import yaml

from afd_devcluster.demo import say, show
from afd_devcluster.realnode.images import ensure_project_images
from afd_devcluster.realnode.node import RealNode
from afd_devcluster.realnode.scenario import (PROMPT, apply, complete, delete_afd, install_operator, models_dir,
                                              node_helm, uninstall_operator, wait_serving, with_hostpath,
                                              write_tiny_checkpoint)

READY_TIMEOUT_SECONDS = 900


def serve_and_complete(node: RealNode, manifest: dict, namespace: str) -> None:
    name = manifest["metadata"]["name"]
    started = time.monotonic()
    host, port = wait_serving(node, namespace, name, READY_TIMEOUT_SECONDS)
    print(f"serving after {time.monotonic() - started:.0f} s", flush=True)
    show(node, "get", "afd,pods,svc", "-n", namespace, "-o", "wide")
    answer = complete(host, port, manifest["spec"]["model"]["name"])
    print(f"POST http://{host}:{port}/v1/completions (the Service's ClusterIP) prompt token ids {PROMPT}")
    print(f"completion: {answer['text']!r}", flush=True)


def run(node: RealNode, example: Path, namespace: str) -> None:
    say("images: operator and CPU runtime, built from images/ and imported into the node's containerd")
    for tag, image_id in ensure_project_images(node).items():
        print(f"{tag} {image_id}")
    helm = node_helm(node, node.state / "helm-home")
    say("helm install of charts/afd-operator")
    install_operator(node, helm)
    try:
        manifest = yaml.safe_load(example.read_text())
        model = manifest["spec"]["model"]
        relative = PurePosixPath(model["path"]).relative_to(model["volume"]["mountPath"])
        host_models = models_dir(node)
        say(f"a tiny checkpoint at {host_models / relative} (the example's hostPath points there)")
        write_tiny_checkpoint(host_models / relative)
        manifest = with_hostpath(manifest, host_models)
        manifest["metadata"]["namespace"] = namespace
        name = manifest["metadata"]["name"]
        node.kubectl("create", "namespace", namespace)
        say(f"kubectl apply -f {example} (namespace {namespace})")
        apply(node, manifest)
        serve_and_complete(node, manifest, namespace)

        # Down, not up: both revisions run side by side during the roll and a wider one would
        # not fit with the old one in these machines' memory (docs/history/testbed-runs.md).
        attention = manifest["spec"]["attention"]
        before = attention["dataParallel"]
        attention["dataParallel"] = max(1, before - 1)
        say(f"roll to a new topology: Attention DP {before} -> {attention['dataParallel']}")
        apply(node, manifest)
        time.sleep(2)
        serve_and_complete(node, manifest, namespace)

        say(f"kubectl delete afd {name}: drain, then teardown")
        delete_afd(node, namespace, name)
        show(node, "get", "all", "-n", namespace)
        node.kubectl("delete", "namespace", namespace, "--timeout=120s", check=False)
    finally:
        say("helm uninstall")
        uninstall_operator(node, helm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m afd_devcluster.realnode.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--example", type=Path, default=Path("examples/cpu-tiny.yaml"))
    parser.add_argument("--namespace", default="afd-demo")
    args = parser.parse_args(argv)
    node = RealNode()
    started_here = not node.running()
    say("the real node (kubelet + containerd + CNI + kube-proxy + cluster DNS)")
    node.start()
    show(node, "get", "nodes", "-o", "wide")
    try:
        run(node, args.example, args.namespace)
    finally:
        if started_here:
            say("stopping the real node, undoing its host changes")
            left = node.stop()
            for line in left:
                print(f"left on the host: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
