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
