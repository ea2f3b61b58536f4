"""Connector, FFN loop and Attention-side behaviours over real gloo ranks."""

from contextlib import contextmanager
import subprocess
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from afd_devcluster import free_port
from afd_shared_experts.attention import RemoteMoE
from afd_shared_experts.compute import route
from afd_shared_experts.device import resolve_device
from afd_shared_experts.errors import DeviceUnavailableError, PairingError, PayloadError
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.metrics import ProbeServer
from afd_shared_experts.model import CheckpointReader, load_attention_weights, load_ffn_weights, tensor_bytes
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import token_range
from afd_shared_experts.tp import all_gather_and_trim, shard_tokens
from afd_shared_experts.trace import TRACE_DIR_ENV, read_traces
from plugin_harness import (DelayedCompletionTransport, ThreadWorld, assert_matches_oracle, connected, oracle_outputs,
                            rss_bytes, run_threads)


def test_zero_token_ranks_always_get_replies(checkpoints):
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    x = torch.randn(1, spec.hidden_size)
    with ThreadWorld(model_dir, 2, 4, placement="ffn") as world:
        out = world.run(x)  # Attention rank 0 has no token; 3 of 4 FFN ranks get no shared row
        zero = dict(sum((r.zero_token_replies for r in world.runtimes), start=__import__("collections").Counter()))
        served = sum(r.items_served for r in world.runtimes)
    assert_matches_oracle(out, oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")
    assert served == 2 * 4 * len(spec.moe_layers)  # every FFN rank answered every dispatch
    assert zero["shared"] == served - len(spec.moe_layers)
    assert zero["routed"] >= 4 * len(spec.moe_layers)  # all of rank 0's dispatches are empty


def test_padding_rows_are_never_dispatched(checkpoints):
    model_dir = checkpoints["qwen2_moe"]
    spec = load_spec(model_dir)
    x = torch.randn(5, spec.hidden_size)
    padded = torch.cat([x, torch.full((3, spec.hidden_size), 1e4)])
    with ThreadWorld(model_dir, 1, 2, placement="ffn") as world:
        layer = spec.moe_layers[0]
        out = world.layers[0][layer].forward(padded, num_tokens=5)
        sent = sum(c.sent_bytes["work"] for c in world.attention_connectors)
        layout = world.attention_connectors[0].layout
    expected = oracle_outputs(model_dir, x, "float32", [layer])[layer]
    assert_matches_oracle({layer: out[:5]}, {layer: expected}, "float32")
    assert torch.equal(out[5:], torch.zeros(3, spec.hidden_size))
    # The staged plane sends each frame's header and valid rows: the 5 real tokens' top-k rows.
    assert sent == (2 * layout.header_rows + 5 * spec.top_k) * spec.hidden_size * 4


@contextmanager
def one_attention_rank_served(model_dir):
    """1 Attention x 1 FFN rank (placement ffn), the FFN runtime serving: yields (spec, the
    Attention connector, the Attention weights, the runtime)."""
    spec, (attention, ffn) = connected(model_dir, 1, 1)
    runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32))).start()
    try:
        yield spec, attention, load_attention_weights(model_dir, spec, "ffn", torch.float32), runtime
    finally:
        attention.close()
        runtime.join(10)
        ffn.close()


def test_stages_complete_out_of_order_and_pair_correctly(checkpoints):
    """Both stages of each layer dispatched before either is combined, combined stage 1 first."""
    model_dir = checkpoints["deepseek_v2"]
    with one_attention_rank_served(model_dir) as (spec, attention, weights, runtime):
        xs = [torch.randn(6, spec.hidden_size), torch.randn(9, spec.hidden_size)]
        for layer in spec.moe_layers:
            remote = RemoteMoE(spec=spec, layer=layer, connector=attention, num_ffn_ranks=1, placement="ffn",
                               partition="affinity", dtype=torch.float32)
            pendings = [remote.dispatch(x, *route(spec, weights[layer].gate, x), stage=stage, stages=2)
                        for stage, x in enumerate(xs)]
            outs = {stage: remote.combine(pendings[stage]) for stage in (1, 0)}
            for stage, x in enumerate(xs):
                assert_matches_oracle({layer: outs[stage]}, oracle_outputs(model_dir, x, "float32", [layer]), "float32")
        assert attention.pending_dispatches() == 0
        assert runtime.expert_passes == 2 * len(spec.moe_layers)


