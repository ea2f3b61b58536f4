"""What the plugin's stage traces (plugin/afd_shared_experts/trace.py) say about a run inside a
window of CLOCK_MONOTONIC nanoseconds: each side's busy time, the Attention-only part of each
step, the FFN's expert passes, and where the Attention side waited for replies."""

from __future__ import annotations

from typing import Iterable, NamedTuple


def busy_seconds(traces: list[dict], window: list[int]) -> tuple[float, float]:
    """(Attention busy, FFN busy) seconds inside the generate window, from the stage traces."""
    start, end = window

    def inside(kind: str, role: str) -> float:
        return sum(max(0, min(i["end_ns"], end) - max(i["start_ns"], start)) for i in traces
                   if i["kind"] == kind and i["role"] == role) / 1e9

    wall = (end - start) / 1e9
    return wall - inside("combine_wait", "attention"), inside("expert_pass", "ffn") + inside("reply", "ffn")


def attention_only_seconds(traces: list[dict], window: list[int]) -> float:
    """Seconds of the generate window in which the FFN side can have no work: outside every
    step's MoE span on the Attention rank (its first dispatch to its last combine). That is
    the dense layer, the first MoE layer's attention, the final norm, the LM head, sampling and
    scheduling: the part of each step that micro-batch stages cannot overlap."""
    start, end = window
    spans: dict[int, list[int]] = {}
    for i in traces:
        if i["role"] == "attention" and i["kind"] in ("dispatch", "combine"):
            span = spans.setdefault(i["step"], [i["start_ns"], i["end_ns"]])
            span[0], span[1] = min(span[0], i["start_ns"]), max(span[1], i["end_ns"])
    inside = sum(max(0, min(stop, end) - max(first, start)) for first, stop in spans.values())
    return (end - start - inside) / 1e9


def attention_steps(traces: list[dict], window: list[int]) -> int:
    """Forward steps of the Attention rank that dispatched inside the generate window: one per
    new token when every request runs in every step, more when the scheduler holds some back."""
    return len({i["step"] for i in traces if i["role"] == "attention" and i["kind"] == "dispatch"
                and window[0] <= i["start_ns"] < window[1]})


def expert_passes(traces: list[dict], window: list[int]) -> tuple[float, float]:
    """(mean ms, mean rows) of the FFN's expert passes that started inside the generate window."""
    passes = [i for i in traces if i["kind"] == "expert_pass" and window[0] <= i["start_ns"] < window[1]]
    return (sum(i["end_ns"] - i["start_ns"] for i in passes) / len(passes) / 1e6,
            sum(i["rows"] for i in passes) / len(passes))


class ReplyWaits(NamedTuple):
    """Seconds an Attention rank waited for replies in a window, split by where in the step."""

    steps: int  # steps that waited for a reply inside the window
    last: float  # for each step's last reply (its last MoE layer's last stage)
    others: float  # for every other reply
    # The FFN side's expert pass and reply for each step's last (layer, stage): after that
    # dispatch the step has nothing left to compute but the combines, so its wait is this pass.
    last_ffn: float


def _seconds(intervals: Iterable[dict]) -> float:
    return sum(i["end_ns"] - i["start_ns"] for i in intervals) / 1e9


def reply_waits(traces: list[dict], window: tuple[int, int]) -> ReplyWaits:
    """Where the Attention side's waits for replies (``combine_wait``) that began in ``window``
    went (one Attention rank's traces); a ValueError when none did (no traces were written)."""
    start, end = window
    waits = [i for i in traces if i["role"] == "attention" and i["kind"] == "combine_wait"
             and start <= i["start_ns"] < end]
    if not waits:
        raise ValueError(f"no Attention rank's wait for a reply began in the window ({len(traces)} intervals traced)")
    last: dict[int, tuple[int, int]] = {}
    for i in waits:
        last[i["step"]] = max(last.get(i["step"], (-1, -1)), (i["layer"], i["stage"]))

    def is_last(i: dict) -> bool:
        return last.get(i["step"]) == (i["layer"], i["stage"])

    waited_last = _seconds(filter(is_last, waits))
    return ReplyWaits(len(last), waited_last, _seconds(waits) - waited_last,
                      _seconds(i for i in traces if i["role"] == "ffn" and i["kind"] in ("expert_pass", "reply")
                               and is_last(i)))
