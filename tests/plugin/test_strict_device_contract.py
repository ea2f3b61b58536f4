"""The direct plane's accelerator code path (links.GroupedTransport) on the CPU, under a
communicator double that enforces NCCL's point-to-point rules (strict_communicator.py): the
double's rules one by one, then the real Attention and FFN code in real rank processes."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from afd_devcluster import free_port
from afd_devcluster.checkpoints import write_moe_checkpoint
from afd_shared_experts.compute import route
from afd_shared_experts.device import select_device
from afd_shared_experts.errors import AFDError
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import token_range
from afd_shared_experts.links import GroupedTransport, accelerator_link_transport
from afd_shared_experts.transport import SEND, P2POperation
from plugin_harness import assert_matches_oracle, oracle_outputs, run_threads
from strict_communicator import ContractViolation, StrictCommunicator, StrictStreams, strict_link_transport

CPU = torch.device("cpu")


def pair(stall_seconds: float = 20.0) -> list[StrictCommunicator]:
    """Two ranks' communicators of one link, made in two threads (the store's rendezvous)."""
    port = free_port()

    def rank(r):
        store = dist.TCPStore("127.0.0.1", port, 2, r == 0, timedelta(seconds=30))
        return StrictCommunicator("work", store, r, 2, CPU, stall_seconds)

    return run_threads([lambda r=r: rank(r) for r in range(2)], timeout=60)


def grouped(communicator: StrictCommunicator) -> GroupedTransport:
    from afd_shared_experts.device import current_device

    return GroupedTransport("work", communicator, StrictStreams("t"), CPU, current_device)


def on_selected_thread(fn):
    def run():
        select_device(CPU)
        return fn()
    return run


def test_a_post_outside_a_group_is_refused():
    """torch's ProcessGroupNCCL coalesced only posts of several ops: the FFN side's single
    receive went to another communicator than the Attention side's batched send (a hang)."""
    sender, receiver = pair()
    select_device(CPU)
    with pytest.raises(ContractViolation, match=r"rank 1, work link: recv with rank 0 outside a group"):
        receiver.recv(torch.zeros(4), 0, stream=object())
    handles = grouped(sender).batch([P2POperation(SEND, torch.ones(4), 1, 0)])  # one op: still one group
    assert sender.groups_posted == 1 and len(handles) == 1


def test_a_size_the_two_ends_disagree_on_fails_both_with_the_sizes():
    sender, receiver = pair()

    def send():
        return grouped(sender).batch([P2POperation(SEND, torch.ones(4), 1, 0)])[0]

    def receive():
        return grouped(receiver).batch([P2POperation("irecv", torch.zeros(5), 0, 0)])[0]

    send_handle, receive_handle = run_threads([on_selected_thread(send), on_selected_thread(receive)])
    with pytest.raises(ContractViolation, match=r"message 0 from rank 0: sender's \(sequence, elements, dtype\) "
                                                r"\[0, 4, 0\], receiver's \[0, 5, 0\]"):
        receive_handle.event.synchronize()


def test_a_receive_nobody_sends_to_is_reported_as_a_stall():
    _, receiver = pair(stall_seconds=1.0)
    select_device(CPU)
    handle = grouped(receiver).batch([P2POperation("irecv", torch.zeros(4), 0, 0)])[0]
    with pytest.raises(ContractViolation, match=r"stalled for 1.0s, waiting on: recv \(header\) rank 0 "
                                                r"\(NCCL would hang here\)"):
        handle.event.synchronize()


def test_a_thread_that_did_not_select_the_device_is_refused():
    sender, _ = pair()

    def unselected():
        with pytest.raises(RuntimeError, match=r"thread 'unselected' posts on the work link of cpu but selected "
                                               r"no device"):
            grouped(sender).batch([P2POperation(SEND, torch.ones(4), 1, 0)])
        with pytest.raises(ContractViolation, match=r"thread 'unselected' opened a group with current device none"):
            sender.group_start()

    errors = []
    thread = threading.Thread(target=_capture, args=(unselected, errors), name="unselected")
    thread.start()
    thread.join(30)
    assert errors == []


def _capture(fn, errors):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


