"""End-to-end with real vLLM 0.23.0 on CPU (offline vllm.LLM), every engine from vLLM's
default compilation (one Dynamo trace compiled by inductor on this platform; the AFD engines
call the remote MoE as the custom ops afd::dispatch / afd::combine): AFD greedy output equals
plain vLLM's, and the Attention side holds exactly the shared-expert bytes less under placement
'ffn'. Three vLLM starts per model (plain, placement ffn with 2 micro-batch stages, placement
attention with 1), each AFD one with two FFN server processes. Every run has the test bed's
stand-in for a platform plugin's own FusedMoE registration (as vllm-ascend makes) loaded beside
the plugin. Every prompt is queued before the first step, so the prefill step and each decode
step hold all four requests (the stage tests split every such step). Attention TP 2 runs eager
with 2 stages (the engines' --enforce-eager, as a user may give it)."""

from collections import Counter

import pytest
import torch
from safetensors import safe_open

from afd_devcluster.checkpoints import cached_vllm_checkpoint, write_vllm_checkpoint
from afd_devcluster.ports import stable_port
from afd_shared_experts.moe_spec import load_spec
from stage_traces import assert_staged_schedule
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    afd_block,
    afd_run,
    free_port,
    install_testbed_plugin,
    run_driver,
)

MODELS = ("deepseek_v2", "deepseek_v3", "qwen2_moe")
STAGES = {"ffn": 2, "attention": 1}
# vLLM's defaults on its CPU platform, which an AFD engine keeps: a compiled model, no graphs.
COMPILED = {"enforce_eager": False, "compilation_mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "NONE"}
# The test bed's engines run with Dynamo off to start fast (vllm_harness.base_env); these compile.
DYNAMO_ON = {"TORCHDYNAMO_DISABLE": "0"}


def plain_reference(tmp_path_factory, model_type: str, seed: int):
    """(folder, tiny checkpoint of model_type, the generation request, plain vLLM's run of it),
    from vLLM's default compilation. The checkpoint's path and the afd blocks' ports stay the
    same run after run, so vLLM's compile cache (keyed on the engine config) serves later runs."""
    root = tmp_path_factory.mktemp(model_type)
    model = cached_vllm_checkpoint(model_type, seed=seed)
    request = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": 2, "enforce_eager": False}
    return root, model, request, run_driver(request, root, "plain", env=DYNAMO_ON)


@pytest.fixture(scope="module", params=MODELS)
def runs(request, tmp_path_factory):
    """One model's runs by name ("plain", "ffn", "attention") and its checkpoint ("model"); one
    model at a time, so each setup stays within the per-test timeout."""
    install_testbed_plugin()
    model_type = request.param
    root, model, generation, plain = plain_reference(tmp_path_factory, model_type, MODELS.index(model_type))
    results = {"plain": plain, "model": model}
    for placement in ("ffn", "attention"):
        block = afd_block("attention", port=stable_port(f"offline-{model_type}-{placement}"), placement=placement,
                          stages=STAGES[placement])
        # The load format the operator renders for Attention engines.
        results[placement] = afd_run(model, {**generation, "load_format": "afd"}, block, root, placement,
                                     env=DYNAMO_ON)
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
    block = afd_block("attention", port=free_port(), attention_ranks=2, tp=2, stages=2)
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


@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_afd_engines_keep_vllms_default_compilation(runs, placement):
    assert runs["plain"]["graph_mode"] == runs[placement]["graph_mode"] == COMPILED
    assert "enforce_eager set" not in runs[placement]["log"]


@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_afd_greedy_ids_equal_plain_vllm(runs, placement):
    plain = runs["plain"]["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    assert runs[placement]["token_ids"] == plain


@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_afd_logprobs_equal_plain_vllm_up_to_float32_rounding(runs, placement):
    """Not bit for bit: AFD sums a token's expert rows in the Attention side's combine, plain vLLM
    inside its fused MoE kernel, in another order (docs/benchmarks.md measured differences up to
    3e-6 on these checkpoints). A wrong routing weight, scale or shared-expert gate moves them by
    orders of magnitude more, also where the greedy ids happen to agree."""
    plain, afd = runs["plain"]["logprobs"], runs[placement]["logprobs"]
    assert len(afd) == len(plain) == len(PROMPTS)
    differences = []
    for prompt_plain, prompt_afd, ids in zip(plain, afd, runs["plain"]["token_ids"]):
        assert len(prompt_afd) == len(prompt_plain) == MAX_TOKENS
        for position_plain, position_afd, chosen in zip(prompt_plain, prompt_afd, ids):
            assert str(chosen) in position_afd
            differences += [abs(position_afd[token] - logprob) for token, logprob in position_plain.items()
                            if token in position_afd]
    assert max(differences) < 1e-4


def test_steps_ran_as_micro_batch_stages_with_one_expert_pass_per_stage(runs):
    assert_staged_schedule(runs["ffn"]["traces"], stages=STAGES["ffn"], attention_ranks=1)


def test_attention_tensor_parallel_2_runs_stages_in_the_same_order_on_both_ranks(tensor_parallel_2):
    assert_staged_schedule(tensor_parallel_2["afd"]["traces"], stages=2, attention_ranks=2)


def assert_both_ffn_servers_served(result: dict) -> None:
    """From the stage traces each process wrote (the servers' /metrics end with them: an FFN
    server stops once every Attention rank shut down): each of the two FFN servers ran expert
    passes over rows, and together they passed every row the Attention side dispatched."""
    served = Counter()
    for interval in result["traces"]:
        if interval["role"] == "ffn" and interval["kind"] == "expert_pass":
            served[interval["rank"]] += interval["rows"]
    dispatched = sum(i["rows"] for i in result["traces"] if i["role"] == "attention" and i["kind"] == "dispatch")
    assert len(served) == 2 and all(rows > 0 for rows in served.values()), (served, result["ffn_logs"][-1][-2000:])
    assert sum(served.values()) == dispatched > 0, (served, dispatched)


@pytest.mark.parametrize("placement", ["ffn", "attention"])
def test_both_ffn_servers_served_work(runs, placement):
    assert_both_ffn_servers_served(runs[placement])


def test_attention_bytes_shrink_by_exactly_the_shared_experts(runs):
    (ffn,) = runs["ffn"]["parameter_bytes"]
    (attention,) = runs["attention"]["parameter_bytes"]
    (plain,) = runs["plain"]["parameter_bytes"]
    shared = shared_expert_bytes(runs["model"])
    assert shared > 0 and attention - ffn == shared
    # No routed expert weight on the Attention side under either placement.
    assert plain > attention


def test_remote_experts_are_built_only_for_afd_and_the_platform_layer_is_restored(runs):
    # Plain vLLM builds the platform's registered FusedMoE; an AFD model builds remote experts in
    # every MoE layer, and the platform's registration is in force again once it is built.
    assert runs["plain"]["experts_classes"] == [["PlatformFusedMoE"]]
    for placement in ("ffn", "attention"):
        assert runs[placement]["experts_classes"] == [["AFDFusedMoE"]]
    for run in ("plain", "ffn", "attention"):
        assert runs[run]["fused_moe_registered"] == ["PlatformFusedMoE"]


def test_attention_tensor_parallel_2_with_placement_ffn_equals_plain_vllm(tensor_parallel_2):
    plain, afd = tensor_parallel_2["plain"], tensor_parallel_2["afd"]
    assert all(len(ids) == MAX_TOKENS for ids in plain["token_ids"])
    assert afd["token_ids"] == plain["token_ids"]
    assert afd["experts_classes"] == [["AFDFusedMoE"], ["AFDFusedMoE"]]
    assert_both_ffn_servers_served(afd)


def test_load_format_afd_reads_no_routed_expert_from_disk(runs):
    # vLLM's loader skipped every routed-expert weight before reading it; under placement 'ffn'
    # only the (small) shared-expert tensors were read and dropped by the wrapper.
    spec = load_spec(runs["model"])
    shared_modules = (spec.shared_prefix, "shared_expert_gate") if spec.has_shared_gate else (spec.shared_prefix,)
    shared = sum(len(expert_tensor_names(runs["model"], m)) for m in shared_modules)
    assert runs["attention"]["remote_tensors_read"] == [0]
    assert runs["ffn"]["remote_tensors_read"] == [shared] and shared > 0


def test_default_load_format_still_drops_remote_tensors(tensor_parallel_2):
    # With vLLM's default loader every remote tensor is read (and dropped by name) on each worker.
    model = tensor_parallel_2["model"]
    remote = len(expert_tensor_names(model, "experts")) + len(expert_tensor_names(model, "shared_experts"))
    assert tensor_parallel_2["afd"]["remote_tensors_read"] == [remote, remote]
