"""What a checkpoint's config.json makes of it (moe_spec, torch-free) and the Attention engine's
refusals built on it (vllm/compat.require_afd_model, importable without vLLM)."""

from types import SimpleNamespace

import pytest

from afd_devcluster.checkpoints import MODEL_TYPES, model_config
from afd_shared_experts.config import AFDConfigError, parse_afd_config
from afd_shared_experts.moe_spec import (CONFIG_DEFAULTS, GATE_SIGMOID_GROUPED, GATE_SOFTMAX_TOPK, PLACEMENT_NONE,
                                         CheckpointError, spec_from_config)
from afd_shared_experts.vllm.compat import require_afd_model
from vllm_harness import afd_block


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_keys_a_config_leaves_out_take_the_config_class_defaults(model_type):
    defaults = CONFIG_DEFAULTS[model_type]
    full = model_config(model_type, layers=6)
    sparse = {k: v for k, v in full.items() if k not in defaults}
    spec, defaulted = spec_from_config(full, "full"), spec_from_config(sparse, "sparse")
    assert defaulted.norm_topk_prob == defaults["norm_topk_prob"]
    assert defaulted.moe_layers[0] == defaults.get("first_k_dense_replace", 0)
    if "n_shared_experts" in CONFIG_DEFAULTS[model_type]:
        assert defaulted.shared_intermediate_size == (spec.moe_intermediate_size
                                                      * CONFIG_DEFAULTS[model_type]["n_shared_experts"])


def test_the_families_gates_and_shared_experts():
    specs = {t: spec_from_config(model_config(t), t) for t in MODEL_TYPES}
    assert {t for t, s in specs.items() if s.gate_kind == GATE_SIGMOID_GROUPED} == {
        "deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_moe"}
    assert {t for t, s in specs.items() if s.gate_kind == GATE_SOFTMAX_TOPK} == {"qwen2_moe", "qwen3_moe"}
    assert [t for t, s in specs.items() if not s.has_shared_experts] == ["qwen3_moe"]
    # A placement only means something where there is a shared expert.
    assert specs["qwen3_moe"].placement("ffn") == specs["qwen3_moe"].placement("attention") == PLACEMENT_NONE
    assert specs["glm4_moe"].placement("ffn") == "ffn"
    # GLM-4.5's first dense layers are not MoE layers.
    glm = spec_from_config(model_config("glm4_moe", layers=4, first_k_dense_replace=1), "glm")
    assert glm.moe_layers == (1, 2, 3)


@pytest.mark.parametrize("config,rule", [
    ({"model_type": "mixtral"}, r"model_type must be one of deepseek_v2, .* \(got 'mixtral'\)"),
    ({"model_type": None}, r"model_type must be one of .* \(got None\)"),
    ({"model_type": "llama4_text"}, r"model_type 'llama4_text': its router weight scales each expert's input"),
    ({"model_type": "glm4_moe", "scoring_func": "softmax"}, r"scoring_func must be 'sigmoid' for glm4_moe"),
    ({"model_type": "qwen3_moe", "hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
    ({"model_type": "kimi_k2", "n_group": 3}, r"n_group must divide the routed experts"),
])
def test_what_cannot_be_served_is_refused_naming_the_key(config, rule):
    base = model_config(config["model_type"]) if config["model_type"] in MODEL_TYPES else model_config("qwen2_moe")
    with pytest.raises(CheckpointError, match=rule):
        spec_from_config({**base, **config}, "ckpt/config.json")


def engine(tmp_path, model_type: str, ffn_ranks: int = 2, pipeline_parallel: int = 1):
    import json

    (tmp_path / "config.json").write_text(json.dumps(model_config(model_type)))
    return SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline_parallel)), parse_afd_config(
        afd_block("attention", port=1, ffn_ranks=ffn_ranks))


def test_the_attention_engine_refuses_an_architecture_without_a_wrapper(tmp_path):
    vllm_config, cfg = engine(tmp_path, "qwen3_moe")
    wrapped = ("Qwen3MoeForCausalLM",)
    require_afd_model(vllm_config, cfg, "Qwen3MoeForCausalLM", wrapped)
    with pytest.raises(ValueError, match=r"architecture Qwen3MoeForSequenceClassification has no AFD model wrapper "
                                         r"\(AFD serves Qwen3MoeForCausalLM\)"):
        require_afd_model(vllm_config, cfg, "Qwen3MoeForSequenceClassification", wrapped)
    uneven, cfg3 = engine(tmp_path, "qwen3_moe", ffn_ranks=3)
    with pytest.raises(AFDConfigError, match=r"afd.num_ffn_ranks: must divide the model's 8 routed experts"):
        require_afd_model(uneven, cfg3, "Qwen3MoeForCausalLM", wrapped)
    pipelined, cfg = engine(tmp_path, "qwen3_moe", pipeline_parallel=2)
    with pytest.raises(ValueError, match=r"afd: pipeline parallel is not supported \(--pipeline-parallel-size 2\)"):
        require_afd_model(pipelined, cfg, "Qwen3MoeForCausalLM", wrapped)
