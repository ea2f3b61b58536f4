"""The Helm chart with real helm 3 and 4: lint, templates validated by kubernetes-validate and
by the test apiserver, the values schema, and docs/install.md run command by command against
the apiserver, with the operator running on the chart's ServiceAccount token and serving the
chart's webhook certificate (least privilege proven by the audit log)."""

from __future__ import annotations

import base64
import json
import re
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry

from afd_operator import naming
from afd_devcluster import ControlPlane, FakeKubelet, free_port
from afd_devcluster.operator_process import OperatorProcess
from afd_operator.metrics import OperatorMetrics
from afd_shared_experts.metrics import RuntimeMetrics
from k8s_helpers import Helm, service_account_kubeconfig, validate_built_in, wait_for

CHART = "charts/afd-operator"
CRD_FILE = "afd.inference.dev_afddeployments.yaml"
# The release docs/install.md installs.
RELEASE, RELEASE_NS, DEMO_NS = "afd-operator", "afd-system", "afd-demo"
SERVICE_ACCOUNT = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}"

# Every rule the operator needs in a watched namespace (the chart's Role/ClusterRole).
NAMESPACED_RULES = [
    {"apiGroups": ["afd.inference.dev"], "resources": ["afddeployments"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["afd.inference.dev"], "resources": ["afddeployments/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods", "services"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["monitoring.coreos.com"], "resources": ["podmonitors"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": ["scheduling.volcano.sh"], "resources": ["podgroups"], "verbs": ["get", "create", "delete"]},
]
CRD_WATCH_RULE = {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                  "verbs": ["list", "watch"]}
NAMESPACE_WATCH_RULE = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}

VALUE_SETS = {
    "default": [],
    "namespaced": ["--set", "watchNamespaces={chart-ns-a,chart-ns-b}", "--set", "verbose=true",
                   "--set", "resources.limits.cpu=500m", "--set", "image.repository=registry-path/afd-operator",
                   "--set", "image.tag=dev"],
    "cert-manager+monitoring": ["--set", "webhook.certificate.source=certManager",
                                "--set", "metrics.serviceMonitor.enabled=true", "--set", "dashboards.enabled=true",
                                "--set", "alerts.enabled=true", "--set", "webhook.externalURL=https://127.0.0.1:9443"],
    "minimal": ["--set", "webhook.enabled=false", "--set", "metrics.service.enabled=false"],
}
# Third-party kinds the chart may render: stand-in CRDs so the test apiserver can dry-run them.
THIRD_PARTY_KINDS = [("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
                     ("monitoring.coreos.com", "PrometheusRule", "prometheusrules"),
                     ("cert-manager.io", "Issuer", "issuers"), ("cert-manager.io", "Certificate", "certificates")]


@pytest.fixture(scope="module", params=["3", "4"], ids=["helm3", "helm4"])
def helm(request, repo_root: Path, tmp_path_factory) -> Helm:
    return Helm(repo_root, request.param, tmp_path_factory.mktemp(f"helm{request.param}-home"))


@pytest.fixture(scope="module")
def helm4(repo_root: Path, tmp_path_factory) -> Helm:
    return Helm(repo_root, "4", tmp_path_factory.mktemp("helm4-home"))


def render(helm: Helm, repo_root: Path, *args: str, namespace: str = RELEASE_NS) -> list[dict[str, Any]]:
    out = helm("template", RELEASE, str(repo_root / CHART), "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


# -- static checks ----------------------------------------------------------------------------
def test_chart_crd_is_the_generated_crd(repo_root: Path) -> None:
    assert (repo_root / CHART / "crds" / CRD_FILE).read_bytes() == (repo_root / "crds" / CRD_FILE).read_bytes()
    assert [p.name for p in (repo_root / CHART / "crds").iterdir()] == [CRD_FILE]


def test_lint_strict(helm: Helm, repo_root: Path) -> None:
    result = helm("lint", "--strict", str(repo_root / CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("args, path", [
    (["--set", "webhook.failurePolicy=Sometimes"], "failurePolicy"),
    (["--set", "ports.metrics=0"], "metrics"),
    (["--set", "watchNamespaces={Bad_Namespace}"], "watchNamespaces"),
    (["--set", "webhook.certificate.source=vault"], "source"),
    (["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"], "enabled"),
    (["--set", "resyncSeconds=0"], "resyncSeconds"),
    (["--set", "webhook.externalURL=http://127.0.0.1:9443"], "externalURL"),
    (["--set", "replicas=2"], "replicas"),
    (["--set", "alerts.restartsPerHour=0"], "restartsPerHour"),
    (["--set", "alerts.instanceNotReadyFor=15 minutes"], "instanceNotReadyFor"),
], ids=["policy", "port", "namespace", "cert-source", "monitor-without-service", "resync", "plain-http", "unknown",
        "alert-restarts", "alert-duration"])
def test_schema_rejects_bad_values(helm: Helm, repo_root: Path, args: list[str], path: str) -> None:
    result = helm("template", RELEASE, str(repo_root / CHART), *args, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert path in result.stderr, result.stderr


def test_cluster_wide_rbac_is_exactly_what_the_operator_calls(helm4: Helm, repo_root: Path) -> None:
    objects = render(helm4, repo_root)
    (role,) = find(objects, "ClusterRole")
    assert role["rules"] == [CRD_WATCH_RULE, *NAMESPACED_RULES]
    assert not find(objects, "Role")
    (binding,) = find(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": RELEASE_NS}]


def test_watch_namespaces_become_flags_and_roles(helm4: Helm, repo_root: Path) -> None:
    objects = render(helm4, repo_root, *VALUE_SETS["namespaced"])
    (role,) = find(objects, "ClusterRole")
    assert role["rules"] == [CRD_WATCH_RULE, NAMESPACE_WATCH_RULE]
    roles = find(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["chart-ns-a", "chart-ns-b"]
    assert all(r["rules"] == NAMESPACED_RULES for r in roles)
    assert sorted(b["metadata"]["namespace"] for b in find(objects, "RoleBinding")) == ["chart-ns-a", "chart-ns-b"]
    (deployment,) = find(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=chart-ns-a" in args and "--namespace=chart-ns-b" in args
    assert "--all-namespaces" not in args and "--verbose" in args


def test_no_wildcards_and_no_secrets_in_any_value_set(helm4: Helm, repo_root: Path) -> None:
    for args in VALUE_SETS.values():
        objects = render(helm4, repo_root, *args)
        for role in find(objects, "ClusterRole") + find(objects, "Role"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
                assert "secrets" not in rule["resources"], rule


def test_deployment_is_one_hardened_operator(helm4: Helm, repo_root: Path) -> None:
    (deployment,) = find(render(helm4, repo_root), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    args = container["args"]
    assert "--liveness=http://0.0.0.0:8081/healthz" in args and "--all-namespaces" in args
    assert {a.split("=")[0] for a in args} >= {"--webhook-port", "--webhook-host", "--webhook-cert", "--webhook-key"}
    assert not [a for a in args if a.startswith("--webhook-configuration")], "the chart owns the configuration"


def operator_metric_names() -> set[str]:
    names: set[str] = set()
    for registry in (OperatorMetrics(CollectorRegistry()).registry, RuntimeMetrics("ffn", CollectorRegistry()).registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def test_dashboard_queries_only_existing_metrics(repo_root: Path) -> None:
    dashboard = json.loads((repo_root / CHART / "dashboards" / "afd.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\bafd_[a-z_]+\b", target["expr"])}
    assert used <= operator_metric_names(), used - operator_metric_names()
    assert {"afd_operator_reconciles_total", "afd_operator_instances", "afd_tokens_received_total"} <= used


# -- against the apiserver -----------------------------------------------------------------------
def third_party_crd(group: str, kind: str, plural: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {"spec": {
                             "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]}}


@pytest.fixture(scope="module")
def dry_run_cluster(cluster: ControlPlane, repo_root: Path) -> ControlPlane:
    cluster.kubectl("apply", "-f", str(repo_root / "crds" / CRD_FILE))
    # PodMonitor and PodGroup: the kinds the operator writes besides the built-in ones.
    cluster.kubectl("apply", "-f", str(repo_root / "tests" / "fixtures" / "third-party-crds.yaml"))
    for group, kind, plural in THIRD_PARTY_KINDS:
        cluster.kubectl("apply", "-f", "-", input_text=json.dumps(third_party_crd(group, kind, plural)))
    for ns in ("chart-dry-run", "chart-ns-a", "chart-ns-b"):
        cluster.kubectl("create", "namespace", ns, check=False)
    for group, _, plural in THIRD_PARTY_KINDS:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{group}", "--timeout=30s")
    return cluster


@pytest.mark.parametrize("values", VALUE_SETS, ids=list(VALUE_SETS))
def test_rendered_objects_are_valid(helm: Helm, repo_root: Path, dry_run_cluster: ControlPlane, values: str) -> None:
    objects = render(helm, repo_root, *VALUE_SETS[values], namespace="chart-dry-run")
    builtin = [o for o in objects if "." not in o["apiVersion"].split("/")[0] or
               o["apiVersion"].split("/")[0].endswith(".k8s.io")]
    assert len(builtin) >= 4  # ServiceAccount, ClusterRole, its binding, Deployment at least
    for obj in builtin:
        validate_built_in(obj)
    manifest = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    result = dry_run_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input_text=manifest, check=False)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == len(objects)


def doc_commands(repo_root: Path) -> list[tuple[str, str]]:
    """(section, command) for every line of every ```sh block of docs/install.md, in order."""
    section, in_block, commands = "", False, []
    for line in (repo_root / "docs" / "install.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```sh":
            in_block = True
        elif line.strip() == "```":
            in_block = False
        elif in_block and line.strip():
            commands.append((section, line.strip()))
    return commands


@dataclass
class Walkthrough:
    """docs/install.md being followed: how to run its commands, and what they started."""
    cluster: ControlPlane
    repo_root: Path
    env: dict[str, str]
    workdir: Path
    webhook_port: int
    operator: OperatorProcess | None = None
    operator_started_at: float = 0.0

    def run(self, command: str) -> subprocess.CompletedProcess:
        result = subprocess.run(["bash", "-c", command], cwd=self.repo_root, env=self.env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, f"docs/install.md: `{command}` failed:\n{result.stdout}\n{result.stderr}"
        if shlex.split(command)[:2] == ["helm", "install"]:
            self.start_operator()
        return result

    def start_operator(self) -> None:
        """What the chart's Deployment would run, as a local process: its ServiceAccount's token,
        its arguments, the certificate from its Secret and the policy from its ConfigMap (no
        kubelet runs the pod here)."""
        manifest = subprocess.run(["helm", "get", "manifest", RELEASE, "-n", RELEASE_NS], env=self.env,
                                  capture_output=True, text=True, check=True).stdout
        (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
        chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        secret = json.loads(self.cluster.kubectl("get", "secret", f"{RELEASE}-webhook-tls", "-n", RELEASE_NS,
                                                 "-o", "json").stdout)
        files = {}
        for key in ("tls.crt", "tls.key"):
            files[key] = self.workdir / key
            files[key].write_bytes(base64.b64decode(secret["data"][key]))
        policy = json.loads(self.cluster.kubectl("get", "configmap", f"{RELEASE}-policy", "-n", RELEASE_NS,
                                                 "-o", "json").stdout)
        files["policy"] = self.workdir / "policy.yaml"
        files["policy"].write_text(policy["data"]["values.yaml"])
        replaced = {"--webhook-port": str(self.webhook_port), "--webhook-cert": str(files["tls.crt"]),
                    "--webhook-key": str(files["tls.key"]), "--policy": str(files["policy"])}
        args = []
        for arg in chart_args:
            flag = arg.split("=", 1)[0]
            if flag in ("--in-cluster", "--metrics-port", "--liveness"):
                continue  # a kubeconfig instead of the pod's mount; OperatorProcess picks free ports
            args.append(f"{flag}={replaced[flag]}" if flag in replaced else arg)
        kubeconfig = service_account_kubeconfig(self.cluster, RELEASE_NS, RELEASE, self.workdir / "sa-kubeconfig")
        self.operator_started_at = time.time()
        self.operator = OperatorProcess(kubeconfig, self.workdir / "operator.log", resync_seconds=1.0,
                                        extra_args=(*args, "--webhook-listen=127.0.0.1")).start()
        wait_for(lambda: port_open(self.webhook_port), "the operator's webhook listening", 30)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def helm_shim(directory: Path, helm: Helm, webhook_port: int) -> Path:
    """`helm` for the docs' commands: the real binary, plus the one value a dev cluster without
    Service routing needs (the apiserver reaches the webhook on loopback)."""
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "helm"
    shim.write_text(f"""#!/bin/sh
case "$1" in
  install|upgrade) exec {shlex.quote(helm.binary)} "$@" --set webhook.externalURL=https://127.0.0.1:{webhook_port} ;;
  *) exec {shlex.quote(helm.binary)} "$@" ;;
esac
""")
    shim.chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def walkthrough(cluster: ControlPlane, api_client, helm4: Helm, repo_root: Path, dry_run_cluster: ControlPlane,
                tmp_path_factory) -> Iterator[Walkthrough]:
    workdir = tmp_path_factory.mktemp("walkthrough")
    port = free_port()
    env = {**helm4.env, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{helm_shim(workdir / 'bin', helm4, port)}:{helm4.env['PATH']}"}
    walk = Walkthrough(cluster, repo_root, env, workdir, port)
    with FakeKubelet(api_client, [f"chart-node-{i}" for i in range(4)],
                     label_selector=f"{naming.LABEL_MANAGED_BY}={naming.MANAGER}", deletion_delay_seconds=0.2):
        try:
            for section, command in doc_commands(repo_root):
                if section != "Uninstall":
                    walk.run(command)
            yield walk
        finally:
            # Whatever the tests left: AFDDeployments go while the operator can still drain them.
            cluster.kubectl("delete", "afd", "--all", "-n", DEMO_NS, "--timeout=60s", check=False)
            if walk.operator:
                walk.operator.stop()
            subprocess.run(["helm", "uninstall", RELEASE, "-n", RELEASE_NS, "--ignore-not-found"], env=env,
                           capture_output=True)
            cluster.kubectl("apply", "-f", str(repo_root / "crds" / CRD_FILE))


def test_install_walkthrough_converged_and_rolled(walkthrough: Walkthrough) -> None:
    obj = json.loads(walkthrough.cluster.kubectl("get", "afd", "tiny-cpu", "-n", DEMO_NS, "-o", "json").stdout)
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and obj["status"]["observedGeneration"] == 2
    assert obj["spec"]["ffn"]["ranks"] == 4 and obj["status"]["updatedReplicas"] == 1
    pods = walkthrough.cluster.kubectl("get", "pods", "-n", DEMO_NS, "-o", "name").stdout.split()
    assert len(pods) == 2 + 4, pods  # two Attention pods, four FFN pods of the new revision only
    assert walkthrough.cluster.kubectl("get", "servicemonitor", RELEASE, "-n", RELEASE_NS).returncode == 0


def test_a_squatted_name_is_a_name_conflict_under_the_charts_rbac(walkthrough: Walkthrough) -> None:
    """The operator reads the holder of a name its create found taken (get, granted by the
    chart) and reports it; the squatter is left as it was."""
    cluster = walkthrough.cluster
    cluster.kubectl("create", "service", "clusterip", "squatted", "--tcp=80:80", "-n", DEMO_NS)
    spec = json.loads(cluster.kubectl("get", "afd", "tiny-cpu", "-n", DEMO_NS, "-o", "json").stdout)["spec"]
    manifest = {"apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
                "metadata": {"name": "squatted", "namespace": DEMO_NS}, "spec": spec}
    cluster.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))

    def conflict() -> Any:
        obj = json.loads(cluster.kubectl("get", "afd", "squatted", "-n", DEMO_NS, "-o", "json").stdout)
        return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "NameConflict"), None)

    try:
        condition = wait_for(conflict, "NameConflict on squatted", 60)
        assert condition["message"].startswith("Service squatted exists and is controlled by nothing (no controller "
                                               "reference)"), condition
        service = json.loads(cluster.kubectl("get", "service", "squatted", "-n", DEMO_NS, "-o", "json").stdout)
        assert "ownerReferences" not in service["metadata"] and service["spec"]["selector"] == {"app": "squatted"}
    finally:
        cluster.kubectl("delete", "afd", "squatted", "-n", DEMO_NS, "--timeout=60s", check=False)
        cluster.kubectl("delete", "service", "squatted", "-n", DEMO_NS, check=False)


# (verb, resource, subresource): kubectl would read "pods/exec" as the pod named "exec".
CAN = [("get", "afddeployments.afd.inference.dev", ""),
       ("list", "afddeployments.afd.inference.dev", ""), ("watch", "afddeployments.afd.inference.dev", ""),
       ("patch", "afddeployments.afd.inference.dev", ""), ("patch", "afddeployments.afd.inference.dev", "status"),
       ("create", "pods", ""), ("patch", "pods", ""), ("delete", "pods", ""), ("watch", "pods", ""),
       ("create", "services", ""), ("patch", "services", ""), ("delete", "services", ""),
       ("create", "configmaps", ""), ("delete", "configmaps", ""), ("create", "events", ""),
       ("get", "pods", ""), ("get", "services", ""), ("get", "configmaps", ""),
       ("get", "poddisruptionbudgets.policy", ""), ("get", "networkpolicies.networking.k8s.io", ""),
       ("watch", "endpointslices.discovery.k8s.io", ""),
       ("watch", "poddisruptionbudgets.policy", ""), ("create", "poddisruptionbudgets.policy", ""),
       ("watch", "networkpolicies.networking.k8s.io", ""), ("patch", "networkpolicies.networking.k8s.io", ""),
       ("patch", "podmonitors.monitoring.coreos.com", ""), ("delete", "podgroups.scheduling.volcano.sh", ""),
       ("list", "customresourcedefinitions.apiextensions.k8s.io", "")]
CANNOT = [("get", "secrets", ""), ("list", "secrets", ""), ("watch", "secrets", ""), ("create", "secrets", ""),
          ("update", "afddeployments.afd.inference.dev", ""), ("delete", "afddeployments.afd.inference.dev", ""),
          ("create", "afddeployments.afd.inference.dev", ""), ("update", "afddeployments.afd.inference.dev", "status"),
          ("update", "pods", ""), ("create", "pods", "exec"), ("patch", "pods", "status"), ("get", "pods", "log"),
          ("patch", "configmaps", ""), ("create", "deployments.apps", ""), ("delete", "namespaces", ""),
          ("list", "namespaces", ""), ("create", "customresourcedefinitions.apiextensions.k8s.io", ""),
          ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io", ""),
          ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""), ("create", "serviceaccounts", "token"),
          ("patch", "podgroups.scheduling.volcano.sh", ""), ("delete", "events", ""),
          ("patch", "endpointslices.discovery.k8s.io", ""), ("update", "poddisruptionbudgets.policy", ""),
          ("create", "pods", "eviction"), ("*", "*", "")]


@pytest.mark.parametrize("verb, resource, subresource, allowed",
                         [(*c, True) for c in CAN] + [(*c, False) for c in CANNOT],
                         ids=[f"can-{v}-{r}{'/' + s if s else ''}" for v, r, s in CAN]
                         + [f"cannot-{v}-{r}{'/' + s if s else ''}" for v, r, s in CANNOT])
def test_service_account_can_do_exactly_what_the_operator_needs(walkthrough: Walkthrough, verb: str, resource: str,
                                                                subresource: str, allowed: bool) -> None:
    args = ["auth", "can-i", verb, resource, "-n", DEMO_NS, f"--as={SERVICE_ACCOUNT}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    result = walkthrough.cluster.kubectl(*args, check=False)
    assert result.stdout.strip() == ("yes" if allowed else "no"), result.stdout + result.stderr


def test_operator_on_the_chart_token_was_never_forbidden(walkthrough: Walkthrough) -> None:
    events = walkthrough.cluster.audit_events(SERVICE_ACCOUNT, since=walkthrough.operator_started_at)
    writes = {(e["verb"], e["objectRef"]["resource"]) for e in events if e["verb"] in ("create", "patch", "delete")}
    assert {("create", "pods"), ("create", "services"), ("create", "configmaps"), ("patch", "afddeployments"),
            ("create", "events")} <= writes, writes
    forbidden = [(e["verb"], e["requestURI"]) for e in events if e.get("responseStatus", {}).get("code") == 403]
    assert forbidden == []


def test_chart_webhook_rejects_an_invalid_afddeployment(walkthrough: Walkthrough, repo_root: Path) -> None:
    doc = yaml.safe_load((repo_root / "examples" / "cpu-tiny.yaml").read_text())
    doc["metadata"]["name"] = "invalid"
    doc["spec"]["ffn"]["ranks"] = 3
    result = walkthrough.cluster.kubectl("apply", "-n", DEMO_NS, "-f", "-", input_text=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert 'admission webhook "validation.afd.inference.dev" denied the request' in result.stderr, result.stderr
    assert "spec.ffn.ranks: must divide model.routedExperts (8)" in result.stderr


def test_chart_webhook_judges_a_scale(walkthrough: Walkthrough, repo_root: Path) -> None:
    """`kubectl scale` writes only /scale; the replica count enters the rollout budget's rule."""
    doc = yaml.safe_load((repo_root / "examples" / "cpu-tiny.yaml").read_text())
    doc["metadata"]["name"] = "scaled"
    doc["spec"].update(replicas=2, updateStrategy={"maxSurge": "0%", "maxUnavailable": "50%"})
    walkthrough.cluster.kubectl("apply", "-n", DEMO_NS, "-f", "-", input_text=yaml.safe_dump(doc))
    try:
        refused = walkthrough.cluster.kubectl("scale", "afd", "scaled", "-n", DEMO_NS, "--replicas=1", check=False)
        assert refused.returncode != 0, refused.stdout
        assert 'admission webhook "scale-validation.afd.inference.dev" denied the request' in refused.stderr
        assert "spec.updateStrategy.maxUnavailable: maxSurge and maxUnavailable must not both be 0" in refused.stderr
        walkthrough.cluster.kubectl("scale", "afd", "scaled", "-n", DEMO_NS, "--replicas=4")
        stored = json.loads(walkthrough.cluster.kubectl("get", "afd", "scaled", "-n", DEMO_NS, "-o", "json").stdout)
        assert stored["spec"]["replicas"] == 4
    finally:
        walkthrough.cluster.kubectl("delete", "afd", "scaled", "-n", DEMO_NS, "--timeout=60s", check=False)


def test_uninstall_keeps_the_crd(walkthrough: Walkthrough, repo_root: Path) -> None:
    commands = [c for section, c in doc_commands(repo_root) if section == "Uninstall"]
    crd = "crd/afddeployments.afd.inference.dev"
    for command in commands:
        walkthrough.run(command)
        if command.startswith("helm uninstall"):
            assert walkthrough.cluster.kubectl("get", crd, check=False).returncode == 0, "helm uninstall removed the CRD"
            assert walkthrough.cluster.kubectl("get", "validatingwebhookconfiguration", RELEASE,
                                               check=False).returncode != 0
    assert walkthrough.cluster.kubectl("get", crd, check=False).returncode != 0  # the docs' last command
    assert walkthrough.cluster.kubectl("get", "pods", "-n", DEMO_NS, "-o", "name").stdout.strip() == ""
    walkthrough.cluster.kubectl("apply", "-f", str(repo_root / "crds" / CRD_FILE))
    wait_for(lambda: walkthrough.cluster.kubectl("wait", "--for=condition=Established", crd, "--timeout=5s",
                                                 check=False).returncode == 0, "the CRD back", 30)


def test_every_install_doc_command_is_run(repo_root: Path) -> None:
    """The walkthrough fixture runs every section but Uninstall, test_uninstall_keeps_the_crd
    runs Uninstall: both read the same list, so this only checks the list is the whole doc."""
    commands = doc_commands(repo_root)
    assert {s for s, _ in commands} == {"Install", "Deploy a model", "Read the status", "Scrape the metrics",
                                        "Upgrade", "Uninstall"}
    text = (repo_root / "docs" / "install.md").read_text()
    shell_lines = [ln for ln in text.splitlines() if re.match(r"^(kubectl|helm) ", ln)]
    assert sorted(shell_lines) == sorted(c for _, c in commands), "a command outside a ```sh block"
