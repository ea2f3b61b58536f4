"""Where a reference implementation's gate differs from vLLM's, vLLM's semantics are the
plugin's (the Attention engine routes with vLLM's own router; the core's ``route`` follows it).

Sigmoid grouped gates (DeepSeek-V3, Kimi-K2, DeepSeek-V3.2, GLM-4.5): vLLM 0.23.0
(``grouped_topk``) masks the experts of dropped groups with -inf before the top-k; transformers
5.5 (the vLLM venv's) masks them with 0.0. They pick different experts when a kept expert's
biased score is negative: 0.0 then beats it and an expert of a dropped group is chosen."""

import torch

from afd_shared_experts.compute import route
from afd_shared_experts.model import GateWeights
from afd_shared_experts.moe_spec import GATE_SIGMOID_GROUPED, MoESpec


def test_a_kept_expert_with_a_negative_biased_score_beats_every_dropped_group():
    # 4 experts in 2 groups, top-2 of 1 group. Group 0 (experts 0, 1) wins on its biased sum;
    # expert 1's biased score is negative, below a dropped expert's 0.0 mask.
    spec = MoESpec(model_type="deepseek_v3", hidden_size=4, moe_intermediate_size=4, shared_intermediate_size=4,
                   num_routed_experts=4, top_k=2, gate_kind=GATE_SIGMOID_GROUPED, num_groups=2, topk_groups=1,
                   norm_topk_prob=True, routed_scaling_factor=1.0, has_shared_gate=False, moe_layers=(0,))
    logits = torch.tensor([[4.0, -4.0, 0.0, 0.0]])  # sigmoid: ~0.982, ~0.018, 0.5, 0.5
    bias = torch.tensor([0.5, -0.1, -0.3, -0.3])  # biased: 1.482, -0.082 | 0.2, 0.2 -> group 0 kept
    gate = GateWeights(weight=torch.eye(4), correction_bias=bias)
    ids, weights = route(spec, gate, logits)
    assert sorted(ids[0].tolist()) == [0, 1]  # vLLM: dropped experts are -inf, expert 1 still chosen
    scores = logits.sigmoid()
    assert torch.allclose(weights[0], scores[0, ids[0]] / scores[0, ids[0]].sum())
    # transformers' rule on the same scores: keep the best group by its top-2 biased sum, set the
    # other groups' experts to 0.0, take the top-2. It picks an expert of the dropped group.
    biased = scores[0] + bias
    kept_group = biased.view(2, 2).topk(2, dim=-1).values.sum(-1).argmax()
    zero_masked = biased.view(2, 2).clone()
    zero_masked[1 - kept_group] = 0.0
    zero_mask_choice = set(zero_masked.flatten().topk(2).indices.tolist())
    assert kept_group == 0 and zero_mask_choice != set(ids[0].tolist()) and zero_mask_choice & {2, 3}
