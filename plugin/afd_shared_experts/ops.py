"""The remote MoE as two torch custom ops, ``afd::dispatch`` and ``afd::combine``.

A model calls ``dispatch`` then ``combine`` where its MoE layer would call its experts;
torch.compile sees two opaque calls with fake implementations (shapes only),
ordered by the token tensor that ``dispatch`` returns and ``combine`` takes. The real
implementations look the layer up by name (``register``) and run its ``dispatch`` /
``combine`` (``attention.RemoteMoE``, or the vLLM glue's layer, which routes, shards for TP,
hands the Attention side to the next micro-batch and gathers), keeping each pending combine
per (layer, stage) in order. They run as Python at run time whether the caller is eager or
compiled; they keep Python state (the pending FIFOs, the connector's counters and frame pool)
that a replayed CUDA/ACL graph would skip, so they are not for graph capture (AFD engines run
eager off the CPU: docs/compat.md, "Graph modes"). Torch only: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteLayer:
    """What the ops call for one layer: ``dispatch(hidden_states, routing)`` sends its rows and
    returns what ``combine(pending)`` needs to produce the layer's output. ``routing`` is the
    tensors the model passes (``[topk_ids, topk_weights]`` for ``RemoteMoE``; the router logits
    for the vLLM glue, which routes inside)."""

    dispatch: Callable[[torch.Tensor, list[torch.Tensor]], object]
    combine: Callable[[object], torch.Tensor]


_layers: dict[str, RemoteLayer] = {}
_pending: dict[tuple[str, int], deque] = {}
_lock = threading.Lock()
# The micro-batch the calling thread computes (the vLLM glue installs its own; 0 elsewhere).
_current_stage: Callable[[], int] = lambda: 0  # noqa: E731


def register(name: str, layer: RemoteLayer) -> None:
    """Make ``layer`` the one the ops call for ``name`` (a model's layer prefix)."""
    with _lock:
        _layers[name] = layer


def register_remote_moe(name: str, remote) -> None:
    """An ``attention.RemoteMoE`` under ``name``: routing is ``[topk_ids, topk_weights]``."""
    register(name, RemoteLayer(dispatch=lambda hidden_states, routing: remote.dispatch(hidden_states, *routing),
                               combine=remote.combine))


def set_stage_source(source: Callable[[], int]) -> None:
    global _current_stage
    _current_stage = source


def _queue(name: str) -> deque:
    key = (name, _current_stage())
    with _lock:
        return _pending.setdefault(key, deque())


@torch.library.custom_op("afd::dispatch", mutates_args=())
def dispatch(hidden_states: torch.Tensor, routing: list[torch.Tensor], layer: str) -> torch.Tensor:
    """Send the layer's rows to the FFN ranks; returns the token ``combine`` takes."""
    remote = _layers.get(layer)
    if remote is None:
        raise KeyError(f"afd::dispatch: no remote MoE layer registered as {layer!r} (registered: {sorted(_layers)})")
    queue = _queue(layer)
    if queue:
        # A forward combines each (layer, stage) before it dispatches the same again: what is
        # still here belongs to a step that failed in between. The connector drains its replies
        # when the next step dispatches (P2PConnector.dispatch); its pending combine goes here.
        logger.warning("afd: layer %s: %d dispatch(es) of a failed step were never combined", layer, len(queue))
        queue.clear()
    queue.append(remote.dispatch(hidden_states, routing))
    return hidden_states.new_empty(0)


@dispatch.register_fake
def _(hidden_states, routing, layer):
    return hidden_states.new_empty(0)


@torch.library.custom_op("afd::combine", mutates_args=())
def combine(token: torch.Tensor, hidden_states: torch.Tensor, layer: str) -> torch.Tensor:
    """The layer's MoE output for the oldest dispatch of this (layer, stage)."""
    queue = _queue(layer)
    if not queue:
        raise RuntimeError(f"afd::combine: layer {layer!r} stage {_current_stage()} has no pending dispatch")
    return _layers[layer].combine(queue.popleft())


@combine.register_fake
def _(token, hidden_states, layer):
    return torch.empty_like(hidden_states)


def remote_moe(hidden_states: torch.Tensor, routing: list[torch.Tensor], layer: str) -> torch.Tensor:
    """dispatch then combine: the whole remote MoE of one layer."""
    return torch.ops.afd.combine(torch.ops.afd.dispatch(hidden_states, routing, layer), hidden_states, layer)
