"""StageBatcher (pure, hand-built work items) and the merged expert pass of FFNRuntime."""

import pytest
import torch

from afd_shared_experts.wire import FFNPayload, WorkItem
from afd_shared_experts.errors import PairingError
from afd_shared_experts.ffn_batching import StageBatcher, group_key
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import load_ffn_weights
from afd_shared_experts.moe_spec import load_spec
from plugin_harness import TOLERANCE, relative_error

WINDOW = 1.0
EMPTY = FFNPayload(rows=torch.empty(0, 4), routed_counts=(0, 0), shared_prefix=(0, 0), shared_extra=0)


def work(source, layer, stage=0, *, step=0, stages=1, payload=EMPTY):
    return WorkItem(source=source, layer=layer, stage=stage, payload=payload, step=step, stages=stages)


def keys(group):
    return [(item.source, *group_key(item)) for item in group]


def test_group_waits_for_every_rank_whatever_the_arrival_order():
    batcher = StageBatcher([0, 1, 2])
    batcher.add(work(2, 3), now=0.0)
    batcher.add(work(0, 3), now=0.1)
    assert batcher.pop_group(now=0.2, gather_window=WINDOW) is None  # rank 1 may still send it
    batcher.add(work(1, 3), now=0.3)
    assert keys(batcher.pop_group(now=0.3, gather_window=WINDOW)) == [(0, 0, 3, 0), (1, 0, 3, 0), (2, 0, 3, 0)]
    assert batcher.pop_group(now=0.3, gather_window=WINDOW) is None and batcher.queued() == 0
    # Every rank has sent work now: a slow one is awaited past the window, for as long as it takes.
    batcher.add(work(0, 3, step=1), now=1.0)
    batcher.add(work(2, 3, step=1), now=1.0)
    assert batcher.pop_group(now=100.0, gather_window=WINDOW) is None
    assert batcher.seconds_to_deadline(now=100.0, gather_window=WINDOW) is None
    batcher.add(work(1, 3, step=1), now=100.0)
    assert keys(batcher.pop_group(now=100.0, gather_window=WINDOW)) == [(0, 1, 3, 0), (1, 1, 3, 0), (2, 1, 3, 0)]
    assert batcher.partial_groups == 0


def test_a_rank_with_fewer_stages_is_not_awaited_for_the_later_stages():
    batcher = StageBatcher([0, 1])
    batcher.add(work(0, 1, 0, stages=2), now=0.0)
    batcher.add(work(1, 1, 0, stages=1), now=0.0)
    batcher.add(work(0, 1, 1, stages=2), now=0.0)
    assert keys(batcher.pop_group(now=0.0, gather_window=WINDOW)) == [(0, 0, 1, 0), (1, 0, 1, 0)]
    # Rank 1 runs one stage: not awaited for stage 1.
    assert keys(batcher.pop_group(now=0.0, gather_window=WINDOW)) == [(0, 0, 1, 1)]
    batcher.add(work(1, 2, 0, stages=1), now=0.1)
    assert batcher.pop_group(now=0.1, gather_window=WINDOW) is None  # rank 0 sends layer 2 too
    batcher.add(work(0, 2, 0, stages=2), now=0.2)
    assert keys(batcher.pop_group(now=0.2, gather_window=WINDOW)) == [(0, 0, 2, 0), (1, 0, 2, 0)]
    assert batcher.pop_group(now=0.2, gather_window=WINDOW) is None  # rank 0's stage 1 of layer 2 is awaited alone
    assert batcher.seconds_to_deadline(now=0.2, gather_window=WINDOW) is None


def test_a_rank_ahead_after_fewer_stages_waits_for_the_rank_still_owing_stages():
    # Rank 1 ran step 0's last layer in one stage and went on to step 1 while rank 0 still owes
    # stage 1 of that layer (seen with vLLM DP engines): step 1 waits for rank 0, not going alone.
    batcher = StageBatcher([0, 1])
    batcher.add(work(0, 2, 0, stages=2), now=0.0)
    batcher.add(work(1, 2, 0, stages=1), now=0.0)
    assert keys(batcher.pop_group(now=0.0, gather_window=WINDOW)) == [(0, 0, 2, 0), (1, 0, 2, 0)]
    batcher.add(work(1, 1, 0, step=1, stages=2), now=0.1)
    assert batcher.pop_group(now=5.0, gather_window=WINDOW) is None
    batcher.add(work(0, 2, 1, stages=2), now=5.0)
    assert keys(batcher.pop_group(now=5.0, gather_window=WINDOW)) == [(0, 0, 2, 1)]
    assert batcher.pop_group(now=5.0, gather_window=WINDOW) is None
    batcher.add(work(0, 1, 0, step=1, stages=1), now=5.1)
    assert keys(batcher.pop_group(now=5.1, gather_window=WINDOW)) == [(0, 1, 1, 0), (1, 1, 1, 0)]
    assert batcher.partial_groups == 0


