"""Equivalence with the HF transformers MoE modules over real gloo ranks (threads)."""

import pytest
import torch

from afd_shared_experts.moe_spec import load_spec
from plugin_harness import ThreadWorld, assert_matches_oracle, oracle_outputs

TOPOLOGIES = [(1, 1), (2, 1), (3, 2), (4, 4), (1, 4)]
PLACEMENTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
MODELS = ["deepseek_v2", "deepseek_v2_group_limited", "deepseek_v3", "qwen2_moe"]
MORE_MODELS = ["kimi_k2", "deepseek_v32", "glm4_moe", "qwen3_moe"]
MORE_TOPOLOGIES = [(2, 1), (3, 2), (1, 4)]


def token_counts(attention_ranks, ffn_ranks):
    return sorted({0, 1, attention_ranks - 1, ffn_ranks - 1, 7, 33, 257})


# (model, Attention ranks, FFN ranks): every topology for the first families, fewer for the
# families whose MoE reuses one of their gate kinds.
CASES = [(m, a, f) for m in MODELS for a, f in TOPOLOGIES] + [(m, a, f) for m in MORE_MODELS for a, f in MORE_TOPOLOGIES]


@pytest.mark.parametrize("placement,partition", PLACEMENTS, ids=["ffn-affinity", "ffn-contiguous", "attention"])
@pytest.mark.parametrize("model,attention_ranks,ffn_ranks", CASES, ids=[f"{m}-{a}A{f}F" for m, a, f in CASES])
def test_fp32_matches_oracle_for_every_token_count(checkpoints, model, placement, partition, attention_ranks, ffn_ranks):
    """Each family against its own transformers MoE module (Kimi-K2 against DeepSeek-V3's). Qwen3-MoE
    has no shared expert: whatever the placement, no shared row is sent or computed."""
    model_dir = checkpoints[model]
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(attention_ranks * 10 + ffn_ranks)
    with ThreadWorld(model_dir, attention_ranks, ffn_ranks, placement=placement, partition=partition) as world:
        for num_tokens in token_counts(attention_ranks, ffn_ranks):
            x = torch.randn(num_tokens, spec.hidden_size, generator=gen)
            expected = oracle_outputs(model_dir, x, "float32", spec.moe_layers)
            actual = world.run(x)
            assert_matches_oracle(actual, expected, "float32")
            # Repeated step on the same input: bit-identical.
            again = world.run(x)
            assert all(torch.equal(actual[l], again[l]) for l in actual)
        shared_tokens = [r.shared_tokens for r in world.runtimes]
        layout_shared = world.runtimes[0].connector.layout.shared
    if spec.placement(placement) == "ffn":
        # Every real token's shared expert ran exactly once per layer and step.
        total = 2 * len(spec.moe_layers) * sum(token_counts(attention_ranks, ffn_ranks))
        assert sum(shared_tokens) == total
        assert layout_shared == partition
    else:
        assert shared_tokens == [0] * ffn_ranks
        assert layout_shared == "none"  # the frames hold no shared section either


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("placement,partition", PLACEMENTS, ids=["ffn-affinity", "ffn-contiguous", "attention"])
@pytest.mark.parametrize("model", ["deepseek_v2", "deepseek_v3", "qwen2_moe", "glm4_moe", "qwen3_moe"])
def test_half_precision_matches_oracle(checkpoints, model, placement, partition, dtype):
    model_dir = checkpoints[model]
    spec = load_spec(model_dir)
    x = torch.randn(33, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    expected = oracle_outputs(model_dir, x, dtype, spec.moe_layers)
    with ThreadWorld(model_dir, 3, 2, placement=placement, partition=partition, dtype=dtype) as world:
        actual = world.run(x)
        residual_scaled = world.run(x, model_units=False)
    assert_matches_oracle(actual, expected, dtype)
    r = spec.routed_scaling_factor
    for layer in spec.moe_layers:
        if dtype == "float16":
            # vLLM's fp16 guard: the layer returns routed + S/r, i.e. the model output / r.
            assert torch.allclose(residual_scaled[layer] * r, actual[layer])
            if r != 1.0:
                assert not torch.allclose(residual_scaled[layer], expected[layer], rtol=0.05, atol=0.05)
        else:
            assert torch.equal(residual_scaled[layer], actual[layer])


def test_placements_agree_bitwise_in_fp32(checkpoints):
    """Switching placement keeps the old behaviour: same numbers, shared expert moved."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    x = torch.randn(57, spec.hidden_size, generator=torch.Generator().manual_seed(5))
    results = {}
    for placement, partition in PLACEMENTS:
        with ThreadWorld(model_dir, 2, 2, placement=placement, partition=partition) as world:
            results[(placement, partition)] = world.run(x)
    base = results[("attention", "affinity")]
    for key, out in results.items():
        for layer in spec.moe_layers:
            assert torch.allclose(out[layer], base[layer], rtol=1e-6, atol=1e-6), key
