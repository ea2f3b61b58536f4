"""Attention tensor-parallel helpers: after the TP all-reduce every TP rank holds all T
tokens; each dispatches only its shard and the results are all-gathered back."""

from __future__ import annotations

import torch


def shard_rows(num_tokens: int, tp_size: int) -> int:
    return -(-num_tokens // tp_size)


def shard_tokens(hidden_states: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[torch.Tensor, int]:
    """This TP rank's ceil(T/TP) rows, zero-padded, and how many of them are real."""
    total = hidden_states.shape[0]
    per_rank = shard_rows(total, tp_size)
    lo = min(tp_rank * per_rank, total)
    hi = min(lo + per_rank, total)
    shard = hidden_states.new_zeros(per_rank, *hidden_states.shape[1:])
    shard[: hi - lo] = hidden_states[lo:hi]
    return shard, hi - lo


def all_gather_and_trim(shard_output: torch.Tensor, num_tokens: int, tp_group) -> torch.Tensor:
    """All-gather every TP rank's shard output and drop the padding. Every TP rank must call
    this, even one whose shard is all padding, or the others deadlock."""
    gathered = [torch.empty_like(shard_output) for _ in range(tp_group.size())]
    tp_group.allgather([gathered], [shard_output.contiguous()]).wait()
    return torch.cat(gathered)[:num_tokens]
