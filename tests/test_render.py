"""Renderer: the Kubernetes objects of a deployment (pure), checked offline."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import yaml

from afd_operator import naming
from afd_operator.api import AFDDeploymentSpec
from afd_operator.planner import plan
from afd_operator.policy import DEFAULT_DNS_TO, DEFAULT_METRICS_FROM, ClusterPolicy, NetworkIsolation
from afd_operator.render import image_version_label, render
from afd_operator.revision import revision_of
from afd_operator.validation import validate_object
from afd_shared_experts.config import parse_afd_config

from k8s_helpers import SCHEMA_VERSIONS, validate_built_in
from pod_security import restricted_violations
from test_planner import spec_of



def render_spec(spec: AFDDeploymentSpec, uid: str = "uid-1") -> list[dict[str, Any]]:
    return render(spec, plan(spec, "ds", "ns"), owner_uid=uid)


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_object_inventory_and_owner_references() -> None:
    objs = render_spec(spec_of(replicas=2, scheduling={"gang": {"provider": "volcano", "queue": "q"}},
                               metrics={"podMonitor": True}))
    kinds = Counter(o["kind"] for o in objs)
    # 2 instances x (2 attention + 2 ffn) pods, a headless Service, PDB and PodGroup per instance
    # (host networking: no NetworkPolicy can select the pods).
    assert kinds == Counter({"Pod": 8, "Service": 3, "PodGroup": 2, "ConfigMap": 1,
                             "PodDisruptionBudget": 2, "PodMonitor": 1})
    for o in objs:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment", "name": "ds",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert o["metadata"]["labels"][naming.LABEL_MANAGED_BY] == "afd-operator"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    assert render_spec(spec_of(replicas=2)) == render_spec(spec_of(replicas=2))


def test_pod_group_gangs_the_whole_instance() -> None:
    objs = render_spec(spec_of(scheduling={"gang": {"provider": "volcano", "queue": "q"},
                                           "priorityClassName": "hi"}))
    groups = of_kind(objs, "PodGroup")
    for group in groups:
        members = [p for p in of_kind(objs, "Pod")
                   if p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]]
        assert group["spec"] == {"minMember": len(members), "queue": "q", "priorityClassName": "hi"}
        assert all(p["spec"]["schedulerName"] == "volcano" for p in members)


def test_ascend_pod_shape() -> None:
    spec = spec_of(ascend={"socketInterface": "eth9", "hcclBufferSizeMB": {"ffn": 1024}, "shmSize": "32Gi"},
                   termination={"gracePeriodSeconds": 77})
    objs = render_spec(spec)
    for pod in of_kind(objs, "Pod"):
        s = pod["spec"]
        c = s["containers"][0]
        assert s["hostNetwork"] is True and s["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert s["restartPolicy"] == "Never"
        assert s["terminationGracePeriodSeconds"] == 77
        assert s["hostname"] == pod["metadata"]["name"]
        assert s["subdomain"] == pod["metadata"]["labels"][naming.LABEL_AFD_INSTANCE]
        devices = c["resources"]["requests"]["huawei.com/Ascend910"]
        assert devices == c["resources"]["limits"]["huawei.com/Ascend910"] == 2
        env = env_of(pod)
        assert env["HCCL_IF_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["HCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "eth9"
        assert env["VLLM_PLUGINS"] == "ascend,afd_shared_experts"
        role = pod["metadata"]["labels"][naming.LABEL_ROLE]
        assert env.get("HCCL_BUFFSIZE") == ("1024" if role == "ffn" else None)
        vols = {v["name"]: v for v in s["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert vols["hccn-conf"]["hostPath"] == {"path": "/etc/hccn.conf", "type": "File"}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/usr/local/Ascend/driver"]["readOnly"] is True
        for port in c["ports"]:
            assert port["hostPort"] == port["containerPort"]


def test_only_the_head_serves_a_prometheus_multiprocess_directory() -> None:
    # vLLM's /metrics on the head aggregates its engine processes (the plugin's afd_* counters of
    # each Attention rank) from this directory; a fresh emptyDir per pod, so no stale counts.
    pods = of_kind(render_spec(spec_of(replicas=1)), "Pod")
    heads = [p for p in pods if p["metadata"]["labels"][naming.LABEL_HEAD] == "true"]
    assert len(heads) == 1 and len(pods) > 2  # a headless Attention pod and FFN pods too
    for pod in pods:
        c = pod["spec"]["containers"][0]
        head = pod["metadata"]["labels"][naming.LABEL_HEAD] == "true"
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        if head:
            assert env_of(pod)["PROMETHEUS_MULTIPROC_DIR"] == mounts["prometheus-multiproc"]
            assert vols["prometheus-multiproc"] == {"name": "prometheus-multiproc", "emptyDir": {}}
        else:
            assert "PROMETHEUS_MULTIPROC_DIR" not in env_of(pod) and "prometheus-multiproc" not in vols


def test_probes_and_prestop_per_role() -> None:
    pods = {p["metadata"]["name"]: p for p in of_kind(render_spec(spec_of(replicas=1)), "Pod")}
    head = next(p for p in pods.values() if p["metadata"]["labels"][naming.LABEL_HEAD] == "true")
    hc = head["spec"]["containers"][0]
    assert hc["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert hc["startupProbe"]["failureThreshold"] * hc["startupProbe"]["periodSeconds"] >= 1800
    assert hc["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    for pod in pods.values():
        c = pod["spec"]["containers"][0]
        if pod["metadata"]["labels"][naming.LABEL_ROLE] == "ffn":
            assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
            assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "health"}
        elif pod is not head:
            assert "readinessProbe" not in c and "--headless" in c["command"]
            continue
        # Serving within 2 s of the server answering; a stall of 15 s or less keeps the pod in the
        # Service; a minute of failed liveness restarts it.
        assert c["startupProbe"]["periodSeconds"] <= 2 and c["readinessProbe"]["periodSeconds"] <= 2
        readiness, liveness = c["readinessProbe"], c["livenessProbe"]
        assert (readiness["failureThreshold"] - 1) * readiness["periodSeconds"] >= 14
        assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 60


@pytest.mark.parametrize("grace,head_timeout,headless_timeout", [(120, 105, 110), (30, 15, 20), (12, 1, 2), (0, 1, 1)])
def test_engines_drain_and_exit_within_the_termination_grace_period(grace, head_timeout, headless_timeout) -> None:
    """vLLM's --shutdown-timeout leaves room for the head's preStop and for the processes to
    exit before the kubelet's SIGKILL; never 0 (vLLM would force-kill its workers at once and
    no Attention rank would send its AFD shutdown notice)."""
    spec = spec_of(termination={"gracePeriodSeconds": grace, "drainSeconds": 0})
    for pod in of_kind(render_spec(spec), "Pod"):
        c = pod["spec"]["containers"][0]
        if pod["metadata"]["labels"][naming.LABEL_ROLE] == "ffn":
            assert "--shutdown-timeout" not in c["command"]
            continue
        head = pod["metadata"]["labels"][naming.LABEL_HEAD] == "true"
        timeout = c["command"][c["command"].index("--shutdown-timeout") + 1]
        assert timeout == str(head_timeout if head else headless_timeout)
        assert pod["spec"]["terminationGracePeriodSeconds"] == grace
        if head:
            assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(min(5, grace))]


def test_cpu_platform_has_no_devices_and_pod_networking() -> None:
    for pod in of_kind(render_spec(spec_of(platform="cpu")), "Pod"):
        s, c = pod["spec"], pod["spec"]["containers"][0]
        assert "hostNetwork" not in s and "dnsPolicy" not in s
        assert not any("huawei.com" in k for k in c.get("resources", {}).get("limits", {}))
        assert env_of(pod)["VLLM_PLUGINS"] == "afd_shared_experts"
        assert "HCCL_IF_IP" not in env_of(pod)
        assert all("hostPort" not in p for p in c["ports"])


def test_pod_template_overrides_are_merged() -> None:
    spec = spec_of(attention={
        "env": [{"name": "VLLM_PLUGINS", "value": "mine"}, {"name": "EXTRA", "value": "1"}],
        "podTemplate": {
            "labels": {"team": "a"}, "annotations": {"note": "x"}, "nodeSelector": {"pool": "npu"},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}},
        },
    })
    for pod in of_kind(render_spec(spec), "Pod"):
        if pod["metadata"]["labels"][naming.LABEL_ROLE] != "attention":
            assert "nodeSelector" not in pod["spec"]
            continue
        assert pod["metadata"]["labels"]["team"] == "a"
        assert pod["metadata"]["annotations"] == {"note": "x"}
        assert pod["spec"]["nodeSelector"] == {"pool": "npu"}
        assert pod["spec"]["tolerations"] == [{"key": "k", "operator": "Exists"}]
        c = pod["spec"]["containers"][0]
        assert c["resources"]["requests"] == {"cpu": "8", "huawei.com/Ascend910": 2}
        assert c["resources"]["limits"] == {"memory": "64Gi", "huawei.com/Ascend910": 2}
        assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
        names = [e["name"] for e in c["env"]]
        assert names.count("VLLM_PLUGINS") == 1 and env_of(pod)["VLLM_PLUGINS"] == "mine"


def test_api_service_selects_only_serving_heads() -> None:
    objs = render_spec(spec_of())
    api = next(o for o in of_kind(objs, "Service") if o["metadata"]["name"] == "ds")
    sel = api["spec"]["selector"]
    assert sel[naming.LABEL_SERVING] == "true" and sel[naming.LABEL_HEAD] == "true"
    assert api["spec"]["ports"][0]["targetPort"] == "api"
    # No pod is rendered serving: the operator sets the label once an instance is Ready.
    assert not any(naming.LABEL_SERVING in p["metadata"]["labels"] for p in of_kind(objs, "Pod"))
    for svc in of_kind(objs, "Service"):
        if svc["spec"].get("clusterIP") == "None":
            assert svc["spec"]["publishNotReadyAddresses"] is True


def test_each_instance_has_a_budget_of_one_disrupted_pod() -> None:
    objs = render_spec(spec_of(replicas=2, updateStrategy={"maxUnavailable": 1}))
    pdbs = of_kind(objs, "PodDisruptionBudget")
    instances = sorted({p["metadata"]["labels"][naming.LABEL_AFD_INSTANCE] for p in of_kind(objs, "Pod")})
    assert [p["metadata"]["name"] for p in pdbs] == instances
    for pdb in pdbs:
        pods = [p for p in of_kind(objs, "Pod")
                if p["metadata"]["labels"][naming.LABEL_AFD_INSTANCE] == pdb["metadata"]["name"]]
        # An integer minAvailable: the disruption controller counts the pods its selector finds.
        # Pods not Ready yet may be evicted: a drain never waits on a starting instance.
        assert pdb["spec"] == {"minAvailable": len(pods) - 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                               "selector": {"matchLabels": {naming.LABEL_AFD_INSTANCE: pdb["metadata"]["name"]}}}


def network_policies(spec: AFDDeploymentSpec, policy: ClusterPolicy = ClusterPolicy()) -> list[dict[str, Any]]:
    return of_kind(render(spec, plan(spec, "ds", "ns"), policy=policy), "NetworkPolicy")


def test_a_network_policy_per_instance_admits_its_own_pods_api_clients_and_scrapers() -> None:
    nps = network_policies(spec_of(platform="cpu"))
    assert [n["metadata"]["name"] for n in nps] == ["ds-" + revision_of(spec_of(platform="cpu")) + f"-{i}"
                                                     for i in range(2)]
    own = {"matchLabels": {naming.LABEL_AFD_INSTANCE: nps[0]["metadata"]["name"]}}
    assert nps[0]["spec"] == {
        "podSelector": own, "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"podSelector": own}]},
                    {"ports": [{"protocol": "TCP", "port": "api"}]},
                    {"from": list(DEFAULT_METRICS_FROM), "ports": [{"protocol": "TCP", "port": "metrics"}]}],
        # Out: the instance and the cluster DNS only (no metadata endpoint, no other tenant).
        "egress": [{"to": [{"podSelector": own}]},
                   {"to": list(DEFAULT_DNS_TO), "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]}
    # The default scrapers are one namespace's Prometheus, not any namespace's pod labelled so.
    (scraper,) = DEFAULT_METRICS_FROM
    assert scraper["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}


def test_the_admins_egress_grants_and_dns_peers_are_the_only_way_out() -> None:
    grants = ({"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 9000}]},)
    dns = ({"ipBlock": {"cidr": "10.0.0.10/32"}},)
    (np, _) = network_policies(spec_of(platform="cpu"),
                               ClusterPolicy(network=NetworkIsolation(dns_to=dns, egress_to=grants)))
    own = np["spec"]["podSelector"]
    assert np["spec"]["egress"] == [{"to": [{"podSelector": own}]},
                                    {"to": list(dns), "ports": [{"protocol": "UDP", "port": 53},
                                                                {"protocol": "TCP", "port": 53}]},
                                    *grants]
    # No DNS peers: no DNS rule (an empty `to` would admit every destination on port 53).
    (np, _) = network_policies(spec_of(platform="cpu"), ClusterPolicy(network=NetworkIsolation(dns_to=())))
    assert np["spec"]["egress"] == [{"to": [{"podSelector": own}]}]


def test_allowed_clients_restrict_the_api_port_and_scrapers_keep_their_way_in() -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"team": "search"}}}, {"ipBlock": {"cidr": "10.1.0.0/16"}}]
    scrapers = ({"namespaceSelector": {"matchLabels": {"name": "monitoring"}}},)
    (np, _) = network_policies(spec_of(platform="cpu", service={"allowedClients": clients}),
                               ClusterPolicy(network=NetworkIsolation(metrics_from=scrapers)))
    api_rule = np["spec"]["ingress"][1]
    assert api_rule == {"ports": [{"protocol": "TCP", "port": "api"}], "from": clients + list(scrapers)}
    assert np["spec"]["ingress"][2]["from"] == list(scrapers)


def test_no_network_policy_where_it_cannot_apply_or_the_cluster_turns_them_off() -> None:
    assert network_policies(spec_of()) == []  # platform ascend: host networking
    assert network_policies(spec_of(platform="cpu"), ClusterPolicy(network=NetworkIsolation(enabled=False))) == []
    no_metrics = network_policies(spec_of(platform="cpu", metrics={"enabled": False}))
    assert all(len(np["spec"]["ingress"]) == 2 for np in no_metrics)


def test_runtime_pods_are_restricted_and_cpu_pods_run_non_root_on_a_read_only_root() -> None:
    for pod in of_kind(render_spec(spec_of(platform="cpu")), "Pod"):
        s, (c,) = pod["spec"], pod["spec"]["containers"]
        assert s["automountServiceAccountToken"] is False
        assert s["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
        # Where vLLM, torch and Python write: an emptyDir, also HOME and TMPDIR.
        assert {"name": "scratch", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "scratch", "emptyDir": {}} in s["volumes"]
        assert env_of(pod)["HOME"] == env_of(pod)["TMPDIR"] == "/tmp"
    for pod in of_kind(render_spec(spec_of()), "Pod"):  # ascend: the driver's group opens the devices
        s, (c,) = pod["spec"], pod["spec"]["containers"]
        assert s["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True,
                                        "runAsUser": 1000, "supplementalGroups": [1000]}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
        env = env_of(pod)
        assert env["HOME"] == "/tmp" and {env[k] for k in ("ASCEND_CACHE_PATH", "ASCEND_WORK_PATH",
                                                           "ASCEND_PROCESS_LOG_PATH")} <= {
            "/tmp/ascend/cache", "/tmp/ascend/work", "/tmp/ascend/log"}
        assert {"name": "scratch", "mountPath": "/tmp"} in c["volumeMounts"]
    grouped = of_kind(render_spec(spec_of(ascend={"runAsUser": 1234, "driverGroup": 1001})), "Pod")[0]
    assert (grouped["spec"]["securityContext"]["runAsUser"], grouped["spec"]["securityContext"]["supplementalGroups"]) \
        == (1234, [1001])
    for pod in of_kind(render_spec(spec_of(ascend={"runAsRoot": True})), "Pod"):  # the stock images' way
        s, (c,) = pod["spec"], pod["spec"]["containers"]
        assert s["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                        "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}}
        assert "HOME" not in env_of(pod) and "ASCEND_CACHE_PATH" not in env_of(pod)


def test_cpu_runtime_pods_pass_the_restricted_pod_security_standard() -> None:
    """The Pod Security Standards' rules (tests/pod_security.py) over every CPU pod, a model on a
    PVC and on a host path (which only baseline's hostPath rule refuses), and what Ascend pods
    still break of restricted."""
    for model in ({"name": "m", "path": "/models/m"},
                  {"name": "m", "path": "/models/m", "volume": {"claimName": "models", "mountPath": "/models"}}):
        pods = of_kind(render_spec(spec_of(platform="cpu", model=model)), "Pod")
        assert pods and all(restricted_violations(pod) == [] for pod in pods), [restricted_violations(p) for p in pods]
    hosted = of_kind(render_spec(spec_of(platform="cpu", model={"name": "m", "path": "/models/m", "volume": {
        "hostPath": "/srv/models", "mountPath": "/models"}})), "Pod")
    for pod in hosted:
        (model_volume,) = [i for i, v in enumerate(pod["spec"]["volumes"]) if "hostPath" in v]
        assert restricted_violations(pod) == [f"spec.volumes[{model_volume}].hostPath: hostPath volumes"]
    # The rules can fail: each change below breaks exactly the rule it should.
    pod = of_kind(render_spec(spec_of(platform="cpu")), "Pod")[0]
    context = pod["spec"]["containers"][0]["securityContext"]
    for field, value, rule in (("runAsNonRoot", False, "runAsNonRoot: must be true"),
                               ("allowPrivilegeEscalation", True, "allowPrivilegeEscalation: must be false"),
                               ("capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "SYS_ADMIN beyond baseline"),
                               ("privileged", True, "privileged: privileged")):
        broken = json.loads(json.dumps(pod))
        broken["spec"]["containers"][0]["securityContext"] = {**context, field: value}
        assert any(rule in v for v in restricted_violations(broken)), (field, restricted_violations(broken))
    # Ascend pods break only baseline's hostPath rule (the driver's paths), and as root two more.
    for root, more in ((False, []), (True, ["must be true (here or in the pod)", "DAC_OVERRIDE beyond restricted"])):
        (ascend,) = {tuple(restricted_violations(p)) for p in of_kind(render_spec(spec_of(
            ascend={"hostNetwork": False, "mountHccnConf": False, "runAsRoot": root})), "Pod")
            if p["metadata"]["name"].endswith("ffn-0")}
        assert [v.split(":")[1].strip() for v in ascend] == ["hostPath volumes"] * 3 + more, ascend


@pytest.mark.parametrize("image,label", [
    ("repo/vllm:v0.23.0", "v0.23.0"),
    ("host:5000/repo/vllm", None),
    ("vllm@sha256:abc", None),
    ("vllm:1.0+build", "1.0-build"),
])
def test_version_label_from_image_tag(image: str, label: Any) -> None:
    assert image_version_label(image) == label


def test_built_in_kinds_validate_offline(examples: list) -> None:
    """Every built-in object rendered for the examples passes the upstream OpenAPI schema of
    every Kubernetes from 1.28 to the newest kubernetes-validate ships."""
    checked = 0
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            obj, problems = validate_object(doc)
            assert problems == []
            for o in render(obj.spec, plan(obj.spec, obj.metadata.name, obj.metadata.namespace), owner_uid="u"):
                if o["apiVersion"] in ("v1", "policy/v1", "networking.k8s.io/v1"):
                    validate_built_in(o)
                    checked += 1
    assert checked >= 10 and len(SCHEMA_VERSIONS) >= 10 and SCHEMA_VERSIONS[0] == "1.28.0"


def test_each_pod_carries_its_planned_config_as_the_plugin_serializes_it() -> None:
    spec = spec_of(replicas=2, connector={"name": "P2PConnector", "extraConfig": {"dynamicQuant": 1}},
                   sharedExperts={"placement": "attention", "partition": "contiguous"})
    p = plan(spec, "ds", "ns")
    planned = {pod.name: pod for inst in p.instances for pod in inst.pods}
    pods = of_kind(render(spec, p), "Pod")
    assert len(pods) == len(planned) == 8
    for pod in pods:
        command = pod["spec"]["containers"][0]["command"]
        assert command.count("--additional-config") == 1
        flag = command.index("--additional-config")
        # Exactly the config the planner built, read back by the parser the pod runs.
        parsed = parse_afd_config(json.loads(command[flag + 1]))
        assert parsed == planned[pod["metadata"]["name"]].afd_config
        assert (parsed.connector, parsed.dynamic_quant, parsed.shared_experts.partition) == ("p2p", 1, "contiguous")


def test_startup_timeout_bounds_the_rendezvous_and_vllms_engine_start() -> None:
    """An Attention head waits at the rendezvous for FFN servers still loading their experts,
    and vLLM for that engine, as long as the instance may take to become Ready; a user's own
    VLLM_ENGINE_READY_TIMEOUT_S wins."""
    pods = of_kind(render_spec(spec_of(startup={"timeoutSeconds": 2400})), "Pod")
    for pod in pods:
        command = pod["spec"]["containers"][0]["command"]
        block = parse_afd_config(json.loads(command[command.index("--additional-config") + 1]))
        assert (block.rendezvous_timeout_seconds, block.timeout_seconds) == (2400.0, 60.0)
        role = pod["metadata"]["labels"][naming.LABEL_ROLE]
        assert env_of(pod).get("VLLM_ENGINE_READY_TIMEOUT_S") == ("2400" if role == "attention" else None)
    user = spec_of(attention={"env": [{"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": "99"}]})
    heads = [p for p in of_kind(render_spec(user), "Pod") if p["metadata"]["labels"][naming.LABEL_ROLE] == "attention"]
    assert heads and all(env_of(p)["VLLM_ENGINE_READY_TIMEOUT_S"] == "99" for p in heads)


def threads_by_role(spec: AFDDeploymentSpec) -> dict[str, set]:
    out: dict[str, set] = {}
    for pod in of_kind(render_spec(spec), "Pod"):
        out.setdefault(pod["metadata"]["labels"][naming.LABEL_ROLE], set()).add(env_of(pod).get("OMP_NUM_THREADS"))
    return out


def test_cpu_rank_processes_get_their_share_of_the_pods_cores_as_openmp_threads() -> None:
    """Platform cpu: each rank process's OpenMP threads are its share of the container's CPU
    limit (else request), at least 1; none set without a CPU, on Ascend, or over a user's own."""
    def cpu_spec(attention_cpu: dict, ffn_cpu: dict, **overrides: Any) -> AFDDeploymentSpec:
        return spec_of(platform="cpu", attention={"podTemplate": {"resources": attention_cpu}, **overrides},
                       ffn={"podTemplate": {"resources": ffn_cpu}})

    # Attention pods hold 2 ranks (DP 2 x TP 2 over 2 devices per pod), FFN pods 2 ranks.
    assert threads_by_role(cpu_spec({"limits": {"cpu": "8"}, "requests": {"cpu": "1"}},
                                    {"requests": {"cpu": "3"}})) == {"attention": {"4"}, "ffn": {"1"}}
    assert threads_by_role(cpu_spec({"requests": {"cpu": "500m"}}, {"limits": {"cpu": 6}})) == \
        {"attention": {"1"}, "ffn": {"3"}}
    assert threads_by_role(cpu_spec({"limits": {"cpu": "4500m"}}, {"requests": {"cpu": "0.5e1"}})) == \
        {"attention": {"2"}, "ffn": {"2"}}
    assert threads_by_role(cpu_spec({"requests": {"memory": "1Gi"}}, {})) == {"attention": {None}, "ffn": {None}}
    user = cpu_spec({"limits": {"cpu": "8"}}, {"limits": {"cpu": "8"}},
                    env=[{"name": "OMP_NUM_THREADS", "value": "7"}])
    assert threads_by_role(user) == {"attention": {"7"}, "ffn": {"4"}}
    ascend = spec_of(attention={"podTemplate": {"resources": {"limits": {"cpu": "8"}}}})
    assert threads_by_role(ascend) == {"attention": {None}, "ffn": {None}}


def test_a_failed_rank_leaves_its_log_tail_as_termination_message() -> None:
    for pod in of_kind(render_spec(spec_of()), "Pod"):
        assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_revision_configmap_holds_only_the_plan_summary_and_no_pod_mounts_it() -> None:
    objs = render_spec(spec_of(replicas=1))
    (cm,) = of_kind(objs, "ConfigMap")
    assert json.loads(cm["data"].pop("plan.json")) == {
        "revision": cm["metadata"]["labels"][naming.LABEL_REVISION], "topology": "DP2xTP2+EP4",
        "attentionRanks": 4, "attentionPods": 2, "ffnRanks": 4, "ffnPods": 2}
    assert cm["data"] == {}
    for pod in of_kind(objs, "Pod"):
        assert not any("configMap" in v for v in pod["spec"]["volumes"])
        assert not any(m["mountPath"].startswith("/etc/afd") for m in pod["spec"]["containers"][0]["volumeMounts"])


def test_host_ports_shift_per_instance_and_repeat_within_a_role() -> None:
    """Under host networking every declared port is a host port, so the scheduler never puts
    two pods that declare the same one on a node: FFN pods of one instance land on different
    nodes, while another instance (shifted by hostPortStride) may share them."""
    spec = spec_of(replicas=2, ascend={"hostPortStride": 100})
    by_instance: dict[str, list[list[tuple[str, int, int]]]] = {}
    for pod in of_kind(render_spec(spec), "Pod"):
        ports = [(p["name"], p["containerPort"], p["hostPort"]) for p in pod["spec"]["containers"][0]["ports"]]
        if pod["metadata"]["labels"][naming.LABEL_ROLE] == "ffn":
            by_instance.setdefault(pod["metadata"]["labels"][naming.LABEL_AFD_INSTANCE], []).append(ports)
    first, second = (by_instance[name] for name in sorted(by_instance, key=lambda n: int(n.rsplit("-", 1)[1])))
    assert first == [[("health", 9401, 9401), ("metrics", 9400, 9400)]] * 2
    assert second == [[("health", 9501, 9501), ("metrics", 9500, 9500)]] * 2
