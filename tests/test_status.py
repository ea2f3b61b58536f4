"""The status, built through the API's models (pure, no cluster): every condition type written is
one `ConditionType` holds, the status written is exactly what the models read back, a status
that stands keeps its keys, and lastTransitionTime moves only with a condition's status."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
from pydantic import ValidationError

import afd_operator.status as status_module
from afd_operator.api import AFDDeploymentSpec, AFDDeploymentStatus, ConditionType, Phase
from afd_operator.decisions import Decision, InstanceRecord
from afd_operator.observe import format_time
from afd_operator.policy import NetworkIsolation
from afd_operator.revision import revision_of
from afd_operator.status import build_status, invalid_status, write_failed_status
from afd_operator.problems import Problem
from afd_operator.writer import ApiWriteError, NameConflictError

NOW = 1_000_000.0
SPEC = AFDDeploymentSpec.model_validate({"image": "img:v1", "platform": "cpu", "model": {"name": "m", "path": "/m"}})
REVISION = revision_of(SPEC)
REFUSED = ApiWriteError("create", "Pod", "d-x-0-ffn-0", 403, "Forbidden", "exceeded quota")
SQUATTED = NameConflictError("Service", "d", "nothing (no controller reference)")
INVALID = [Problem("spec.replicas", "must be at least 0")]


def instance(phase: Phase, **fields: Any) -> InstanceRecord:
    return InstanceRecord(name=f"d-{REVISION}-0", revision=REVISION, index=0, phase=phase, **fields)


READY = Decision(instances=[instance(Phase.READY, first_ready=NOW - 60)])
FAILING = Decision(instances=[instance(Phase.FAILED, consecutive_failures=1, restarts=1, retry_after=NOW + 10,
                                       last_failure="pod d-x-0-ffn-0 exited")],
                   rollout_in_progress=True, progress_reason="Scaling", progress_message="0/1 instance(s) Ready",
                   degraded=["instance d-x-0 stays down"])


def built(decision: Decision, previous: Optional[dict[str, Any]] = None, now: float = NOW,
          network: NetworkIsolation = NetworkIsolation()) -> dict[str, Any]:
    return build_status("d", SPEC, REVISION, decision, [], previous, 7, now, network)


def every_kind_of_status() -> list[dict[str, Any]]:
    """A status from each builder, through each of their branches."""
    statuses = [built(d, network=n) for d in (READY, FAILING, Decision())
                for n in (NetworkIsolation(), NetworkIsolation(enabled=False))]
    statuses.append(build_status("d", SPEC, REVISION, READY, [], None, 7, NOW,
                                 unreadable_snapshots=["ConfigMap d-x-runtime: plan.json is not JSON"]))
    return statuses + [invalid_status(INVALID, statuses[0], 8, NOW), invalid_status(INVALID, None, 8, NOW),
                       write_failed_status(REFUSED, statuses[0], 7, NOW), write_failed_status(REFUSED, None, 7, NOW),
                       write_failed_status(SQUATTED, None, 7, NOW)]


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_every_condition_written_is_a_condition_type_and_each_type_is_written() -> None:
    statuses = every_kind_of_status()
    for status in statuses:
        read_back = AFDDeploymentStatus.model_validate(status)
        assert read_back.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True) == status
    assert {c["type"] for s in statuses for c in s["conditions"]} == {t.value for t in ConditionType}


def test_a_condition_type_outside_the_enum_is_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    # The builders as they would be with one condition written under a plain string the enum
    # does not hold: each refuses to build the status.
    types = {member.name: member for member in ConditionType}
    monkeypatch.setattr(status_module, "ConditionType", SimpleNamespace(**{**types, "CONFIG_VALID": "SpecValid"}))
    with pytest.raises(ValidationError, match="SpecValid"):
        built(READY)
    with pytest.raises(ValidationError, match="SpecValid"):
        invalid_status(INVALID, None, 8, NOW)
    monkeypatch.setattr(status_module, "ConditionType", SimpleNamespace(**{**types, "API_WRITE_FAILED": "WriteFailed"}))
    with pytest.raises(ValidationError, match="WriteFailed"):
        write_failed_status(REFUSED, None, 7, NOW)


def test_a_name_conflict_names_the_object_and_its_holder() -> None:
    (condition,) = write_failed_status(SQUATTED, None, 7, NOW)["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == ("NameConflict", "True", "NameConflict")
    assert condition["message"] == ("Service d exists and is controlled by nothing (no controller reference), not by "
                                    "this AFDDeployment: the operator neither adopts nor deletes it; rename this "
                                    "AFDDeployment or remove that object")


def test_a_status_that_stands_keeps_exactly_its_keys() -> None:
    assert set(write_failed_status(REFUSED, None, 7, NOW)) == {"conditions"}
    assert set(invalid_status(INVALID, None, 8, NOW)) == {"conditions", "observedGeneration"}
    previous = built(READY)
    refused = write_failed_status(REFUSED, previous, 8, NOW + 5)
    assert {k: v for k, v in refused.items() if k != "conditions"} == {
        k: v for k, v in previous.items() if k != "conditions"}
    assert refused["conditions"][:-1] == previous["conditions"]
    # Nothing empty travels: no message on a condition without one, no unset instance field.
    assert "message" not in conditions(previous)["ConfigValid"]
    assert set(previous["instances"][0]) == {"name", "index", "revision", "phase", "podsReady", "podsTotal",
                                             "restarts", "consecutiveFailures", "firstReadyTime"}


def test_last_transition_time_moves_only_with_the_status() -> None:
    first = built(READY)
    assert {c["lastTransitionTime"] for c in first["conditions"]} == {format_time(NOW)}
    assert built(READY, first, NOW + 60) == first  # nothing changed: nothing to write

    failing = conditions(built(FAILING, first, NOW + 60))
    moved = {kind for kind, c in failing.items() if c["lastTransitionTime"] == format_time(NOW + 60)}
    assert moved == {"Ready", "Available", "Progressing", "Degraded"}
    assert failing["ConfigValid"] == conditions(first)["ConfigValid"]

    invalid = conditions(invalid_status(INVALID, first, 8, NOW + 120))
    assert invalid["ConfigValid"]["lastTransitionTime"] == format_time(NOW + 120)
    assert {k: c for k, c in invalid.items() if k != "ConfigValid"} == {
        k: c for k, c in conditions(first).items() if k != "ConfigValid"}
    refused = conditions(write_failed_status(REFUSED, first, 7, NOW + 120))
    again = conditions(write_failed_status(REFUSED, {**first, "conditions": list(refused.values())}, 7, NOW + 180))
    assert again["ApiWriteFailed"]["lastTransitionTime"] == format_time(NOW + 120)

    # A previous condition without a time gets one, whether or not its status changed.
    untimed = {**first, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                       for c in first["conditions"]]}
    assert {c["lastTransitionTime"] for c in built(READY, untimed, NOW + 60)["conditions"]} == {format_time(NOW + 60)}


def test_a_status_another_version_stored_still_gets_the_refusal_recorded() -> None:
    stored = {"observedGeneration": 3, "replicas": "three",
              "conditions": [{"type": "Ready", "status": "True", "reason": "AllInstancesReady",
                              "lastTransitionTime": format_time(NOW - 5)}]}
    written = invalid_status(INVALID, stored, 4, NOW)
    assert {c["type"]: c["status"] for c in written["conditions"]} == {"Ready": "True", "ConfigValid": "False"}
    assert written["observedGeneration"] == 4


def test_an_invalid_spec_drops_the_write_conditions_of_the_spec_before_it() -> None:
    """A NameConflict (or a refused write) met under the last valid spec does not stand once the
    spec is invalid: nothing is written for it, so nothing conflicts."""
    conflicted = write_failed_status(SQUATTED, built(READY), 7, NOW)
    refused = write_failed_status(REFUSED, conflicted, 7, NOW)
    assert {"NameConflict", "ApiWriteFailed"} <= set(conditions(refused))
    invalid = invalid_status(INVALID, refused, 8, NOW + 5)
    kinds = conditions(invalid)
    assert "NameConflict" not in kinds and "ApiWriteFailed" not in kinds
    assert kinds["ConfigValid"]["status"] == "False" and kinds["Ready"] == conditions(built(READY))["Ready"]
