"""Attention side of the MoE layer: local gate, remote routed experts, exact combine.

A vLLM model wrapper calls ``RemoteMoE.forward(hidden_states, topk_ids, topk_weights)``
(or ``dispatch`` + ``combine`` to overlap other work) in place of its FusedMoE call.
Dispatch packs each FFN rank's rows into its frame (``wire.py``) on the input's device;
combine gathers the replies back and sums each token's top-k in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from .compute import combine, route, shared_expert_output
from .contract import AFDConnector
from .wire import KIND_WORK, DispatchTicket
from .metrics import RuntimeMetrics
from .model import GateWeights, SharedExpertWeights
from .moe_spec import MoESpec
from .partition import affinity_slot, contiguous_assignment
from .trace import clocks, stage_trace, trace_enabled


@dataclass
class PendingCombine:
    """What the combine of one dispatch needs, all on the input's device: for each (token, slot)
    row the row of the flattened reply frames [F * reply_capacity, H] holding its expert output,
    and for each token where its shared output lands (placement 'ffn')."""

    ticket: DispatchTicket
    gather_index: torch.Tensor  # [T * k]
    shared_index: torch.Tensor | None  # [T]
    weights: torch.Tensor  # [T, k] float32
    num_tokens: int
    total_rows: int
    local_shared: torch.Tensor | None


class RemoteMoE:
    """One MoE layer's routed (and, under placement 'ffn', shared) experts on FFN ranks. A model
    without a shared expert runs under placement 'none': routed rows only, whatever was asked.

    Dispatch and combine are tensor operations on the input's device with shapes that depend
    only on the token count: no host sync and no data-dependent shape (the row counts reach the
    FFN side inside the frames' headers, written on the device). torch.compile traces them
    whole (tested on the CPU); a captured CUDA/ACL graph would replay their kernels without
    their host-side work (the frame pool, the posts), so no graph capture of them is claimed or
    run: AFD engines run eager off the CPU (docs/compat.md, "Graph modes").
    """

    def __init__(
        self,
        *,
        spec: MoESpec,
        layer: int,
        connector: AFDConnector,
        num_ffn_ranks: int,
        placement: str,
        partition: str,
        dtype: torch.dtype,
        shared: SharedExpertWeights | None = None,
        metrics: RuntimeMetrics | None = None,
    ):
        placement = spec.placement(placement)
        if placement == "attention" and shared is None:
            raise ValueError("placement 'attention' needs the shared-expert weights on the Attention rank")
        if placement == "ffn" and shared is not None:
            raise ValueError("placement 'ffn': the Attention rank must not hold shared-expert weights")
        if partition not in ("affinity", "contiguous"):
            raise ValueError(f"partition must be affinity or contiguous (got {partition!r})")
        self.spec, self.layer, self.connector = spec, layer, connector
        self.num_ffn_ranks = num_ffn_ranks
        self.local_experts = spec.local_experts(num_ffn_ranks)
        self.placement, self.partition, self.dtype = placement, partition, dtype
        self.shared, self.metrics = shared, metrics
        self.trace = stage_trace("attention", connector.rank) if trace_enabled() else None
        self._static_headers: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._frame_start_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                num_tokens: int | None = None, stage: int = 0, stages: int = 1) -> torch.Tensor:
        return self.combine(self.dispatch(hidden_states, topk_ids, topk_weights, num_tokens=num_tokens, stage=stage,
                                          stages=stages))

    def _designated_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T * k] bool: the row that carries its token's shared work to the FFN side."""
        real, top_k = ids.shape
        if not (self.placement == "ffn" and self.partition == "affinity"):
            return torch.zeros(real * top_k, dtype=torch.bool, device=ids.device)
        slot = affinity_slot(ids, self.local_experts, self.num_ffn_ranks)
        return (torch.arange(top_k, device=ids.device) == slot[:, None]).reshape(-1)

    def _static_header(self, stage: int, stages: int, device: torch.device) -> torch.Tensor:
        """The header fields fixed per (layer, stage, stages), made on the device once."""
        key = (stage, stages, device)
        header = self._static_headers.get(key)
        if header is None:
            values = self.connector.layout.static_header(KIND_WORK, self.layer, stage, stages, self.connector.rank)
            # A copy up that never waits on the stream (first use of a key only).
            header = self._static_headers[key] = torch.tensor([values], dtype=torch.int64).to(device, non_blocking=True)
        return header

    def _frame_starts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[F] each FFN rank's first row in the flattened work frames (after its header) and in
        the flattened reply frames, made on the device once."""
        starts = self._frame_start_cache.get(device)
        if starts is None:
            layout = self.connector.layout
            ranks = torch.arange(self.num_ffn_ranks, dtype=torch.int64)
            starts = self._frame_start_cache[device] = (
                (ranks * layout.work_rows + layout.header_rows).to(device, non_blocking=True),
                (ranks * layout.reply_capacity).to(device, non_blocking=True))
        return starts

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 num_tokens: int | None = None, stage: int = 0, stages: int = 1) -> PendingCombine:
        """Send this step's rows. Rows at index >= num_tokens are padding: never sent, zero output.
        ``stages``: how many stages this rank runs in this step (the FFN gathers one (step, layer,
        stage) from every Attention rank into one expert pass)."""
        started = clocks() if self.trace is not None else None
        total_rows, hidden = hidden_states.shape
        real = total_rows if num_tokens is None else num_tokens
        if not 0 <= real <= total_rows:
            raise ValueError(f"num_tokens must be in [0, {total_rows}] (got {real})")
        layout = self.connector.layout
        layout.check_tokens(real, f"layer {self.layer}")
        device = hidden_states.device
        x = hidden_states[:real].to(self.dtype)
        ids = topk_ids[:real].to(torch.int64).reshape(real, self.spec.top_k)
        top_k, ffn, local = ids.shape[1], self.num_ffn_ranks, self.local_experts
        rows = real * top_k

        # Wire order: by expert (so by FFN rank), within an expert the rows carrying their
        # token's shared work first, then by token (rows are token-major and the sort stable).
        flat_ids = ids.reshape(-1)
        designated = self._designated_rows(ids)
        group = flat_ids * 2 + ~designated
        order = torch.argsort(group, stable=True)
        # Rows per (expert, designated first); index_add_ rather than bincount, whose CUDA
        # kernel reads the largest value on the host.
        counts = torch.zeros(2 * self.spec.num_routed_experts, dtype=torch.int64, device=device)
        counts = counts.index_add_(0, group, torch.ones_like(group)).view(ffn, local, 2)
        routed_counts, designated_counts = counts.sum(2), counts[:, :, 0]
        per_rank = routed_counts.sum(1)
        rank_start = per_rank.cumsum(0) - per_rank
        wire_rank = flat_ids.index_select(0, order) // local
        wire_tokens = order // top_k
        work_starts, reply_starts = self._frame_starts(device)
        wire_row = torch.arange(rows, device=device)

        frames = self.connector.acquire()
        try:
            flat_work = frames.work.view(-1, hidden)
            flat_work.index_copy_(0, wire_row + (work_starts - rank_start).index_select(0, wire_rank),
                                  x.index_select(0, wire_tokens))
            reply_row = wire_row + (reply_starts - rank_start).index_select(0, wire_rank)
            # The combine reads each (token, slot) row's output straight from the replies.
            gather_index = torch.empty_like(reply_row).index_copy_(0, order, reply_row)
            extra = torch.zeros(ffn, dtype=torch.int64, device=device)
            shared_index = None
            if self.placement == "ffn" and self.partition == "contiguous":
                # Each token once more, after its range's rank's routed rows.
                token_rank, index_in_range, extra = contiguous_assignment(real, ffn, device)
                slot = per_rank.index_select(0, token_rank) + index_in_range
                flat_work.index_copy_(0, work_starts.index_select(0, token_rank) + slot, x)
                shared_index = reply_starts.index_select(0, token_rank) + slot
            elif self.placement == "ffn":
                # Each token's one designated row; its shared output follows the rank's routed rows,
                # in the wire order of the rank's designated rows.
                wire_designated = designated.index_select(0, order)
                designated_per_rank = designated_counts.sum(1)
                designated_start = designated_per_rank.cumsum(0) - designated_per_rank
                first_shared = reply_starts + per_rank - designated_start - 1
                source = wire_designated.cumsum(0) + first_shared.index_select(0, wire_rank)
                target = torch.where(wire_designated, wire_tokens, real)  # non-designated rows land in slot `real`
                shared_index = torch.zeros(real + 1, dtype=torch.int64, device=device).scatter_(0, target,
                                                                                               source)[:real]

            tokens = torch.full((ffn, 1), real, dtype=torch.int64, device=device)  # a fill: no host sync
            layout.headers(frames.work).copy_(torch.cat([self._static_header(stage, stages, device).expand(ffn, -1),
                                                         tokens, torch.stack([per_rank + extra, extra], 1),
                                                         routed_counts, designated_counts], 1))
            ticket = self.connector.dispatch(self.layer, stage, frames, tokens=real, stages=stages)
        except BaseException:
            self.connector.release(frames)  # not dispatched: back to the pool
            raise
        if started is not None:
            self.trace.record("dispatch", started[0], wall_ns=started[1], step=ticket.step, layer=self.layer,
                              stage=stage, rows=rows)
        if self.metrics is not None:  # host-known: every row goes to one FFN rank, each token's shared work once
            self.metrics.tokens_dispatched.labels(kind="routed", layer=str(self.layer)).inc(rows)
            self.metrics.tokens_dispatched.labels(kind="shared", layer=str(self.layer)).inc(
                real if self.placement == "ffn" else 0)
        # Under placement 'attention' the shared expert runs here while FFN ranks work.
        local_shared = shared_expert_output(x, self.shared) if self.placement == "attention" else None
        return PendingCombine(ticket=ticket, gather_index=gather_index, shared_index=shared_index,
                              weights=topk_weights[:real].float().reshape(real, top_k), num_tokens=real,
                              total_rows=total_rows, local_shared=local_shared)

    def combine(self, pending: PendingCombine) -> torch.Tensor:
        started = clocks() if self.trace is not None else None
        ticket, frames = self.connector.receive_replies(pending.ticket.stage)
        if started is not None:
            where = dict(step=ticket.step, layer=self.layer, stage=ticket.stage)
            self.trace.record("combine_wait", started[0], wall_ns=started[1], rows=0, **where)
            started = clocks()
        try:
            if ticket != pending.ticket:
                raise RuntimeError(f"combine out of order: expected {pending.ticket}, the connector answered {ticket}")
            real, top_k = pending.weights.shape
            hidden = frames.reply.shape[-1]
            replies = frames.reply.view(-1, hidden)
            # Each token's expert outputs in slot order, then its weighted sum over its top-k in slot
            # order: no atomics, the same float32 sum whatever the wire order.
            by_slot = replies.index_select(0, pending.gather_index).view(real, top_k, hidden)
            routed_sum = (by_slot.float() * pending.weights[:, :, None]).sum(dim=1)
            if pending.local_shared is not None:
                shared = pending.local_shared
            elif pending.shared_index is not None:
                shared = replies.index_select(0, pending.shared_index)
            else:
                shared = None
            out = combine(routed_sum, shared, self.spec.routed_scaling_factor, self.dtype)
        finally:
            self.connector.release(frames)  # every read of the replies is queued before this, or failed
        if started is not None:
            self.trace.record("combine", started[0], wall_ns=started[1], rows=real, **where)
        if pending.total_rows == real:
            return out
        padded = torch.zeros(pending.total_rows, hidden, dtype=self.dtype, device=out.device)
        padded[:real] = out
        return padded


class AttentionMoELayer:
    """Gate on the Attention rank + RemoteMoE: the whole MoE layer as the model sees it."""

    def __init__(self, gate: GateWeights, remote: RemoteMoE):
        self.gate, self.remote = gate, remote

    def forward(self, hidden_states: torch.Tensor, *, num_tokens: int | None = None, stage: int = 0) -> torch.Tensor:
        x = hidden_states.to(self.remote.dtype)
        real = x.shape[0] if num_tokens is None else num_tokens
        ids, weights = route(self.remote.spec, self.gate, x[:real])
        return self.remote.forward(x, ids, weights, num_tokens=real, stage=stage)
