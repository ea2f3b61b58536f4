"""FFN side: gather the work of one (step, layer, stage) from every Attention rank.

An FFN rank receives, per Attention rank, that rank's work items in the order it dispatched
them: per step and MoE layer, stages 0..stages-1 (the header says how many stages the rank runs
in the step). ``StageBatcher`` keeps one queue per Attention rank and releases a group, the
queue heads that share a (step, layer, stage), once no other Attention rank is still expected
to send that key, so the runtime computes the group in one expert pass. It only ever takes
queue heads: every Attention rank gets its replies in its dispatch order, whatever the
grouping. Rows never mix: each row's expert output depends on that row alone, up to float
rounding (CPU BLAS picks its GEMM kernel by row count: 1, 2-3 and 4+ rows round differently).

Who is awaited for a key (step, layer, stage), besides the ranks whose head has it:
- an Attention rank that has shut down: never (its queued items are dropped: it closed
  without waiting for their replies);
- for a stage s > 0: only ranks that run more than s stages of that (step, layer) and have not
  sent stage s yet (a rank running fewer stages in a step never sends stage s);
- for stage 0: also a rank that still owes later stages of an earlier layer (it sends those
  first; the rank that ran fewer stages is a layer or a step ahead meanwhile);
- a rank whose last item's key is not below the group's: never (its keys only grow);
- a rank that has sent work before: for as long as it takes (Attention ranks run their forwards
  in lockstep, as vLLM runs data-parallel MoE engines; a lost rank ends the wait through the
  connector's liveness checks, a shut-down one through ``close_source``), so once every rank
  has sent work the grouping, and with it every float32 result, is the same whatever the
  timing;
- a rank that has not sent anything yet: within the gather window (seconds from the group's
  first item; the caller's policy, passed per call). Past it the group goes without that rank
  (counted in ``partial_groups``) and the rank is not awaited again until it sends (an
  Attention rank that joins the world and idles holds only the first group); when its item of
  the missed key comes after all, it goes at once on its own.
Heads of different keys: the smallest (step, layer, stage) goes first; the others wait for
their own peers.

Pure (no I/O, no clock: the caller passes ``now``), so every case is tested with hand-built
items.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .wire import WorkItem
from .errors import PairingError

GroupKey = tuple[int, int, int]  # (step, layer, stage)


def group_key(item: WorkItem) -> GroupKey:
    return item.step, item.layer, item.stage


@dataclass(frozen=True)
class _Queued:
    item: WorkItem
    arrived: float
    late: bool  # its group already went without it


class StageBatcher:
    def __init__(self, sources: Iterable[int], *, name: str = "FFN rank"):
        self.name = name
        self._queues: dict[int, deque[_Queued]] = {source: deque() for source in sources}
        self._active = set(self._queues)
        self._engaged: set[int] = set()  # sent work before: awaited without a deadline
        self._newcomers = set(self._queues)  # sent nothing yet and not left out: awaited within the window
        # The key a source must send next when it is within a layer's stages (None: any stage 0).
        self._due: dict[int, tuple[GroupKey, int] | None] = {source: None for source in self._queues}
        self._missed: dict[int, GroupKey] = {}  # the group a source was left out of, until its next item
        self._last: dict[int, GroupKey] = {}  # the key a source sent last (its keys only grow)
        self.partial_groups = 0

    @property
    def sources(self) -> list[int]:
        """Attention ranks that have not shut down."""
        return sorted(self._active)

    def queued(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def add(self, item: WorkItem, now: float) -> None:
        """A received work item; its source's items must come in dispatch order."""
        source = item.source
        if source not in self._active:
            raise PairingError(f"{self.name}: work item from Attention rank {source}, which is not an active source "
                               f"(active: {self.sources})")
        self._check_order(item)
        late = self._missed.pop(source, None) == group_key(item)
        self._last[source] = group_key(item)
        self._queues[source].append(_Queued(item, now, late))
        self._engaged.add(source)
        self._newcomers.discard(source)

    def _check_order(self, item: WorkItem) -> None:
        step, layer, stage = key = group_key(item)
        last = self._last.get(item.source)
        if last is not None and key <= last:
            raise PairingError(f"{self.name}: Attention rank {item.source} sent step {step} layer {layer} stage "
                               f"{stage} after step {last[0]} layer {last[1]} stage {last[2]} (a rank's (step, layer, "
                               "stage) only grows)")
        due = self._due[item.source]
        if due is not None and (key, item.stages) != due:
            (due_step, due_layer, due_stage), due_stages = due
            raise PairingError(
                f"{self.name}: Attention rank {item.source} sent step {step} layer {layer} stage {stage} of "
                f"{item.stages}, but stage {due_stage} of {due_stages} of step {due_step} layer {due_layer} is due "
                "(the stages of one layer arrive in order 0..stages-1)")
        if due is None and stage != 0:
            raise PairingError(f"{self.name}: Attention rank {item.source} sent stage {stage} of step {step} layer "
                               f"{layer} without its stage 0 (the stages of one layer arrive in order 0..stages-1)")
        self._due[item.source] = ((step, layer, stage + 1), item.stages) if stage + 1 < item.stages else None

    def close_source(self, source: int) -> None:
        """An Attention rank shut down: never awaited again; its queued items are dropped."""
        self._active.discard(source)
        self._engaged.discard(source)
        self._newcomers.discard(source)
        self._missed.pop(source, None)
        if source in self._queues:
            self._queues[source].clear()

    def _may_send(self, source: int, key: GroupKey) -> bool:
        """Whether ``source`` (no queued item) will still send ``key``: every stage 0 above its
        last key (ranks run every layer of every step), a later stage only while that layer's
        stages are due (how many stages a rank runs in a step, its stage 0 said). A rank still
        owing stages of an earlier layer sends those first, then this key: a rank that ran
        fewer stages of that layer may be a step ahead meanwhile."""
        if key[2] == 0:
            last = self._last.get(source)
            return last is None or key > last
        due = self._due[source]
        return due is not None and due[0] == key

    def _next(self) -> tuple[GroupKey, list[int], list[int], float] | None:
        """(key, sources holding it at their head, sources still awaited, first arrival)."""
        heads = {source: queue[0] for source, queue in self._queues.items() if queue}
        if not heads:
            return None
        key = min(group_key(head.item) for head in heads.values())
        members = sorted(source for source, head in heads.items() if group_key(head.item) == key)
        if all(heads[source].late for source in members):
            return key, members, [], min(heads[source].arrived for source in members)
        awaited = sorted(source for source in (self._engaged | self._newcomers) & self._active
                         if source not in heads and self._may_send(source, key))
        return key, members, awaited, min(heads[source].arrived for source in members)

    def pop_group(self, now: float, gather_window: float) -> list[WorkItem] | None:
        """The next complete group (items in Attention rank order), or None while its peers may
        still send within ``gather_window`` seconds of its first item."""
        if gather_window < 0:
            raise ValueError(f"gather_window must be >= 0 (got {gather_window})")
        upcoming = self._next()
        if upcoming is None:
            return None
        _, members, awaited, first_arrival = upcoming
        if awaited:
            if self._engaged.intersection(awaited) or now - first_arrival < gather_window:
                return None
            self._newcomers.difference_update(awaited)
            self._missed.update((source, upcoming[0]) for source in awaited)
            self.partial_groups += 1
        return [self._queues[source].popleft().item for source in members]

    def seconds_to_deadline(self, now: float, gather_window: float) -> float | None:
        """How long the next group may still wait for its peers; None when it waits for a rank
        that has sent work before (no deadline) or nothing is queued."""
        upcoming = self._next()
        if upcoming is None or self._engaged.intersection(upcoming[2]):
            return None
        return max(0.0, upcoming[3] + gather_window - now)
