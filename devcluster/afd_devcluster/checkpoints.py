"""Tiny random Hugging Face MoE checkpoints, written here so nothing is downloaded.

`write_moe_checkpoint`: config.json + the MoE layers' tensors only (gate, routed and shared
experts, classic per-expert names), what the plugin's torch runtime and the transformers oracle
load. `write_vllm_checkpoint`: a complete checkpoint vLLM can serve (attention, norms, dense
first layers, embeddings, a word-level tokenizer). Each family's config.json carries the keys
of its published models (groups, top-k, scaling, first dense layers, top-k normalisation, MTP
layers) at tiny sizes. Used by the tests, the real node's scenario and the benchmarks; seeded,
so the same arguments write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from afd_devcluster.cache import cache_root
from afd_shared_experts.moe_spec import SIGMOID_GROUPED_TYPES, spec_from_config
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# Every model_type the plugin serves: DeepSeek-V2/V3, Kimi-K2 and DeepSeek-V3.2 (DeepSeek-V3's
# MoE), GLM-4.5, Qwen2-MoE, Qwen3-MoE (no shared expert).
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_moe", "qwen2_moe", "qwen3_moe")
# The model types whose vLLM 0.23.0 model runs on CPU: DeepSeek-V3.2's sparse-attention indexer
# does not.
VLLM_CPU_MODEL_TYPES = tuple(t for t in MODEL_TYPES if t != "deepseek_v32")
# Vocabulary size of write_vllm_checkpoint's model and tokenizer (ids 0-2 are its special tokens).
VOCAB = 128
# Head size 64 (DeepSeek: qk_nope + qk_rope; the others: head_dim) is in vLLM's CPU attention
# backend's supported set; the CPU fused-MoE kernel needs 2 * moe_intermediate_size to be a
# multiple of its tile (64 works).
COMMON_SHAPE = dict(hidden=64, inter=64, experts=8, top_k=2, layers=3, vocab_size=VOCAB, intermediate_size=64,
                    max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                    torch_dtype="float32", bos_token_id=1, eos_token_id=2)
DEEPSEEK_SHAPE = dict(COMMON_SHAPE, num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=32,
                      qk_rope_head_dim=32, v_head_dim=32, kv_lora_rank=32, q_lora_rank=None, first_k_dense_replace=1)
QWEN2_MOE_SHAPE = dict(COMMON_SHAPE, num_attention_heads=1, num_key_value_heads=1, use_sliding_window=False)
QWEN3_MOE_SHAPE = dict(COMMON_SHAPE, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       use_sliding_window=False)
GLM4_MOE_SHAPE = dict(COMMON_SHAPE, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      first_k_dense_replace=1)
VLLM_SHAPES = {"qwen2_moe": QWEN2_MOE_SHAPE, "qwen3_moe": QWEN3_MOE_SHAPE, "glm4_moe": GLM4_MOE_SHAPE}


def model_config(model_type: str, *, hidden: int = 32, inter: int = 16, experts: int = 8, top_k: int = 2,
                 layers: int = 2, **overrides) -> dict:
    """The config.json of a tiny `model_type` model; `overrides` are config keys."""
    common = {"hidden_size": hidden, "moe_intermediate_size": inter, "num_experts_per_tok": top_k,
              "num_hidden_layers": layers, "hidden_act": "silu", "intermediate_size": 2 * inter,
              "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "rms_norm_eps": 1e-6}
    deepseek_v3 = {"n_routed_experts": experts, "n_shared_experts": 2, "routed_scaling_factor": 2.5, "n_group": 4,
                   "topk_group": 2, "norm_topk_prob": True, "first_k_dense_replace": 0, "moe_layer_freq": 1,
                   "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1}
    families = {
        "deepseek_v2": (["DeepseekV2ForCausalLM"], {
            "n_routed_experts": experts, "n_shared_experts": 1, "routed_scaling_factor": 1.5, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "first_k_dense_replace": 0, "moe_layer_freq": 1}),
        "deepseek_v3": (["DeepseekV3ForCausalLM"], deepseek_v3),
        # Kimi-K2: DeepSeek-V3's architecture and MoE, one expert group, its own scaling factor.
        "kimi_k2": (["DeepseekV3ForCausalLM"], {**deepseek_v3, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                                               "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0}),
        "deepseek_v32": (["DeepseekV32ForCausalLM"], {**deepseek_v3, "index_n_heads": 2, "index_head_dim": 32,
                                                     "index_topk": 16}),
        "glm4_moe": (["Glm4MoeForCausalLM"], {
            "n_routed_experts": experts, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0, "num_nextn_predict_layers": 1,
            "partial_rotary_factor": 0.5, "use_qk_norm": False, "attention_bias": True}),
        "qwen2_moe": (["Qwen2MoeForCausalLM"], {
            "num_experts": experts, "shared_expert_intermediate_size": 2 * inter, "norm_topk_prob": False,
            "decoder_sparse_step": 1, "mlp_only_layers": []}),
        "qwen3_moe": (["Qwen3MoeForCausalLM"], {
            "num_experts": experts, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "attention_bias": False}),
    }
    if model_type not in families:
        raise ValueError(model_type)
    architectures, keys = families[model_type]
    cfg = {**common, "model_type": model_type, "architectures": architectures, **keys}
    cfg.update(overrides)
    return cfg


def write_moe_checkpoint(directory: Path, model_type: str, *, seed: int = 0, **overrides) -> Path:
    """config.json + model.safetensors holding only the MoE layers' tensors, with classic
    per-expert HF tensor names; `overrides` go to model_config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model_config(model_type, **overrides)
    spec = spec_from_config(cfg, str(directory))
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, experts = spec.hidden_size, spec.moe_intermediate_size, spec.num_routed_experts

    def rand(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen) * scale

    tensors = {}
    for layer in spec.moe_layers:
        base = f"model.layers.{layer}.mlp"
        tensors[f"{base}.gate.weight"] = rand(experts, hidden, scale=1.0)
        if model_type in SIGMOID_GROUPED_TYPES:
            tensors[f"{base}.gate.e_score_correction_bias"] = rand(experts, scale=0.1)
        for e in range(experts):
            tensors[f"{base}.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            tensors[f"{base}.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            tensors[f"{base}.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        if spec.has_shared_experts:
            shared, shared_inter = f"{base}.{spec.shared_prefix}", spec.shared_intermediate_size
            tensors[f"{shared}.gate_proj.weight"] = rand(shared_inter, hidden)
            tensors[f"{shared}.up_proj.weight"] = rand(shared_inter, hidden)
            tensors[f"{shared}.down_proj.weight"] = rand(hidden, shared_inter)
        if spec.has_shared_gate:
            tensors[f"{base}.shared_expert_gate.weight"] = rand(1, hidden)
    save_tensors(tensors, directory)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """``model.safetensors`` readable by every user like the checkpoint's other files:
    safetensors creates it 0600, and the runtime image reads it as a non-root user."""
    path = directory / "model.safetensors"
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))
    path.chmod(0o644)


