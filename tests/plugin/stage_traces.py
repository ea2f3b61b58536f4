"""What the stage traces of a run (afd_shared_experts.trace) must show when its Attention ranks
split steps into micro-batch stages: the ping-pong schedule, one FFN expert pass per (step,
layer, stage), and the FFN computing one micro-batch while the Attention side computes the next."""

from __future__ import annotations

from collections import defaultdict


def by_key(traces: list[dict], role: str, kind: str) -> dict[tuple, list[dict]]:
    """Intervals of one role and kind by (rank, step, layer, stage)."""
    found: dict[tuple, list[dict]] = defaultdict(list)
    for interval in traces:
        if interval["role"] == role and interval["kind"] == kind:
            found[(interval["rank"], interval["step"], interval["layer"], interval["stage"])].append(interval)
    return found


def stages_per_layer(dispatches: dict[tuple, list[dict]]) -> dict[tuple, int]:
    """How many stages each (Attention rank, step, layer) dispatched."""
    counts: dict[tuple, int] = defaultdict(int)
    for rank, step, layer, _ in dispatches:
        counts[(rank, step, layer)] += 1
    return counts


def assert_staged_schedule(traces: list[dict], *, stages: int, attention_ranks: int) -> dict:
    """The assertions every staged run shares; returns counts for the caller's own checks."""
    dispatches = by_key(traces, "attention", "dispatch")
    waits = by_key(traces, "attention", "combine_wait")
    passes = by_key(traces, "ffn", "expert_pass")
    assert dispatches and passes, "no stage trace recorded"
    assert {rank for rank, *_ in dispatches} == set(range(attention_ranks))
    per_layer = stages_per_layer(dispatches)
    assert max(per_layer.values()) == stages, sorted(set(per_layer.values()))
    staged = [key for key, count in per_layer.items() if count > 1]
    for rank, step, layer in staged:
        count = per_layer[(rank, step, layer)]
        (first_wait,) = waits[(rank, step, layer, 0)]
        for stage in range(count):
            (dispatch,) = dispatches[(rank, step, layer, stage)]
            # Micro-batch s+1 dispatches only after s did (its attention ran in between), and
            # every micro-batch of the layer is dispatched before the first combine waits.
            if stage:
                (previous,) = dispatches[(rank, step, layer, stage - 1)]
                assert dispatch["start_ns"] >= previous["end_ns"], (rank, step, layer, stage)
            assert first_wait["start_ns"] >= dispatch["end_ns"], (rank, step, layer, stage)
    # The FFN side: exactly one expert pass per (FFN rank, step, layer, stage), merging every
    # Attention rank that dispatched that (step, layer, stage).
    senders: dict[tuple, int] = defaultdict(int)
    for _, step, layer, stage in dispatches:
        senders[(step, layer, stage)] += 1
    ffn_ranks = {rank for rank, *_ in passes}
    for (rank, step, layer, stage), intervals in passes.items():
        assert len(intervals) == 1, (rank, step, layer, stage, len(intervals))
        assert intervals[0]["peers"] == senders[(step, layer, stage)], (rank, step, layer, stage)
    assert {(step, layer, stage) for _, step, layer, stage in passes} == set(senders)
    assert all(sum(1 for key in passes if key[0] == rank) == len(senders) for rank in ffn_ranks)
    return {"staged_layers": len(staged), "layers": len(per_layer), "merged_passes":
            sum(1 for intervals in passes.values() if intervals[0]["peers"] > 1)}


def overlapped_layers(traces: list[dict]) -> int:
    """(Attention rank, step, layer, stage) where an FFN expert pass of micro-batch s ran while
    that Attention rank computed micro-batch s+1 (after dispatching s, before dispatching s+1);
    both processes' intervals are on the host's one monotonic clock."""
    dispatches = by_key(traces, "attention", "dispatch")
    passes = by_key(traces, "ffn", "expert_pass")
    overlapped = 0
    for (rank, step, layer, stage), (dispatch,) in dispatches.items():
        following = dispatches.get((rank, step, layer, stage + 1))
        if not following:
            continue
        window = (dispatch["end_ns"], following[0]["start_ns"])
        if any(key[1:] == (step, layer, stage) and interval["start_ns"] < window[1] and interval["end_ns"] > window[0]
               for key, intervals in passes.items() for interval in intervals):
            overlapped += 1
    return overlapped
