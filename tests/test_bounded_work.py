"""Bounded work: the documented maxima hold, validation does the same work whatever `replicas`
says, and the worst spec the maxima allow is answered within the admission webhook's timeout."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

import afd_operator.validation as validation
from afd_operator.api import MAX_REPLICAS, MAX_ROLE_RANKS
from afd_operator.planner import plan, plan_instance
from afd_operator.render import render_instance
from afd_operator.revision import revision_of
from afd_operator.validation import MAX_DEPLOYMENT_PODS, MAX_INDEX, MAX_SPEC_BYTES, validate_object
from afd_shared_experts.config import AFDConfig

# The chart's webhook timeout: an answer later than this is a refusal the user cannot read.
WEBHOOK_TIMEOUT_SECONDS = 10


def doc(**spec: Any) -> dict[str, Any]:
    base = {"image": "runtime:v1", "platform": "cpu", "model": {"name": "m", "path": "/models/m"},
            "attention": {"dataParallel": 2}, "ffn": {"ranks": 2}}
    return {"apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
            "metadata": {"name": "bounded", "namespace": "ns"}, "spec": {**base, **spec}}


def plugin_configs_built(monkeypatch: pytest.MonkeyPatch, obj: dict[str, Any]) -> int:
    """How many pod configs the plugin's parser builds to validate `obj`."""
    calls = []
    original = AFDConfig.build.__func__
    monkeypatch.setattr(AFDConfig, "build", classmethod(lambda cls, **kw: calls.append(1) or original(cls, **kw)))
    assert validate_object(obj)[1] == []
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("spec", [
    {},
    # Host networking: ports shift per instance, checked by arithmetic up to the last index.
    {"platform": "ascend", "ascend": {"hostPortStride": 1}, "service": {"port": 10000},
     "connector": {"port": 20000}, "attention": {"dataParallel": 2, "dataParallelRpcPort": 30000},
     "metrics": {"port": 40000}, "ffn": {"ranks": 2, "healthPort": 50000}},
], ids=["pod-network", "host-network"])
def test_validation_work_does_not_grow_with_replicas(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]) -> None:
    one = plugin_configs_built(monkeypatch, doc(replicas=1, **spec))
    most = plugin_configs_built(monkeypatch, doc(replicas=MAX_REPLICAS, updateStrategy={"maxSurge": "100%"}, **spec))
    assert one == most == 4  # two instances (the first, the last that may exist) x two roles


def test_a_port_collision_between_distant_instances_is_found_without_visiting_them() -> None:
    obj = doc(replicas=MAX_REPLICAS, updateStrategy={"maxSurge": "100%"}, platform="ascend",
              ascend={"hostPortStride": 1}, service={"port": 10000}, connector={"port": 11000},
              attention={"dataParallel": 2, "dataParallelRpcPort": 30000}, metrics={"port": 40000},
              ffn={"ranks": 2, "healthPort": 50000})
    assert [str(p) for p in validate_object(obj)[1]] == [
        "spec.service.port: port 11000 collides with spec.connector.port of instance 0 (instance 1000); "
        "ports must be distinct"]


def worst_allowed() -> dict[str, Any]:
    """The largest spec the maxima allow: most ranks and pods, longest lists, and strings as long
    as the spec's size bound leaves room for."""
    pods_per_role = MAX_ROLE_RANKS

    def spec_with(long: str) -> dict[str, Any]:
        template = {
            "labels": {f"example.com/l{i}": "x" * 63 for i in range(64)},
            "annotations": {f"example.com/a{i}": "y" * 200 for i in range(64)},
            "nodeSelector": {f"example.com/n{i}": "z" * 63 for i in range(64)},
            "tolerations": [{"key": f"example.com/t{i}", "operator": "Exists"} for i in range(64)],
            "volumes": [{"name": f"v{i}", "configMap": {"name": f"c{i}"}} for i in range(64)],
            "volumeMounts": [{"name": f"v{i}", "mountPath": f"/mnt/{i}", "readOnly": True} for i in range(64)],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": f"k{j}", "operator": "In", "values": [f"v{k}" for k in range(16)]}
                                      for j in range(16)]} for _ in range(16)]}}},
        }
        env = [{"name": f"E{i}", "value": long} for i in range(128)]
        return doc(
            replicas=MAX_DEPLOYMENT_PODS // (2 * pods_per_role), updateStrategy={"maxSurge": "100%"},
            attention={"dataParallel": MAX_ROLE_RANKS, "engineArgs": [f"--x{i}={long}" for i in range(128)],
                       "env": env, "podTemplate": copy.deepcopy(template)},
            ffn={"ranks": MAX_ROLE_RANKS, "env": env, "podTemplate": copy.deepcopy(template)},
        )

    # 128 engine arguments and 2 x 128 variables hold the long string: fill what the bound leaves.
    room = MAX_SPEC_BYTES - len(json.dumps(spec_with("")["spec"], separators=(",", ":")))
    return spec_with("v" * (room // (3 * 128)))


def test_the_worst_allowed_spec_is_answered_within_the_webhook_timeout() -> None:
    obj = worst_allowed()
    started = time.monotonic()
    parsed, problems = validate_object(obj)  # the webhook's work
    validated = time.monotonic() - started
    assert problems == [] and parsed is not None
    spec = parsed.spec
    started = time.monotonic()
    p = plan(spec, "bounded", "ns", indices=[])  # the operator's per reconciliation
    objects = render_instance(spec, p, plan_instance(spec, "bounded", "ns", revision_of(spec), MAX_INDEX))
    rendered = time.monotonic() - started
    print(f"worst allowed spec: validated in {validated:.2f}s; one instance of {len(objects) - 3} pods planned and "
          f"rendered in {rendered:.2f}s")
    assert len(objects) == 3 + 2 * MAX_ROLE_RANKS  # its Service, PDB, NetworkPolicy and pods
    assert validated < WEBHOOK_TIMEOUT_SECONDS and rendered < WEBHOOK_TIMEOUT_SECONDS


def test_a_spec_past_its_size_bound_is_refused_by_name() -> None:
    obj = worst_allowed()
    obj["spec"]["ffn"]["env"].append({"name": "ONE_MORE", "value": "w" * 1000})
    (problem,) = validate_object(obj)[1]
    assert problem.path == "spec" and f"at most {MAX_SPEC_BYTES}: the operator keeps a copy" in problem.message


def test_beyond_the_maxima_is_refused_by_name() -> None:
    obj = worst_allowed()
    obj["spec"]["replicas"] += 1
    assert [str(p) for p in validate_object(obj)[1]] == [
        f"spec.replicas: replicas x pods per instance ({(obj['spec']['replicas']) * 2 * MAX_ROLE_RANKS}) must be at "
        f"most {MAX_DEPLOYMENT_PODS} pods"]
    obj["spec"]["attention"]["engineArgs"].append("--one-more")
    obj["spec"]["ffn"]["podTemplate"]["tolerations"].append({"operator": "Exists"})
    assert {p.path for p in validate_object(obj)[1]} == {"spec.attention.engineArgs",
                                                         "spec.ffn.podTemplate.tolerations"}
