"""Revision: a stable hash of everything that shapes an instance.

Two specs with the same revision produce interchangeable instances; any change that would
make ranks of the old and new spec disagree (image, model, parallel sizes, FFN ranks,
shared-expert placement, connector, env, ports, ...) changes it. Fields that only steer
the operator (replica count, rollout/recovery/startup policy, Service type, PodMonitor)
are left out so that changing them never restarts a world.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .api import AFDDeploymentSpec, AsyncSpec

REVISION_LENGTH = 10

# Top-level spec fields (wire names) that do not shape an instance.
NON_SHAPING_FIELDS = ("replicas", "updateStrategy", "recovery", "startup")
# Nested fields that do not shape an instance: (parent, child).
NON_SHAPING_NESTED = (("service", "type"), ("metrics", "podMonitor"))


def shaping_spec(spec: AFDDeploymentSpec) -> dict[str, Any]:
    """The instance-shaping part of the spec, with defaults filled in (wire names)."""
    data = spec.model_dump(mode="json", by_alias=True)
    for key in NON_SHAPING_FIELDS:
        data.pop(key, None)
    for parent, child in NON_SHAPING_NESTED:
        data.get(parent, {}).pop(child, None)
    # A spec that leaves `async` at its defaults hashes as before the block existed, so
    # upgrading the operator does not roll those instances.
    if data.get("async") == AsyncSpec().model_dump(mode="json", by_alias=True):
        del data["async"]
    return data


def revision_of(spec: AFDDeploymentSpec) -> str:
    canonical = json.dumps(shaping_spec(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
