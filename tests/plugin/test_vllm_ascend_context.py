"""The FFN vLLM backend's Ascend branch (vllm/ffn.py), on CPU with real vLLM 0.23.0 and a
stand-in vllm_ascend tree (vllm_ascend_standin/) that records its calls: the branch makes the
calls vllm-ascend 0.23.0's NPU worker and model runner (worker/model_runner_v1.py) make around
a forward, so ``AscendFusedMoE`` finds its MoE communication method in the forward context; and
it fails with a clear message where vllm_ascend cannot be imported."""

from pathlib import Path

import pytest

from afd_devcluster.checkpoints import write_moe_checkpoint
from test_vllm_ffn_experts import run_vllm_driver

DRIVER = Path(__file__).resolve().parent / "vllm_ascend_context_driver.py"
THE_CONFIG = "<the rank's VllmConfig>"
NUM_FFN_RANKS = 2
COUNTS = [0, 3, 1, 2]  # rows per local expert of FFN rank 0 (8 experts over 2 ranks)
SHARED_ROWS = 5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("ascend_context")
    # vLLM's CPU fused-MoE kernel tiles 2 * moe_intermediate_size by 64.
    model = write_moe_checkpoint(root / "model", "deepseek_v3", seed=3, hidden=32, inter=32, experts=8, top_k=2, layers=2)
    request = {"model": str(model), "num_ffn_ranks": NUM_FFN_RANKS, "counts": COUNTS, "shared_rows": SHARED_ROWS}
    return run_vllm_driver(DRIVER, request, root, timeout=300)


def forward_context_call(num_tokens: int) -> list:
    """set_ascend_forward_context as vllm-ascend 0.23.0's runner calls it for an eager step
    without attention, DP, PCP, drafts, sinks or EPLB: every parameter, defaults included."""
    return ["set_ascend_forward_context", {
        "attn_metadata": None, "vllm_config": THE_CONFIG, "num_tokens": num_tokens, "num_tokens_across_dp": None,
        "in_profile_run": False, "num_actual_tokens": num_tokens, "aclgraph_runtime_mode": "NONE",
        "batch_descriptor": None, "model_instance": None, "is_draft_model": False, "skip_compiled": False,
        "max_tokens_across_pcp": 0, "draft_attn_metadatas": None, "has_sinks": False, "input_ids": None,
        "eplb_heat_collection_status": False}]


def test_ascend_branch_sets_up_the_process_as_vllm_ascends_worker_and_runner(result):
    # Worker: register_ascend_customop(vllm_config); model runner __init__:
    # set_mc2_tokens_capacity(vllm_config, max_num_seqs, uniform decode query length 1),
    # set_mc2_mask(vllm_config, device); once per process, before the first forward.
    assert result["calls"][:3] == [
        ["register_ascend_customop", {"vllm_config": THE_CONFIG}],
        ["set_mc2_tokens_capacity", {"vllm_config": THE_CONFIG, "max_num_reqs": result["max_num_seqs"],
                                     "uniform_decode_query_len": 1}],
        ["set_mc2_mask", {"vllm_config": THE_CONFIG, "device": "cpu"}],
    ]


def test_each_work_item_runs_inside_set_ascend_forward_context(result):
    # One routed and one shared computation: one context each, with that work item's row count.
    assert result["calls"][3:] == [forward_context_call(sum(COUNTS)), forward_context_call(SHARED_ROWS)]
    # The same numbers as in plain vLLM's forward context (the stand-in sets that one too).
    assert result["outputs_equal_plain_context"] == [True, True]


def test_ascend_branch_without_vllm_ascend_fails_clearly(result):
    message = result["missing_error"]
    assert message is not None
    assert "needs vllm-ascend 0.23.0" in message and "vllm_ascend.utils cannot be imported" in message