def test_later_items_of_one_rank_wait_behind_its_earlier_ones():
    batcher = StageBatcher([0, 1])
    for layer in (1, 2):
        batcher.add(work(0, layer, step=5), now=0.0)
    batcher.add(work(0, 1, step=6), now=0.0)
    assert batcher.pop_group(now=0.5, gather_window=WINDOW) is None
    batcher.add(work(1, 1, step=5), now=0.6)
    assert keys(batcher.pop_group(now=0.6, gather_window=WINDOW)) == [(0, 5, 1, 0), (1, 5, 1, 0)]
    assert batcher.pop_group(now=0.6, gather_window=WINDOW) is None  # (5, 2, 0) waits for rank 1, not mixed with step 6
    batcher.add(work(1, 2, step=5), now=0.7)
    assert keys(batcher.pop_group(now=0.7, gather_window=WINDOW)) == [(0, 5, 2, 0), (1, 5, 2, 0)]
    batcher.add(work(1, 1, step=6), now=0.8)
    assert keys(batcher.pop_group(now=0.8, gather_window=WINDOW)) == [(0, 6, 1, 0), (1, 6, 1, 0)]


def test_ranks_on_different_steps_are_served_oldest_step_first():
    batcher = StageBatcher([0, 1])
    batcher.add(work(0, 1, step=8), now=0.0)
    batcher.add(work(1, 1, step=7), now=0.1)
    # Rank 0 is past step 7 (its head is step 8): step 7 goes at once, with rank 1 alone.
    assert keys(batcher.pop_group(now=0.1, gather_window=WINDOW)) == [(1, 7, 1, 0)]
    assert batcher.pop_group(now=0.2, gather_window=WINDOW) is None
    batcher.add(work(1, 1, step=8), now=0.3)
    assert keys(batcher.pop_group(now=0.3, gather_window=WINDOW)) == [(0, 8, 1, 0), (1, 8, 1, 0)]
    assert batcher.partial_groups == 0


def test_a_rank_that_shuts_down_is_no_longer_awaited_and_its_items_are_dropped():
    batcher = StageBatcher([0, 1, 2])
    batcher.add(work(0, 1), now=0.0)
    batcher.add(work(1, 1), now=0.0)
    batcher.add(work(1, 2), now=0.0)
    assert batcher.pop_group(now=0.0, gather_window=WINDOW) is None
    batcher.close_source(2)
    assert keys(batcher.pop_group(now=0.0, gather_window=WINDOW)) == [(0, 0, 1, 0), (1, 0, 1, 0)]
    batcher.close_source(1)
    assert batcher.queued() == 0 and batcher.sources == [0]
    batcher.add(work(0, 2), now=0.1)
    assert keys(batcher.pop_group(now=0.1, gather_window=WINDOW)) == [(0, 0, 2, 0)]
    with pytest.raises(PairingError, match=r"work item from Attention rank 1, which is not an active source "
                                           r"\(active: \[0\]\)"):
        batcher.add(work(1, 3), now=0.2)


def test_a_rank_that_never_sent_holds_one_group_for_the_gather_window_then_none():
    batcher = StageBatcher([0, 1])
    batcher.add(work(0, 1), now=10.0)
    assert batcher.pop_group(now=10.5, gather_window=WINDOW) is None
    assert batcher.seconds_to_deadline(now=10.5, gather_window=WINDOW) == pytest.approx(0.5)
    assert keys(batcher.pop_group(now=11.0, gather_window=WINDOW)) == [(0, 0, 1, 0)]
    assert batcher.partial_groups == 1
    batcher.add(work(0, 2), now=11.1)
    assert keys(batcher.pop_group(now=11.1, gather_window=WINDOW)) == [(0, 0, 2, 0)]  # rank 1 no longer expected
    # Its late item is served, and it is expected again from then on.
    batcher.add(work(1, 1), now=11.2)
    assert keys(batcher.pop_group(now=11.2, gather_window=WINDOW)) == [(1, 0, 1, 0)]
    batcher.add(work(0, 1, step=1), now=11.3)
    assert batcher.pop_group(now=11.3, gather_window=WINDOW) is None
    batcher.add(work(1, 1, step=1), now=11.4)
    assert keys(batcher.pop_group(now=11.4, gather_window=WINDOW)) == [(0, 1, 1, 0), (1, 1, 1, 0)]
    assert batcher.partial_groups == 1


@pytest.mark.parametrize("items,message", [
    ([work(0, 1, 1, stages=2)], r"sent stage 1 of step 0 layer 1 without its stage 0"),
    ([work(0, 1, 0, stages=3), work(0, 1, 2, stages=3)],
     r"sent step 0 layer 1 stage 2 of 3, but stage 1 of 3 of step 0 layer 1 is due"),
    ([work(0, 1, 0, stages=2), work(0, 2, 0, stages=2)],
     r"sent step 0 layer 2 stage 0 of 2, but stage 1 of 2 of step 0 layer 1 is due"),
    ([work(0, 1, 0, stages=2), work(0, 1, 1, stages=3)],
     r"sent step 0 layer 1 stage 1 of 3, but stage 1 of 2 of step 0 layer 1 is due"),
])
def test_stages_out_of_order_are_a_pairing_error(items, message):
    batcher = StageBatcher([0], name="FFN rank 0")
    with pytest.raises(PairingError, match=r"FFN rank 0: Attention rank 0 " + message):
        for item in items:
            batcher.add(item, now=0.0)


