"""The checked-in CRD is exactly what the models generate, and it is structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

from afd_operator.api import (MAX_ENGINE_ARGS, MAX_EXTRA_CONFIG_KEYS, MAX_REPLICAS, MAX_ROLE_RANKS,
                              MAX_SECONDS)
from afd_operator.crd import CRD_FILE, build_crd, crd_yaml
from afd_operator.kube_types import MAX_LIST_ITEMS

# Nothing preserves unknown fields: the API server prunes what the models do not know, and
# afdctl and the webhook refuse it, so no field reaches a pod unchecked.
FREE_FORM_PATHS: set[str] = set()


def walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if "items" in schema:
        yield from walk(schema["items"], path + "[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], path + "{}")


def test_checked_in_crd_matches_the_models(repo_root: Path) -> None:
    checked_in = (repo_root / "crds" / CRD_FILE).read_text()
    assert checked_in == crd_yaml(), "crds/ is stale: run `afdctl crd > crds/" + CRD_FILE + "`"


def test_schema_is_structural() -> None:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    preserved = set()
    for path, node in walk(root, ""):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.add(path)
        elif not node.get("x-kubernetes-int-or-string") and path != "metadata":
            assert "type" in node, f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
    assert preserved == FREE_FORM_PATHS


def test_int_or_percent_fields() -> None:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    strategy = root["properties"]["spec"]["properties"]["updateStrategy"]["properties"]
    assert strategy["maxSurge"]["x-kubernetes-int-or-string"] is True
    assert strategy["maxUnavailable"]["x-kubernetes-int-or-string"] is True


def test_documented_maxima_are_enforced_by_the_schema() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["replicas"]["maximum"] == MAX_REPLICAS  # `kubectl scale` goes through the schema, not the webhook
    assert spec["attention"]["properties"]["dataParallel"]["maximum"] == MAX_ROLE_RANKS
    assert spec["ffn"]["properties"]["ranks"]["maximum"] == MAX_ROLE_RANKS
    assert spec["attention"]["properties"]["engineArgs"]["maxItems"] == MAX_ENGINE_ARGS
    assert spec["connector"]["properties"]["extraConfig"]["maxProperties"] == MAX_EXTRA_CONFIG_KEYS
    assert spec["termination"]["properties"]["gracePeriodSeconds"]["maximum"] == MAX_SECONDS
    volumes = spec["ffn"]["properties"]["podTemplate"]["properties"]["volumes"]
    assert volumes["maxItems"] == MAX_LIST_ITEMS and "hostPath" in volumes["items"]["properties"]


def test_status_fields_declared_so_nothing_is_pruned() -> None:
    status = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert {"observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "currentRevision",
            "updateRevision", "topology", "instances", "conditions", "selector"} <= set(status["properties"])
    instance = status["properties"]["instances"]["items"]["properties"]
    assert {"index", "revision", "phase", "podsReady", "podsTotal", "restarts", "lastFailure"} <= set(instance)


def test_crd_yaml_round_trips() -> None:
    assert yaml.safe_load(crd_yaml()) == build_crd()
