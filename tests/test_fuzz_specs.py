"""A seeded fuzz of AFDDeployment files: hundreds of mutations of the examples (values, keys,
pod-template pieces, bytes) through `afdctl validate`. Every case gets an answer within
HANG_SECONDS: exit 0, or exit 1 with one line per problem (`FILE: field.path: rule`), never a
traceback; and for every file that validates, the AFDDeployment and every object the operator
would render (the first instance and the last one that may exist at once) are accepted by the
real API server (server-side dry run), and every generated name fits a DNS label at the largest
index an instance can take."""

from __future__ import annotations

import copy
import io
import math
import os
import random
import re
import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from afd_devcluster import ControlPlane
from afd_operator import naming
from afd_operator.cli import main
from afd_operator.planner import attention_layout, ffn_layout, plan, rollout_budget
from afd_operator.policy import policy_from_values
from afd_operator.render import render
from afd_operator.revision import revision_of
from afd_operator.problems import MAX_SHOWN
from afd_operator.validation import MAX_INDEX, validate_object
from dry_run import dry_run_create, ensure_priority_class, serving_client
from k8s_helpers import EXAMPLES_HOST_ACCESS, delete_afddeployments

# Fixed, so every run of the suite checks the same cases; another seed explores further.
SEED = int(os.environ.get("AFD_FUZZ_SEED", "26"))
CASES = int(os.environ.get("AFD_FUZZ_CASES", "400"))
HANG_SECONDS = 10
# Values that broke, or nearly broke, earlier versions (and some that are fine).
NASTY: list[Any] = [
    None, True, False, 0, 1, -1, 2, 7, 64, 513, 1025, 2**31, 2**63, 2**64, 1e30, 0.5, -0.0, math.nan, math.inf,
    -math.inf, "", " ", " 2", "2", "500m", "4Gi", "-1Gi", "1e3", "0x10", "25%", "150%", "a b", "A_B", "ok",
    "default", "/abs/path", "/tmp", "/dev/shm", "relative/path", "/data/../etc", "x" * 70, "y" * 300, "tab\there", "new\nline",
    "nul\x00byte", "Ünïcödé", "afd.inference.dev/serving", "example.com/key", "--port=1", "--enforce-eager",
    "Always", "Memory", "Exists", "NoExecute", [], [1, "two"], {}, {"a": 1}, {"nested": {"deeper": [{}]}},
]
# Pieces a pod template may hold, right and wrong, grafted whole to reach the deeper rules.
PIECES: list[tuple[str, Any]] = [
    ("labels", {"team": "search", "tier": "gold"}),
    ("labels", {"example.com/owner": "x" * 63}),
    ("annotations", {"example.com/note": "any text: even spaces"}),
    ("nodeSelector", {"kubernetes.io/arch": "amd64"}),
    ("tolerations", [{"key": "dedicated", "operator": "Equal", "value": "afd", "effect": "NoSchedule"}]),
    ("tolerations", [{"operator": "Exists"}]),
    ("tolerations", [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}]),
    ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}}),
    ("affinity", {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"app": "afd"}}}}]}}),
    ("topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]),
    ("volumes", [{"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]),
    ("volumes", [{"name": "conf", "configMap": {"name": "afd-conf", "items": [{"key": "a", "path": "a.json"}]}}]),
    ("volumes", [{"name": "creds", "secret": {"secretName": "afd-creds", "defaultMode": 0o440}}]),
    ("volumes", [{"name": "data", "hostPath": {"path": "/data/models/extra", "type": "Directory"}}]),
    ("volumes", [{"name": "claim", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}]),
    ("volumeMounts", [{"name": "dshm", "mountPath": "/cache", "readOnly": True}]),
    ("volumeMounts", [{"name": "cache", "mountPath": "/cache", "subPath": "afd"}]),
    ("resources", {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2, "memory": "2Gi"}}),
    ("resources", {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 1}}),
    ("resources", {"requests": {"ephemeral-storage": "10Gi"}}),
    ("serviceAccountName", "default"),
    ("serviceAccountName", "reader"),
]
OTHER_PIECES: list[tuple[str, Any]] = [
    ("spec.service.allowedClients", [{"namespaceSelector": {"matchLabels": {"team": "search"}}},
                                     {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]),
    ("spec.service.allowedClients", [{"podSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}]),
    ("spec.attention.env", [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory",
                                                                               "containerName": "attention"}}}]),
    ("spec.ffn.env", [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]),
    ("spec.connector.extraConfig", {"data_plane": "staged"}),
    ("spec.scheduling", {"priorityClassName": "afd-high", "gang": {"provider": "volcano", "queue": "q"}}),
    ("spec.updateStrategy", {"maxSurge": "100%", "maxUnavailable": 1}),
    ("spec.replicas", 3),
    ("metadata.name", "z" * 38),
    # Names that extend another deployment's generated names (an instance, a pod, a snapshot).
    ("metadata.name", "tiny-cpu-b28c05ba4c-0"),
    ("metadata.name", "deepseek-v3-0123456789-0-attn"),
    ("metadata.name", "tiny-cpu-b28c05ba4c-runtime"),
    # Operator-owned engine flags in the spellings vLLM's parser reads.
    ("spec.attention.engineArgs", ["--tensor_parallel_size=8"]),
    ("spec.attention.engineArgs", ["--data-parallel-address", "10.0.0.1"]),
    ("spec.attention.engineArgs", ["--additional-config.afd.host=evil"]),
    ("spec.attention.engineArgs", ["--config", "override.yaml"]),
    ("spec.attention.engineArgs", ["--tensor-parallel", "8"]),
    ("spec.attention.engineArgs", ["-tp=8"]),
    ("spec.attention.engineArgs", ["-dpa", "10.0.0.1"]),
    # Sizes past what the API server or the operator's bookkeeping holds.
    ("spec.ffn.env", [{"name": f"BLOB_{i}", "value": "x" * 30_000} for i in range(10)]),
    ("spec.attention.podTemplate.annotations", {f"example.com/blob-{i}": "y" * 60_000 for i in range(5)}),
    # What the cluster's host-access policy governs beyond the node.
    ("spec.service.type", "LoadBalancer"),
    ("spec.scheduling", {"priorityClassName": "system-node-critical"}),
    ("spec.attention.podTemplate.volumes", [{"name": "token", "secret": {"secretName": "default-token-abcde"}}]),
]


def paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON-like document."""
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from paths(value, prefix + (i,))


def at(obj: Any, path: tuple) -> Any:
    for part in path:
        obj = obj[part]
    return obj


def graft(doc: dict, dotted: str, value: Any) -> None:
    node = doc
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node
    if isinstance(node, dict):
        node[last] = copy.deepcopy(value)


def mutate(rng: random.Random, doc: dict) -> None:
    """One change of a document: a value, a key, or a piece grafted in."""
    choice = rng.random()
    path = rng.choice([p for p in paths(doc) if p])
    parent, key = at(doc, path[:-1]), path[-1]
    if choice < 0.35:
        parent[key] = copy.deepcopy(rng.choice(NASTY))
    elif choice < 0.45 and isinstance(parent, dict):
        del parent[key]
    elif choice < 0.55 and isinstance(parent, dict) and isinstance(key, str):
        spelled = rng.choice([re.sub(r"([A-Z])", r"_\1", key).lower(), key.upper(), key + "s", "x" + key])
        parent[spelled] = parent.pop(key)
    elif choice < 0.85:
        role = rng.choice(["attention", "ffn"])
        field, value = rng.choice(PIECES)
        graft(doc, f"spec.{role}.podTemplate.{field}", value)
    else:
        graft(doc, *rng.choice(OTHER_PIECES))


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """A change of the file itself: truncated, a line repeated, a byte replaced, an encoding."""
    choice = rng.random()
    if choice < 0.25:
        return data[:rng.randrange(len(data))]
    lines = data.splitlines(keepends=True)
    if choice < 0.5:
        i = rng.randrange(len(lines))
        return b"".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])
    if choice < 0.75:
        i = rng.randrange(len(data))
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
    return data.decode().encode(rng.choice(["utf-16", "latin-1", "utf-8-sig", "utf-32"]), errors="replace")


class Hung(Exception):
    pass


def answer(path: Path, policy_file: Path) -> tuple[int, list[str]]:
    """afdctl's answer, or Hung after HANG_SECONDS."""
    def stop(*_: Any) -> None:
        raise Hung(f"no answer within {HANG_SECONDS}s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(HANG_SECONDS)
    try:
        out, err = io.StringIO(), io.StringIO()
        code = main(["validate", "-f", str(path), "--policy", str(policy_file)], out=out, err=err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue().splitlines()


def names_fit_at_the_largest_index(doc: dict, spec: Any) -> list[str]:
    name, revision = doc["metadata"]["name"], revision_of(spec)
    names = [naming.instance_name(name, revision, MAX_INDEX)]
    for role, layout in (("attention", attention_layout(spec)), ("ffn", ffn_layout(spec))):
        names += [naming.pod_name(name, revision, MAX_INDEX, role, k) for k in range(layout.pods)]
    return [n for n in names if not naming.is_dns_1035_label(n)]


@pytest.fixture(scope="module")
def dyn(api_client, cluster: ControlPlane, repo_root: Path):
    return serving_client(api_client, cluster, repo_root)


@pytest.fixture(scope="module")
def namespace(dyn, cluster: ControlPlane) -> Iterator[str]:
    name = f"fuzz-{uuid.uuid4().hex[:8]}"
    dyn.resources.get(api_version="v1", kind="Namespace").create(body={"metadata": {"name": name}})
    yield name
    delete_afddeployments(cluster, name)


def test_every_mutated_file_gets_an_answer_and_valid_ones_render_what_the_api_server_accepts(
        dyn, namespace: str, examples: list[Path], examples_policy_file: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    policy = policy_from_values(EXAMPLES_HOST_ACCESS)
    bases = [yaml.safe_load(p.read_text()) for p in examples]
    verdicts = {"valid": 0, "invalid": 0}
    refused: list[str] = []
    for case in range(CASES):
        doc = copy.deepcopy(rng.choice(bases))
        doc["metadata"]["namespace"] = namespace
        for _ in range(rng.randint(1, 3)):
            mutate(rng, doc)
        data = yaml.safe_dump(doc, allow_unicode=True).encode()
        if rng.random() < 0.15:
            data = mutate_bytes(rng, data)
        file = tmp_path / f"case-{case}.yaml"
        file.write_bytes(data)
        code, lines = answer(file, examples_policy_file)
        where = f"case {case} (seed {SEED}): {data[:400]!r}"
        assert code in (0, 1), where
        assert not any("Traceback" in line or "could not be validated" in line for line in lines), (where, lines)
        assert all(re.fullmatch(rf"{re.escape(str(file))}: \S[^\n]*?: .+", line)
                   and len(line) <= len(str(file)) + 2 * MAX_SHOWN + 12 for line in lines), (where, lines)
        assert (code == 1) == bool(lines), (where, lines)
        if code == 1:
            verdicts["invalid"] += 1
            continue
        verdicts["valid"] += 1
        for parsed in [d for d in yaml.safe_load_all(data) if d]:
            obj, problems = validate_object(parsed, policy)
            assert problems == [], where
            assert names_fit_at_the_largest_index(parsed, obj.spec) == [], where
            refused += dry_runs(dyn, namespace, parsed, obj, where)
    print(f"fuzz (seed {SEED}): {verdicts}")
    assert refused == []
    # The mix reaches both sides: enough files validate for the dry runs to mean something.
    assert verdicts["valid"] >= CASES // 10 and verdicts["invalid"] >= CASES // 2, verdicts


def dry_runs(dyn, namespace: str, parsed: dict, obj: Any, where: str) -> list[str]:
    """The AFDDeployment, then what the operator renders for its first and last instance."""
    from kubernetes.dynamic.exceptions import DynamicApiError

    spec, name = obj.spec, obj.metadata.name
    parsed = {**parsed, "metadata": {**parsed["metadata"], "namespace": namespace}}  # the one that exists
    last = max(spec.replicas + rollout_budget(spec).surge - 1, 0)
    objects = [parsed] + render(spec, plan(spec, name, namespace, indices={0, last}), owner_uid=str(uuid.uuid4()))
    if spec.scheduling.priority_class_name:
        ensure_priority_class(dyn, spec.scheduling.priority_class_name)
    refused = []
    for o in objects:
        try:
            dry_run_create(dyn, o, namespace)
        except DynamicApiError as err:
            refused.append(f"{where}: {o['kind']} {o['metadata']['name']}: {err.summary()}")
    return refused
