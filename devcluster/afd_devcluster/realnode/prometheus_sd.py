"""Scrape targets for Debian's Prometheus from the real node's API, over HTTP service discovery.

Debian builds Prometheus without its Kubernetes service discovery (`kubernetes_sd_configs` is
an unknown field there), so this feed plays that part: on each poll it lists the API and
answers `http_sd_configs` with the targets a `kubernetes_sd_configs` + relabeling setup would
keep: the container ports a PodMonitor names on the pods it selects (role `pod`), and the
endpoints of Services annotated `prometheus.io/scrape: "true"` (role `endpoints`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from afd_devcluster.ports import free_port
from afd_devcluster.realnode.node import RealNode


def _label_name(key: str) -> str:
    """A Kubernetes label key as kubernetes_sd spells it in a meta label."""
    return "".join(c if c.isalnum() else "_" for c in key)


def pod_targets(pods: list[dict], selector: dict[str, str], port_names: set[str]) -> list[dict]:
    """One target group per (Ready or not) running pod port: what a PodMonitor selects."""
    groups = []
    for pod in pods:
        labels = pod["metadata"].get("labels", {})
        ip = pod.get("status", {}).get("podIP")
        if not ip or any(labels.get(k) != v for k, v in selector.items()):
            continue
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                if port.get("name") in port_names:
                    groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                        "__meta_kubernetes_namespace": pod["metadata"]["namespace"],
                        "__meta_kubernetes_pod_name": pod["metadata"]["name"],
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_port_name": port["name"],
                        **{f"__meta_kubernetes_pod_label_{_label_name(k)}": v for k, v in labels.items()}}})
    return groups


def annotated_endpoint_targets(services: list[dict], endpoints: list[dict]) -> list[dict]:
    """Ready addresses of Services annotated prometheus.io/scrape=true, on their annotated port."""
    wanted = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services
              if s["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
    groups = []
    for ep in endpoints:
        service = wanted.get((ep["metadata"]["namespace"], ep["metadata"]["name"]))
        if service is None:
            continue
        port = service["metadata"]["annotations"].get("prometheus.io/port")
        for subset in ep.get("subsets", []):
            ports = [port] if port else [str(p["port"]) for p in subset.get("ports", [])]
            for address in subset.get("addresses", []):
                for p in ports:
                    groups.append({"targets": [f"{address['ip']}:{p}"], "labels": {
                        "__meta_kubernetes_namespace": ep["metadata"]["namespace"],
                        "__meta_kubernetes_service_name": ep["metadata"]["name"],
                        "__meta_kubernetes_pod_name": (address.get("targetRef") or {}).get("name", "")}})
    return groups


class TargetFeed:
    """An HTTP SD endpoint on loopback: /pods?namespace=NS&label=K=V&ports=a,b and
    /endpoints?namespace=NS. Use as a context manager; `url(path)` gives a feed's URL."""

    def __init__(self, node: RealNode):
        self.node = node
        self.port = free_port()
        self._server: Optional[ThreadingHTTPServer] = None

    def _list(self, kind: str, namespace: str) -> list[dict]:
        return json.loads(self.node.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]

    def groups(self, path: str, query: dict[str, list[str]]) -> list[dict]:
        namespace = query["namespace"][0]
        if path == "/pods":
            selector = dict(item.split("=", 1) for item in query.get("label", []))
            return pod_targets(self._list("pods", namespace), selector, set(query["ports"][0].split(",")))
        if path == "/endpoints":
            return annotated_endpoint_targets(self._list("services", namespace), self._list("endpoints", namespace))
        raise KeyError(path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> "TargetFeed":
        from urllib.parse import parse_qs, urlsplit

        feed = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                try:
                    body = json.dumps(feed.groups(parts.path, parse_qs(parts.query))).encode()
                    status = 200
                except (KeyError, RuntimeError) as exc:
                    body, status = str(exc).encode(), 500
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Prometheus gave up on a slow answer; it asks again at its next refresh

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


def scrape_jobs(feed: TargetFeed, deployment_namespace: str, deployment: str, operator_namespace: str,
                refresh: str = "5s") -> list[dict]:
    """Prometheus scrape jobs: the AFD pods (the rendered PodMonitor's ports `api` and
    `metrics`) and the operator's annotated metrics Service, relabeled as a kubernetes_sd
    setup would be."""
    # No `namespace` target label on the operator: its series carry the namespace of the
    # AFDDeployment they describe, which a target label would rename to exported_namespace.
    pod = [{"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    return [
        {"job_name": "afd-pods", "http_sd_configs": [{"url": feed.url(
            f"/pods?namespace={deployment_namespace}&label=afd.inference.dev/deployment={deployment}"
            "&ports=api,metrics"), "refresh_interval": refresh}],
         "relabel_configs": pod + [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                                   {"source_labels": ["__meta_kubernetes_pod_label_afd_inference_dev_role"],
                                    "target_label": "role"}]},
        {"job_name": "afd-operator", "http_sd_configs": [{"url": feed.url(f"/endpoints?namespace={operator_namespace}"),
                                                          "refresh_interval": refresh}],
         "relabel_configs": pod},
    ]
