"""The Attention-side core is device-correct: dispatch, partition and combine run on the
input's device with one host sync per layer and step.

Tensors of the ``meta`` device carry shapes but no data: an op that reads data on the host
(.tolist(), .item(), bool(), a boolean-mask index) raises, and so does mixing in a tensor
allocated on the CPU. The one allowed sync, ``attention.host_row_counts``, is replayed from
a CPU run of the same step.
"""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import afd_shared_experts.attention as attention
from afd_shared_experts.attention import AttentionMoELayer, RemoteMoE
from afd_shared_experts.wire import DispatchTicket, FFNPayload, WorkItem
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import GATE_SIGMOID_GROUPED, MoESpec, load_attention_weights, load_ffn_weights, load_spec
from afd_shared_experts.tp import shard_tokens
from plugin_harness import ThreadWorld
from test_plugin_partition import routing

VARIANTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
VARIANT_IDS = ["ffn-affinity", "ffn-contiguous", "attention"]
FFN_RANKS = 4


class RecordingConnector:
    """Test double for the transport: keeps every dispatch's payloads and answers it with
    rows of the announced reply shape, on the payloads' device (meta included)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        self.hidden_size, self.dtype = hidden_size, dtype
        self.dispatched: list[list] = []
        self._replies: list = []

    def dispatch(self, layer, stage, payloads, *, step=None, stages=1):
        self.dispatched.append(payloads)
        replies = [torch.ones(p.routed_rows + p.shared_rows, self.hidden_size, dtype=self.dtype, device=p.rows.device)
                   for p in payloads]
        ticket = DispatchTicket(layer=layer, seq=len(self.dispatched), stage=stage)
        self._replies.append((ticket, replies))
        return ticket

    def receive_replies(self, stage):
        return self._replies.pop(0)


def attention_layers(model_dir, device, placement, partition, dtype):
    spec = load_spec(model_dir)
    connector = RecordingConnector(spec.hidden_size, dtype)
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
def test_remote_moe_runs_on_meta_tensors(checkpoints, monkeypatch, model, placement, partition, dtype, case):
    model_dir = checkpoints[model]
    spec = load_spec(model_dir)
    cpu_inputs = CASES[case](spec.hidden_size)

    # The CPU run of the same steps supplies the row counts the meta run cannot read.
    recorded = []
    real_sync = attention.host_row_counts
    monkeypatch.setattr(attention, "host_row_counts", lambda counts: recorded.append(real_sync(counts)) or recorded[-1])
    cpu_layers, cpu_connector = attention_layers(model_dir, "cpu", placement, partition, dtype)
    run_steps(cpu_layers, cpu_inputs)

    replay = list(recorded)

    def replayed_counts(counts):
        assert counts.device.type == "meta"
        return replay.pop(0)

    monkeypatch.setattr(attention, "host_row_counts", replayed_counts)
    meta_layers, meta_connector = attention_layers(model_dir, "meta", placement, partition, dtype)
    meta_inputs = [(x.to("meta"), real) for x, real in cpu_inputs]
    outputs = run_steps(meta_layers, meta_inputs)

    assert replay == [] and len(recorded) == 2 * len(cpu_inputs) * len(spec.moe_layers)
    for (x, _), per_layer in zip(meta_inputs, outputs):
        for out in per_layer.values():
            assert (out.device.type, out.shape, out.dtype) == ("meta", x.shape, dtype)
    assert len(meta_connector.dispatched) == len(cpu_connector.dispatched)
    for meta_payloads, cpu_payloads in zip(meta_connector.dispatched, cpu_connector.dispatched):
        for meta_payload, cpu_payload in zip(meta_payloads, cpu_payloads):
            assert meta_payload.rows.device.type == "meta"
            assert meta_payload.rows.shape == cpu_payload.rows.shape
            assert (meta_payload.routed_counts, meta_payload.shared_prefix, meta_payload.shared_extra) == (
                cpu_payload.routed_counts, cpu_payload.shared_prefix, cpu_payload.shared_extra)


def test_meta_run_catches_a_host_read(checkpoints, monkeypatch):
    """The meta run is a real detector: a host read in the hot path (here, the count sync
    left unpatched) fails it, and the hot path reaches that sync without failing before."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    entered = []
    real_sync = attention.host_row_counts
    monkeypatch.setattr(attention, "host_row_counts", lambda counts: entered.append(counts.device.type) or real_sync(counts))
    layers, _ = attention_layers(model_dir, "meta", "ffn", "affinity", torch.float32)
    layer = next(iter(layers.values()))
    with pytest.raises((RuntimeError, NotImplementedError)):
        layer.forward(torch.empty(5, spec.hidden_size, device="meta"))
    assert entered == ["meta"]


