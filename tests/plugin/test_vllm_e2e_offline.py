"""End-to-end with real vLLM 0.23.0 on CPU (offline vllm.LLM): AFD greedy output equals
plain vLLM's, and the Attention side holds exactly the shared-expert bytes less under
placement 'ffn'. Three vLLM starts per model (plain, placement ffn, placement attention),
each AFD one with two FFN server processes. Every run has the test bed's stand-in for a
platform plugin's own FusedMoE registration (as vllm-ascend makes) loaded beside the plugin."""

import pytest
import torch
from safetensors import safe_open

from afd_shared_experts.model import load_spec
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    afd_block,
    free_port,
    http_status,
    install_testbed_plugin,
    run_driver,
    start_ffn_servers,
    write_vllm_checkpoint,
)

MODELS = ("deepseek_v2", "deepseek_v3", "qwen2_moe")


def afd_run(model, request: dict, block: dict, root, tag: str) -> dict:
    """The driver as an AFD Attention side with two FFN server processes (stopped after)."""
    servers = start_ffn_servers(model, block, root, tag=f"ffn-{tag}")
    try:
        result = run_driver({**request, "additional_config": block}, root, f"afd-{tag}")
        # Still serving after the run: the engine's exit closed its connector cleanly.
        result["ffn_ready_after_run"] = [http_status(port, "/ready") for _, port in servers]
    finally:
        for proc, _ in servers:
            proc.stop()
    result["ffn_logs"] = [proc.log() for proc, _ in servers]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    install_testbed_plugin()
    results = {}
    for seed, model_type in enumerate(MODELS):
        root = tmp_path_factory.mktemp(model_type)
        model = write_vllm_checkpoint(root / "model", model_type, seed=seed)
        request = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
        results[model_type, "plain"] = run_driver(request, root, "plain")
        for placement in ("ffn", "attention"):
            block = afd_block("attention", port=free_port(), placement=placement)
            # The load format the operator renders for Attention engines.
            results[model_type, placement] = afd_run(model, {**request, "load_format": "afd"}, block, root, placement)
        results[model_type, "model"] = model
    return results


@pytest.fixture(scope="module")
def tensor_parallel_2(tmp_path_factory):
    """Attention TP 2 (two workers: Attention ranks 0 and 1, each dispatching its token shard)
    with placement 'ffn', and plain vLLM at TP 2: its reductions differ from TP 1's, so that is
    the reference. vLLM's default load format here (a user's --load-format override)."""
    install_testbed_plugin()
    root = tmp_path_factory.mktemp("tp2")
    model = write_vllm_checkpoint(root / "model", "deepseek_v2")
    request = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "tensor_parallel_size": 2}
    block = afd_block("attention", port=free_port(), attention_ranks=2, tp=2)
    return {"plain": run_driver(request, root, "plain-tp2"), "afd": afd_run(model, request, block, root, "tp2"),
            "model": model}


def expert_tensor_names(model_dir, module: str) -> list[str]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return [name for name in f.keys() if f".mlp.{module}." in name]


def shared_expert_bytes(model_dir) -> int:
    """Bytes of every shared-expert tensor (Qwen2-MoE: with its shared-expert gate) as float32."""
    spec = load_spec(model_dir)
    modules = (spec.shared_prefix, "shared_expert_gate") if spec.has_shared_gate else (spec.shared_prefix,)
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if any(f".mlp.{module}." in n for module in modules)]
        assert len(names) == len(spec.moe_layers) * (4 if spec.has_shared_gate else 3)
        for name in names:
            total += f.get_tensor(name).numel() * torch.float32.itemsize
    return total


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_afd_greedy_ids_equal_plain_vllm(runs, model_type, placement):
    plain = runs[model_type, "plain"]["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    assert runs[model_type, placement]["token_ids"] == plain


@pytest.mark.parametrize("model_type", MODELS)
def test_both_ffn_servers_served_work(runs, model_type):
    for placement in ("ffn", "attention"):
        for log in runs[model_type, placement]["ffn_logs"]:
            assert "serving" in log, log[-2000:]


@pytest.mark.parametrize("model_type", MODELS)
def test_attention_bytes_shrink_by_exactly_the_shared_experts(runs, model_type):
    (ffn,) = runs[model_type, "ffn"]["parameter_bytes"]
    (attention,) = runs[model_type, "attention"]["parameter_bytes"]
    (plain,) = runs[model_type, "plain"]["parameter_bytes"]
    shared = shared_expert_bytes(runs[model_type, "model"])
    assert shared > 0 and attention - ffn == shared
    # No routed expert weight on the Attention side under either placement.
    assert plain > attention


@pytest.mark.parametrize("model_type", MODELS)
def test_remote_experts_are_built_only_for_afd_and_the_platform_layer_is_restored(runs, model_type):
    # Plain vLLM builds the platform's registered FusedMoE; an AFD model builds remote experts in
    # every MoE layer, and the platform's registration is in force again once it is built.
    assert runs[model_type, "plain"]["experts_classes"] == [["PlatformFusedMoE"]]
    for placement in ("ffn", "attention"):
        assert runs[model_type, placement]["experts_classes"] == [["AFDFusedMoE"]]
    for run in ("plain", "ffn", "attention"):
        assert runs[model_type, run]["fused_moe_registered"] == ["PlatformFusedMoE"]


def test_attention_tensor_parallel_2_with_placement_ffn_equals_plain_vllm(tensor_parallel_2):
    plain, afd = tensor_parallel_2["plain"], tensor_parallel_2["afd"]
    assert all(len(ids) == MAX_TOKENS for ids in plain["token_ids"])
    assert afd["token_ids"] == plain["token_ids"]
    assert afd["experts_classes"] == [["AFDFusedMoE"], ["AFDFusedMoE"]]
    assert all("serving" in log for log in afd["ffn_logs"]), afd["ffn_logs"]


@pytest.mark.parametrize("model_type", MODELS)
def test_load_format_afd_reads_no_routed_expert_from_disk(runs, model_type):
    # vLLM's loader skipped every routed-expert weight before reading it; under placement 'ffn'
    # only the (small) shared-expert tensors were read and dropped by the wrapper.
    spec = load_spec(runs[model_type, "model"])
    shared_modules = (spec.shared_prefix, "shared_expert_gate") if spec.has_shared_gate else (spec.shared_prefix,)
    shared = sum(len(expert_tensor_names(runs[model_type, "model"], m)) for m in shared_modules)
    assert runs[model_type, "attention"]["remote_tensors_read"] == [0]
    assert runs[model_type, "ffn"]["remote_tensors_read"] == [shared] and shared > 0


def test_default_load_format_still_drops_remote_tensors(tensor_parallel_2):
    # With vLLM's default loader every remote tensor is read (and dropped by name) on each worker.
    model = tensor_parallel_2["model"]
    remote = len(expert_tensor_names(model, "experts")) + len(expert_tensor_names(model, "shared_experts"))
    assert tensor_parallel_2["afd"]["remote_tensors_read"] == [remote, remote]
