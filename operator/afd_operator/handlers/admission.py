"""Validating admission (registered by main.register when a webhook server is configured):
AFDDeployments through `validate_object` (schema, cross-field rules, the cluster's host-access
policy, and the plugin's own parser on every pod's afd block), every problem listed with its field
path, also when only their /scale changes (`kubectl scale`: the replica count enters cross-field
rules such as the rollout budget); pods through `membership_refusal` (only the operator makes a
pod an instance's member)."""

from __future__ import annotations

from typing import Any, Optional

import kopf

from ..api import API_VERSION, KIND
from ..membership import membership_refusal
from ..validation import validate_object


def validate_afddeployment(body: kopf.Body, memo: kopf.Memo, operation: Optional[str] = None,
                           old: Optional[kopf.Body] = None, **_: Any) -> None:
    spec = dict(body.get("spec") or {})
    if operation not in ("CREATE", "UPDATE") or (old is not None and dict(old.get("spec") or {}) == spec):
        # A deletion, or metadata only (finalizers, annotations, labels): an object stored under
        # older or laxer rules must stay deletable, and its finalizer removable.
        return
    obj = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
           "metadata": dict(body.metadata), "spec": spec}
    _refuse_problems(obj, memo)


def _refuse_problems(obj: dict[str, Any], memo: kopf.Memo) -> None:
    _, problems = validate_object(obj, memo.config.policy)
    if problems:
        raise kopf.AdmissionError("invalid AFDDeployment:\n" + "\n".join(str(p) for p in problems), code=422)


def validate_afddeployment_scale(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A Scale of an AFDDeployment: the stored object with the new replica count, judged whole."""
    meta = body.metadata
    stored = memo.reconciler.writer.get(API_VERSION, KIND, meta.namespace, meta.name)
    if stored is None:
        return  # the API server answers NotFound itself
    replicas = (body.get("spec") or {}).get("replicas")
    _refuse_problems({"apiVersion": stored.get("apiVersion"), "kind": stored.get("kind"),
                      "metadata": stored["metadata"], "spec": {**stored.get("spec", {}), "replicas": replicas}}, memo)


def guard_pod_membership(body: kopf.Body, memo: kopf.Memo, userinfo: kopf.UserInfo, operation: Optional[str] = None,
                         old: Optional[kopf.Body] = None, **_: Any) -> None:
    refusal = membership_refusal(operation, str(userinfo.get("username", "")), memo.config.webhook.operator_username,
                                 old.metadata.labels if old is not None else None, body.metadata.labels)
    if refusal:
        raise kopf.AdmissionError(refusal, code=403)