@pytest.mark.parametrize("placement,partition", VARIANTS, ids=VARIANT_IDS)
def test_one_host_sync_per_layer_per_step_on_real_ranks(checkpoints, monkeypatch, placement, partition):
    """Counted over real gloo ranks (threads): each Attention rank calls the count sync
    exactly once per layer and step, also with an empty batch; the meta test above shows
    there is no other."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    calls: list[int] = []
    real_sync = attention.host_row_counts

    def counted(counts):
        calls.append(threading.get_ident())
        return real_sync(counts)

    monkeypatch.setattr(attention, "host_row_counts", counted)
    attention_ranks = 2
    with ThreadWorld(model_dir, attention_ranks, 2, placement=placement, partition=partition) as world:
        for tokens in (0, 1, 9, 9):
            calls.clear()
            world.run(torch.randn(tokens, spec.hidden_size))
            per_thread = [calls.count(t) for t in set(calls)]
            assert sorted(per_thread) == [len(spec.moe_layers)] * attention_ranks, (tokens, per_thread)


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


@settings(max_examples=200, deadline=None)
@given(routed_step())
def test_both_sides_agree_on_each_tokens_shared_rank(case):
    """Every real token's shared work goes to exactly one FFN rank; under affinity that rank
    already receives the token and no extra row is sent. The FFN side finds the shared rows
    from the header counts alone; they are the rows the Attention side expects back."""
    ids, weights, real, ffn, per_rank, partition = case
    hidden = 3
    x = torch.arange(ids.shape[0] * hidden, dtype=torch.float32).reshape(-1, hidden)
    connector = RecordingConnector(hidden, torch.float32)
    remote = RemoteMoE(spec=small_spec(ffn * per_rank, ids.shape[1], hidden), layer=0, connector=connector,
                       num_ffn_ranks=ffn, placement="ffn", partition=partition, dtype=torch.float32)
    pending = remote.dispatch(x, ids, weights, num_tokens=real)
    payloads = connector.dispatched[0]
    shared_rank_of = {}
    for f, (payload, plan) in enumerate(zip(payloads, pending.plans)):
        # Routed rows: the tokens' hidden states, grouped by local expert, with their weights.
        assert torch.equal(payload.rows[:payload.routed_rows], x[plan.tokens])
        experts_of_rows = torch.repeat_interleave(torch.arange(per_rank) + f * per_rank,
                                                  torch.tensor(payload.routed_counts))
        hits = ids[plan.tokens] == experts_of_rows[:, None]
        assert hits.sum(dim=1).tolist() == [1] * payload.routed_rows
        assert torch.equal(plan.weights, weights[plan.tokens][hits])
        # What the FFN side computes the shared expert on, from the counts in the header.
        ffn_side, offset = [], 0
        for count, prefix in zip(payload.routed_counts, payload.shared_prefix):
            ffn_side += plan.tokens[offset:offset + prefix].tolist()
            offset += count
        if partition == "contiguous":
            assert payload.shared_prefix == (0,) * per_rank
            ffn_side = list(range(real * f // ffn, real * (f + 1) // ffn))
            assert torch.equal(payload.rows[payload.routed_rows:], x[ffn_side])
        else:
            assert payload.shared_extra == 0 and payload.rows.shape[0] == payload.routed_rows
            # Zero extra rows: the rank already receives each token it does shared work for.
            assert all(t in set(plan.tokens.tolist()) for t in ffn_side)
        assert plan.shared_tokens.tolist() == ffn_side
        for token in ffn_side:
            assert token not in shared_rank_of
            shared_rank_of[token] = f
    assert sorted(shared_rank_of) == list(range(real))
    # Deterministic: the same step again gives the same partition.
    again = remote.dispatch(x, ids, weights, num_tokens=real)
    assert all(torch.equal(a.shared_tokens, b.shared_tokens) for a, b in zip(pending.plans, again.plans))


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
    out, routed_rows, shared_rows = runtime.process(WorkItem(source=0, layer=layer, seq=0, stage=0, payload=payload))
    assert (routed_rows, shared_rows) == (sum(counts), sum(prefix) + 2)
    assert out.device.type == "meta" and out.shape == (routed_rows + shared_rows, spec.hidden_size)
