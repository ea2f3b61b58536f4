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

    Greedy least-loaded choice among the token's candidate ranks (ties -> lower rank), in
    token order: deterministic, zero extra rows, and perfectly balanced (ceil(N/F)) when
    every token's candidates cover all ranks.
    """
    owners = (topk_ids // experts_per_rank).tolist()
    load = [0] * num_ffn_ranks
    chosen = []
    for token_owners in owners:
        best = min(set(token_owners), key=lambda rank: (load[rank], rank))
        load[best] += 1
        chosen.append(best)
    return torch.tensor(chosen, dtype=torch.int64)