def write_vllm_checkpoint(directory: Path, model_type: str, seed: int = 0, **shape) -> Path:
    """A complete tiny checkpoint of ``model_type`` vLLM can serve: the MoE tensors of
    write_moe_checkpoint plus attention, norms, dense MLP, embeddings, tokenizer.
    `shape` overrides the family's shape (e.g. experts=48)."""
    directory = Path(directory)
    overrides = dict(VLLM_SHAPES.get(model_type, DEEPSEEK_SHAPE), **shape)
    hidden, inter, experts, top_k, layers = (overrides.pop(k) for k in ("hidden", "inter", "experts", "top_k", "layers"))
    write_moe_checkpoint(directory, model_type, seed=seed, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                         layers=layers, **overrides)
    cfg = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1000)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    tensors["model.embed_tokens.weight"] = torch.randn(VOCAB, hidden, generator=gen)
    tensors["lm_head.weight"] = rand(VOCAB, hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    for layer in range(layers):
        base = f"model.layers.{layer}"
        tensors[f"{base}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{base}.post_attention_layernorm.weight"] = torch.ones(hidden)
        attention = _gqa_attention(cfg, rand) if model_type in VLLM_SHAPES else _mla_attention(cfg, rand)
        tensors.update({f"{base}.self_attn.{name}": t for name, t in attention.items()})
        if layer < cfg.get("first_k_dense_replace", 0):
            # Dense layer: drop the MoE tensors the generic writer made, add the dense MLP.
            for name in [n for n in tensors if n.startswith(f"{base}.mlp.")]:
                del tensors[name]
            tensors[f"{base}.mlp.gate_proj.weight"] = rand(cfg["intermediate_size"], hidden)
            tensors[f"{base}.mlp.up_proj.weight"] = rand(cfg["intermediate_size"], hidden)
            tensors[f"{base}.mlp.down_proj.weight"] = rand(hidden, cfg["intermediate_size"])
    save_tensors(tensors, directory)
    _write_tokenizer(directory)
    return directory


def cached_vllm_checkpoint(model_type: str, seed: int = 0, **shape) -> Path:
    """write_vllm_checkpoint's checkpoint at a path that stays the same run after run (under
    the project's cache, keyed by the arguments and this writer's source): vLLM's compile cache
    keys on the engine config, the model's path among it, so a later run's engines find what an
    earlier one compiled (vLLM 0.23.0 on CPU traces again and takes inductor's cached kernels:
    an engine's start measured 50-62 s cold, 18-21 s so). Written once (into a temporary
    folder, then renamed); readers must not change it."""
    key = json.dumps([model_type, seed, sorted(shape.items()), torch.__version__,
                      Path(__file__).read_text(), Path(spec_from_config.__code__.co_filename).read_text()])
    target = cache_root() / "checkpoints" / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write_vllm_checkpoint(staging, model_type, seed=seed, **shape)
        staging.chmod(0o755)
        os.rename(staging, target)
    except OSError:
        # Another process renamed its copy first (the same bytes: the writer is seeded).
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_config_checkpoint(directory: Path, config: dict) -> Path:
    """``config`` as config.json and the tokenizer, no weights: what vLLM reads to build an
    engine config (and what the plugin reads to accept or refuse a checkpoint)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(directory)
    return directory


def _mla_attention(cfg: dict, rand) -> dict[str, torch.Tensor]:
    hidden, heads, kv_rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return {"q_proj.weight": rand(heads * (nope + rope), hidden),
            "kv_a_proj_with_mqa.weight": rand(kv_rank + rope, hidden),
            "kv_a_layernorm.weight": torch.ones(kv_rank),
            "kv_b_proj.weight": rand(heads * (nope + v), kv_rank),
            "o_proj.weight": rand(hidden, heads * v)}


def _gqa_attention(cfg: dict, rand) -> dict[str, torch.Tensor]:
    """q/k/v/o projections: with biases on Qwen2-MoE and where attention_bias is set (GLM-4.5),
    with per-head q/k RMSNorm weights on Qwen3-MoE."""
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    out = {"q_proj.weight": rand(heads * head_dim, hidden), "k_proj.weight": rand(kv_heads * head_dim, hidden),
           "v_proj.weight": rand(kv_heads * head_dim, hidden), "o_proj.weight": rand(hidden, heads * head_dim)}
    if cfg["model_type"] == "qwen2_moe" or cfg.get("attention_bias"):
        out.update({"q_proj.bias": rand(heads * head_dim) * 0.1, "k_proj.bias": rand(kv_heads * head_dim) * 0.1,
                    "v_proj.bias": rand(kv_heads * head_dim) * 0.1})
    if cfg["model_type"] == "qwen3_moe":
        out.update({"q_norm.weight": torch.ones(head_dim), "k_norm.weight": torch.ones(head_dim)})
    return out


def _write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over VOCAB tokens "t0".."t127" (no download needed)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 512}))