# --------------------------------------------------------------------------- real rank processes

ATTENTION_RANKS, FFN_RANKS, TOKENS = 2, 3, 11
STEP_TOKENS = (1, 4, None)  # per Attention rank; None: its whole share
VARIANTS = [(placement, stages) for placement in ("ffn", "attention") for stages in (1, 2)]


def _connector(model_dir, role: str, rank: int, placement: str, port: int):
    from plugin_harness import make_connector

    return make_connector(load_spec(model_dir), role, rank, ATTENTION_RANKS, FFN_RANKS, port, timeout=60,
                          placement=placement, max_tokens=TOKENS, data_plane="direct",
                          link_transport=strict_link_transport(stall_seconds=60.0))


def _attention_rank(model_dir, rank: int, variants, ports, x, results) -> None:
    from afd_shared_experts.attention import AttentionMoELayer, RemoteMoE
    from afd_shared_experts.model import load_attention_weights

    try:
        torch.set_num_threads(1)
        select_device(CPU)
        spec = load_spec(model_dir)
        for (placement, stages), port in zip(variants, ports):
            weights = load_attention_weights(model_dir, spec, placement, torch.float32, CPU)
            connector = _connector(model_dir, "attention", rank, placement, port)
            connector.init()
            try:
                layers = {l: AttentionMoELayer(w.gate, RemoteMoE(spec=spec, layer=l, connector=connector,
                                                                 num_ffn_ranks=FFN_RANKS, placement=placement,
                                                                 partition="affinity", dtype=torch.float32,
                                                                 shared=w.shared))
                          for l, w in weights.items()}
                outputs = {}
                for tokens in STEP_TOKENS:  # messages sized for 1, 4 and all tokens; the last step is checked
                    step_x = x[:tokens]
                    parts = [step_x[slice(*token_range(s, step_x.shape[0], stages))] for s in range(stages)]
                    for l, moe in layers.items():
                        pending = [moe.remote.dispatch(part, *route(spec, moe.gate, part), stage=s, stages=stages)
                                   for s, part in enumerate(parts)]
                        outputs[l] = torch.cat([moe.remote.combine(p) for p in pending])
                results.put(("ok", "attention", rank, placement, stages, outputs))
            finally:
                connector.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", "attention", rank, None, None, traceback.format_exc()))


def _ffn_rank(model_dir, index: int, variants, ports, results) -> None:
    from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
    from afd_shared_experts.model import load_ffn_weights

    try:
        torch.set_num_threads(1)
        select_device(CPU)  # the main thread; the runtime thread must select its own
        spec = load_spec(model_dir)
        for placement, stages in variants:
            weights = load_ffn_weights(model_dir, spec, placement, index, FFN_RANKS, torch.float32, CPU)
            connector = _connector(model_dir, "ffn", ATTENTION_RANKS + index, placement, ports[(placement, stages)])
            connector.init()
            runtime = FFNRuntime(connector, torch_experts(weights)).start()
            try:
                runtime.join(120)
            finally:
                connector.close()
            results.put(("ok", "ffn", index, placement, stages, runtime.items_served))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", "ffn", index, None, None, traceback.format_exc()))


