"""Validating admission: `validate_object` (schema, cross-field rules, and the plugin's own
parser on every pod's afd block), every problem listed with its field path (registered by
main.register when a webhook server is configured)."""

from __future__ import annotations

from typing import Any

import kopf

from ..validation import validate_object


def validate_afddeployment(body: kopf.Body, **_: Any) -> None:
    obj = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
           "metadata": dict(body.metadata), "spec": dict(body.spec)}
    _, problems = validate_object(obj)
    if problems:
        raise kopf.AdmissionError("invalid AFDDeployment:\n" + "\n".join(str(p) for p in problems), code=422)
