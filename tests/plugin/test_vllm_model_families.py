"""The MoE families beyond DeepSeek-V2/V3 and Qwen2-MoE with real vLLM 0.23.0 on CPU: Qwen3-MoE
(no shared expert), GLM-4.5 (sigmoid grouped gate, shared expert, a first dense layer, an MTP
layer in its config) and Kimi-K2 (DeepSeek-V3's classes under its own model_type). Each tiny
checkpoint carries its published model's config keys. AFD greedy ids equal plain vLLM's with 2
micro-batch stages against one FFN pod holding 2 ranks, and with 1 stage against two pods of one
rank, under each placement that applies (offline vLLM); and through `vllm serve`. DeepSeek-V3.2
does not start on vLLM's CPU platform (its attention indexer): its MoE is checked at the core
level (test_plugin_oracle.py)."""

import pytest

from afd_devcluster.checkpoints import write_vllm_checkpoint
from afd_shared_experts.moe_spec import load_spec
from stage_traces import assert_staged_schedule
from vllm_harness import (MAX_TOKENS, PROMPTS, afd_block, afd_run, complete, free_port, http_status,
                          install_testbed_plugin, run_driver, served_model, start_ffn_servers, start_vllm_serve,
                          wait_until)

# (placement asked for, stages, FFN ranks of each pod) of every family's AFD runs. Qwen3-MoE's
# placement does not apply (no shared expert): whatever it asks for, it runs routed only.
AFD_RUNS = (("ffn", 2, (2,)), ("attention", 1, (1, 1)))
FAMILIES = ("glm4_moe", "kimi_k2", "qwen3_moe")
START_TIMEOUT = 300


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    install_testbed_plugin()
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    model = write_vllm_checkpoint(root / "model", model_type, seed=3)
    plain = run_driver({"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS}, root, "plain")
    request = {"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "load_format": "afd"}
    runs = {(placement, stages): afd_run(model, request, afd_block("attention", port=free_port(), placement=placement,
                                                                   stages=stages), root, f"{placement}-{stages}",
                                         split=split)
            for placement, stages, split in AFD_RUNS}
    return {"type": model_type, "model": model, "root": root, "plain": plain, "afd": runs}


def test_afd_greedy_ids_equal_plain_vllm(family):
    plain = family["plain"]["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    spec = load_spec(family["model"])
    for (placement, stages), run in family["afd"].items():
        assert run["token_ids"] == plain, (placement, stages)
        # Remote experts in every MoE layer; no routed-expert tensor read from disk, only the
        # shared expert's under placement 'ffn' (none for a model without one).
        assert run["experts_classes"] == [["AFDFusedMoE"]]
        shared_tensors = len(spec.moe_layers) * (4 if spec.has_shared_gate else 3)
        assert run["remote_tensors_read"] == [shared_tensors if spec.placement(placement) == "ffn" else 0]


def test_two_stage_runs_split_every_step_with_one_expert_pass_per_stage(family):
    # Every prompt is queued before the first step: each step holds all four requests.
    assert_staged_schedule(family["afd"][("ffn", 2)]["traces"], stages=2, attention_ranks=1)


def test_a_model_without_shared_experts_reports_the_placement_as_not_applicable(family):
    for (placement, _), run in family["afd"].items():
        logs = "\n".join(run["ffn_logs"])
        if family["type"] == "qwen3_moe":
            assert f"qwen3_moe has no shared experts: shared_experts.placement '{placement}' does not apply" in logs
            assert "(placement none," in logs
        else:
            assert "does not apply" not in logs
            assert f"(placement {placement}," in logs


def test_vllm_serve_answers_like_plain_vllm(family):
    """`vllm serve` as the operator renders it (load format afd, 2 stages) against one FFN pod
    of 2 ranks; requests one at a time."""
    model, root = family["model"], family["root"]
    answers = {}
    for name, block in (("plain", None), ("afd", afd_block("attention", port=free_port(), stages=2))):
        servers = start_ffn_servers(model, block, root, tag="ffn-serve", split=(2,)) if block else []
        port = free_port()
        api = start_vllm_serve(model, port, root, f"serve-{name}", block=block)
        procs = [proc for proc, _ in servers] + [api]
        try:
            wait_until(lambda: http_status(port, "/health") == 200, START_TIMEOUT, f"{name} vllm serve", procs)
            served = served_model(port)
            answers[name] = [(c["text"], c["token_ids"]) for c in (complete(port, served, p) for p in PROMPTS)]
        finally:
            for proc in procs:
                proc.stop()
    assert all(len(ids) == MAX_TOKENS for _, ids in answers["plain"])
    assert answers["afd"] == answers["plain"]
