"""Which FFN rank computes each real token's shared expert.

Both strategies are computed on the Attention side from data it owns (top-k ids, token
count, F); the result reaches the FFN side through the row order and header counts.
"""

from __future__ import annotations

import torch


def contiguous_assignment(num_tokens: int, num_ffn_ranks: int, device: torch.device | str = "cpu"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r takes tokens [r*N//F, (r+1)*N//F): each token's rank, its index within that range,
    and every rank's range size, as tensors on ``device`` (no host sync). Token t's rank is the
    largest r with r*N//F <= t, which is ((t+1)*F - 1) // N."""
    tokens = torch.arange(num_tokens, device=device)
    ranks = torch.arange(num_ffn_ranks, device=device)
    sizes = (ranks + 1) * num_tokens // num_ffn_ranks - ranks * num_tokens // num_ffn_ranks
    if not num_tokens:
        return tokens, tokens, sizes
    token_rank = ((tokens + 1) * num_ffn_ranks - 1) // num_tokens
    return token_rank, tokens - token_rank * num_tokens // num_ffn_ranks, sizes


def affinity_slot(topk_ids: torch.Tensor, experts_per_rank: int, num_ffn_ranks: int) -> torch.Tensor:
    """For each token, the slot of its top-k whose expert carries its shared work to an FFN rank
    that already receives it for that routed expert.

    Token t's rank is the first of its candidate ranks at or after rank t mod F, counting
    cyclically: a function of (ids, F) alone, so deterministic; zero extra rows; and balanced
    (ceil(N/F) per rank) when every token's candidates cover all ranks. On that rank its
    lowest-numbered expert carries it. One argmin over (cyclic distance, expert id) finds both;
    tensor ops on the ids' device, with no host sync.
    """
    if num_ffn_ranks == 1:
        return topk_ids.argmin(dim=1)
    start = torch.arange(topk_ids.shape[0], device=topk_ids.device) % num_ffn_ranks
    distance = (topk_ids // experts_per_rank - start[:, None]) % num_ffn_ranks
    return (distance * (experts_per_rank * num_ffn_ranks) + topk_ids).argmin(dim=1)
