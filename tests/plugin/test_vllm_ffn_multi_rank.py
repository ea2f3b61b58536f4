"""FFN pods with several ranks against real vLLM 0.23.0 on CPU (`vllm serve`), with the rank
counts and splits the operator renders for the Ascend examples, and an uneven split. Each FFN
pod is `python -m afd_shared_experts.ffn_server --ffn-local-ranks N`: one supervisor, one
process per rank. The model (DeepSeek-V3 shape, 48 routed experts) divides by 16, 4 and 3 FFN
ranks. One `vllm serve` per world (~65 s each here), plus the plain reference. The prompts go
one at a time, then all at once; the uneven world splits its steps into 2 micro-batch stages,
and every world's stage traces show one expert pass per (step, layer, stage) on every FFN rank,
ranks that share a pod included.

What runs, and why the Attention side is smaller than the examples' DP4 x TP4, is in
docs/plugin.md ("FFN server: one process per rank").
"""

from __future__ import annotations

import signal

import pytest

from afd_devcluster.checkpoints import write_vllm_checkpoint
from afd_shared_experts.trace import read_traces
from plugin_harness import child_pids
from stage_traces import assert_staged_schedule
from vllm_harness import (
    afd_block,
    free_port,
    greedy_completions,
    http_status,
    install_testbed_plugin,
    start_ffn_servers,
    start_vllm_serve,
    wait_until,
)

START_TIMEOUT = 900
EXPERTS = 48
# name: (Attention data parallel, tensor parallel, FFN ranks per pod, FFN expert backend,
# micro-batch stages)
WORLDS = {
    # examples/small-ascend.yaml: 4 FFN ranks in 2 pods of 2.
    "small-ascend": (2, 1, (2, 2), "vllm", 1),
    # examples/deepseek-v3-ascend.yaml: 16 FFN ranks in one pod (torch backend: 16 vLLM imports
    # do not fit this machine's memory beside the engines).
    "deepseek-v3-ascend": (2, 1, (16,), "torch", 1),
    # Stages against ranks that share a pod: one expert pass per (layer, stage) on each rank.
    "uneven-staged": (1, 1, (2, 1), "vllm", 2),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    install_testbed_plugin()
    return write_vllm_checkpoint(tmp_path_factory.mktemp("multi-rank") / "model", "deepseek_v3", seed=4,
                                 experts=EXPERTS)


def serve(model, logdir, name: str, block: dict | None, split: tuple[int, ...] = (), backend: str = "vllm",
          data_parallel: int = 1, tensor_parallel: int = 1) -> dict:
    """`vllm serve` (AFD with the FFN pods of `split` when `block` is given, both sides writing
    stage traces to logdir/traces): completions sent one at a time and at once, the pods' /ready
    and rank processes; everything stopped after."""
    api_port = free_port()
    traces = logdir / "traces"
    pods = start_ffn_servers(model, block, logdir, split=split, extra_args=("--expert-backend", backend),
                             trace_dir=traces) if block else []
    procs = [proc for proc, _ in pods]
    try:
        api = start_vllm_serve(model, api_port, logdir, name, block=block, data_parallel=data_parallel,
                               tensor_parallel=tensor_parallel, trace_dir=traces if block else None,
                               extra_args=("--shutdown-timeout", "15"))
        procs.append(api)
        wait_until(lambda: http_status(api_port, "/health") == 200, START_TIMEOUT, f"{name} vllm serve /health", procs)
        result = {"completions": greedy_completions(api_port), "at_once": greedy_completions(api_port, at_once=True),
                  "ready": [http_status(port, "/ready") for _, port in pods],
                  "rank_processes": [len(child_pids(proc.popen.pid)) for proc, _ in pods]}
        # The Attention side ends first and its engines finish their step (an idle DP engine's
        # dummy steps included), so both sides' traces hold every step whole.
        api.signal(signal.SIGTERM)
        api.wait(60)
        return result
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    return serve(model, tmp_path_factory.mktemp("plain"), "plain", None)["completions"]


@pytest.fixture(scope="module", params=WORLDS)
def world(request, model, tmp_path_factory):
    data_parallel, tensor_parallel, split, backend, stages = WORLDS[request.param]
    block = afd_block("attention", port=free_port(), attention_ranks=data_parallel * tensor_parallel,
                      ffn_ranks=sum(split), tp=tensor_parallel, stages=stages)
    logdir = tmp_path_factory.mktemp(request.param)
    result = serve(model, logdir, request.param, block, split, backend, data_parallel, tensor_parallel)
    # Read once every process ended.
    return {**result, "split": split, "stages": stages, "attention_ranks": data_parallel * tensor_parallel,
            "traces": read_traces(logdir / "traces")}


def test_every_pod_is_ready_with_one_process_per_rank(world):
    assert world["ready"] == [200] * len(world["split"])
    assert world["rank_processes"] == list(world["split"])


def test_completions_equal_plain_vllm(world, reference):
    assert world["completions"] == reference
    assert world["at_once"] == reference


def test_every_rank_runs_one_expert_pass_per_layer_and_stage(world):
    counts = assert_staged_schedule(world["traces"], stages=world["stages"], attention_ranks=world["attention_ranks"])
    # FFN ranks trace their world rank: after the Attention ranks.
    ffn_ranks = {interval["rank"] for interval in world["traces"] if interval["kind"] == "expert_pass"}
    first = world["attention_ranks"]
    assert ffn_ranks == set(range(first, first + sum(world["split"])))
    assert (counts["staged_layers"] > 0) == (world["stages"] > 1), counts
