"""Micro-batch stages of one Attention step: where the step is cut.

An AFD Attention rank with ``num_stages = S > 1`` runs each step as S micro-batches, so that
the attention of micro-batch s+1 runs while the FFN side computes the experts of micro-batch s
(docs/design/async-afd.md). Cuts fall between requests only: every request's tokens stay in one
micro-batch, which every attention backend handles (vLLM's CPU backend prefills with SDPA over
a chunk's own tokens on some CPUs, so a request split across micro-batches would lose context).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .config import MinSplitTokens


class StageSlice(NamedTuple):
    """Requests [req_start, req_stop) and their tokens [tok_start, tok_stop) of one micro-batch."""

    req_start: int
    req_stop: int
    tok_start: int
    tok_stop: int


def stage_plan(tokens_per_request: Sequence[int], stages: int) -> list[StageSlice]:
    """The micro-batches of a step whose requests schedule ``tokens_per_request`` tokens (in
    batch order), at most ``stages`` of them, each of at least one request, with token counts as
    even as request boundaries allow. A step with fewer requests than ``stages`` runs fewer; one
    slice means the step runs unsplit."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1 (got {stages})")
    requests = len(tokens_per_request)
    if requests == 0:
        return []
    count = min(stages, requests)
    ends = []  # token offset after each request
    total = 0
    for tokens in tokens_per_request:
        total += tokens
        ends.append(total)
    cuts = [0]  # request index where each micro-batch starts
    for k in range(1, count):
        target = total * k / count
        # Leave at least one request for this micro-batch and each one after it.
        lowest, highest = cuts[-1] + 1, requests - (count - k)
        cut = min(range(lowest, highest + 1), key=lambda r: (abs(ends[r - 1] - target), r))
        cuts.append(cut)
    cuts.append(requests)
    return [StageSlice(start, stop, ends[start - 1] if start else 0, ends[stop - 1])
            for start, stop in zip(cuts, cuts[1:])]


def step_stages(tokens_per_request: Sequence[int], stages: int, min_split: MinSplitTokens) -> int:
    """How many stages a step runs: ``stages`` once the step holds at least its phase's minimum
    tokens (``min_split.decode`` when every request schedules one token, ``min_split.prefill``
    otherwise), else 1. A small step split in two pays each micro-batch's fixed costs twice
    and gains less overlap than that."""
    if stages == 1 or not tokens_per_request:
        return 1
    decode = max(tokens_per_request) == 1
    return stages if sum(tokens_per_request) >= (min_split.decode if decode else min_split.prefill) else 1