def test_gather_window_must_not_be_negative():
    with pytest.raises(ValueError, match=r"gather_window must be >= 0 \(got -1\)"):
        StageBatcher([0]).pop_group(now=0.0, gather_window=-1)


def random_item(source, spec, layer, counts, prefix, extra, generator):
    rows = torch.randn(sum(counts) + extra, spec.hidden_size, generator=generator)
    return work(source, layer, payload=FFNPayload(rows=rows, routed_counts=tuple(counts), shared_prefix=tuple(prefix),
                                                  shared_extra=extra))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe"])
def test_one_pass_over_every_peer_equals_one_pass_per_peer(checkpoints, model_type):
    """Same rows, same layout, float32 rounding apart: CPU BLAS (MKL) picks its GEMM kernel by
    row count, so a block of 1-3 rows computed alone differs in the last bits from the same rows
    inside a taller GEMM (measured up to ~2e-6 absolute); rows never mix."""
    model_dir = checkpoints[model_type]
    spec = load_spec(model_dir)
    layer = spec.moe_layers[0]
    generator = torch.Generator().manual_seed(11)
    local = spec.local_experts(2)
    calls = {"routed": 0, "shared": 0}
    experts = torch_experts(load_ffn_weights(model_dir, spec, "ffn", 1, 2, torch.float32))

    class Counted:
        holds_shared = True

        def routed(self, rows, counts):
            calls["routed"] += 1
            return experts[layer].routed(rows, counts)

        def shared(self, rows):
            calls["shared"] += 1
            return experts[layer].shared(rows)

    items = [
        random_item(0, spec, layer, [3, 0, 1, 2][:local], [1, 0, 1, 0][:local], 0, generator),
        random_item(1, spec, layer, [0] * local, [0] * local, 0, generator),  # a zero-row peer
        random_item(2, spec, layer, [1, 4, 0, 0][:local], [0, 2, 0, 0][:local], 2, generator),
        random_item(3, spec, layer, [2, 1, 1, 5][:local], [2, 1, 0, 0][:local], 1, generator),
    ]
    merged = FFNRuntime(None, {layer: Counted()})
    replies = merged.process_group(items)
    assert calls == {"routed": 1, "shared": 1}
    assert merged.expert_passes == 1 and merged.pass_peers == {4: 1}
    separate = FFNRuntime(None, experts)
    for item, (rows, routed, shared) in zip(items, replies):
        want_rows, want_routed, want_shared = separate.process(item)
        assert (routed, shared) == (want_routed, want_shared) == (item.payload.routed_rows, item.payload.shared_rows)
        assert rows.shape == want_rows.shape
        error = relative_error(rows, want_rows)
        assert error <= TOLERANCE["float32"], f"Attention rank {item.source}: merged pass differs by {error:.3g}"
    assert separate.expert_passes == len(items)
    assert merged.items_served == separate.items_served == len(items)


def test_a_rank_behind_after_a_missed_group_catches_up_alone_instead_of_deadlocking():
    """Rank 1 starts late: rank 0 runs step 0 alone past the window. Rank 1's step 0 items then
    go alone (rank 0's keys are past them, so it is not awaited), and from step 1 on both are
    grouped again."""
    batcher = StageBatcher([0, 1])
    batcher.add(work(0, 1), now=0.0)
    assert keys(batcher.pop_group(now=2.0, gather_window=WINDOW)) == [(0, 0, 1, 0)]
    batcher.add(work(0, 2), now=2.1)
    assert keys(batcher.pop_group(now=2.1, gather_window=WINDOW)) == [(0, 0, 2, 0)]
    batcher.add(work(1, 1), now=3.0)  # late: its group went without it
    assert keys(batcher.pop_group(now=3.0, gather_window=WINDOW)) == [(1, 0, 1, 0)]
    batcher.add(work(1, 2), now=3.1)  # rank 0 (engaged) already sent (0, 2, 0): not awaited
    assert keys(batcher.pop_group(now=3.1, gather_window=WINDOW)) == [(1, 0, 2, 0)]
    batcher.add(work(0, 1, step=1), now=4.0)
    assert batcher.pop_group(now=40.0, gather_window=WINDOW) is None  # rank 1 is awaited again, no deadline
    batcher.add(work(1, 1, step=1), now=40.0)
    assert keys(batcher.pop_group(now=40.0, gather_window=WINDOW)) == [(0, 1, 1, 0), (1, 1, 1, 0)]
    assert batcher.partial_groups == 1


def test_a_rank_whose_keys_do_not_grow_is_a_pairing_error():
    batcher = StageBatcher([0], name="FFN rank 0")
    batcher.add(work(0, 2, step=3), now=0.0)
    with pytest.raises(PairingError, match=r"FFN rank 0: Attention rank 0 sent step 3 layer 1 stage 0 after step 3 "
                                           r"layer 2 stage 0 \(a rank's \(step, layer, stage\) only grows\)"):
        batcher.add(work(0, 1, step=3), now=0.0)