def test_2a_3f_on_the_grouped_device_path_for_both_placements_and_one_and_two_stages(tmp_path):
    """Every rank a process; every post goes through GroupedTransport over the strict double;
    the FFN side serves from its runtime thread. Outputs match the transformers oracle."""
    model_dir = write_moe_checkpoint(tmp_path / "v3-12", "deepseek_v3", seed=3, experts=12)
    spec = load_spec(model_dir)
    x = torch.randn(TOKENS, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    shares = [x[slice(*token_range(a, TOKENS, ATTENTION_RANKS))].clone() for a in range(ATTENTION_RANKS)]
    ports = {variant: free_port() for variant in VARIANTS}
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_attention_rank, args=(model_dir, a, VARIANTS, [ports[v] for v in VARIANTS],
                                                           shares[a], results), daemon=True)
             for a in range(ATTENTION_RANKS)]
    ranks += [context.Process(target=_ffn_rank, args=(model_dir, f, VARIANTS, ports, results), daemon=True)
              for f in range(FFN_RANKS)]
    for rank in ranks:
        rank.start()
    collected, errors = [], []
    try:
        deadline = time.monotonic() + 240
        while len(collected) + len(errors) < len(ranks) * len(VARIANTS) and time.monotonic() < deadline:
            try:
                status, role, index, placement, stages, payload = results.get(timeout=1)
            except queue.Empty:
                continue
            if status == "ok":
                collected.append((role, index, placement, stages, payload))
            else:
                errors.append(f"{role} rank {index}:\n{payload}")
                # the rank that broke a rule fails first; its peers then lose their connections
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for rank in ranks:
            rank.join(30)
            if rank.is_alive():
                rank.kill()
    assert not errors, "\n".join(sorted(errors, key=lambda e: "ContractViolation" not in e))
    assert len(collected) == len(ranks) * len(VARIANTS), f"{len(collected)} results within 240 s"
    expected = oracle_outputs(model_dir, x, "float32", spec.moe_layers)
    for placement, stages in VARIANTS:
        outputs = {index: payload for role, index, p, s, payload in collected
                   if (role, p, s) == ("attention", placement, stages)}
        got = {l: torch.cat([outputs[a][l] for a in range(ATTENTION_RANKS)]) for l in spec.moe_layers}
        assert_matches_oracle(got, expected, "float32")
        served = [payload for role, _, p, s, payload in collected if (role, p, s) == ("ffn", placement, stages)]
        # every FFN rank served every (step, layer, stage) of both Attention ranks
        assert served == [ATTENTION_RANKS * len(STEP_TOKENS) * len(spec.moe_layers) * stages] * FFN_RANKS, served


@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_bytes_per_layer_follow_the_steps_tokens_within_twice_their_exact_frames(checkpoints, placement):
    """On the device path a dispatch of T tokens travels in messages sized for the next power of
    two (both ends derive it from the header's T): at most twice the frames of exactly T tokens,
    whatever the token budget (here 2048, so a 1-token step used to carry 2048 tokens' frames)."""
    from plugin_harness import ThreadWorld

    budget = 2048
    with ThreadWorld(checkpoints["deepseek_v3"], 1, 2, placement=placement, data_plane="direct", max_tokens=budget,
                     link_transport=strict_link_transport(stall_seconds=30.0)) as world:
        attention, layout = world.attention_connectors[0], world.attention_connectors[0].layout
        layers, row_bytes = len(world.spec.moe_layers), layout.hidden_size * layout.row_bytes_per_element
        for tokens in (1, 8, 32, 256, 2048):
            x = torch.randn(tokens, world.spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
            work_before = attention.sent_bytes["work"]
            replies_before = sum(c.sent_bytes["replies"] for c in world.ffn_connectors)

            def forward():
                select_device(CPU)
                return {l: moe.forward(x) for l, moe in world.layers[0].items()}

            (outputs,) = run_threads([forward], timeout=120)
            work = (attention.sent_bytes["work"] - work_before) / layers
            replies = (sum(c.sent_bytes["replies"] for c in world.ffn_connectors) - replies_before) / layers
            exact_work = layout.num_ffn_ranks * (layout.header_rows + layout.capacity_for(tokens)) * row_bytes
            exact_replies = layout.num_ffn_ranks * layout.reply_capacity_for(tokens) * row_bytes
            assert exact_work <= work <= 2 * exact_work, (tokens, work, exact_work)
            assert exact_replies <= replies <= 2 * exact_replies, (tokens, replies, exact_replies)
            if tokens == 1:
                assert work * 500 < layout.num_ffn_ranks * layout.work_rows * row_bytes  # not the budget's frames
        assert_matches_oracle(outputs, oracle_outputs(checkpoints["deepseek_v3"], x, "float32", world.spec.moe_layers),
                              "float32")


def test_a_connector_without_vllm_refuses_the_direct_plane_on_an_accelerator_clearly():
    with pytest.raises(AFDError, match=r"data plane direct on cuda:0: its links are vLLM's PyNcclCommunicator, "
                                       r"and vLLM cannot be imported here"):
        accelerator_link_transport("work", dist.HashStore(), 0, 2, torch.device("cuda", 0))
