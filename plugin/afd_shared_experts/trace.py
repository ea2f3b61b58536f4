"""Stage trace: compute and wait intervals per (step, layer, stage), one JSON line each.

Off unless ``AFD_TRACE_DIR`` names a directory; then every (role, rank) of a process appends to
``trace-<role>-<rank>-<pid>.jsonl`` there, one line per interval, written as it ends (a killed
process keeps what it recorded). When off, ``stage_trace`` returns None and a call site costs
one ``is None`` check.

Each interval carries ``start_ns``/``end_ns`` from ``time.monotonic_ns()`` (CLOCK_MONOTONIC:
one clock for every process of a Linux host, so two processes' intervals compare directly)
and ``wall_ns`` (``time.time_ns()`` at the start) to line up hosts. Kinds recorded:
- Attention (``attention.RemoteMoE``): ``dispatch`` (routing bookkeeping up to the posted
  sends; under placement 'attention' the local shared expert runs after it), ``combine_wait``
  (waiting for every FFN rank's reply), ``combine`` (the weighted sum after it);
- FFN (``ffn_runtime.FFNRuntime``): ``group_wait`` (receiving until a group is complete),
  ``expert_pass`` (one routed and one shared pass over every peer's rows, split back),
  ``reply`` (posting the replies); ``peers`` says how many Attention ranks the group merged.
``rows`` counts payload rows as sent (routed rows plus extra shared rows), summed over the FFN
ranks for ``dispatch`` and over the Attention ranks for ``expert_pass``; ``combine`` counts tokens.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

TRACE_DIR_ENV = "AFD_TRACE_DIR"

_traces: dict[tuple[str, str, int], "StageTrace"] = {}
_traces_lock = threading.Lock()


class StageTrace:
    """The intervals of one (role, rank), appended to its file."""

    def __init__(self, path: Path, role: str, rank: int):
        self.path, self.role, self.rank = path, role, rank
        self._lock = threading.Lock()  # micro-batch threads of one rank share the file
        # Line-buffered: each interval reaches the file when it is recorded.
        self._file = open(path, "a", buffering=1)

    def record(self, kind: str, started_ns: int, *, step: int, layer: int, stage: int, rows: int,
               wall_ns: int, **extra: int) -> None:
        """One interval from ``started_ns`` (``time.monotonic_ns()``) to now."""
        line = json.dumps({"kind": kind, "role": self.role, "rank": self.rank, "step": step, "layer": layer,
                           "stage": stage, "rows": rows, "start_ns": started_ns, "end_ns": time.monotonic_ns(),
                           "wall_ns": wall_ns, **extra})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def trace_enabled() -> bool:
    return bool(os.environ.get(TRACE_DIR_ENV))


def stage_trace(role: str, rank: int) -> StageTrace | None:
    """The trace of (role, rank) in this process, shared by all its layers; None when off."""
    directory = os.environ.get(TRACE_DIR_ENV)
    if not directory:
        return None
    with _traces_lock:
        trace = _traces.get((directory, role, rank))
        if trace is None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = Path(directory) / f"trace-{role}-{rank}-{os.getpid()}.jsonl"
            trace = _traces[(directory, role, rank)] = StageTrace(path, role, rank)
        return trace


def clocks() -> tuple[int, int]:
    """(monotonic, wall) nanoseconds now: what an interval's start records."""
    return time.monotonic_ns(), time.time_ns()


def read_traces(directory: str | Path) -> list[dict]:
    """Every interval recorded under ``directory``, ordered by start."""
    intervals = []
    for path in sorted(Path(directory).glob("trace-*.jsonl")):
        with open(path) as handle:
            intervals.extend(json.loads(line) for line in handle if line.strip())
    return sorted(intervals, key=lambda interval: interval["start_ns"])
