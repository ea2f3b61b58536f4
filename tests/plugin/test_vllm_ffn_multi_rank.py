"""FFN pods with several ranks against real vLLM 0.23.0 on CPU (`vllm serve`), with the rank
counts and splits the operator renders for the Ascend examples, and an uneven split. Each FFN
pod is `python -m afd_shared_experts.ffn_server --ffn-local-ranks N`: one supervisor, one
process per rank. The model (DeepSeek-V3 shape, 48 routed experts) divides by 16, 4 and 3 FFN
ranks. One `vllm serve` per world (~65 s each here), plus the plain reference.

What runs, and why the Attention side is smaller than the examples' DP4 x TP4, is in
docs/plugin.md ("FFN server: one process per rank").
"""

from __future__ import annotations

import pytest

from plugin_harness import child_pids
from vllm_harness import (
    afd_block,
    free_port,
    greedy_completions,
    http_status,
    install_testbed_plugin,
    start_ffn_servers,
    start_vllm_serve,
    wait_until,
    write_vllm_checkpoint,
)

START_TIMEOUT = 900
EXPERTS = 48
# name: (Attention data parallel, tensor parallel, FFN ranks per pod, FFN expert backend)
WORLDS = {
    # examples/small-ascend.yaml: 4 FFN ranks in 2 pods of 2.
    "small-ascend": (2, 1, (2, 2), "vllm"),
    # examples/deepseek-v3-ascend.yaml: 16 FFN ranks in one pod (torch backend: 16 vLLM imports
    # do not fit this machine's memory beside the engines).
    "deepseek-v3-ascend": (2, 1, (16,), "torch"),
    "uneven": (1, 1, (2, 1), "vllm"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    install_testbed_plugin()
    return write_vllm_checkpoint(tmp_path_factory.mktemp("multi-rank") / "model", "deepseek_v3", seed=4,
                                 experts=EXPERTS)


def serve(model, logdir, name: str, block: dict | None, split: tuple[int, ...] = (), backend: str = "vllm",
          data_parallel: int = 1, tensor_parallel: int = 1) -> dict:
    """`vllm serve` (AFD with the FFN pods of `split` when `block` is given): completions, the
    pods' /ready and rank processes; everything stopped after."""
    api_port = free_port()
    pods = start_ffn_servers(model, block, logdir, split=split, extra_args=("--expert-backend", backend)) \
        if block else []
    procs = [proc for proc, _ in pods]
    try:
        api = start_vllm_serve(model, api_port, logdir, name, block=block, data_parallel=data_parallel,
                               tensor_parallel=tensor_parallel)
        procs.append(api)
        wait_until(lambda: http_status(api_port, "/health") == 200, START_TIMEOUT, f"{name} vllm serve /health", procs)
        return {"completions": greedy_completions(api_port), "ready": [http_status(port, "/ready") for _, port in pods],
                "rank_processes": [len(child_pids(proc.popen.pid)) for proc, _ in pods]}
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    return serve(model, tmp_path_factory.mktemp("plain"), "plain", None)["completions"]


@pytest.fixture(scope="module", params=WORLDS)
def world(request, model, tmp_path_factory):
    data_parallel, tensor_parallel, split, backend = WORLDS[request.param]
    block = afd_block("attention", port=free_port(), attention_ranks=data_parallel * tensor_parallel,
                      ffn_ranks=sum(split), tp=tensor_parallel)
    result = serve(model, tmp_path_factory.mktemp(request.param), request.param, block, split, backend,
                   data_parallel, tensor_parallel)
    return {**result, "split": split}


def test_every_pod_is_ready_with_one_process_per_rank(world):
    assert world["ready"] == [200] * len(world["split"])
    assert world["rank_processes"] == list(world["split"])


def test_completions_equal_plain_vllm(world, reference):
    assert world["completions"] == reference
