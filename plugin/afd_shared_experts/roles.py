"""Role ranks in the AFD world, derived from the launch topology (no vLLM import).

Both the vLLM glue (from the live parallel config) and the FFN server (from its command
line) go through these functions, so every process of a deployment derives its rank in the
AFD world, and checks the afd block against its own topology, the same way.
World ordering: Attention ranks 0..A-1, FFN ranks A..A+F-1.
"""

from __future__ import annotations

from .config import AFDConfig, AFDConfigError


def attention_role_rank(cfg: AFDConfig, *, dp_rank: int, dp_size: int, tp_rank: int, tp_size: int,
                        pcp_rank: int = 0, pcp_size: int = 1) -> int:
    """Rank of an Attention worker: (global_dp_rank * pcp + pcp_rank) * tp + tp_rank.

    The afd block must describe the same Attention topology vLLM was started with.
    """
    if cfg.role != "attention":
        raise AFDConfigError("afd.role", "must be 'attention' in a vLLM engine process", cfg.role)
    width = pcp_size * tp_size
    if cfg.num_attention_ranks != dp_size * width:
        raise AFDConfigError(
            "afd.num_attention_ranks",
            f"must equal the engine's data-parallel size x tensor-parallel size"
            f"{' x prefill-context-parallel size' if pcp_size > 1 else ''} ({dp_size} x {width})",
            cfg.num_attention_ranks,
        )
    if cfg.attn_ranks_per_dp != width:
        raise AFDConfigError("afd.connector_extra_config.attn_ranks_per_dp",
                             f"must equal the engine's ranks per data-parallel replica ({width})",
                             cfg.attn_ranks_per_dp)
    for name, rank, size in (("data-parallel", dp_rank, dp_size), ("tensor-parallel", tp_rank, tp_size),
                             ("prefill-context-parallel", pcp_rank, pcp_size)):
        if not 0 <= rank < size:
            raise ValueError(f"{name} rank {rank} is outside the engine's {name} size {size}")
    return (dp_rank * pcp_size + pcp_rank) * tp_size + tp_rank


def ffn_world_ranks(cfg: AFDConfig, *, rank_start: int, local_ranks: int) -> list[int]:
    """World ranks of an FFN server holding FFN ranks [rank_start, rank_start + local_ranks)."""
    if cfg.role != "ffn":
        raise AFDConfigError("afd.role", "must be 'ffn' for the FFN server", cfg.role)
    if local_ranks < 1:
        raise ValueError(f"--ffn-local-ranks must be >= 1 (got {local_ranks})")
    if rank_start < 0 or rank_start + local_ranks > cfg.num_ffn_ranks:
        raise AFDConfigError("afd.num_ffn_ranks",
                             f"must cover the server's FFN ranks [{rank_start}, {rank_start + local_ranks}) "
                             "(--ffn-rank-start, --ffn-local-ranks)", cfg.num_ffn_ranks)
    return [cfg.ffn_world_rank(rank_start + i) for i in range(local_ranks)]
