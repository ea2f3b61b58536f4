"""Where a step is cut into micro-batch stages (afd_shared_experts.stages, pure)."""

import pytest

from afd_shared_experts.config import MinSplitTokens
from afd_shared_experts.stages import StageSlice, stage_plan, step_stages


def test_decode_steps_split_evenly():
    assert stage_plan([1] * 8, 2) == [StageSlice(0, 4, 0, 4), StageSlice(4, 8, 4, 8)]
    assert [s.req_stop - s.req_start for s in stage_plan([1] * 7, 3)] == [2, 3, 2]


def test_cuts_fall_between_requests_nearest_the_even_token_split():
    # 24 tokens in two: the request boundary nearest 12 is after the second request (10).
    assert stage_plan([6, 4, 8, 1, 3, 2], 2) == [StageSlice(0, 2, 0, 10), StageSlice(2, 6, 10, 24)]
    # A long prompt is never split: it runs as a stage of its own.
    assert stage_plan([100, 1, 1, 1], 2) == [StageSlice(0, 1, 0, 100), StageSlice(1, 4, 100, 103)]


@pytest.mark.parametrize("tokens, stages, expected", [
    ([5], 3, 1),  # a single request: one stage
    ([3, 3], 3, 2),  # fewer requests than stages: one stage per request
    ([], 2, 0),  # an empty step
    ([2, 2, 2], 1, 1),
])
def test_a_step_with_fewer_requests_than_stages_runs_fewer(tokens, stages, expected):
    assert len(stage_plan(tokens, stages)) == expected


@pytest.mark.parametrize("tokens, stages", [([1] * 9, 4), ([7, 1, 1, 30, 2, 2, 9], 3), ([1, 1], 2), ([4] * 5, 5)])
def test_stages_cover_the_step_in_order_each_with_a_request(tokens, stages):
    plan = stage_plan(tokens, stages)
    assert plan[0].req_start == 0 and plan[0].tok_start == 0
    assert plan[-1].req_stop == len(tokens) and plan[-1].tok_stop == sum(tokens)
    for before, after in zip(plan, plan[1:]):
        assert (before.req_stop, before.tok_stop) == (after.req_start, after.tok_start)
    for piece in plan:
        assert piece.req_stop > piece.req_start
        assert piece.tok_stop - piece.tok_start == sum(tokens[piece.req_start:piece.req_stop])


def test_stages_must_be_positive():
    with pytest.raises(ValueError, match="stages must be >= 1"):
        stage_plan([1, 1], 0)


@pytest.mark.parametrize("tokens, expected", [
    ([1] * 31, 1),  # a decode step below the decode minimum runs unsplit
    ([1] * 32, 2),
    ([1] * 200, 2),
    ([40, 1, 1], 1),  # holds a prefill: the prefill minimum applies, not the decode one
    ([500, 12], 2),
    ([], 1),
])
def test_a_step_is_split_only_once_it_holds_its_phases_minimum(tokens, expected):
    assert step_stages(tokens, 2, MinSplitTokens(decode=32, prefill=512)) == expected
    assert step_stages(tokens, 1, MinSplitTokens(decode=1, prefill=1)) == 1