def test_replies_must_follow_each_attention_ranks_dispatch_order(checkpoints):
    """Replies carry no header: an Attention rank pairs them by order, so the FFN side refuses a
    reply to any work item but a source's oldest unanswered one, and a reply of the wrong size."""
    model_dir = checkpoints["deepseek_v2"]
    spec, (attention, ffn) = connected(model_dir, 1, 1)
    weights = load_attention_weights(model_dir, spec, "ffn", torch.float32)
    runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32)))
    first, second = spec.moe_layers[:2]
    remotes = {layer: RemoteMoE(spec=spec, layer=layer, connector=attention, num_ffn_ranks=1, placement="ffn",
                                partition="affinity", dtype=torch.float32) for layer in (first, second)}
    x = torch.randn(4, spec.hidden_size)
    pendings = [remotes[layer].dispatch(x, *route(spec, weights[layer].gate, x)) for layer in (first, second)]
    try:
        items = [ffn.receive_work(timeout=10) for _ in range(2)]
        replies = [runtime.process(item)[0] for item in items]
        with pytest.raises(PairingError, match=rf"for layer {second} stage 0, but its oldest unanswered work item is "
                                               rf"layer {first} stage 0"):
            ffn.send_reply(items[1], replies[1])
        with pytest.raises(PayloadError, match=r"reply rows shape \(3, \d+\) must be \(\d+, \d+\)"):
            ffn.send_reply(items[0], replies[0][:3])
        for item, reply in zip(items, replies):
            ffn.send_reply(item, reply)
        for layer, pending in zip((first, second), pendings):
            assert_matches_oracle({layer: remotes[layer].combine(pending)}, oracle_outputs(model_dir, x, "float32", [layer]),
                                  "float32")
    finally:
        attention.close()
        ffn.close()


def test_work_of_every_attention_rank_is_served_in_one_pass_whatever_the_arrival_order(checkpoints):
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    with ThreadWorld(model_dir, 3, 1, placement="ffn") as world:
        runtime, connector = world.runtimes[0], world.ffn_connectors[0]
        original = connector._take_work  # looked up per header, also by a receive already waiting
        arrived = []

        def take_work(source, frame, header):
            arrived.append(source)
            return original(source, frame, header)

        connector._take_work = take_work
        layer = spec.moe_layers[0]
        xs = {a: torch.randn(3 + a, spec.hidden_size) for a in range(3)}
        outs, threads = {}, []
        for a in (2, 0, 1):
            thread = threading.Thread(target=lambda a=a: outs.__setitem__(a, world.layers[a][layer].forward(xs[a])))
            thread.start()
            threads.append(thread)
            while len(arrived) < len(threads):  # next rank dispatches only after this one arrived
                time.sleep(0.001)
        for thread in threads:
            thread.join(20)
        assert runtime.expert_passes == 1 and runtime.pass_peers == {3: 1}
    assert arrived[:3] == [2, 0, 1]  # then their shutdown notices
    for a, x in xs.items():
        assert_matches_oracle({layer: outs[a]}, oracle_outputs(model_dir, x, "float32", [layer]), "float32")


def test_thousand_steps_do_not_grow_memory(checkpoints):
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    x = torch.randn(4, spec.hidden_size)
    layer = spec.moe_layers[0]
    with ThreadWorld(model_dir, 1, 2, placement="ffn") as world:
        moe = world.layers[0][layer]
        first = moe.forward(x)
        for _ in range(100):
            moe.forward(x)
        baseline = rss_bytes()
        for _ in range(1000):
            assert torch.equal(moe.forward(x), first)
        growth = rss_bytes() - baseline
        assert world.attention_connectors[0].pending_dispatches() == 0
        assert all(c.sends_in_flight() <= 1 for c in world.ffn_connectors)
        assert threading.active_count() < 40
    assert growth < 8 * 2**20, f"RSS grew by {growth} bytes over 1000 steps"


