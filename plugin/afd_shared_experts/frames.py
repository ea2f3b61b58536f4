"""The Attention side's frame sets: a fixed pool, allocated once when the connector starts
(inside vLLM's model build, so before its memory profile, which then counts them), never grown
at run time. A dispatch takes the set released longest ago; the caller's stream (device links)
or the host (gloo) first waits for that set's previous sends, so a frame is never written while
a send still reads it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .device import host_buffer
from .errors import AFDError
from .transport import InFlight
from .wire import WireLayout

# Frame sets beyond the stages' own: a stage's next dispatch takes a set while its previous
# set's sends may still be completing on a device link.
SPARE_FRAME_SETS = 1


@dataclass(eq=False)
class FrameSet:
    """One dispatch's buffers on the compute device: work frames [F, work_rows, H] (written by
    the caller) and reply frames [F, reply_capacity, H]; under ``staged`` on an accelerator, their
    pinned host twins."""

    work: torch.Tensor
    reply: torch.Tensor
    work_host: torch.Tensor | None = None
    reply_host: torch.Tensor | None = None
    sends: InFlight = field(default_factory=InFlight)


def new_frame_set(layout: WireLayout, ffn_ranks: int, device: torch.device, *, host_staging: bool) -> FrameSet:
    frames = FrameSet(work=layout.work_frames(ffn_ranks, device), reply=layout.reply_frames(ffn_ranks, device))
    if host_staging:  # the staged plane on an accelerator: pinned host twins
        frames.work_host = host_buffer(frames.work.shape, layout.dtype, device)
        frames.reply_host = host_buffer(frames.reply.shape, layout.dtype, device)
    return frames


def pool_size(stages: int) -> int:
    """Frame sets of an Attention rank running ``stages`` micro-batches: each stage holds one
    dispatch until its combine, and a dispatch of two stages may be pending at once however
    many stages run (a caller may dispatch both halves before combining either)."""
    return max(stages, 2) + SPARE_FRAME_SETS


class FramePool:
    def __init__(self, rank: int, size: int, make: Callable[[], FrameSet]):
        if size < 1:
            raise ValueError(f"frame pool size must be >= 1 (got {size})")
        self.rank, self.size = rank, size
        self._free: deque[FrameSet] = deque(make() for _ in range(size))

    def take(self, wait_for_sends: Callable[[FrameSet], None]) -> FrameSet:
        """The set released longest ago, once ``wait_for_sends`` ordered its reuse after its sends."""
        if not self._free:
            raise AFDError(f"rank {self.rank}: all {self.size} frame sets hold dispatches not yet combined (the pool "
                           "is sized by afd.num_stages; combine a dispatch before dispatching more)")
        frames = self._free.popleft()
        wait_for_sends(frames)
        frames.sends = InFlight()
        return frames

    def give_back(self, frames: FrameSet) -> None:
        self._free.append(frames)

    def sends_in_flight(self) -> int:
        return sum(not frames.sends.done() for frames in self._free)
