"""Graph modes with real vLLM 0.23.0 on CPU: an AFD Attention engine started with vLLM's default
compilation settings (no enforce_eager) runs eager, says why in its log, and gives plain vLLM's
greedy ids. The remote MoE does host-side work and point-to-point calls inside the forward, which
no captured graph (CUDA/ACL) replays and torch.compile cannot trace (docs/compat.md)."""

import pytest

from afd_shared_experts.vllm.compat import EAGER_REASON
from test_vllm_e2e_offline import afd_run, assert_both_ffn_servers_served, plain_reference
from vllm_harness import MAX_TOKENS, afd_block, free_port, install_testbed_plugin, run_driver

MODELS = ("deepseek_v3", "qwen2_moe")
EAGER = {"enforce_eager": True, "compilation_mode": "NONE", "cudagraph_mode": "NONE"}


def default_compilation_runs(tmp_path_factory, model_type: str, seed: int) -> dict:
    """Plain vLLM eager (the reference), the AFD Attention engine (placement 'ffn', two FFN
    servers) with vLLM's default compilation settings and its log, and the engine config vLLM's
    defaults give this model without an afd block (config only, no engine)."""
    root, model, request, plain = plain_reference(tmp_path_factory, model_type, seed)
    block = afd_block("attention", port=free_port(), placement="ffn")
    afd = afd_run(model, {**request, "load_format": "afd", "enforce_eager": False}, block, root,
                  "default-compilation")
    return {"plain": plain, "afd": afd, "afd_log": (root / "afd-default-compilation.log").read_text(errors="replace"),
            "plain_defaults": run_driver({**request, "enforce_eager": False, "config_only": True}, root,
                                         "plain-defaults")}


@pytest.fixture(scope="module", params=MODELS)
def runs(request, tmp_path_factory):
    """One model at a time, so each setup stays within the per-test timeout."""
    install_testbed_plugin()
    return default_compilation_runs(tmp_path_factory, request.param, MODELS.index(request.param))


def test_vllm_defaults_compile_this_model_on_cpu(runs):
    # The AFD run below was given these settings: a compiled model, not eager.
    defaults = runs["plain_defaults"]["graph_mode"]
    assert defaults["enforce_eager"] is False and defaults["compilation_mode"] != "NONE"


def test_afd_engine_with_default_compilation_runs_eager_and_logs_why(runs):
    assert runs["afd"]["graph_mode"] == EAGER
    assert f"afd: enforce_eager set, whatever compilation settings were given: {EAGER_REASON}" in runs["afd_log"]


def test_afd_engine_with_default_compilation_equals_plain_vllm(runs):
    plain = runs["plain"]["token_ids"]
    assert all(len(ids) == MAX_TOKENS for ids in plain)
    afd = runs["afd"]
    assert afd["token_ids"] == plain
    assert afd["experts_classes"] == [["AFDFusedMoE"]]
    assert_both_ffn_servers_served(afd)