@pytest.mark.parametrize("placement,partition", [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")])
def test_delayed_completions_never_expose_unfinished_buffers(checkpoints, placement, partition):
    model_dir = checkpoints["qwen2_moe"]
    spec = load_spec(model_dir)
    injectors = []

    def wrap(transport):
        injectors.append(DelayedCompletionTransport(transport))
        return injectors[-1]

    x = torch.randn(33, spec.hidden_size)
    with ThreadWorld(model_dir, 2, 2, placement=placement, partition=partition, transport_wrapper=wrap) as world:
        for _ in range(3):
            out = world.run(x)
            assert_matches_oracle(out, oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")
    assert [v for i in injectors for v in i.violations] == []


def test_fault_injector_detects_a_buffer_reused_in_flight():
    class Inner:
        def isend(self, tensor, dst, tag):
            return type("Done", (), {"wait": lambda self: None})()

    injector = DelayedCompletionTransport(Inner(), delay=0.05)  # read after the write below
    buffer = torch.ones(3)
    handle = injector.isend(buffer, 1, 0)
    buffer.add_(1)  # what a connector must never do
    handle.wait()
    assert injector.violations and "modified while in flight" in injector.violations[0]


def test_weights_by_role_and_placement(checkpoints):
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    reader = CheckpointReader(model_dir)
    layer = spec.moe_layers[0]
    gate_bytes = tensor_bytes(reader.get(f"model.layers.{layer}.mlp.gate.weight", torch.float32),
                              reader.get(f"model.layers.{layer}.mlp.gate.e_score_correction_bias", torch.float32))
    shared_bytes = 3 * spec.hidden_size * spec.shared_intermediate_size * 4
    expert_bytes = 3 * spec.hidden_size * spec.moe_intermediate_size * 4
    on_ffn = load_attention_weights(model_dir, spec, "ffn", torch.float32)
    on_attention = load_attention_weights(model_dir, spec, "attention", torch.float32)
    assert all(w.shared is None and w.parameter_bytes() == gate_bytes for w in on_ffn.values())
    assert all(w.parameter_bytes() == gate_bytes + shared_bytes for w in on_attention.values())
    for placement, extra in (("ffn", shared_bytes), ("attention", 0)):
        shard = load_ffn_weights(model_dir, spec, placement, 1, 4, torch.float32)
        assert all(w.parameter_bytes() == 2 * expert_bytes + extra for w in shard.values())
    shard = load_ffn_weights(model_dir, spec, "ffn", 1, 4, torch.float32)[layer]
    assert shard.routed.first_expert == 2
    up = reader.get(f"model.layers.{layer}.mlp.experts.3.up_proj.weight", torch.float32)
    assert torch.equal(shard.routed.gate_up[1, spec.moe_intermediate_size:], up)


def test_metrics_and_probe_endpoints(checkpoints):
    model_dir = checkpoints["deepseek_v2"]
    spec = load_spec(model_dir)
    world = ThreadWorld(model_dir, 1, 1, placement="ffn", with_metrics=True)
    runtime = world.runtimes[0]
    server = ProbeServer(runtime.metrics, lambda: runtime.ready, "127.0.0.1", 0, 0).start()
    try:
        world.run(torch.randn(5, spec.hidden_size))
        get = lambda port, path: urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        body = get(server.metrics_port, "/metrics").read().decode()
        assert 'afd_tokens_received_total{kind="shared",layer="0"} 5.0' in body
        assert 'afd_connector_sent_bytes_total{kind="replies"}' in body
        assert "afd_ffn_work_wait_seconds_bucket" in body
        attention_body = world.attention_connectors[0].metrics.exposition().decode()
        assert 'afd_tokens_dispatched_total{kind="routed",layer="1"} 10.0' in attention_body
        assert "afd_attention_reply_wait_seconds_count 2.0" in attention_body
        assert get(server.health_port, "/health").status == 200
        assert get(server.health_port, "/ready").status == 200
    finally:
        world.close()
    with pytest.raises(urllib.error.HTTPError) as info:
        get(server.health_port, "/ready")
    assert info.value.code == 503
    server.stop()


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_tensor_parallel_shard_and_gather(checkpoints, num_tokens):
    """Attention TP=2 (one DP replica): each TP rank dispatches its shard; every TP rank
    joins the gather, even with an all-padding shard."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    x = torch.randn(num_tokens, spec.hidden_size)
    tp_port = free_port()
    with ThreadWorld(model_dir, 2, 2, placement="ffn") as world:
        def tp_rank(rank):
            store = dist.TCPStore("127.0.0.1", tp_port, 2, rank == 0, timedelta(seconds=20))
            group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))
            shard, real = shard_tokens(x, rank, 2)
            outs = {}
            for layer, moe in world.layers[rank].items():
                outs[layer] = all_gather_and_trim(moe.forward(shard, num_tokens=real), num_tokens, group)
            return outs

        results = run_threads([lambda r=r: tp_rank(r) for r in range(2)])
    expected = oracle_outputs(model_dir, x, "float32", spec.moe_layers)
    for outs in results:
        assert_matches_oracle(outs, expected, "float32")


def test_npu_request_without_torch_npu_fails_fast():
    with pytest.raises(DeviceUnavailableError, match="torch_npu/CANN cannot be loaded"):
        resolve_device("npu")


# The first group waits this long for ranks that have sent nothing yet: far above the start
# skew of rank threads on a loaded machine (1 s was exceeded at load 9 on 2 cores), so a
# partial group in these tests is a bug, not a slow thread.
UNHURRIED_GATHER_WINDOW = 30.0


def staged_step(world, a, x, *, stages):
    """Attention rank a's forward of every MoE layer with its tokens in ``stages`` micro-batches,
    all dispatched before the first combine, as the micro-batch schedule runs them."""
    parts = [x[slice(*token_range(s, x.shape[0], stages))] for s in range(stages)]
    outs = {}
    for layer, moe in world.layers[a].items():
        pendings = [moe.remote.dispatch(part, *route(world.spec, moe.gate, part), stage=s, stages=stages)
                    for s, part in enumerate(parts)]
        outs[layer] = torch.cat([moe.remote.combine(pending) for pending in pendings])
    return outs


@pytest.mark.parametrize("attention_ranks", [2, 4])
@pytest.mark.parametrize("ffn_ranks", [1, 2])
@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_one_expert_pass_per_layer_and_stage_however_many_attention_ranks(checkpoints, attention_ranks, ffn_ranks,
                                                                         placement):
    """Step 0: one stage, the last Attention rank has no token (header-only work). Step 1: two
    stages, except the last rank, which has one request and runs one stage."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    layers, last = len(spec.moe_layers), attention_ranks - 1
    steps = [
        {a: (torch.randn(0 if a == last else 3 + a, spec.hidden_size), 1) for a in range(attention_ranks)},
        {a: (torch.randn(1, spec.hidden_size), 1) if a == last else (torch.randn(5, spec.hidden_size), 2)
         for a in range(attention_ranks)},
    ]
    with ThreadWorld(model_dir, attention_ranks, ffn_ranks, placement=placement, with_metrics=True) as world:
        for runtime in world.runtimes:
            runtime.gather_window = UNHURRIED_GATHER_WINDOW
        for step, inputs in enumerate(steps):
            outs = run_threads([lambda a=a: staged_step(world, a, inputs[a][0], stages=inputs[a][1])
                                for a in range(attention_ranks)], timeout=60)
            got = {layer: torch.cat([o[layer] for o in outs]) for layer in spec.moe_layers}
            x = torch.cat([inputs[a][0] for a in range(attention_ranks)])
            assert_matches_oracle(got, oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")
        for runtime in world.runtimes:
            # Per FFN rank: step 0 one pass per layer over every rank, step 1 stage 0 over every
            # rank and stage 1 over all but the last.
            assert runtime.partial_groups == 0
            assert runtime.expert_passes == 3 * layers
            assert runtime.pass_peers == {attention_ranks: 2 * layers, attention_ranks - 1: layers}
            assert runtime.items_served == layers * (3 * attention_ranks - 1)
            exposition = runtime.metrics.exposition().decode()
            assert f'afd_ffn_expert_passes_total{{stage="0"}} {2.0 * layers}' in exposition
            assert f'afd_ffn_expert_passes_total{{stage="1"}} {1.0 * layers}' in exposition
            assert f"afd_ffn_expert_pass_peers_count {3.0 * layers}" in exposition
            assert f"afd_ffn_expert_pass_peers_sum {layers * (3.0 * attention_ranks - 1)}" in exposition
    lint = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_trace_records_both_sides_of_every_stage(checkpoints, tmp_path, monkeypatch):
    """AFD_TRACE_DIR: per (step, layer, stage) one FFN expert pass over both Attention ranks'
    rows, after both dispatches started and before either combine wait ended (one clock)."""
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    model_dir = checkpoints["qwen2_moe"]
    spec = load_spec(model_dir)
    with ThreadWorld(model_dir, 2, 1, placement="ffn") as world:
        world.runtimes[0].gather_window = UNHURRIED_GATHER_WINDOW
        for _ in range(2):
            run_threads([lambda a=a: staged_step(world, a, torch.randn(4 + a, spec.hidden_size), stages=2)
                         for a in range(2)], timeout=60)
    intervals = read_traces(tmp_path)
    by_kind = {}
    for interval in intervals:
        key = (interval["step"], interval["layer"], interval["stage"])
        by_kind.setdefault(interval["kind"], {}).setdefault(key, []).append(interval)
    groups = [(step, layer, stage) for step in range(2) for layer in spec.moe_layers for stage in range(2)]
    assert sorted(by_kind["expert_pass"]) == groups
    for key in groups:
        (expert_pass,) = by_kind["expert_pass"][key]
        dispatches, waits = by_kind["dispatch"][key], by_kind["combine_wait"][key]
        assert sorted(d["rank"] for d in dispatches) == sorted(w["rank"] for w in waits) == [0, 1]
        assert expert_pass["peers"] == 2 and expert_pass["rows"] == sum(d["rows"] for d in dispatches) > 0
        assert expert_pass["start_ns"] >= max(d["start_ns"] for d in dispatches)
        assert expert_pass["end_ns"] <= min(w["end_ns"] for w in waits)
        assert len(by_kind["reply"][key]) == len(by_kind["combine"][key]) // 2 == 1
    assert all(i["wall_ns"] > 0 and i["end_ns"] >= i["start_ns"] for i in intervals)


def test_both_ends_count_the_same_steps(checkpoints):
    """No step number travels: the Attention connector and the FFN connector each count an
    Attention rank's steps from its dispatches (a stage-0 dispatch of a layer not above the
    previous stage 0's starts a step) and agree."""
    model_dir = checkpoints["deepseek_v2"]
    spec, (attention, ffn) = connected(model_dir, 1, 1)
    weights = load_attention_weights(model_dir, spec, "ffn", torch.float32)
    runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32)))
    x = torch.randn(3, spec.hidden_size)
    remotes = {layer: RemoteMoE(spec=spec, layer=layer, connector=attention, num_ffn_ranks=1, placement="ffn",
                                partition="affinity", dtype=torch.float32) for layer in spec.moe_layers}
    sent, received = [], []
    try:
        for step_stages in (1, 1, 2):
            for layer, remote in remotes.items():
                pendings = [remote.dispatch(x, *route(spec, weights[layer].gate, x), stage=stage, stages=step_stages)
                            for stage in range(step_stages)]
                sent += [(p.ticket.step, p.ticket.layer, p.ticket.stage) for p in pendings]
                for _ in pendings:
                    item = ffn.receive_work(timeout=10)
                    received.append((item.step, item.layer, item.stage))
                    ffn.send_reply(item, runtime.process(item)[0])
                [remote.combine(p) for p in pendings]
    finally:
        attention.close()
        ffn.close()
    first, second = spec.moe_layers
    assert sent == received == [(0, first, 0), (0, second, 0), (1, first, 0), (1, second, 0),
                                (2, first, 0), (2, first, 1), (2, second, 0), (2, second, 1)]
