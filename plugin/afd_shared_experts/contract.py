"""The AFD connector's contract between Attention and FFN ranks: transport only, no model
knowledge (``connector.P2PConnector`` implements it)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .frames import FrameSet
from .wire import DispatchTicket, WireLayout, WorkItem


class AFDConnector(ABC):
    """Transport contract between Attention and FFN ranks (no model knowledge)."""

    layout: WireLayout

    @abstractmethod
    def init(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Idempotent; safe after partial init; drops pending work and unblocks receivers."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool: ...

    # Attention side
    @abstractmethod
    def acquire(self) -> FrameSet:
        """Frames for the next dispatch, free of any send or combine in flight."""

    @abstractmethod
    def dispatch(self, layer: int, stage: int, frames: FrameSet, *, tokens: int, stages: int = 1) -> DispatchTicket:
        """Send one (layer, stage) of ``tokens`` tokens (the count the headers hold, known on the
        host): ``frames.work[f]`` (header written) to FFN rank f, and post the reply receives
        into ``frames.reply``. ``stages`` is how many stages this rank runs in this step (the
        FFN expects its stages 0..stages-1 of each layer in order)."""

    @abstractmethod
    def receive_replies(self, stage: int) -> tuple[DispatchTicket, FrameSet]:
        """The oldest pending dispatch of ``stage`` with its replies in ``frames.reply``
        (readable in the caller's stream order); ``release`` the frames after use."""

    @abstractmethod
    def release(self, frames: FrameSet) -> None:
        """Return a dispatch's frames to the pool once its combine has read the replies."""

    # FFN side
    @abstractmethod
    def receive_work(self, timeout: float | None = None) -> WorkItem | None:
        """Next work item from any Attention rank in arrival order; None when an Attention rank
        shut down, when ``timeout`` seconds passed without work, or once no Attention rank is
        active (``active_sources()`` tells them apart)."""

    @abstractmethod
    def active_sources(self) -> list[int]:
        """Attention ranks that have not shut down."""

    @abstractmethod
    def send_reply(self, item: WorkItem, rows: torch.Tensor) -> None:
        """Answer ``item`` (items of one source in arrival order) with its reply rows."""
