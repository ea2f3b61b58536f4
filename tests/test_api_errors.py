"""A write the real API refuses shows in the AFDDeployment's status and events within one
reconciliation, and clears once the API accepts the write again."""

from __future__ import annotations

import time
from typing import Any, Optional

from afd_devcluster import OPERATOR_USER
from k8s_helpers import wait_for
from operator_env import CONVERGE_SECONDS, Env, base_spec, env, kubelet, operator  # noqa: F401 (fixtures)

QUOTA = "no-pods"


def refuse_pods(env: Env) -> None:
    """A ResourceQuota of zero pods: the quota admission plugin refuses every pod create (403)."""
    env.core.create_namespaced_resource_quota(env.ns, {"metadata": {"name": QUOTA}, "spec": {"hard": {"pods": "0"}}})
    # No controller-manager runs here to count usage: report it as the quota controller would.
    env.core.patch_namespaced_resource_quota_status(
        QUOTA, env.ns, {"status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}})


def first(requests: list[dict[str, Any]], start: int, match: Any) -> Optional[int]:
    return next((i for i in range(start, len(requests)) if match(requests[i])), None)


def is_refused_pod_create(request: dict[str, Any]) -> bool:
    ref = request["objectRef"]
    return (request["verb"] == "create" and ref.get("resource") == "pods"
            and request.get("responseStatus", {}).get("code") == 403)


def is_status_write(request: dict[str, Any]) -> bool:
    ref = request["objectRef"]
    return ref.get("resource") == "afddeployments" and ref.get("subresource") == "status"


def test_refused_pod_create_sets_condition_and_event_until_accepted(env: Env) -> None:
    refuse_pods(env)
    since = time.time()
    env.create("capped", base_spec())
    cond = wait_for(lambda: (c := env.condition("capped", "ApiWriteFailed")) and c["status"] == "True" and c,
                    "ApiWriteFailed=True", CONVERGE_SECONDS)
    assert cond["reason"] == "CreatePodForbidden", cond
    assert cond["message"].startswith("create Pod capped-") and "403 Forbidden" in cond["message"], cond
    assert QUOTA in cond["message"], cond
    # The operator creates the event right after the status write that carries the condition.
    wait_for(lambda: any(e.startswith("CreatePodForbidden: create Pod capped-") for e in env.events("capped")),
             "the CreatePodForbidden event", CONVERGE_SECONDS)
    assert env.pods() == []

    # Within one reconciliation: the status write that reports the refusal follows the first
    # refused create with no other pod create in between.
    def refusal_then_report() -> Optional[tuple[int, int, list[dict[str, Any]]]]:
        mine = [r for r in env.cluster.write_requests(OPERATOR_USER, since)
                if r["objectRef"].get("namespace") == env.ns]
        refused = first(mine, 0, is_refused_pod_create)
        report = None if refused is None else first(mine, refused, is_status_write)
        return None if report is None else (refused, report, mine)
    refused, report, requests = wait_for(refusal_then_report, "the refusal and its status write in the audit log")
    between = [r for r in requests[refused + 1:report] if r["objectRef"].get("resource") == "pods"]
    assert between == [], between

    env.core.delete_namespaced_resource_quota(QUOTA, env.ns)
    env.wait_ready("capped", 1)
    assert env.condition("capped", "ApiWriteFailed") is None
