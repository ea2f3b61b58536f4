"""The MoE description of a checkpoint, from its HF config (config.json) alone: torch-free, so
the operator's ``afdctl validate`` gives the answer the pods give at start.

Families: DeepSeek-V2, DeepSeek-V3 (and Kimi-K2, DeepSeek-V3.2: the same MoE), GLM-4.5,
Qwen2-MoE and Qwen3-MoE. Anything else is refused naming config.json's ``model_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GATE_SOFTMAX_GREEDY = "softmax_greedy"
GATE_SOFTMAX_GROUP_LIMITED = "softmax_group_limited"
GATE_SIGMOID_GROUPED = "sigmoid_grouped"
GATE_SOFTMAX_TOPK = "softmax_topk"

# What runs the shared expert of a model without one: nothing, whatever the placement asked for.
PLACEMENT_NONE = "none"

# model_type -> family parser below. DeepSeek-V3's MoE is also Kimi-K2's (its own model_type on
# the DeepseekV3ForCausalLM architecture) and DeepSeek-V3.2's (which adds an attention indexer).
SIGMOID_GROUPED_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_moe")
SOFTMAX_TOPK_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = ("deepseek_v2", *SIGMOID_GROUPED_TYPES, *SOFTMAX_TOPK_TYPES)
# transformers' config-class defaults of the keys a config.json may leave out (vLLM reads the
# config through those classes, so an absent key means the class default there too).
_DEEPSEEK_V3_DEFAULTS = dict(n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                             first_k_dense_replace=3, norm_topk_prob=True)
CONFIG_DEFAULTS = {
    "deepseek_v2": dict(n_shared_experts=2, routed_scaling_factor=1.0, first_k_dense_replace=0, norm_topk_prob=False,
                        topk_method="greedy"),
    "deepseek_v3": _DEEPSEEK_V3_DEFAULTS, "kimi_k2": _DEEPSEEK_V3_DEFAULTS, "deepseek_v32": _DEEPSEEK_V3_DEFAULTS,
    "glm4_moe": dict(n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
                     norm_topk_prob=True),
    "qwen2_moe": dict(norm_topk_prob=False, decoder_sparse_step=1),
    "qwen3_moe": dict(norm_topk_prob=False, decoder_sparse_step=1, shared_expert_intermediate_size=0),
}
# Families whose router weight scales each expert's *input*: the combine weights expert outputs,
# so their experts cannot be computed remotely the way this plugin computes them.
INPUT_SCALED_ROUTER_TYPES = ("llama4", "llama4_text")


class CheckpointError(ValueError):
    """The checkpoint directory does not describe a supported MoE model."""


@dataclass(frozen=True)
class MoESpec:
    model_type: str
    hidden_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # 0: the model has no shared expert
    num_routed_experts: int
    top_k: int
    gate_kind: str
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    has_shared_gate: bool
    moe_layers: tuple[int, ...]
    quant_method: str | None = None  # config.json's quantization_config.quant_method

    @property
    def has_shared_experts(self) -> bool:
        return self.shared_intermediate_size > 0

    @property
    def shared_prefix(self) -> str:
        return "shared_expert" if self.model_type in SOFTMAX_TOPK_TYPES else "shared_experts"

    def local_experts(self, num_ffn_ranks: int) -> int:
        return self.num_routed_experts // num_ffn_ranks

    def placement(self, requested: str) -> str:
        """Where the shared expert runs: ``requested``, or 'none' for a model without one."""
        return requested if self.has_shared_experts else PLACEMENT_NONE


def _require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise CheckpointError(f"{where}: config.json lacks {key!r}")
    return cfg[key]


def _deepseek_style(cfg: dict, where: str, model_type: str) -> dict:
    """DeepSeek-V2/V3, Kimi-K2, DeepSeek-V3.2 and GLM-4.5: first dense layers, n_shared_experts
    MLPs merged into one, a routed scaling factor."""
    layers = int(_require(cfg, "num_hidden_layers", where))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    moe_inter = int(_require(cfg, "moe_intermediate_size", where))
    if model_type in SIGMOID_GROUPED_TYPES:
        gate_kind = GATE_SIGMOID_GROUPED
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise CheckpointError(f"{where}: scoring_func must be 'sigmoid' for {model_type} (got {scoring!r})")
    else:
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"{where}: topk_method must be greedy or group_limited_greedy (got {method!r})")
        gate_kind = GATE_SOFTMAX_GREEDY if method == "greedy" else GATE_SOFTMAX_GROUP_LIMITED
    return dict(
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(cfg.get("n_shared_experts") or 0),
        num_routed_experts=int(_require(cfg, "n_routed_experts", where)),
        gate_kind=gate_kind,
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        has_shared_gate=False,
        moe_layers=tuple(l for l in range(layers) if l >= first_dense and l % freq == 0),
    )


def _qwen_style(cfg: dict, where: str, model_type: str) -> dict:
    """Qwen2-MoE and Qwen3-MoE: softmax top-k, every decoder_sparse_step-th layer sparse unless
    listed in mlp_only_layers, an optional gated shared expert (Qwen3-MoE's published
    checkpoints have none)."""
    layers = int(_require(cfg, "num_hidden_layers", where))
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    n_routed = int(_require(cfg, "num_experts", where))
    shared_inter = int(_require(cfg, "shared_expert_intermediate_size", where) or 0)
    return dict(
        moe_intermediate_size=int(_require(cfg, "moe_intermediate_size", where)),
        shared_intermediate_size=shared_inter,
        num_routed_experts=n_routed,
        gate_kind=GATE_SOFTMAX_TOPK,
        num_groups=1,
        topk_groups=1,
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        routed_scaling_factor=1.0,
        has_shared_gate=shared_inter > 0,
        moe_layers=tuple(l for l in range(layers) if l not in mlp_only and n_routed > 0 and (l + 1) % step == 0),
    )


def spec_from_config(cfg: dict, where: str) -> MoESpec:
    """The MoE description of a HF config (config.json's contents); ``where`` names the
    checkpoint in errors. Refuses, naming the config key, what the plugin cannot serve."""
    model_type = cfg.get("model_type")
    if model_type in INPUT_SCALED_ROUTER_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r}: its router weight scales each expert's input (Llama-4 style), "
            "while AFD's combine weights the experts' outputs; such a model cannot be served with AFD")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)} "
                              f"(got {model_type!r})")
    cfg = {**CONFIG_DEFAULTS[model_type], **cfg}
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act must be 'silu' (got {act!r})")
    family = _qwen_style if model_type in SOFTMAX_TOPK_TYPES else _deepseek_style
    spec = MoESpec(model_type=model_type, hidden_size=int(_require(cfg, "hidden_size", where)),
                   top_k=int(_require(cfg, "num_experts_per_tok", where)), **family(cfg, where, model_type))
    if spec.top_k > spec.num_routed_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok ({spec.top_k}) exceeds the routed experts")
    if spec.gate_kind in (GATE_SOFTMAX_GROUP_LIMITED, GATE_SIGMOID_GROUPED):
        if spec.num_routed_experts % spec.num_groups or not 1 <= spec.topk_groups <= spec.num_groups:
            raise CheckpointError(f"{where}: n_group must divide the routed experts and topk_group must be in "
                                  "[1, n_group]")
    if not spec.moe_layers:
        raise CheckpointError(f"{where}: the model has no MoE layer")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        spec = replace(spec, quant_method=str(method or "unknown"))
    return spec


def load_spec(model_dir: str | Path) -> MoESpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a HF-format checkpoint directory)")
    return spec_from_config(json.loads(path.read_text()), str(path))
