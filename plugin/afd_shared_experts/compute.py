"""Gates (Attention side) and expert MLPs (both sides), with the models' exact semantics."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import GateWeights, SharedExpertWeights
from .moe_spec import GATE_SIGMOID_GROUPED, GATE_SOFTMAX_GREEDY, GATE_SOFTMAX_GROUP_LIMITED, GATE_SOFTMAX_TOPK, MoESpec


def route(spec: MoESpec, gate: GateWeights, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [T, k] (int64) and weights [T, k] (float32), *without* the routed
    scaling factor: the combine applies it exactly once."""
    num_experts = spec.num_routed_experts
    if spec.gate_kind == GATE_SOFTMAX_TOPK:
        # Qwen2-MoE: logits in the model dtype, softmax in float32.
        logits = F.linear(hidden_states, gate.weight.to(hidden_states.dtype))
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(logits.dtype).float()

    logits = F.linear(hidden_states.float(), gate.weight.float())
    per_group = num_experts // spec.num_groups
    if spec.gate_kind == GATE_SIGMOID_GROUPED:
        scores = logits.sigmoid()
        choice = scores + gate.correction_bias.float()
        group_scores = choice.view(-1, spec.num_groups, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        keep = _group_mask(group_scores, spec.topk_groups, per_group)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights

    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if spec.gate_kind == GATE_SOFTMAX_GROUP_LIMITED:
        group_scores = scores.view(-1, spec.num_groups, per_group).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(group_scores, spec.topk_groups, per_group), 0.0)
    elif spec.gate_kind != GATE_SOFTMAX_GREEDY:
        raise ValueError(f"unknown gate kind {spec.gate_kind!r}")
    weights, ids = torch.topk(scores, spec.top_k, dim=-1, sorted=False)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights


def _group_mask(group_scores: torch.Tensor, topk_groups: int, per_group: int) -> torch.Tensor:
    chosen = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.repeat_interleave(per_group, dim=1)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def shared_expert_output(x: torch.Tensor, shared: SharedExpertWeights) -> torch.Tensor:
    """S(x), including Qwen2-MoE's sigmoid(shared_expert_gate(x)) factor on the same rows."""
    out = swiglu(x, shared.gate_up, shared.down)
    if shared.shared_gate is not None:
        out = torch.sigmoid(F.linear(x, shared.shared_gate)) * out
    return out


def combine(
    routed_sum: torch.Tensor, shared_out: torch.Tensor | None, routed_scaling_factor: float, dtype: torch.dtype
) -> torch.Tensor:
    """Final MoE output from the weighted routed sum (float32, unscaled) and S(x) (None: the
    model has no shared expert).

    Non-fp16, or no shared expert: r * routed + S. fp16 with a shared expert (vLLM's overflow
    guard; the model keeps its residual stream scaled by 1/r): routed + S / r. Either way r is
    applied exactly once.
    """
    if shared_out is None:
        return (routed_sum * routed_scaling_factor).to(dtype)
    if dtype == torch.float16:
        out = routed_sum + shared_out.float() * (1.0 / routed_scaling_factor)
    else:
        out = routed_sum * routed_scaling_factor + shared_out.float()
    return out.to(dtype)
