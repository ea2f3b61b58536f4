"""What the controller's decision is made of: the instance records the status keeps, the
actions the reconciler writes, the events it records, and one instance as a decision sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .api import Phase
from .observe import ObservedPod


@dataclass(frozen=True)
class InstanceRecord:
    """What the previous status says about an instance (the operator's own memory)."""

    name: str
    revision: str
    index: int
    phase: Phase
    restarts: int = 0
    consecutive_failures: int = 0
    last_failure: Optional[str] = None
    retry_after: Optional[float] = None
    first_ready: Optional[float] = None  # set once the world has been Ready; cleared when it is recreated


# -- actions: what the reconciler must write ------------------------------------------------
@dataclass(frozen=True)
class CreatePods:
    """Create every pod of one role of an instance (of the current revision)."""

    instance: str
    revision: str
    index: int
    role: str


@dataclass(frozen=True)
class SetServing:
    """Add (serving) or remove the serving label of Attention heads."""

    instance: str
    pods: tuple[str, ...]
    serving: bool


@dataclass(frozen=True)
class StartDrain:
    """Take heads out of the Service and stamp when their drain started."""

    instance: str
    pods: tuple[str, ...]


@dataclass(frozen=True)
class DeletePods:
    instance: str
    pods: tuple[str, ...]


Action = Union[CreatePods, SetServing, StartDrain, DeletePods]


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class InstanceView:
    """One instance as this decision sees it."""

    record: InstanceRecord
    pods: list[ObservedPod]
    previous_phase: Phase = Phase.PENDING  # as the last status recorded it
    draining: bool = False
    failure: Optional[str] = None
    exhausted: bool = False

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def revision(self) -> str:
        return self.record.revision

    def of_role(self, role: str) -> list[ObservedPod]:
        return [p for p in self.pods if p.role == role]

    @property
    def head(self) -> Optional[ObservedPod]:
        return next((p for p in self.pods if p.head), None)


@dataclass
class Decision:
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    instances: list[InstanceRecord] = field(default_factory=list)  # the new status records
    rollout_in_progress: bool = False
    progress_reason: str = "Complete"
    progress_message: str = ""
    degraded: list[str] = field(default_factory=list)
    became_ready: list[tuple[str, float]] = field(default_factory=list)  # (instance, seconds to Ready)
    restarted: int = 0
    gone: set[str] = field(default_factory=set)  # instances fully drained: their records are dropped
    next_wakeup: Optional[float] = None  # the earliest time a timer elapses

    def wake_at(self, when: float) -> None:
        self.next_wakeup = when if self.next_wakeup is None else min(self.next_wakeup, when)
