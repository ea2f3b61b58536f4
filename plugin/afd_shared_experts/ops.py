"""The remote MoE as two torch custom ops, ``afd::dispatch`` and ``afd::combine``.

A model calls ``dispatch`` then ``combine`` where its MoE layer would call its experts;
torch.compile and graph capture see two opaque calls with fake implementations (shapes only),
ordered by the token tensor that ``dispatch`` returns and ``combine`` takes. The real
implementations look the layer up by name (``register``) and run its ``dispatch`` /
``combine`` (``attention.RemoteMoE``, or the vLLM glue's layer with its TP shard and gather),
keeping each pending combine per (layer, stage) in order. Torch only: no vLLM import.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Protocol

import torch


class RemoteLayer(Protocol):
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> object: ...

    def combine(self, pending: object) -> torch.Tensor: ...


_layers: dict[str, RemoteLayer] = {}
_pending: dict[tuple[str, int], deque] = {}
_lock = threading.Lock()
# The micro-batch the calling thread computes (the vLLM glue installs its own; 0 elsewhere).
_current_stage: Callable[[], int] = lambda: 0  # noqa: E731


def register(name: str, layer: RemoteLayer) -> None:
    """Make ``layer`` the one the ops call for ``name`` (a model's layer prefix)."""
    with _lock:
        _layers[name] = layer


def set_stage_source(source: Callable[[], int]) -> None:
    global _current_stage
    _current_stage = source


def _queue(name: str) -> deque:
    key = (name, _current_stage())
    with _lock:
        return _pending.setdefault(key, deque())


@torch.library.custom_op("afd::dispatch", mutates_args=())
def dispatch(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             layer: str) -> torch.Tensor:
    """Send the layer's rows to the FFN ranks; returns the token ``combine`` takes."""
    remote = _layers.get(layer)
    if remote is None:
        raise KeyError(f"afd::dispatch: no remote MoE layer registered as {layer!r} (registered: {sorted(_layers)})")
    _queue(layer).append(remote.dispatch(hidden_states, topk_ids, topk_weights))
    return hidden_states.new_empty(0)


@dispatch.register_fake
def _(hidden_states, topk_ids, topk_weights, layer):
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


def remote_moe(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               layer: str) -> torch.Tensor:
    """dispatch then combine: the whole remote MoE of one layer."""
    return torch.ops.afd.combine(torch.ops.afd.dispatch(hidden_states, topk_ids, topk_weights, layer), hidden_states,
                                 layer)
