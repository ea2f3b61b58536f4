"""The AFD wire format (v3): per (layer, stage, Attention rank, FFN rank) one work message
(two on the ``direct`` plane) and one reply.

Per Attention rank a -> FFN rank f (one AFD world: Attention ranks 0..A-1, FFN ranks A..A+F-1):
- work: a *frame* [header_rows + capacity, H] in the model dtype. Its first ``header_rows``
  rows carry an int32 header, bit for bit (layer, stage, the sender's stage count in this step,
  the dispatch's token count, row counts per local expert); the rows after it are the routed
  rows grouped by local expert (within a group the rows whose shared work this rank does
  first), then the extra shared rows of the contiguous partition.
- reply (f -> a): the rows only, [routed rows + shared rows, H] in the frame's row order, no
  header: the Attention side wrote the counts and reads them from its own copy, on its device.

Sizes follow the step, not the token budget: a dispatch of T tokens is carried in frames sized
for ``rung(T)`` tokens, the smallest power of two >= T (at most the budget's ``max_tokens``),
so a message is at most twice the frame of exactly T tokens. The ``direct`` plane (nccl/hccl:
both ends post equal sizes, and the sender cannot read its device-written row counts) sends
the header alone, then the rows of the rung's capacity; the FFN side reads the header on its
host (T is there) and posts the rows receive of the same size, then answers with a reply of
the rung's reply capacity, which the Attention side posted knowing T. The ``staged`` plane
(gloo) sends a frame up to its last valid row in one message, which a receive of the full
capacity accepts. Every dispatch reaches every FFN rank (a frame with no rows when it has
none) and every FFN rank answers every dispatch, so no side waits for a message that never
comes. The FFN side counts each Attention rank's steps itself (``StepCounter``), so a step
number never travels. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import MAX_STAGES, AFDConfig
from .errors import AFDError, PayloadError

MAGIC = 0xAFD3  # format version 3
KIND_WORK, KIND_SHUTDOWN = 1, 2
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Only gloo reads tags; pairing never depends on them (HCCL/NCCL ignore them).
TAG_WORK, TAG_REPLY = 1, 2
BYTE_KINDS = ("work", "replies")
SHARED_ROWS = ("none", "affinity", "contiguous")

# The int32 header: the fixed fields, the dispatch's tokens, its rows, then the row counts of
# every local expert, then how many of each expert's rows lead its group as shared-expert rows.
STATIC_FIELDS = ("magic", "kind", "layer", "stage", "stages", "source", "dtype", "hidden", "local_experts")
TOKENS_FIELD = len(STATIC_FIELDS)  # tokens of the dispatch (sets the messages' sizes)
ROWS_FIELD = TOKENS_FIELD + 1  # valid rows after the header: routed + extra shared
EXTRA_FIELD = ROWS_FIELD + 1  # extra shared rows (contiguous partition), after the routed rows
COUNTS_AT = EXTRA_FIELD + 1


class CapacityError(AFDError):
    """A step holds more tokens than the frames were sized for."""


@dataclass(frozen=True)
class WireLayout:
    """Frame sizes of one AFD world; every rank must build the same one (the connector checks
    at rendezvous). ``max_tokens`` is the most tokens one dispatch carries (the engine's
    ``--max-num-batched-tokens``); a token's top-k experts are distinct, so one FFN rank gets at
    most ``min(top_k, local_experts)`` rows of it, plus one extra shared row under the contiguous
    partition (at most ceil(tokens / F) of them per rank). A reply holds the routed rows and
    the shared ones: under ``shared`` "affinity" up to one per token, under "contiguous" the
    extra rows, under "none" (placement 'attention', or a model without shared experts) none."""

    hidden_size: int
    dtype: torch.dtype
    local_experts: int
    num_ffn_ranks: int
    top_k: int
    max_tokens: int
    shared: str = "none"  # which shared rows an FFN rank computes: none, affinity, contiguous

    @classmethod
    def for_world(cls, spec, cfg: AFDConfig, *, dtype: torch.dtype, token_budget: int) -> WireLayout:
        """The layout of a world serving ``spec`` (a ``model.MoESpec``) under ``cfg`` with the
        engines' ``--max-num-batched-tokens`` ``token_budget``: an Attention TP rank dispatches its
        ceil(T / TP) shard of a step (TP = ``attn_ranks_per_dp``)."""
        shared = cfg.shared_experts
        return cls(hidden_size=spec.hidden_size, dtype=dtype, local_experts=spec.local_experts(cfg.num_ffn_ranks),
                   num_ffn_ranks=cfg.num_ffn_ranks, top_k=spec.top_k,
                   max_tokens=-(-token_budget // cfg.attn_ranks_per_dp),
                   shared=shared.partition if spec.placement(shared.placement) == "ffn" else "none")

    def __post_init__(self):
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"wire dtype must be one of {', '.join(map(str, DTYPE_CODES))} (got {self.dtype})")
        if (self.hidden_size * self.row_bytes_per_element) % 4:
            raise ValueError(f"hidden_size {self.hidden_size} x {self.row_bytes_per_element} bytes must be a multiple "
                             "of 4 bytes (the header is int32 in the first rows)")
        if self.shared not in SHARED_ROWS:
            raise ValueError(f"shared must be one of {', '.join(SHARED_ROWS)} (got {self.shared!r})")
        for name in ("hidden_size", "local_experts", "num_ffn_ranks", "top_k", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")

    @property
    def row_bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def header_len(self) -> int:
        return COUNTS_AT + 2 * self.local_experts

    @property
    def header_rows(self) -> int:
        return math.ceil(self.header_len * 4 / (self.hidden_size * self.row_bytes_per_element))

    def rung(self, tokens: int) -> int:
        """Tokens the messages of a ``tokens``-token dispatch are sized for: the smallest power
        of two >= tokens (1 for none), at most ``max_tokens``; both ends compute it from T."""
        return min(self.max_tokens, 1 << max(tokens - 1, 0).bit_length())

    def routed_rows_for(self, tokens: int) -> int:
        return tokens * min(self.top_k, self.local_experts)

    def extra_rows_for(self, tokens: int) -> int:
        """Extra shared rows of one work frame (contiguous partition): one FFN rank's range."""
        return -(-tokens // self.num_ffn_ranks) if self.shared == "contiguous" else 0

    def capacity_for(self, tokens: int) -> int:
        """Rows after the header that a dispatch of ``tokens`` tokens may fill."""
        return self.routed_rows_for(tokens) + self.extra_rows_for(tokens)

    def reply_capacity_for(self, tokens: int) -> int:
        """Rows of a reply to a ``tokens``-token dispatch: the routed rows, then the shared outputs."""
        shared = {"none": 0, "affinity": tokens, "contiguous": self.extra_rows_for(tokens)}[self.shared]
        return self.routed_rows_for(tokens) + shared

    def rows_message_rows(self, tokens: int) -> int:
        """Rows of the direct plane's rows message (and receive) for a ``tokens``-token dispatch."""
        return self.capacity_for(self.rung(tokens))

    def reply_message_rows(self, tokens: int) -> int:
        """Rows of the direct plane's reply (and its receive) to a ``tokens``-token dispatch."""
        return self.reply_capacity_for(self.rung(tokens))

    @property
    def capacity(self) -> int:
        """Rows of one work frame after its header (the budget's)."""
        return self.capacity_for(self.max_tokens)

    @property
    def reply_capacity(self) -> int:
        return self.reply_capacity_for(self.max_tokens)

    @property
    def work_rows(self) -> int:
        return self.header_rows + self.capacity

    def describe(self) -> str:
        """What two ranks must agree on, as one comparable string."""
        return (f"hidden {self.hidden_size}, dtype {str(self.dtype).removeprefix('torch.')}, local experts "
                f"{self.local_experts}, FFN ranks {self.num_ffn_ranks}, top-k {self.top_k}, max tokens "
                f"{self.max_tokens}, shared rows {self.shared}")

    def check_tokens(self, num_tokens: int, what: str) -> None:
        """Host-side (the token count is a shape): refuse a step the frames cannot hold."""
        if num_tokens > self.max_tokens:
            raise CapacityError(f"{what}: {num_tokens} tokens in one dispatch, but the AFD frames hold at most "
                                f"{self.max_tokens} (the engines' --max-num-batched-tokens over the Attention tensor "
                                "parallel size, the same on every rank of the world)")

    def work_frames(self, count: int, device: torch.device | str) -> torch.Tensor:
        # Zeroed once: the header rows' unused tail goes on the wire as it is.
        return torch.zeros(count, self.work_rows, self.hidden_size, dtype=self.dtype, device=device)

    def reply_frames(self, count: int, device: torch.device | str) -> torch.Tensor:
        return torch.empty(count, self.reply_capacity, self.hidden_size, dtype=self.dtype, device=device)

    def headers(self, frames: torch.Tensor) -> torch.Tensor:
        """[n, header_len] int32 view of the headers of contiguous work frames [n, rows, H]: each
        frame's first ``header_len`` int32 words (three view ops: this runs per dispatch)."""
        return frames.view(torch.int32).view(frames.shape[0], -1)[:, :self.header_len]

    def static_header(self, kind: int, layer: int, stage: int, stages: int, source: int) -> list[int]:
        return [MAGIC, kind, layer, stage, stages, source, DTYPE_CODES[self.dtype], self.hidden_size,
                self.local_experts]


def check_stage(stage: int, stages: int, *, what: str) -> None:
    """The stage rule both ends apply: 1 <= stages <= MAX_STAGES and 0 <= stage < stages."""
    if not 1 <= stages <= MAX_STAGES:
        raise PayloadError(f"{what}: field stages must be in [1, {MAX_STAGES}] (got {stages})")
    if not 0 <= stage < stages:
        raise PayloadError(f"{what}: field stage must be in [0, stages) = [0, {stages}) (got {stage})")


@dataclass(frozen=True)
class WorkHeader:
    kind: int
    layer: int
    stage: int
    stages: int
    tokens: int
    rows: int
    routed_counts: tuple[int, ...]
    shared_prefix: tuple[int, ...]
    shared_extra: int


def decode_work_header(values: list[int], layout: WireLayout, *, source: int) -> WorkHeader:
    """A received header (read on the FFN rank's host), checked against the layout."""
    what = f"work header from Attention rank {source}"
    fields = dict(zip(STATIC_FIELDS, values))
    expected = {"magic": MAGIC, "source": source, "dtype": DTYPE_CODES[layout.dtype], "hidden": layout.hidden_size,
                "local_experts": layout.local_experts}
    for name, want in expected.items():
        if fields[name] != want:
            raise PayloadError(f"{what}: field {name} must be {want} (got {fields[name]})")
    kind = fields["kind"]
    if kind not in (KIND_WORK, KIND_SHUTDOWN):
        raise PayloadError(f"{what}: field kind must be work or shutdown (got {kind})")
    experts = layout.local_experts
    routed = tuple(values[COUNTS_AT:COUNTS_AT + experts])
    prefix = tuple(values[COUNTS_AT + experts:COUNTS_AT + 2 * experts])
    tokens, rows, extra = values[TOKENS_FIELD], values[ROWS_FIELD], values[EXTRA_FIELD]
    if not 0 <= tokens <= layout.max_tokens:
        raise PayloadError(f"{what}: field tokens must be in [0, {layout.max_tokens}] (got {tokens})")
    if any(c < 0 for c in routed) or extra < 0 or any(not 0 <= p <= c for p, c in zip(prefix, routed)):
        raise PayloadError(f"{what}: row counts must satisfy 0 <= shared_prefix <= routed_counts and shared_extra >= 0 "
                           f"(got routed {list(routed)}, shared_prefix {list(prefix)}, shared_extra {extra})")
    capacity = layout.capacity_for(tokens)
    if rows != sum(routed) + extra or rows > capacity:
        raise PayloadError(f"{what}: field rows must equal the routed rows plus shared_extra and be at most the "
                           f"capacity {capacity} of {tokens} tokens (got rows {rows}, routed {sum(routed)}, "
                           f"shared_extra {extra})")
    if kind == KIND_WORK:
        check_stage(fields["stage"], fields["stages"], what=what)
    return WorkHeader(kind=kind, layer=fields["layer"], stage=fields["stage"], stages=fields["stages"], tokens=tokens,
                      rows=rows, routed_counts=routed, shared_prefix=prefix, shared_extra=extra)


def read_work_header(frame: torch.Tensor, layout: WireLayout, *, source: int) -> WorkHeader:
    """The header of a received work frame [work_rows, H], read on the host."""
    return decode_work_header(layout.headers(frame.unsqueeze(0))[0].tolist(), layout, source=source)


def frame_rows(frame: torch.Tensor, layout: WireLayout, header: WorkHeader) -> torch.Tensor:
    """The valid rows of a work frame after its header."""
    return frame[layout.header_rows:layout.header_rows + header.rows]


class StepCounter:
    """Counts the forward steps of one Attention rank from its dispatches: MoE layers run in
    increasing order, so a stage-0 dispatch of a layer not above the previous stage 0's starts
    the next step. Both ends apply it to the same sequence and get the same numbers."""

    def __init__(self):
        self.step, self._last_layer = 0, None

    def advance(self, layer: int, stage: int) -> int:
        if stage == 0:
            if self._last_layer is not None and layer <= self._last_layer:
                self.step += 1
            self._last_layer = layer
        return self.step


@dataclass(frozen=True)
class FFNPayload:
    """Rows for one FFN rank: grouped by local expert, within each group the rows whose
    shared work this rank does first (``shared_prefix``), then ``shared_extra`` rows
    sent only for shared work (contiguous partition)."""

    rows: torch.Tensor
    routed_counts: tuple[int, ...]
    shared_prefix: tuple[int, ...]
    shared_extra: int

    @property
    def routed_rows(self) -> int:
        return sum(self.routed_counts)

    @property
    def shared_rows(self) -> int:
        return sum(self.shared_prefix) + self.shared_extra


@dataclass(frozen=True)
class WorkItem:
    source: int  # Attention rank
    layer: int
    stage: int
    payload: FFNPayload
    step: int = 0  # the sender's forward counter (counted by the receiver)
    stages: int = 1  # how many stages the sender runs in this step (stage < stages)


@dataclass(frozen=True)
class DispatchTicket:
    layer: int
    seq: int  # the dispatching rank's own counter (pairs its replies; never sent)
    stage: int
    step: int = 0
