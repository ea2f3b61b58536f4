"""Who may put a pod into an AFD instance: the operator alone.

Every selector the operator writes (the instance's headless Service, PodDisruptionBudget and
NetworkPolicy, the API Service, the PodMonitor) selects pods by `afd.inference.dev/` labels.
A pod that anyone else labels so would join an instance's DNS, count towards its disruption
budget, be admitted to every port of its pods, or receive the API Service's clients. The
validating webhook therefore refuses a pod carrying those labels, or a change of them, unless
the request comes from the operator's own user. Pure: the webhook handler passes the request's
pieces in.
"""

from __future__ import annotations

from typing import Mapping, Optional

from . import naming
from .api import GROUP

LABEL_PREFIX = f"{GROUP}/"
# The webhook sees only pods carrying one of these (one objectSelector each: selectors cannot
# say "either"); every selector of the operator's objects includes one of them.
GUARDED_LABELS = (naming.LABEL_DEPLOYMENT, naming.LABEL_AFD_INSTANCE)


def membership_labels(labels: Optional[Mapping[str, str]]) -> dict[str, str]:
    return {key: value for key, value in (labels or {}).items() if key.startswith(LABEL_PREFIX)}


def membership_refusal(operation: Optional[str], username: str, operator_username: str,
                       old_labels: Optional[Mapping[str, str]], new_labels: Optional[Mapping[str, str]]) -> Optional[str]:
    """Why a pod CREATE or UPDATE must be refused, or None. The operator may do anything; anyone
    else may create no pod with `afd.inference.dev/` labels and change none of them on a pod
    (other edits of an operator's pod, e.g. the garbage collector's finalizer removal, pass)."""
    if username == operator_username:
        return None
    new = membership_labels(new_labels)
    if operation == "CREATE" and new:
        return (f"labels {', '.join(sorted(new))} are set by the afd-operator alone "
                f"(they make a pod a member of an AFD instance); {username} may not create such a pod")
    if operation == "UPDATE":
        old = membership_labels(old_labels)
        changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        if changed:
            return (f"labels {', '.join(changed)} are set by the afd-operator alone "
                    f"(they make a pod a member of an AFD instance); {username} may not change them")
    return None
