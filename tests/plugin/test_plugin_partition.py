import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_shared_experts.partition import affinity_slot, contiguous_assignment


@st.composite
def routing(draw):
    ffn = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 4))
    experts = ffn * per_rank
    top_k = draw(st.integers(1, min(4, experts)))
    tokens = draw(st.integers(0, 60))
    rows = [draw(st.permutations(range(experts)))[:top_k] for _ in range(tokens)]
    ids = torch.tensor(rows, dtype=torch.int64).reshape(tokens, top_k)
    return ids, per_rank, ffn


def carrier_experts(ids: torch.Tensor, per_rank: int, ffn: int) -> torch.Tensor:
    """Each token's expert that carries its shared work, by ``affinity_slot``."""
    slot = affinity_slot(ids, per_rank, ffn)
    assert slot.shape == (ids.shape[0],)
    return ids.gather(1, slot[:, None]).squeeze(1)


def affinity_assignment(ids: torch.Tensor, per_rank: int, ffn: int) -> torch.Tensor:
    return carrier_experts(ids, per_rank, ffn) // per_rank


@settings(max_examples=150, deadline=None)
@given(routing())
def test_affinity_assigns_each_token_once_to_a_rank_it_already_reaches(case):
    ids, per_rank, ffn = case
    carriers = carrier_experts(ids, per_rank, ffn)
    for token, row in enumerate(ids.tolist()):
        # Zero extra rows: one of the token's own routed rows carries it, the lowest-numbered
        # expert of the token on that rank.
        carrier = int(carriers[token])
        assert carrier in row
        assert carrier == min(e for e in row if e // per_rank == carrier // per_rank)


@settings(max_examples=150, deadline=None)
@given(routing())
def test_affinity_balance_bounds(case):
    ids, per_rank, ffn = case
    assigned = affinity_assignment(ids, per_rank, ffn)
    load = torch.bincount(assigned, minlength=ffn)
    candidates = [set((row // per_rank).tolist()) for row in ids]
    # No rank carries more than the tokens that could go to it.
    for rank in range(ffn):
        assert load[rank] <= sum(rank in c for c in candidates)
    # Rotating start: whenever a token could go anywhere, no rank takes more than ceil(N/F).
    if all(len(c) == ffn for c in candidates):
        assert int(load.max()) <= math.ceil(ids.shape[0] / ffn)


@settings(max_examples=150, deadline=None)
@given(routing())
def test_affinity_follows_its_rule_and_is_deterministic(case):
    """Token t takes its first candidate rank at or after t mod F (cyclically), whatever the
    order of its ids and however often it is computed."""
    ids, per_rank, ffn = case
    assigned = affinity_assignment(ids, per_rank, ffn)
    for token, row in enumerate(ids.tolist()):
        candidates = {expert // per_rank for expert in row}
        expected = next(r % ffn for r in range(token, token + ffn) if r % ffn in candidates)
        assert int(assigned[token]) == expected
    carriers = carrier_experts(ids, per_rank, ffn)
    assert torch.equal(carrier_experts(ids.flip(1), per_rank, ffn), carriers)
    assert torch.equal(carrier_experts(ids.clone(), per_rank, ffn), carriers)


@given(st.integers(0, 500), st.integers(1, 16))
def test_contiguous_assignment_gives_rank_r_tokens_r_n_over_f_to_r_plus_1_n_over_f(tokens, ffn):
    token_rank, index_in_range, sizes = contiguous_assignment(tokens, ffn)
    expected = [(r, t - r * tokens // ffn) for r in range(ffn) for t in range(r * tokens // ffn, (r + 1) * tokens // ffn)]
    assert list(zip(token_rank.tolist(), index_in_range.tolist())) == expected
    assert sizes.tolist() == [(r + 1) * tokens // ffn - r * tokens // ffn for r in range(ffn)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes.tolist()) == tokens