"""The AFD wire format: what one Attention rank and one FFN rank say to each other.

Per Attention rank a -> FFN rank f (one AFD world: Attention ranks 0..A-1, FFN ranks A..A+F-1):
- work: an int64 header (``encode_work_header``: layer, sequence number, stage, the sender's
  step and its number of stages in that step, row counts), then, when it announces rows, one
  payload [routed + extra shared rows, H] in the model dtype;
- reply (f -> a): an int64 header (``REPLY_HEADER_LEN`` values), then, when rows > 0, one
  payload [routed rows + shared rows, H].
Every dispatch reaches every FFN rank (a header-only one when it has no rows) and every FFN
rank answers every dispatch, so no side waits for a message that never comes. The step and
stage count let an FFN rank gather one (step, layer, stage) from every Attention rank into
one expert pass (``ffn_batching.py``). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MAX_STAGES
from .errors import PayloadError

MAGIC = 0xAFD5
KIND_WORK, KIND_SHUTDOWN, KIND_REPLY = 1, 2, 3
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Only gloo reads tags; pairing never depends on them (HCCL/NCCL ignore them).
TAG_HEADER, TAG_PAYLOAD = 1, 2
BYTE_KINDS = ("routed_rows", "shared_rows", "headers", "replies")
REPLY_HEADER_LEN = 8


@dataclass(frozen=True)
class FFNPayload:
    """Rows for one FFN rank: grouped by local expert, within each group the rows whose
    shared work this rank does come first (``shared_prefix``), then ``shared_extra`` rows
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
    seq: int
    stage: int
    payload: FFNPayload
    step: int = 0  # the sender's forward counter
    stages: int = 1  # how many stages the sender runs in this step (stage < stages)


@dataclass(frozen=True)
class DispatchTicket:
    layer: int
    seq: int
    stage: int
    step: int = 0


def encode_work_header(kind: int, layer: int, seq: int, stage: int, source: int, dtype: torch.dtype,
                       hidden: int, payload: FFNPayload | None, local_experts: int, *, step: int = 0,
                       stages: int = 1) -> torch.Tensor:
    """[MAGIC, kind, layer, seq, stage, source, dtype, hidden, local_experts, shared_extra, step,
    stages, routed_counts[E], shared_prefix[E]]."""
    routed = payload.routed_counts if payload else (0,) * local_experts
    prefix = payload.shared_prefix if payload else (0,) * local_experts
    extra = payload.shared_extra if payload else 0
    return torch.tensor([MAGIC, kind, layer, seq, stage, source, DTYPE_CODES[dtype], hidden, local_experts, extra,
                         step, stages, *routed, *prefix], dtype=torch.int64)


def work_header_len(local_experts: int) -> int:
    return 12 + 2 * local_experts


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
    seq: int
    stage: int
    step: int
    stages: int
    routed_counts: tuple[int, ...]
    shared_prefix: tuple[int, ...]
    shared_extra: int


def decode_work_header(header: torch.Tensor, *, source: int, dtype: torch.dtype, hidden: int,
                       local_experts: int) -> WorkHeader:
    values = header.tolist()
    expected = {"magic": MAGIC, "source": source, "dtype": DTYPE_CODES[dtype], "hidden": hidden,
                "local_experts": local_experts}
    got = {"magic": values[0], "source": values[5], "dtype": values[6], "hidden": values[7],
           "local_experts": values[8]}
    for name, want in expected.items():
        if got[name] != want:
            raise PayloadError(f"work header from Attention rank {source}: field {name} must be {want} (got {got[name]})")
    kind = values[1]
    if kind not in (KIND_WORK, KIND_SHUTDOWN):
        raise PayloadError(f"work header from Attention rank {source}: field kind must be work or shutdown (got {kind})")
    routed = tuple(values[12:12 + local_experts])
    prefix = tuple(values[12 + local_experts:])
    extra, step, stages = values[9], values[10], values[11]
    if any(c < 0 for c in routed) or extra < 0 or any(not 0 <= p <= c for p, c in zip(prefix, routed)):
        raise PayloadError(f"work header from Attention rank {source}: row counts must satisfy "
                           f"0 <= shared_prefix <= routed_counts and shared_extra >= 0 (got {values[12:]}, "
                           f"shared_extra {extra})")
    if kind == KIND_WORK:
        if step < 0:
            raise PayloadError(f"work header from Attention rank {source}: field step must be >= 0 (got {step})")
        check_stage(values[4], stages, what=f"work header from Attention rank {source}")
    return WorkHeader(kind=kind, layer=values[2], seq=values[3], stage=values[4], step=step, stages=stages,
                      routed_counts=routed, shared_prefix=prefix, shared_extra=extra)
