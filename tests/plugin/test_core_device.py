"""The Attention-side core is device-correct: dispatch, partition and combine run on the
input's device with no host sync at all.

Tensors of the ``meta`` device carry shapes but no data: an op that reads data on the host
(.tolist(), .item(), bool(), a boolean-mask index) raises, and so does mixing in a tensor
allocated on the CPU. Dispatch and combine run there whole, every layer, every step.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import afd_shared_experts.attention as attention
from afd_shared_experts.attention import AttentionMoELayer, RemoteMoE
from afd_shared_experts.connector import FrameSet
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import load_attention_weights, load_ffn_weights
from afd_shared_experts.moe_spec import GATE_SIGMOID_GROUPED, MoESpec, load_spec
from afd_shared_experts.tp import shard_tokens
from afd_shared_experts.wire import (CapacityError, DispatchTicket, FFNPayload, WireLayout, WorkItem, frame_rows,
                                    read_work_header)
from test_plugin_partition import routing

VARIANTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
VARIANT_IDS = ["ffn-affinity", "ffn-contiguous", "attention"]
FFN_RANKS = 4
MAX_TOKENS = 16


class LoopbackConnector:
    """Test double for the transport: keeps every dispatch's work frames and answers with
    ``answer(frames)`` (default: ones), on the frames' device (meta included)."""

    rank = 0

    def __init__(self, layout: WireLayout, device, answer=None):
        self.layout, self.device = layout, torch.device(device)
        self.answer = answer or (lambda frames: frames.reply.fill_(1))
        self.dispatched: list[torch.Tensor] = []
        self._replies: list = []

    def acquire(self):
        layout = self.layout
        return FrameSet(work=layout.work_frames(layout.num_ffn_ranks, self.device),
                        reply=layout.reply_frames(layout.num_ffn_ranks, self.device))

    def dispatch(self, layer, stage, frames, *, tokens, stages=1):
        self.dispatched.append(frames.work.clone())
        self.answer(frames)
        ticket = DispatchTicket(layer=layer, seq=len(self.dispatched), stage=stage)
        self._replies.append((ticket, frames))
        return ticket

    def receive_replies(self, stage):
        return self._replies.pop(0)

    def release(self, frames):
        pass


def layout_for(spec, placement, partition, dtype, ffn_ranks=FFN_RANKS, max_tokens=MAX_TOKENS):
    return WireLayout(hidden_size=spec.hidden_size, dtype=dtype, local_experts=spec.local_experts(ffn_ranks),
                      num_ffn_ranks=ffn_ranks, top_k=spec.top_k, max_tokens=max_tokens,
                      shared=partition if placement == "ffn" else "none")


def attention_layers(model_dir, device, placement, partition, dtype):
    spec = load_spec(model_dir)
    connector = LoopbackConnector(layout_for(spec, placement, partition, dtype), device)
    weights = load_attention_weights(model_dir, spec, placement, dtype, device)
    layers = {l: AttentionMoELayer(w.gate, RemoteMoE(spec=spec, layer=l, connector=connector, num_ffn_ranks=FFN_RANKS,
                                                     placement=placement, partition=partition, dtype=dtype,
                                                     shared=w.shared))
              for l, w in weights.items()}
    return layers, connector


def run_steps(layers, inputs, steps=2):
    """Every layer on every (rows, real) input, ``steps`` times; outputs of the last step."""
    outputs = []
    for _ in range(steps):
        outputs = [{l: layer.forward(x, num_tokens=real) for l, layer in layers.items()} for x, real in inputs]
    return outputs


def padded_inputs(hidden, rows, real):
    return [(torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)), real)]


def tp_shard_inputs(hidden, rows, tp_size=2):
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
    return [shard_tokens(x, tp_rank, tp_size) for tp_rank in range(tp_size)]


