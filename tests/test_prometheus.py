"""Metrics scraped for real: Prometheus (Debian) with the chart's scrape settings scrapes the
running operator and an FFN runtime's /metrics; the AFD series are read back from its HTTP API."""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from afd_operator import naming
from afd_devcluster import ControlPlane, FakeKubelet
from afd_devcluster.operator_process import OperatorProcess
from afd_devcluster.prometheus import prometheus_server, query
from afd_shared_experts.metrics import ProbeServer, RuntimeMetrics
from k8s_helpers import Helm, wait_for

CHART = "charts/afd-operator"
DEPLOYMENT = "tiny-cpu"  # examples/cpu-tiny.yaml
SCRAPE_VALUES = ["--set", "metrics.serviceMonitor.enabled=true",
                 "--set", "metrics.scrape.interval=1s", "--set", "metrics.scrape.scrapeTimeout=1s"]
# What the FFN rank "served": token rows of layer 3 by kind.
FFN_TOKENS = {"routed": 96, "shared": 32}


@pytest.fixture(scope="module")
def namespace(cluster: ControlPlane, repo_root: Path) -> str:
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / "afd.inference.dev_afddeployments.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/afddeployments.afd.inference.dev", "--timeout=30s")
    name = f"prom-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, api_client, namespace: str, repo_root: Path, tmp_path_factory,
             examples_policy_file: Path) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("prom-operator") / "operator.log"
    with FakeKubelet(api_client, ["prom-node-0", "prom-node-1"],
                     label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}", deletion_delay_seconds=0.2), \
            OperatorProcess(cluster.operator_kubeconfig, log, namespaces=(namespace,), resync_seconds=0.5,
                            extra_args=("--policy", str(examples_policy_file))) as proc:
        cluster.kubectl("apply", "-n", namespace, "-f", str(repo_root / "examples" / "cpu-tiny.yaml"))
        cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"afd/{DEPLOYMENT}", "--timeout=60s")
        yield proc
        cluster.kubectl("delete", "afd", DEPLOYMENT, "-n", namespace, "--timeout=60s")


@pytest.fixture(scope="module")
def ffn_runtime() -> Iterator[ProbeServer]:
    metrics = RuntimeMetrics("ffn")
    for kind, rows in FFN_TOKENS.items():
        metrics.tokens_received.labels(kind, "3").inc(rows)
    metrics.zero_token_replies.labels("shared").inc()
    server = ProbeServer(metrics, lambda: True, "127.0.0.1", 0, 0).start()
    yield server
    server.stop()


def chart_scrape_endpoint(repo_root: Path, tmp_path: Path) -> dict[str, Any]:
    out = Helm(repo_root, "4", tmp_path / "helm-home")("template", "afd-operator", str(repo_root / CHART),
                                                       *SCRAPE_VALUES).stdout
    (monitor,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    return endpoint


def scrape_config(endpoint: dict[str, Any], targets: dict[str, int]) -> dict[str, Any]:
    """The ServiceMonitor's endpoint as plain Prometheus jobs with static loopback targets (no
    Prometheus Operator here to turn it into service discovery)."""
    return {"global": {"evaluation_interval": endpoint["interval"]},
            "scrape_configs": [{"job_name": job, "metrics_path": endpoint["path"],
                                "scrape_interval": endpoint["interval"], "scrape_timeout": endpoint["scrapeTimeout"],
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in targets.items()]}


def value_of(base: str, promql: str) -> float | None:
    result = query(base, promql)
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def prometheus(operator: OperatorProcess, ffn_runtime: ProbeServer, repo_root: Path,
               tmp_path_factory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("prometheus")
    config = scrape_config(chart_scrape_endpoint(repo_root, workdir),
                           {"afd-operator": operator.metrics_port, "afd-runtime": ffn_runtime.metrics_port})
    with prometheus_server(config, workdir) as base:
        yield base


def test_prometheus_scrapes_the_operator_metrics(prometheus: str, namespace: str) -> None:
    wait_for(lambda: value_of(prometheus, 'up{job="afd-operator"}') == 1, "the operator scraped", 30, interval=0.5)
    ready = f'afd_operator_instances{{namespace="{namespace}",deployment="{DEPLOYMENT}",phase="Ready"}}'
    assert wait_for(lambda: value_of(prometheus, ready), "instances by phase", 30, interval=0.5) == 1
    reconciles = value_of(prometheus, 'afd_operator_reconciles_total{job="afd-operator",result="success"}')
    assert reconciles and reconciles > 0
    writes = query(prometheus, 'afd_operator_api_writes_total{verb="create",kind="Pod"}')
    assert writes and float(writes[0]["value"][1]) >= 4  # the example's four pods


def test_prometheus_scrapes_ffn_tokens_by_kind(prometheus: str) -> None:
    wait_for(lambda: value_of(prometheus, 'up{job="afd-runtime"}') == 1, "the FFN runtime scraped", 30, interval=0.5)
    by_kind = {r["metric"]["kind"]: float(r["value"][1])
               for r in query(prometheus, "sum by (kind) (afd_tokens_received_total)")}
    assert by_kind == FFN_TOKENS


def test_dashboard_queries_evaluate(prometheus: str, repo_root: Path) -> None:
    wait_for(lambda: value_of(prometheus, 'up{job="afd-operator"}') == 1, "the operator scraped", 30, interval=0.5)
    dashboard = json.loads((repo_root / CHART / "dashboards" / "afd.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            query(prometheus, target["expr"])  # asserts the PromQL is accepted


def test_expositions_are_promtool_clean(operator: OperatorProcess, ffn_runtime: ProbeServer) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{ffn_runtime.metrics_port}/metrics", timeout=5) as resp:
        runtime_text = resp.read().decode()
    for text in (operator.metrics(), runtime_text):
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    assert 'afd_tokens_received_total{kind="shared",layer="3"} 32.0' in runtime_text
