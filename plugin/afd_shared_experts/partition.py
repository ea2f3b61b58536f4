"""Which FFN rank computes each real token's shared expert.

Both strategies are computed on the Attention side from data it owns (top-k ids, token
count, F); the result reaches the FFN side through the row order and header counts.
"""

from __future__ import annotations

import torch


def contiguous_ranges(num_tokens: int, num_ffn_ranks: int) -> list[tuple[int, int]]:
    """Rank r takes tokens [r*N//F, (r+1)*N//F)."""
    return [(r * num_tokens // num_ffn_ranks, (r + 1) * num_tokens // num_ffn_ranks) for r in range(num_ffn_ranks)]


def affinity_assignment(topk_ids: torch.Tensor, experts_per_rank: int, num_ffn_ranks: int) -> torch.Tensor:
    """For each token, an FFN rank that already receives it for a routed expert.

    Token t takes the first of its candidate ranks at or after rank t mod F, counting
    cyclically: a function of (ids, F) alone, so deterministic; zero extra rows; and balanced
    (ceil(N/F) per rank) when every token's candidates cover all ranks. Tensor ops on the
    ids' device, with no host sync.
    """
    owners = topk_ids // experts_per_rank  # [T, k]
    start = torch.arange(topk_ids.shape[0], device=topk_ids.device) % num_ffn_ranks
    distance = (owners - start[:, None]) % num_ffn_ranks
    return owners.gather(1, distance.argmin(dim=1, keepdim=True)).squeeze(1)
