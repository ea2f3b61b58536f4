"""Attention side of the MoE layer: local gate, remote routed experts, exact combine.

A vLLM model wrapper calls ``RemoteMoE.forward(hidden_states, topk_ids, topk_weights)``
(or ``dispatch`` + ``combine`` to overlap other work) in place of its FusedMoE call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .compute import combine, route, shared_expert_output
from .connector import AFDConnector
from .wire import DispatchTicket, FFNPayload
from .metrics import RuntimeMetrics
from .model import GateWeights, MoESpec, SharedExpertWeights
from .partition import affinity_assignment, contiguous_ranges
from .trace import clocks, stage_trace, trace_enabled


def host_row_counts(counts: torch.Tensor) -> list[list[list[int]]]:
    """The Attention side's only host sync per MoE layer and step.

    ``counts`` [2, F, E_local]: rows per (FFN rank, local expert), then how many of them
    lead their group as shared-expert rows. The host needs them to size every send and
    write the headers; nothing else in dispatch or combine reads device data on the host.
    """
    return counts.tolist()


@dataclass
class _RankPlan:
    tokens: torch.Tensor  # token index of each routed row, in wire order
    weights: torch.Tensor  # top-k weight of each routed row (float32)
    shared_tokens: torch.Tensor  # token index of each shared row, in reply order


@dataclass
class PendingCombine:
    ticket: DispatchTicket
    plans: list[_RankPlan]
    num_tokens: int
    total_rows: int
    local_shared: torch.Tensor | None
    hidden_size: int
    device: torch.device


class RemoteMoE:
    """One MoE layer's routed (and, under placement 'ffn', shared) experts on FFN ranks.

    Every tensor of dispatch and combine lives on the input's device; the row counts are
    read on the host once per call, in ``host_row_counts``.
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
        read_row_counts: Callable[[torch.Tensor], list[list[list[int]]]] | None = None,
    ):
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
        # Wraps host_row_counts (the selfcheck counts it and allows its sync under sync-debug mode).
        self.read_row_counts = read_row_counts

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                num_tokens: int | None = None, stage: int = 0, step: int | None = None,
                stages: int = 1) -> torch.Tensor:
        return self.combine(self.dispatch(hidden_states, topk_ids, topk_weights, num_tokens=num_tokens, stage=stage,
                                          step=step, stages=stages))

    def _designated_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T * k] bool: the row that carries its token's shared work to the FFN side."""
        real, top_k = ids.shape
        if not (self.placement == "ffn" and self.partition == "affinity"):
            return torch.zeros(real * top_k, dtype=torch.bool, device=ids.device)
        assigned = affinity_assignment(ids, self.local_experts, self.num_ffn_ranks)
        # The token's lowest-numbered expert on its assigned rank carries its shared work.
        candidates = torch.where(ids // self.local_experts == assigned[:, None], ids, self.spec.num_routed_experts)
        slot = torch.arange(top_k, device=ids.device)
        return (slot == candidates.argmin(dim=1, keepdim=True)).reshape(-1)

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 num_tokens: int | None = None, stage: int = 0, step: int | None = None,
                 stages: int = 1) -> PendingCombine:
        """Send this step's rows. Rows at index >= num_tokens are padding: never sent, zero output.
        ``step``/``stages``: this rank's forward counter (None: the connector counts) and its
        stage count in it (the FFN gathers one (step, layer, stage) from every Attention rank
        into one expert pass)."""
        started = clocks() if self.trace is not None else None
        total_rows, hidden = hidden_states.shape
        real = total_rows if num_tokens is None else num_tokens
        if not 0 <= real <= total_rows:
            raise ValueError(f"num_tokens must be in [0, {total_rows}] (got {real})")
        device = hidden_states.device
        x = hidden_states[:real].to(self.dtype)
        ids = topk_ids[:real].to(torch.int64)
        if ids.dim() != 2:
            ids = ids.reshape(real, self.spec.top_k)
        top_k = ids.shape[1]
        ffn, num_experts = self.num_ffn_ranks, self.spec.num_routed_experts

        token_of_row = torch.arange(real * top_k, device=device) // top_k
        flat_ids = ids.reshape(-1)
        designated = self._designated_rows(ids)
        # Wire order: by FFN rank, then local expert, designated rows first, then token.
        key = (flat_ids * 2 + (~designated).long()) * (real + 1) + token_of_row
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(2, num_experts, dtype=torch.int64, device=device)
        counts[0].index_add_(0, flat_ids, torch.ones_like(flat_ids))
        counts[1].index_add_(0, flat_ids, designated.long())
        read = self.read_row_counts or host_row_counts
        routed_counts, shared_prefix = read(counts.view(2, ffn, self.local_experts))
        rows_per_rank = [sum(c) for c in routed_counts]
        shared_per_rank = [sum(p) for p in shared_prefix]

        wire_tokens = token_of_row.index_select(0, order)
        wire_weights = topk_weights[:real].float().reshape(-1).index_select(0, order)
        wire_rows = x.index_select(0, wire_tokens)
        # Shared rows come back in wire order of the designated rows, rank by rank.
        designated_first = torch.argsort((~designated.index_select(0, order)).int(), stable=True)
        shared_wire = designated_first[:sum(shared_per_rank)]
        shared_tokens = wire_tokens.index_select(0, shared_wire).split(shared_per_rank)
        ranges = contiguous_ranges(real, ffn) if self.placement == "ffn" and self.partition == "contiguous" else None

        payloads, plans = [], []
        for f, (tokens, rank_weights, rows) in enumerate(zip(wire_tokens.split(rows_per_rank),
                                                             wire_weights.split(rows_per_rank),
                                                             wire_rows.split(rows_per_rank))):
            rank_shared, extra = shared_tokens[f], 0
            if ranges is not None:
                lo, hi = ranges[f]
                extra = hi - lo
                rows = torch.cat([rows, x[lo:hi]])
                rank_shared = torch.arange(lo, hi, device=device)
            payloads.append(FFNPayload(rows=rows, routed_counts=tuple(routed_counts[f]),
                                       shared_prefix=tuple(shared_prefix[f]), shared_extra=extra))
            plans.append(_RankPlan(tokens=tokens, weights=rank_weights, shared_tokens=rank_shared))
        ticket = self.connector.dispatch(self.layer, stage, payloads, step=step, stages=stages)
        if started is not None:
            self.trace.record("dispatch", started[0], wall_ns=started[1], step=ticket.step, layer=self.layer, stage=stage,
                              rows=sum(p.rows.shape[0] for p in payloads))
        if self.metrics is not None:
            self.metrics.tokens_dispatched.labels(kind="routed", layer=str(self.layer)).inc(sum(p.routed_rows for p in payloads))
            self.metrics.tokens_dispatched.labels(kind="shared", layer=str(self.layer)).inc(sum(p.shared_rows for p in payloads))
        # Under placement 'attention' the shared expert runs here while FFN ranks work.
        local_shared = shared_expert_output(x, self.shared) if self.placement == "attention" else None
        return PendingCombine(ticket=ticket, plans=plans, num_tokens=real, total_rows=total_rows,
                              local_shared=local_shared, hidden_size=hidden, device=device)

    def combine(self, pending: PendingCombine) -> torch.Tensor:
        started = clocks() if self.trace is not None else None
        ticket, replies = self.connector.receive_replies(pending.ticket.stage)
        if started is not None:
            where = dict(step=ticket.step, layer=self.layer, stage=ticket.stage)
            self.trace.record("combine_wait", started[0], wall_ns=started[1], rows=0, **where)
            started = clocks()
        if ticket != pending.ticket:
            raise RuntimeError(f"combine out of order: expected {pending.ticket}, the connector answered {ticket}")
        real, hidden, device = pending.num_tokens, pending.hidden_size, pending.device
        routed_sum = torch.zeros(real, hidden, dtype=torch.float32, device=device)
        shared = pending.local_shared
        if shared is None:
            shared = torch.zeros(real, hidden, dtype=self.dtype, device=device)
        for plan, reply in zip(pending.plans, replies):
            routed_count = plan.tokens.shape[0]
            if routed_count:
                routed_sum.index_add_(0, plan.tokens, reply[:routed_count].float() * plan.weights[:, None])
            if plan.shared_tokens.shape[0]:
                shared.index_copy_(0, plan.shared_tokens, reply[routed_count:].to(shared.dtype))
        out = combine(routed_sum, shared, self.spec.routed_scaling_factor, self.dtype)
        if started is not None:
            self.trace.record("combine", started[0], wall_ns=started[1], rows=real, **where)
        if pending.total_rows == real:
            return out
        padded = torch.zeros(pending.total_rows, hidden, dtype=self.dtype, device=device)
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
