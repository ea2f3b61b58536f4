"""Connector lifetimes over real gloo ranks: close unblocks receives, the rendezvous's windows,
and a killed peer failing the other side within its timeout."""

import multiprocessing
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from afd_devcluster import free_port
from afd_shared_experts.attention import AttentionMoELayer, RemoteMoE
from afd_shared_experts.errors import ConnectorClosedError, PeerLostError
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import load_attention_weights, load_ffn_weights
from afd_shared_experts.moe_spec import load_spec
from plugin_harness import (RENDEZVOUS_ONLY_SPEC, attention_rank_that_idles, connected, ffn_rank_that_serves,
                            make_connector, run_threads)


def test_close_unblocks_blocking_receives(checkpoints):
    model_dir = checkpoints["deepseek_v2"]
    spec, (attention, ffn) = connected(model_dir, 1, 1)
    runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32))).start()
    time.sleep(0.2)  # let the loop block in receive_work
    runtime.stop(timeout=5)  # returns (no stored error) instead of hanging
    assert not ffn.is_initialized

    # Attention blocked on a reply that never comes (FFN alive, not serving); close() it.
    attention.close()
    spec, (attention, silent_ffn) = connected(model_dir, 1, 1)
    weights = load_attention_weights(model_dir, spec, "ffn", torch.float32)
    layer = spec.moe_layers[0]
    moe = AttentionMoELayer(weights[layer].gate, RemoteMoE(spec=spec, layer=layer, connector=attention,
                                                           num_ffn_ranks=1, placement="ffn", partition="affinity",
                                                           dtype=torch.float32))
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(moe.forward, torch.randn(2, spec.hidden_size))))
    thread.start()
    time.sleep(0.2)
    attention.close()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(errors[0], ConnectorClosedError)
    attention.close()  # idempotent
    silent_ffn.close()


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def test_close_after_partial_init_is_safe():
    spec = RENDEZVOUS_ONLY_SPEC
    connector = make_connector(spec, "ffn", 1, 1, 1, free_port(), timeout=1, rendezvous_timeout=1)
    with pytest.raises(PeerLostError, match=r"rendezvous at 127\.0\.0\.1:\d+ for world size 2 failed"):
        connector.init()  # nobody hosts the store
    connector.close()
    connector.close()
    with pytest.raises(ConnectorClosedError):
        connector.receive_work()


def test_a_rank_waiting_since_before_rank_0_joins_within_its_window():
    """The FFN servers retry the rendezvous until the Attention head hosts the store. A rank whose
    previous attempt just expired must still join well inside rank 0's window; a TCPStore client
    that found nobody listening sleeps a random backoff of about its timeout (the cause of a CI
    failure: 17.8 s against rank 0's 15 s window). Rank 0's window here is 3 s against the FFN
    rank's 6 s, so a rank that joins late fails rank 0's init. The time to the end of the FFN
    rank's init is not asserted: it includes the process groups' setup, which is not the window."""
    spec = RENDEZVOUS_ONLY_SPEC
    port = free_port()
    give_up = time.monotonic() + 25

    def ffn_rank_retrying():
        while time.monotonic() < give_up:
            connector = make_connector(spec, "ffn", 1, 1, 1, port, timeout=6, rendezvous_timeout=6)
            try:
                connector.init()
                return connector
            except PeerLostError:
                connector.close()
                time.sleep(0.5)
        raise AssertionError("the FFN rank never joined")

    def attention_rank_after_first_attempt_expired():
        time.sleep(6.2)
        connector = make_connector(spec, "attention", 0, 1, 1, port, timeout=3, rendezvous_timeout=3)
        connector.init()
        return connector

    made = run_threads([ffn_rank_retrying, attention_rank_after_first_attempt_expired], timeout=30)
    try:
        assert all(c.is_initialized for c in made)
    finally:
        for connector in made:
            connector.close()


