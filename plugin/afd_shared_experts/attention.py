"""Attention side of the MoE layer: local gate, remote routed experts, exact combine.

A vLLM model wrapper calls ``RemoteMoE.forward(hidden_states, topk_ids, topk_weights)``
(or ``dispatch`` + ``combine`` to overlap other work) in place of its FusedMoE call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compute import combine, route, shared_expert_output
from .connector import AFDConnector, DispatchTicket, FFNPayload
from .metrics import RuntimeMetrics
from .model import GateWeights, MoESpec, SharedExpertWeights
from .partition import affinity_assignment, contiguous_ranges


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


class RemoteMoE:
    """One MoE layer's routed (and, under placement 'ffn', shared) experts on FFN ranks."""

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

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                num_tokens: int | None = None, stage: int = 0) -> torch.Tensor:
        return self.combine(self.dispatch(hidden_states, topk_ids, topk_weights, num_tokens=num_tokens, stage=stage))

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 num_tokens: int | None = None, stage: int = 0) -> PendingCombine:
        """Send this step's rows. Rows at index >= num_tokens are padding: never sent, zero output."""
        total_rows, hidden = hidden_states.shape
        real = total_rows if num_tokens is None else num_tokens
        if not 0 <= real <= total_rows:
            raise ValueError(f"num_tokens must be in [0, {total_rows}] (got {real})")
        x = hidden_states[:real].to(self.dtype)
        ids = topk_ids[:real].to(torch.int64)
        weights = topk_weights[:real].float()
        top_k = ids.shape[1] if ids.dim() == 2 else self.spec.top_k
        e_local, ffn = self.local_experts, self.num_ffn_ranks

        token_of_row = torch.arange(real).repeat_interleave(top_k)
        flat_ids = ids.reshape(-1)
        designated = torch.zeros(flat_ids.shape[0], dtype=torch.bool)
        if self.placement == "ffn" and self.partition == "affinity" and real:
            assigned = affinity_assignment(ids, e_local, ffn)
            # The token's lowest-numbered expert on its assigned rank carries its shared work.
            candidates = torch.where(ids // e_local == assigned[:, None], ids, self.spec.num_routed_experts)
            designated[torch.arange(real) * top_k + candidates.argmin(dim=1)] = True

        # Wire order: by FFN rank, then local expert, designated rows first, then token.
        span = real + 1
        key = (flat_ids * 2 + (~designated).long()) * span + token_of_row
        order = torch.argsort(key, stable=True)
        per_expert = torch.bincount(flat_ids, minlength=self.spec.num_routed_experts).view(ffn, e_local)
        prefix = torch.bincount(flat_ids[designated], minlength=self.spec.num_routed_experts).view(ffn, e_local)
        rows_per_rank = per_expert.sum(dim=1).tolist()
        ranges = contiguous_ranges(real, ffn) if self.placement == "ffn" and self.partition == "contiguous" else None

        payloads, plans, start = [], [], 0
        for f in range(ffn):
            rank_order = order[start:start + rows_per_rank[f]]
            start += rows_per_rank[f]
            tokens = token_of_row[rank_order]
            routed_rows = x[tokens]
            is_designated = designated[rank_order]
            shared_tokens = tokens[is_designated]
            extra = 0
            if ranges is not None:
                lo, hi = ranges[f]
                extra = hi - lo
                routed_rows = torch.cat([routed_rows, x[lo:hi]])
                shared_tokens = torch.arange(lo, hi)
            payloads.append(FFNPayload(rows=routed_rows, routed_counts=tuple(per_expert[f].tolist()),
                                       shared_prefix=tuple(prefix[f].tolist()), shared_extra=extra))
            plans.append(_RankPlan(tokens=tokens, weights=weights.reshape(-1)[rank_order], shared_tokens=shared_tokens))
        ticket = self.connector.dispatch(self.layer, stage, payloads)
        if self.metrics is not None:
            self.metrics.tokens_dispatched.labels(kind="routed", layer=str(self.layer)).inc(sum(p.routed_rows for p in payloads))
            self.metrics.tokens_dispatched.labels(kind="shared", layer=str(self.layer)).inc(sum(p.shared_rows for p in payloads))
        # Under placement 'attention' the shared expert runs here while FFN ranks work.
        local_shared = shared_expert_output(x, self.shared) if self.placement == "attention" else None
        return PendingCombine(ticket=ticket, plans=plans, num_tokens=real, total_rows=total_rows,
                              local_shared=local_shared, hidden_size=hidden)

    def combine(self, pending: PendingCombine) -> torch.Tensor:
        ticket, replies = self.connector.receive_replies(pending.ticket.stage)
        if ticket != pending.ticket:
            raise RuntimeError(f"combine out of order: expected {pending.ticket}, the connector answered {ticket}")
        real, hidden = pending.num_tokens, pending.hidden_size
        routed_sum = torch.zeros(real, hidden, dtype=torch.float32)
        shared = pending.local_shared
        if shared is None:
            shared = torch.zeros(real, hidden, dtype=self.dtype)
        for plan, reply in zip(pending.plans, replies):
            routed_count = plan.tokens.shape[0]
            if routed_count:
                routed_sum.index_add_(0, plan.tokens, reply[:routed_count].float() * plan.weights[:, None])
            if plan.shared_tokens.shape[0]:
                shared[plan.shared_tokens] = reply[routed_count:]
        out = torch.zeros(pending.total_rows, hidden, dtype=self.dtype)
        out[:real] = combine(routed_sum, shared, self.spec.routed_scaling_factor, self.dtype)
        return out


class AttentionMoELayer:
    """Gate on the Attention rank + RemoteMoE: the whole MoE layer as the model sees it."""

    def __init__(self, gate: GateWeights, remote: RemoteMoE):
        self.gate, self.remote = gate, remote

    def forward(self, hidden_states: torch.Tensor, *, num_tokens: int | None = None, stage: int = 0) -> torch.Tensor:
        x = hidden_states.to(self.remote.dtype)
        real = x.shape[0] if num_tokens is None else num_tokens
        ids, weights = route(self.remote.spec, self.gate, x[:real])
        return self.remote.forward(x, ids, weights, num_tokens=real, stage=stage)
