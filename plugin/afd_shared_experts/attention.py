"""Attention side of the MoE layer: local gate, remote routed experts, exact combine.

A vLLM model wrapper calls ``RemoteMoE.forward(hidden_states, topk_ids, topk_weights)``
(or ``dispatch`` + ``combine`` to overlap other work) in place of its FusedMoE call.
Dispatch packs each FFN rank's rows and combine map into its frame (``wire.py``) on the input's
device; each FFN rank answers with one weighted sum per token it serves, and combine adds a
token's (at most one per FFN rank) in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from .compute import combine_scales, route, shared_expert_output
from .contract import AFDConnector
from .wire import KIND_WORK, DispatchTicket, combine_maps
from .metrics import RuntimeMetrics
from .model import GateWeights, SharedExpertWeights
from .moe_spec import MoESpec
from .partition import affinity_slot, contiguous_assignment
from .trace import clocks, stage_trace, trace_enabled


@dataclass
class PendingCombine:
    """What the combine of one dispatch needs, all on the input's device: for each token its
    rows of the flattened reply frames [F * reply_capacity, H], one per FFN rank serving it (a
    column per slot, and one for the contiguous partition's range rank; masked where none)."""

    ticket: DispatchTicket
    gather_index: torch.Tensor  # [T * columns]
    gather_mask: torch.Tensor  # [T, columns] bool
    num_tokens: int
    total_rows: int
    local_shared: torch.Tensor | None  # placement 'attention': S(x), added with shared_scale
    shared_scale: float


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
        self._earlier_cache: dict[torch.device, torch.Tensor] = {}

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                num_tokens: int | None = None, stage: int = 0, stages: int = 1) -> torch.Tensor:
        return self.combine(self.dispatch(hidden_states, topk_ids, topk_weights, num_tokens=num_tokens, stage=stage,
                                          stages=stages))

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
        """[F] each FFN rank's first row after its header in the flattened work frames (its map,
        then its rows) and in the flattened reply frames, made on the device once."""
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
        rung = layout.rung(real)
        routed_scale, shared_scale = combine_scales(self.spec.has_shared_experts, self.spec.routed_scaling_factor,
                                                    self.dtype)

        # Wire order: by expert (so by FFN rank), within an expert the rows carrying their
        # token's shared work first, then by token (rows are token-major and the sort stable).
        flat_ids = ids.reshape(-1)
        affinity = self.placement == "ffn" and self.partition == "affinity"
        shared_slot = affinity_slot(ids, local, ffn) if affinity else None
        designated = (torch.arange(top_k, device=device) == shared_slot[:, None]).reshape(-1) if affinity else \
            torch.zeros(rows, dtype=torch.bool, device=device)
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
        row_starts = work_starts + layout.map_rows_for(rung)  # the rows follow the header and the map
        wire_row = torch.arange(rows, device=device)

        # Each (token, slot)'s FFN rank and its place among the token's slots on that rank.
        slot_rank = ids // local
        place = ((slot_rank[:, :, None] == slot_rank[:, None, :]) & self._earlier_slots(top_k, device)).sum(2)
        token_ids = torch.arange(real, device=device)
        row_token = (slot_rank * real + token_ids[:, None]).reshape(-1)  # (FFN rank, token) of each row
        # The tokens each FFN rank serves (a routed row there, or its shared work), in token order.
        served = torch.zeros(ffn * real, dtype=torch.int64, device=device).index_fill_(0, row_token, 1)
        token_rank = None
        if self.placement == "ffn" and self.partition == "contiguous":
            token_rank, index_in_range, extra = contiguous_assignment(real, ffn, device)
            served.index_fill_(0, token_rank * real + token_ids, 1)
        else:
            extra = torch.zeros(ffn, dtype=torch.int64, device=device)
        served_pos = served.view(ffn, real).cumsum(1).view(-1) - 1
        served_count = served.view(ffn, real).sum(1)

        frames = self.connector.acquire()
        try:
            flat_work = frames.work.view(-1, hidden)
            flat_work.index_copy_(0, wire_row + (row_starts - rank_start).index_select(0, wire_rank),
                                  x.index_select(0, wire_tokens))
            # The combine map: each row's expert output (its place in its rank's wire order) under
            # its token's served row and its place, weighted; then each token's shared output.
            map_rows, map_weights = combine_maps(frames.work, layout, real)
            map_rows.fill_(-1)
            output_of_row = torch.empty_like(order).index_copy_(0, order, wire_row) - \
                rank_start.index_select(0, slot_rank.reshape(-1))
            at = (slot_rank.reshape(-1), served_pos.index_select(0, row_token), place.reshape(-1))
            map_rows.index_put_(at, output_of_row.to(torch.int32))
            map_weights.index_put_(at, topk_weights[:real].float().reshape(-1) * routed_scale)
            if token_rank is not None:
                # Each token once more, after its range's rank's routed rows.
                slot = per_rank.index_select(0, token_rank) + index_in_range
                flat_work.index_copy_(0, row_starts.index_select(0, token_rank) + slot, x)
                shared_rank, shared_output = token_rank, slot
            elif affinity:
                # Each token's one designated row; its shared output follows the rank's routed
                # outputs, in the wire order of the rank's designated rows.
                wire_designated = designated.index_select(0, order)
                designated_per_rank = designated_counts.sum(1)
                first_shared = per_rank - (designated_per_rank.cumsum(0) - designated_per_rank) - 1
                source = wire_designated.cumsum(0) + first_shared.index_select(0, wire_rank)
                target = torch.where(wire_designated, wire_tokens, real)  # non-designated rows land in slot `real`
                shared_output = torch.zeros(real + 1, dtype=torch.int64, device=device).scatter_(0, target,
                                                                                                source)[:real]
                shared_rank = slot_rank.gather(1, shared_slot[:, None]).squeeze(1)
            if token_rank is not None or affinity:
                at = (shared_rank, served_pos.index_select(0, shared_rank * real + token_ids),
                      torch.full_like(token_ids, layout.routed_slots))
                map_rows.index_put_(at, shared_output.to(torch.int32))
                map_weights.index_put_(at, torch.full((real,), shared_scale, device=device))

            tokens = torch.full((ffn, 1), real, dtype=torch.int64, device=device)  # a fill: no host sync
            layout.headers(frames.work).copy_(torch.cat([self._static_header(stage, stages, device).expand(ffn, -1),
                                                         tokens, served_count[:, None],
                                                         torch.stack([per_rank + extra, extra], 1),
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
        # The combine takes each token's reply row from each FFN rank serving it once: at the
        # first of its slots on that rank, and from its range's rank under the contiguous partition.
        reply_index = reply_starts.index_select(0, slot_rank.reshape(-1)) + served_pos.index_select(0, row_token)
        gather_mask = (place == 0).reshape(real, top_k)
        gather_index = torch.where(gather_mask.reshape(-1), reply_index, 0).view(real, top_k)
        if token_rank is not None:
            elsewhere = ~(slot_rank == token_rank[:, None]).any(1, keepdim=True)
            range_index = reply_starts.index_select(0, token_rank) + \
                served_pos.index_select(0, token_rank * real + token_ids)
            gather_index = torch.cat([gather_index, torch.where(elsewhere[:, 0], range_index, 0)[:, None]], 1)
            gather_mask = torch.cat([gather_mask, elsewhere], 1)
        # Under placement 'attention' the shared expert runs here while FFN ranks work.
        local_shared = shared_expert_output(x, self.shared) if self.placement == "attention" else None
        return PendingCombine(ticket=ticket, gather_index=gather_index.reshape(-1), gather_mask=gather_mask,
                              num_tokens=real, total_rows=total_rows, local_shared=local_shared,
                              shared_scale=shared_scale)

    def _earlier_slots(self, top_k: int, device: torch.device) -> torch.Tensor:
        """[k, k] bool: slot j' precedes slot j (made on the device once)."""
        earlier = self._earlier_cache.get(device)
        if earlier is None:
            earlier = self._earlier_cache[device] = torch.ones(top_k, top_k, dtype=torch.bool).tril(-1).to(
                device, non_blocking=True)
        return earlier

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
            real, columns = pending.gather_mask.shape
            hidden = frames.reply.shape[-1]
            # Each token's partial sums, one per FFN rank serving it, added in slot order: no
            # atomics, the same float32 sum whatever the arrival order.
            partials = frames.reply.view(-1, hidden).index_select(0, pending.gather_index).view(real, columns, hidden)
            total = torch.where(pending.gather_mask[:, :, None], partials.float(), 0.0).sum(dim=1)
            if pending.local_shared is not None:
                total = total + pending.local_shared.float() * pending.shared_scale
            out = total.to(self.dtype)
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