def test_rank_0_waits_past_the_liveness_timeout_for_an_ffn_rank_still_loading():
    """FFN servers join only once their experts are loaded, which can take longer than the
    liveness timeout (a CI roll: an Attention head failed its rendezvous while its FFN pods were
    loading on a busy node). Rank 0's bound is the rendezvous timeout; once the world is up,
    liveness is the short timeout again."""
    spec = RENDEZVOUS_ONLY_SPEC
    port = free_port()

    def attention_rank():
        made = make_connector(spec, "attention", 0, 1, 1, port, timeout=1, rendezvous_timeout=30)
        made.init()
        return made

    def ffn_rank_after_loading():
        time.sleep(4)  # four liveness timeouts
        made = make_connector(spec, "ffn", 1, 1, 1, port, timeout=1, rendezvous_timeout=30)
        made.init()
        return made

    started = time.monotonic()
    made = run_threads([attention_rank, ffn_rank_after_loading], timeout=40)
    try:
        assert all(c.is_initialized for c in made) and time.monotonic() - started >= 4
        assert [c.timeout_seconds for c in made] == [1.0, 1.0]
    finally:
        for c in made:
            c.close()


def test_rank_0_gives_up_after_the_rendezvous_timeout():
    spec = RENDEZVOUS_ONLY_SPEC
    connector = make_connector(spec, "attention", 0, 1, 1, free_port(), timeout=1, rendezvous_timeout=1)
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"for world size 2 failed within 1(\.0)?s: .*1/2 clients joined"):
        connector.init()  # no FFN rank ever joins
    assert time.monotonic() - started < 15
    connector.close()


@contextmanager
def rank_process(target, *args):
    """``target(*args, ready)`` in a spawned process: yields (process, ready event); killed at exit."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=target, args=(*args, ready), daemon=True)
    child.start()
    try:
        yield child, ready
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_killed_ffn_rank_fails_attention_within_timeout(checkpoints):
    model_dir = checkpoints["deepseek_v2"]
    spec = load_spec(model_dir)
    port = free_port()
    with rank_process(ffn_rank_that_serves, str(model_dir), port) as (child, ready):
        attention = make_connector(spec, "attention", 0, 1, 1, port, timeout=3)
        try:
            assert ready.wait(60)
            attention.init()
            weights = load_attention_weights(model_dir, spec, "ffn", torch.float32)
            layer = spec.moe_layers[0]
            moe = AttentionMoELayer(weights[layer].gate, RemoteMoE(spec=spec, layer=layer, connector=attention,
                                                                   num_ffn_ranks=1, placement="ffn",
                                                                   partition="affinity", dtype=torch.float32))
            moe.forward(torch.randn(3, spec.hidden_size))  # healthy step
            child.kill()
            child.join(10)
            started = time.monotonic()
            with pytest.raises(PeerLostError, match=r"FFN rank 0 \(world rank 1\)"):
                moe.forward(torch.randn(3, spec.hidden_size))
            assert time.monotonic() - started < 3 + 2  # the configured timeout bounds the failure
        finally:
            attention.close()


def test_killed_attention_rank_fails_ffn_loop_with_clear_error(checkpoints):
    model_dir = checkpoints["deepseek_v2"]
    spec = load_spec(model_dir)
    port = free_port()
    with rank_process(attention_rank_that_idles, str(model_dir), port, 2, 1, 1) as (child, ready):
        attention0 = make_connector(spec, "attention", 0, 2, 1, port, timeout=3)
        ffn = make_connector(spec, "ffn", 2, 2, 1, port, timeout=3)
        try:
            assert ready.wait(60)
            run_threads([attention0.init, ffn.init], timeout=60)
            runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1,
                                                                     torch.float32))).start()
            child.kill()
            child.join(10)
            with pytest.raises(PeerLostError, match=r"Attention rank 1"):
                runtime.join(timeout=15)
        finally:
            attention0.close()
            ffn.close()
