"""CustomResourceDefinition generated from the pydantic models.

pydantic emits JSON Schema (with $refs, anyOf-null, additionalProperties); Kubernetes
wants a *structural* OpenAPI v3 schema: everything inlined, `nullable` instead of
null branches, `x-kubernetes-int-or-string` for int|percent, and
`x-kubernetes-preserve-unknown-fields` only where a model marks a field free-form (none does
today: even the core/v1 pieces are typed). The documented maxima (minimum, maximum, maxLength,
maxItems, maxProperties) are kept, so the API server enforces them too, `kubectl scale`
included. Cross-field rules are not expressed here (1.20 has no CEL); they run in validation.py.
"""

from __future__ import annotations

from typing import Any

import yaml

from .api import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, AFDDeploymentSpec, AFDDeploymentStatus

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{GROUP}_{PLURAL}.yaml"

_KEPT_KEYWORDS = (
    "type", "description", "minimum", "maximum", "minLength", "maxLength", "pattern",
    "enum", "minItems", "maxItems", "maxProperties", "format",
)
_EXTENSIONS = ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string")


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _structural(merged, defs)
    if schema.get("x-kubernetes-int-or-string"):
        out = {"x-kubernetes-int-or-string": True}
        if "description" in schema:
            out["description"] = schema["description"]
        return out
    if "anyOf" in schema:
        branches = [b for b in schema["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express union {schema['anyOf']} structurally")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        out = _structural({**branches[0], **rest}, defs)
        out["nullable"] = True
        return out
    out: dict[str, Any] = {k: schema[k] for k in _KEPT_KEYWORDS if k in schema}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    for ext in _EXTENSIONS:
        if schema.get(ext):
            out[ext] = True
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("type", "object")
        return out
    if "properties" in schema:
        out["type"] = "object"
        out["properties"] = {k: _structural(v, defs) for k, v in schema["properties"].items()}
        if schema.get("required"):
            out["required"] = list(schema["required"])
    elif isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(schema["additionalProperties"], defs)
    if "items" in schema:
        out["items"] = _structural(schema["items"], defs)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec_schema = model_schema(AFDDeploymentSpec)
    status_schema = model_schema(AFDDeploymentStatus)
    columns = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Topology", "type": "string", "jsonPath": ".status.topology"},
        {"name": "Instances", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "Ready instances"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired instances"},
        {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas"},
        {"name": "Revision", "type": "string", "jsonPath": ".status.updateRevision"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "afd-operator", "app.kubernetes.io/part-of": "afd-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES), "categories": ["all", "inference"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "AFDDeployment runs Attention-FFN-disaggregated MoE serving: "
                                   "`replicas` complete connector worlds of Attention and FFN pods.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": status_schema,
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `afdctl crd` from operator/afd_operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
