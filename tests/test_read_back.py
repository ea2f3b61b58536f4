"""What the operator reads back from the cluster is trusted no further than the schema it
wrote: a snapshot's plan summary is read strictly (a tampered one is ignored, never an
exception or a huge allocation), and only the children a deployment controls (by uid) are
its own."""

from __future__ import annotations

import json

import pytest

from afd_operator.api import MAX_ROLE_RANKS
from afd_operator.managers.snapshots import layouts
from afd_operator.observe import (MAX_PLAN_SUMMARY_BYTES, Observed, controller_uid, owned_by, read_plan_summary,
                                  summarize_object, summarize_pod)

GOOD = {"revision": "r1", "topology": "t", "attentionRanks": 2, "attentionPods": 1, "ffnRanks": 2, "ffnPods": 2}


def configmap(plan: object, uid: str = "u1", revision: str = "r1") -> dict:
    data = {"plan.json": plan if isinstance(plan, str) else json.dumps(plan)}
    return {"metadata": {"name": f"d-{revision}-runtime", "labels": {"afd.inference.dev/revision": revision},
                         "ownerReferences": [{"kind": "AFDDeployment", "name": "d", "uid": uid, "controller": True}]},
            "data": data}


def test_the_operators_own_summary_reads_back_whole():
    assert read_plan_summary(configmap(GOOD)["data"]) == (GOOD, None)
    assert layouts(Observed(pods=(), objects=(summarize_object("ConfigMap", configmap(GOOD)),))) == {
        "r1": {"ffn": 2, "attention": 1}}


@pytest.mark.parametrize("plan", [
    {**GOOD, "ffnPods": 1_000_000_000_000},  # would allocate a range of a trillion pods
    {**GOOD, "ffnPods": "1"},  # a TypeError in every reconcile before
    {**GOOD, "ffnPods": True},
    {**GOOD, "attentionPods": 0},
    {**GOOD, "attentionPods": MAX_ROLE_RANKS + 1},
    {**GOOD, "ffnPods": 2.0},
    {key: value for key, value in GOOD.items() if key != "ffnPods"},
    [GOOD],
    "not json {",
    json.dumps(GOOD) + " " * MAX_PLAN_SUMMARY_BYTES,  # past the size a summary can have
    '{"ffnPods": ' + "[" * 100_000 + "]" * 100_000 + "}",
])
def test_a_tampered_summary_is_ignored_not_trusted(plan):
    observed = Observed(pods=(), objects=(summarize_object("ConfigMap", configmap(plan)),))
    assert observed.objects[0].spec == {} and observed.objects[0].problem
    assert layouts(observed) == {}


def test_data_of_the_wrong_shape_reads_as_nothing():
    for data in (None, {"plan.json": 7}, "x"):
        assert read_plan_summary(data) == ({}, "data has no plan.json string")
    # Within the size bound, nesting deeper than the interpreter's recursion limit is still refused.
    assert read_plan_summary({"plan.json": "[" * 2000 + "]" * 2000}) == ({}, "plan.json is not JSON")


def test_only_children_the_deployment_controls_by_uid_are_its_own():
    pod = {"metadata": {"name": "d-r1-0-attn-0", "labels": {
        "afd.inference.dev/instance": "d-r1-0", "afd.inference.dev/revision": "r1", "afd.inference.dev/role": "attention",
        "afd.inference.dev/pod-ordinal": "0"}}, "status": {}}
    ours = summarize_pod({**pod, "metadata": {**pod["metadata"], "ownerReferences": [
        {"kind": "AFDDeployment", "name": "d", "uid": "u1", "controller": True}]}})
    copied_labels = summarize_pod(pod)  # a tenant's pod with the operator's labels, no owner
    other = summarize_pod({**pod, "metadata": {**pod["metadata"], "ownerReferences": [
        {"kind": "AFDDeployment", "name": "d", "uid": "u2", "controller": True}]}})
    not_controller = summarize_pod({**pod, "metadata": {**pod["metadata"], "ownerReferences": [
        {"kind": "AFDDeployment", "name": "d", "uid": "u1"}]}})
    objects = (summarize_object("ConfigMap", configmap(GOOD)), summarize_object("ConfigMap", configmap(GOOD, uid="u2")))
    observed = owned_by(Observed(pods=(ours, copied_labels, other, not_controller), objects=objects), "u1")
    assert observed.pods == (ours,) and observed.objects == objects[:1]
    assert controller_uid({"ownerReferences": [{"uid": 5, "controller": True}]}) is None
    assert controller_uid({"ownerReferences": ["x", None]}) is None


def test_a_malformed_drain_annotation_keeps_the_pod_in_view():
    """Anyone who may annotate pods can break the operator's drain stamp: the pod is still
    observed (before, its index entry failed and the pod dropped out of the operator's view)."""
    pod = {"metadata": {"name": "d-r1-0-attn-0", "annotations": {"afd.inference.dev/drain-started": "yesterday"},
                        "labels": {"afd.inference.dev/instance": "d-r1-0", "afd.inference.dev/revision": "r1",
                                   "afd.inference.dev/role": "attention", "afd.inference.dev/pod-ordinal": "0"}},
           "status": {}}
    summary = summarize_pod(pod)
    assert summary is not None and summary.drain_started_at is None
    pod["metadata"]["annotations"]["afd.inference.dev/drain-started"] = "2026-12-07T07:00:00Z"
    assert summarize_pod(pod).drain_started_at == 1796626800.0
