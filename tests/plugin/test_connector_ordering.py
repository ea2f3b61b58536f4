"""Deadlock freedom of the connector under HCCL/NCCL point-to-point semantics, on CPU.

``InOrderTransport`` runs each pair's operations strictly in post order with tags ignored,
as HCCL/NCCL do; the connector must complete the full AFD exchange under it, and the test
transport must catch an ordering that deadlocks there (the old connector's).
"""

import multiprocessing
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from afd_devcluster import free_port
from afd_shared_experts.compute import route
from afd_shared_experts.transport import ProcessGroupTransport, choose_data_plane
from afd_shared_experts.errors import DeviceUnavailableError
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import token_range
from in_order_transport import InOrderTransport, one_communicator_per_rank
from plugin_harness import (RENDEZVOUS_ONLY_SPEC, ThreadWorld, assert_matches_oracle, make_connector, oracle_outputs,
                            run_threads)

DEADLOCK_BOUND_SECONDS = 3.0
WORK_TAG, REPLY_TAG = 1, 3


def gloo_pair(prefixes: list[str]) -> list[list[ProcessGroupTransport]]:
    """For ranks 0 and 1: one gloo process group per prefix (a communicator each)."""
    store_port = free_port()

    def rank_groups(rank):
        store = dist.TCPStore("127.0.0.1", store_port, 2, rank == 0, timedelta(seconds=20))
        return [ProcessGroupTransport(dist.ProcessGroupGloo(dist.PrefixStore(p, store), rank, 2, timedelta(seconds=60)))
                for p in prefixes]

    return run_threads([lambda r=r: rank_groups(r) for r in range(2)])


def round_trip(attention_work, attention_reply, ffn_work, ffn_reply, *, reply_receive_first: bool):
    """One dispatch and its reply between Attention rank 0 and FFN rank 1. With
    ``reply_receive_first`` the Attention rank posts the reply receive before its send, as
    the old connector did. Returns the Attention rank's send handle and the FFN thread."""
    work, reply = torch.arange(4.0), torch.empty(4)

    def ffn():
        received = torch.empty(4)
        ffn_work.irecv(received, 0, WORK_TAG).wait()
        ffn_reply.isend(received * 2, 0, REPLY_TAG).wait()

    thread = threading.Thread(target=ffn, daemon=True)
    thread.start()
    if reply_receive_first:
        reply_handle = attention_reply.irecv(reply, 1, REPLY_TAG)
        send_handle = attention_work.isend(work, 1, WORK_TAG)
    else:
        send_handle = attention_work.isend(work, 1, WORK_TAG)
        reply_handle = attention_reply.irecv(reply, 1, REPLY_TAG)
    return send_handle, reply_handle, reply, thread


def test_old_ordering_deadlocks_under_in_order_execution_and_separate_directions_do_not():
    (tag_aware_a, in_order_a, work_a, reply_a), (tag_aware_f, in_order_f, work_f, reply_f) = \
        gloo_pair(["tag-aware", "in-order", "work", "reply"])

    # On gloo, which matches by tag, the old order completes: the exchange itself is valid.
    send, receive, reply, ffn = round_trip(tag_aware_a, tag_aware_a, tag_aware_f, tag_aware_f,
                                           reply_receive_first=True)
    send.wait(), receive.wait()
    ffn.join(DEADLOCK_BOUND_SECONDS)
    assert torch.equal(reply, torch.arange(4.0) * 2)

    # One in-order communicator for both directions: the reply receive at the head of the
    # pair's queue holds the send behind it, and the FFN rank waits for that send forever.
    a, f = InOrderTransport(in_order_a), InOrderTransport(in_order_f)
    send, receive, reply, ffn = round_trip(a, a, f, f, reply_receive_first=True)
    assert not send.done.wait(DEADLOCK_BOUND_SECONDS), "the send ran ahead of a receive posted before it"
    assert not receive.is_completed() and ffn.is_alive()
    # Unblock the pair through the raw groups (a stand-in reply, then the reply nobody takes).
    in_order_f.isend(torch.zeros(4), 0, 0).wait()
    send.wait()
    in_order_a.irecv(torch.empty(4), 1, 0).wait()
    ffn.join(DEADLOCK_BOUND_SECONDS)
    assert not ffn.is_alive()

    # Same posting order, but each direction on a communicator of its own: completes.
    send, receive, reply, ffn = round_trip(InOrderTransport(work_a), InOrderTransport(reply_a),
                                           InOrderTransport(work_f), InOrderTransport(reply_f),
                                           reply_receive_first=True)
    assert receive.done.wait(DEADLOCK_BOUND_SECONDS * 5)
    send.wait()
    ffn.join(DEADLOCK_BOUND_SECONDS)
    assert torch.equal(reply, torch.arange(4.0) * 2)


class CountingInOrder:
    """transport_wrapper: every process group of every rank in order, counted."""

    def __init__(self):
        self.transports: list[InOrderTransport] = []
        self._lock = threading.Lock()

    def __call__(self, inner):
        with self._lock:
            self.transports.append(InOrderTransport(inner))
            return self.transports[-1]


