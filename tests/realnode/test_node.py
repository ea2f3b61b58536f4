"""The real node itself: kubelet registers Ready, a pod runs in a runc container on the bridge,
a Service's name resolves through the cluster DNS and its ClusterIP routes through kube-proxy."""

from __future__ import annotations

import json
import uuid

from afd_devcluster.realnode import DNS_SERVICE_IP, NODE_NAME, RealNode
from afd_devcluster.realnode.images import BUSYBOX_IMAGE
from afd_devcluster.tools import wait_for

WAIT_SECONDS = 90
CLIENT_ATTEMPTS = 30  # each at most 10 s (the fetch's bound) + 1 s


def test_node_is_ready_with_the_configured_runtime(real_node: RealNode) -> None:
    node = json.loads(real_node.kubectl("get", "node", NODE_NAME, "-o", "json").stdout)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.20.2"


def test_a_service_resolves_and_routes_to_its_pod(real_node: RealNode) -> None:
    ns = f"check-{uuid.uuid4().hex[:6]}"
    real_node.kubectl("create", "namespace", ns)
    try:
        server = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": ns, "labels": {"app": "web"}},
            "spec": {"containers": [{
                "name": "web", "image": BUSYBOX_IMAGE,
                "command": ["/bin/sh", "-c", "mkdir -p /www && hostname > /www/index.html && "
                            "exec httpd -f -p 8080 -h /www"],
                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}]},
        }
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
                   "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
        real_node.kubectl("apply", "-f", "-", input_text=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                     "items": [server, service]}))
        real_node.kubectl("wait", "-n", ns, "--for=condition=Ready", "pod/web", f"--timeout={WAIT_SECONDS}s")
        cluster_ip = real_node.kubectl("get", "-n", ns, "service", "web", "-o",
                                       "jsonpath={.spec.clusterIP}").stdout.strip()
        # A second pod resolves the Service by its short name (search path) and fetches
        # through the ClusterIP, which only kube-proxy's rules lead to the server pod. Routing
        # converges after the Service is created: on a node just started, a fetch 2 s after it
        # got an HTTP 404, which the server pod never sends (the request went elsewhere). So the
        # client tries again, as any client of a new Service would, within a bound, and only the
        # server pod's own answer (its hostname) ends it.
        attempts = (f"for i in $(seq {CLIENT_ATTEMPTS}); do nslookup web; "
                    "answer=$(timeout 10 wget -q -O - http://web/); "
                    "if [ \"$answer\" = web ]; then echo \"$answer\"; exit 0; fi; "
                    "echo \"attempt $i: answer '$answer'\"; sleep 1; done; exit 1")
        client = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": ns},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "client", "image": BUSYBOX_IMAGE,
                # (busybox's wget -T crashes; its timeout applet bounds the fetch instead)
                "command": ["/bin/sh", "-c", f"cat /etc/resolv.conf; {attempts}"]}]},
        }
        real_node.kubectl("apply", "-f", "-", input_text=json.dumps(client))
        def finished() -> str:
            phase = real_node.kubectl("get", "-n", ns, "pod", "client", "-o", "jsonpath={.status.phase}").stdout.strip()
            return phase if phase in ("Succeeded", "Failed") else ""
        phase = wait_for(finished, "client pod finished", WAIT_SECONDS + 11 * CLIENT_ATTEMPTS, interval=0.5)
        logs = real_node.kubectl("logs", "-n", ns, "client").stdout
        assert phase == "Succeeded", logs
        assert f"nameserver {DNS_SERVICE_IP}" in logs
        assert f"web.{ns}.svc.cluster.local" in logs and cluster_ip in logs
        assert logs.strip().splitlines()[-1] == "web", logs  # the server pod's hostname, served over HTTP
    finally:
        real_node.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=60s", check=False)