CASES = {
    "empty": lambda h: padded_inputs(h, 0, 0),
    "one-token": lambda h: padded_inputs(h, 1, 1),
    "13-tokens": lambda h: padded_inputs(h, 13, 13),
    "padded-16-of-11": lambda h: padded_inputs(h, 16, 11),
    "tp-shards-of-7": lambda h: tp_shard_inputs(h, 7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement,partition", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("model", ["deepseek_v3", "qwen2_moe"])
def test_remote_moe_runs_on_meta_tensors(checkpoints, model, placement, partition, dtype, case):
    """Zero host syncs: dispatch and combine of every layer run on data-less tensors, with the
    frames shaped as the CPU run's."""
    model_dir = checkpoints[model]
    spec = load_spec(model_dir)
    cpu_inputs = CASES[case](spec.hidden_size)
    cpu_layers, cpu_connector = attention_layers(model_dir, "cpu", placement, partition, dtype)
    run_steps(cpu_layers, cpu_inputs)
    meta_layers, meta_connector = attention_layers(model_dir, "meta", placement, partition, dtype)
    meta_inputs = [(x.to("meta"), real) for x, real in cpu_inputs]
    outputs = run_steps(meta_layers, meta_inputs)

    for (x, _), per_layer in zip(meta_inputs, outputs):
        for out in per_layer.values():
            assert (out.device.type, out.shape, out.dtype) == ("meta", x.shape, dtype)
    assert len(meta_connector.dispatched) == len(cpu_connector.dispatched) == 2 * len(cpu_inputs) * len(spec.moe_layers)
    for meta_frames, cpu_frames in zip(meta_connector.dispatched, cpu_connector.dispatched):
        assert meta_frames.device.type == "meta" and meta_frames.shape == cpu_frames.shape


def test_meta_run_catches_a_host_read(checkpoints, monkeypatch):
    """The meta run is a real detector: a host read slipped into the hot path fails it."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    entered = []
    real_slot = attention.affinity_slot

    def slot_read_on_the_host(ids, *args):
        entered.append(ids.device.type)
        slot = real_slot(ids, *args)
        slot.tolist()
        return slot

    monkeypatch.setattr(attention, "affinity_slot", slot_read_on_the_host)
    layers, _ = attention_layers(model_dir, "meta", "ffn", "affinity", torch.float32)
    layer = next(iter(layers.values()))
    with pytest.raises((RuntimeError, NotImplementedError)):
        layer.forward(torch.empty(5, spec.hidden_size, device="meta"))
    assert entered == ["meta"]


@st.composite
def routed_step(draw):
    ids, per_rank, ffn = draw(routing())
    real, top_k = ids.shape
    padding = draw(st.integers(0, 3))  # rows past num_tokens: never sent
    ids = torch.cat([ids, torch.arange(top_k).expand(padding, top_k)])
    weights = torch.rand(real + padding, top_k, generator=torch.Generator().manual_seed(real))
    partition = draw(st.sampled_from(["affinity", "contiguous"]))
    return ids, weights, real, ffn, per_rank, partition


def small_spec(experts: int, top_k: int, hidden: int) -> MoESpec:
    return MoESpec(model_type="deepseek_v3", hidden_size=hidden, moe_intermediate_size=2, shared_intermediate_size=2,
                   num_routed_experts=experts, top_k=top_k, gate_kind=GATE_SIGMOID_GROUPED, num_groups=1,
                   topk_groups=1, norm_topk_prob=True, routed_scaling_factor=1.0, has_shared_gate=False,
                   moe_layers=(0,))


class LabelledExperts:
    """FFN rank ``rank``'s experts as labels: routed expert e maps a row to row * (e + 1) for its
    global e, the shared expert to row * 1000."""

    holds_shared = True

    def __init__(self, rank: int, local: int):
        self.first = rank * local

    def routed(self, rows, counts):
        scale = torch.repeat_interleave(torch.arange(len(counts)) + self.first + 1.0, torch.tensor(counts))
        return rows * scale[:, None]

    def shared(self, rows):
        return rows * 1000


@settings(max_examples=200, deadline=None)
@given(routed_step())
def test_frames_carry_what_the_ffn_side_needs_and_replies_land_where_the_combine_reads(case):
    """Every real token's shared work goes to exactly one FFN rank; under affinity that rank
    already receives the token and no extra row is sent. The FFN side reads its rows from the
    frame header alone, the FFN runtime answers them, and the combine puts every expert's
    answer on its own (token, slot): out = sum_k w_k x (id_k + 1) + 1000 x."""
    ids, weights, real, ffn, per_rank, partition = case
    hidden = 4
    x = torch.arange(ids.shape[0] * hidden, dtype=torch.float32).reshape(-1, hidden) / 7
    spec = small_spec(ffn * per_rank, ids.shape[1], hidden)
    layout = layout_for(spec, "ffn", partition, torch.float32, ffn_ranks=ffn, max_tokens=ids.shape[0] + 1)
    shared_rank_of = {}

    def ffn_side(frames):
        for f in range(ffn):
            header = read_work_header(frames.work[f], layout, source=0)
            rows = frame_rows(frames.work[f], layout, header)
            # Routed rows: real tokens' hidden states, grouped by local expert.
            experts_of_rows = torch.repeat_interleave(torch.arange(per_rank) + f * per_rank,
                                                      torch.tensor(header.routed_counts))
            tokens = [next(t for t in range(real) if torch.equal(x[t], row)) for row in rows[:sum(header.routed_counts)]]
            assert all(experts_of_rows[i].item() in ids[t].tolist() for i, t in enumerate(tokens))
            if partition == "contiguous":
                assert header.shared_prefix == (0,) * per_rank
                assert torch.equal(rows[sum(header.routed_counts):], x[real * f // ffn:real * (f + 1) // ffn])
                shared_tokens = range(real * f // ffn, real * (f + 1) // ffn)
            else:
                assert header.shared_extra == 0  # the rank already receives each token it does shared work for
                offset, shared_tokens = 0, []
                for count, prefix in zip(header.routed_counts, header.shared_prefix):
                    shared_tokens += tokens[offset:offset + prefix]
                    offset += count
            for token in shared_tokens:
                assert token not in shared_rank_of
                shared_rank_of[token] = f
            item = WorkItem(source=0, layer=0, stage=0, payload=FFNPayload(
                rows=rows, routed_counts=header.routed_counts, shared_prefix=header.shared_prefix,
                shared_extra=header.shared_extra))
            reply = FFNRuntime(None, {0: LabelledExperts(f, per_rank)}).process(item)[0]
            frames.reply[f, :reply.shape[0]] = reply

    remote = RemoteMoE(spec=spec, layer=0, connector=LoopbackConnector(layout, "cpu", ffn_side), num_ffn_ranks=ffn,
                       placement="ffn", partition=partition, dtype=torch.float32)
    out = remote.forward(x, ids, weights, num_tokens=real)
    assert sorted(shared_rank_of) == list(range(real))
    routed = (weights[:real, :, None] * x[:real, None, :] * (ids[:real, :, None] + 1)).sum(dim=1)
    torch.testing.assert_close(out[:real], routed + 1000 * x[:real], rtol=1e-6, atol=1e-3)
    assert torch.equal(out[real:], torch.zeros(ids.shape[0] - real, hidden))


def test_a_step_above_the_token_budget_is_refused_before_anything_is_sent(checkpoints):
    spec = load_spec(checkpoints["deepseek_v3"])
    connector = LoopbackConnector(layout_for(spec, "ffn", "affinity", torch.float32), "cpu")
    remote = RemoteMoE(spec=spec, layer=spec.moe_layers[0], connector=connector, num_ffn_ranks=FFN_RANKS,
                       placement="ffn", partition="affinity", dtype=torch.float32)
    x = torch.randn(MAX_TOKENS + 1, spec.hidden_size)
    ids = torch.zeros(MAX_TOKENS + 1, spec.top_k, dtype=torch.int64)
    with pytest.raises(CapacityError, match=rf"layer {spec.moe_layers[0]}: {MAX_TOKENS + 1} tokens in one "
                                                      rf"dispatch, but the AFD frames hold at most {MAX_TOKENS} \(the "
                                                      "engines' --max-num-batched-tokens over the Attention tensor "
                                                      "parallel size"):
        remote.dispatch(x, ids, torch.ones_like(ids, dtype=torch.float32))
    assert connector.dispatched == []
    # Padding rows past num_tokens do not count.
    remote.combine(remote.dispatch(x, ids, torch.ones_like(ids, dtype=torch.float32), num_tokens=MAX_TOKENS))


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen2_moe"])
def test_ffn_torch_experts_load_and_run_on_the_target_device(checkpoints, model):
    model_dir = checkpoints[model]
    spec = load_spec(model_dir)
    weights = load_ffn_weights(model_dir, spec, "ffn", 1, 2, torch.float32, "meta")
    assert {t.device.type for w in weights.values()
            for t in (w.routed.gate_up, w.routed.down, w.shared.gate_up, w.shared.down)} == {"meta"}
    runtime = FFNRuntime(None, torch_experts(weights))
    local = spec.local_experts(2)
    counts = tuple(range(local))  # 0, 1, 2, ... rows per local expert
    prefix = tuple(min(c, 1) for c in counts)
    payload = FFNPayload(rows=torch.empty(sum(counts) + 2, spec.hidden_size, device="meta"), routed_counts=counts,
                         shared_prefix=prefix, shared_extra=2)
    layer = spec.moe_layers[0]
    out, routed_rows, shared_rows = runtime.process(WorkItem(source=0, layer=layer, stage=0, payload=payload))
    assert (routed_rows, shared_rows) == (sum(counts), sum(prefix) + 2)
    assert out.device.type == "meta" and out.shape == (routed_rows + shared_rows, spec.hidden_size)