@pytest.mark.parametrize("data_plane", ["staged", "direct"])
def test_full_exchange_completes_under_in_order_execution(checkpoints, data_plane):
    """2 Attention x 4 FFN ranks, each MoE layer's tokens dispatched as two stages before either
    is combined, combined in reverse order, steps with 0, 1 and 7 tokens (zero-row payloads);
    every FFN rank gathers each (step, layer, stage) of both Attention ranks into one pass."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    wrapper = CountingInOrder()
    with ThreadWorld(model_dir, 2, 4, placement="ffn", transport_wrapper=wrapper, data_plane=data_plane) as world:
        assert {c.data_plane for c in world.attention_connectors + world.ffn_connectors} == {data_plane}
        for runtime in world.runtimes:
            runtime.gather_window = 30.0  # the first group: above any thread start skew under load

        def rank_step(a, x, step):
            halves = [x[slice(*token_range(stage, x.shape[0], 2))] for stage in range(2)]
            outs = {}
            for layer, moe in world.layers[a].items():
                pending = [moe.remote.dispatch(half, *route(spec, moe.gate, half), stage=stage, stages=2)
                           for stage, half in enumerate(halves)]
                outs[layer] = torch.cat(list(reversed([moe.remote.combine(p) for p in reversed(pending)])))
            return outs

        for step, num_tokens in enumerate((0, 1, 7)):
            x = torch.randn(num_tokens, spec.hidden_size)
            parts = [x[slice(*token_range(a, num_tokens, 2))] for a in range(2)]
            outs = run_threads([lambda a=a: rank_step(a, parts[a], step) for a in range(2)], timeout=60)
            got = {layer: torch.cat([o[layer] for o in outs]) for layer in spec.moe_layers}
            if num_tokens:
                assert_matches_oracle(got, oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")
            else:
                assert all(out.shape == (0, spec.hidden_size) for out in got.values())
        served = sum(r.items_served for r in world.runtimes)
        passes = [(r.expert_passes, dict(r.pass_peers)) for r in world.runtimes]
    assert served == 3 * 2 * 2 * 4 * len(spec.moe_layers)  # every FFN rank answered every dispatch
    groups = 3 * 2 * len(spec.moe_layers)  # (step, layer, stage)
    assert passes == [(groups, {2: groups})] * 4
    assert len(wrapper.transports) == 2 * 6  # two process groups (links) per rank, all in order
    assert all(t.lanes.executed for t in wrapper.transports)


def merged_directions_child(model_dir: str, results) -> None:
    """Child process body: the connector with all of a rank's groups on one in-order
    communicator per pair; reports how the first step ended (threads may stay deadlocked)."""
    import os

    torch.set_num_threads(1)
    try:
        spec = load_spec(model_dir)
        world = ThreadWorld(model_dir, 1, 2, placement="ffn", transport_wrapper=one_communicator_per_rank(), timeout=3)
        world.layers[0][spec.moe_layers[0]].forward(torch.randn(6, spec.hidden_size))
        results.put(("completed", ""))
    except Exception as exc:
        results.put((type(exc).__name__, str(exc)))
    results.close()
    results.join_thread()  # flushed before the hard exit that leaves the deadlocked threads behind
    os._exit(0)


def test_in_order_transport_catches_a_deadlocking_connector_layout(checkpoints):
    """Both directions of a pair on one in-order communicator: the FFN rank's next work
    receive (posted as soon as a frame arrives) sits ahead of its reply send, so the Attention
    rank's reply never comes."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=merged_directions_child, args=(str(checkpoints["deepseek_v3"]), results),
                            daemon=True)
    child.start()
    try:
        kind, message = results.get(timeout=90)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert kind == "PeerLostError", message
    assert "no reply to layer" in message and "within 3" in message


def test_data_plane_is_agreed_by_the_whole_world():
    assert choose_data_plane([("auto", "cpu"), ("auto", "h/cuda/GPU-1")]) == "staged"
    assert choose_data_plane([("auto", "h/cuda/GPU-1"), ("auto", "h/cuda/GPU-1")]) == "staged"  # one GPU, two ranks
    assert choose_data_plane([("auto", "h/cuda/GPU-1"), ("auto", "h/cuda/GPU-2")]) == "direct"
    # vllm-ascend has no point-to-point communicator: NPU worlds are staged (vllm/communicators.py)
    assert choose_data_plane([("auto", "h/npu/0"), ("auto", "h/npu/1")]) == "staged"
    assert choose_data_plane([("direct", "cpu"), ("direct", "cpu")]) == "direct"
    with pytest.raises(ValueError, match="data_plane: every rank of the AFD world must request the same data plane "
                                         r"\(got direct, staged\)"):
        choose_data_plane([("staged", "cpu"), ("direct", "cpu")])


def test_connector_construction_fails_fast_on_bad_options():
    spec = RENDEZVOUS_ONLY_SPEC
    with pytest.raises(ValueError, match=r"data_plane must be one of auto, direct, staged \(got 'nccl'\)"):
        make_connector(spec, "ffn", 1, 1, 1, free_port(), timeout=1, data_plane="nccl")
    assert make_connector(spec, "ffn", 1, 1, 1, free_port(), timeout=1).requested_data_plane == "auto"
    assert make_connector(spec, "ffn", 1, 1, 1, free_port(), timeout=1, data_plane="staged").requested_data_plane \
        == "staged"
    with pytest.raises(DeviceUnavailableError, match="torch_npu/CANN cannot be loaded"):
        make_connector(spec, "ffn", 1, 1, 1, free_port(), timeout=1, device="npu")
