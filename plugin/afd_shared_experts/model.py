"""MoE model description from a HF config.json, and checkpoint loading by role.

Checkpoint names follow the classic per-expert HF layout used by DeepSeek-V2/V3 and
Qwen2-MoE checkpoints (and vLLM's loader):
``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias`` (V3), ``mlp.shared_experts.*`` (DeepSeek),
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight`` (Qwen2-MoE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

GATE_SOFTMAX_GREEDY = "softmax_greedy"
GATE_SOFTMAX_GROUP_LIMITED = "softmax_group_limited"
GATE_SIGMOID_GROUPED = "sigmoid_grouped"
GATE_SOFTMAX_TOPK = "softmax_topk"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint directory does not describe a supported MoE model."""


@dataclass(frozen=True)
class MoESpec:
    model_type: str
    hidden_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
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
    def shared_prefix(self) -> str:
        return "shared_expert" if self.model_type == "qwen2_moe" else "shared_experts"

    def local_experts(self, num_ffn_ranks: int) -> int:
        return self.num_routed_experts // num_ffn_ranks


def _require(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise CheckpointError(f"{path}: config.json lacks {key!r}")
    return cfg[key]


def load_spec(model_dir: str | Path) -> MoESpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a HF-format checkpoint directory)")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act must be 'silu' (got {act!r})")
    layers = int(_require(cfg, "num_hidden_layers", path))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        n_routed = int(_require(cfg, "n_routed_experts", path))
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        freq = int(cfg.get("moe_layer_freq", 1))
        moe_layers = tuple(l for l in range(layers) if l >= first_dense and l % freq == 0)
        n_shared = int(cfg.get("n_shared_experts") or 0)
        if n_shared < 1:
            raise CheckpointError(f"{path}: n_shared_experts must be >= 1 for shared-expert placement")
        if model_type == "deepseek_v3":
            gate_kind = GATE_SIGMOID_GROUPED
        else:
            method = cfg.get("topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):
                raise CheckpointError(f"{path}: topk_method must be greedy or group_limited_greedy (got {method!r})")
            gate_kind = GATE_SOFTMAX_GREEDY if method == "greedy" else GATE_SOFTMAX_GROUP_LIMITED
        moe_inter = int(_require(cfg, "moe_intermediate_size", path))
        spec = MoESpec(
            model_type=model_type,
            hidden_size=int(_require(cfg, "hidden_size", path)),
            moe_intermediate_size=moe_inter,
            shared_intermediate_size=moe_inter * n_shared,
            num_routed_experts=n_routed,
            top_k=int(_require(cfg, "num_experts_per_tok", path)),
            gate_kind=gate_kind,
            num_groups=int(cfg.get("n_group") or 1),
            topk_groups=int(cfg.get("topk_group") or 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            has_shared_gate=False,
            moe_layers=moe_layers,
        )
    elif model_type == "qwen2_moe":
        step = int(cfg.get("decoder_sparse_step", 1))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        n_routed = int(_require(cfg, "num_experts", path))
        moe_layers = tuple(l for l in range(layers) if l not in mlp_only and n_routed > 0 and (l + 1) % step == 0)
        spec = MoESpec(
            model_type=model_type,
            hidden_size=int(_require(cfg, "hidden_size", path)),
            moe_intermediate_size=int(_require(cfg, "moe_intermediate_size", path)),
            shared_intermediate_size=int(_require(cfg, "shared_expert_intermediate_size", path)),
            num_routed_experts=n_routed,
            top_k=int(_require(cfg, "num_experts_per_tok", path)),
            gate_kind=GATE_SOFTMAX_TOPK,
            num_groups=1,
            topk_groups=1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=1.0,
            has_shared_gate=True,
            moe_layers=moe_layers,
        )
    else:
        raise CheckpointError(f"{path}: model_type must be deepseek_v2, deepseek_v3 or qwen2_moe (got {model_type!r})")
    if spec.top_k > spec.num_routed_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok ({spec.top_k}) exceeds the routed experts")
    if spec.gate_kind in (GATE_SOFTMAX_GROUP_LIMITED, GATE_SIGMOID_GROUPED):
        if spec.num_routed_experts % spec.num_groups or not 1 <= spec.topk_groups <= spec.num_groups:
            raise CheckpointError(f"{path}: n_group must divide the routed experts and topk_group must be in [1, n_group]")
    if not moe_layers:
        raise CheckpointError(f"{path}: the model has no MoE layer")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        spec = replace(spec, quant_method=str(method or "unknown"))
    return spec


@dataclass
class GateWeights:
    weight: torch.Tensor  # [E, H]
    correction_bias: torch.Tensor | None  # [E], DeepSeek-V3 only


@dataclass
class SharedExpertWeights:
    gate_up: torch.Tensor  # [2 * I_shared, H]
    down: torch.Tensor  # [H, I_shared]
    shared_gate: torch.Tensor | None  # [1, H], Qwen2-MoE only


@dataclass
class RoutedExpertShard:
    first_expert: int
    gate_up: torch.Tensor  # [E_local, 2 * I, H]
    down: torch.Tensor  # [E_local, H, I]


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class CheckpointReader:
    """Reads single named tensors from the safetensors files of a directory (lazily)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._location: dict[str, Path] = {}
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors file")
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    self._location[name] = file

    def read(self, name: str) -> torch.Tensor:
        """The tensor as stored (quantized weights and their scales keep their dtypes)."""
        file = self._location.get(name)
        if file is None:
            raise CheckpointError(f"{self.model_dir}: checkpoint lacks tensor {name!r}")
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(name)

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.read(name).to(device=device, dtype=dtype).contiguous()

    def has(self, name: str) -> bool:
        return name in self._location

    def names_under(self, prefix: str) -> list[str]:
        return sorted(name for name in self._location if name.startswith(prefix))


def _mlp_weights(reader: CheckpointReader, prefix: str, dtype: torch.dtype,
                 device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    gate = reader.get(f"{prefix}.gate_proj.weight", dtype, device)
    up = reader.get(f"{prefix}.up_proj.weight", dtype, device)
    down = reader.get(f"{prefix}.down_proj.weight", dtype, device)
    return torch.cat([gate, up], dim=0), down


def load_gate(reader: CheckpointReader, spec: MoESpec, layer: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> GateWeights:
    base = f"model.layers.{layer}.mlp.gate"
    bias = None
    if spec.gate_kind == GATE_SIGMOID_GROUPED:
        bias = reader.get(f"{base}.e_score_correction_bias", dtype, device)
    return GateWeights(weight=reader.get(f"{base}.weight", dtype, device), correction_bias=bias)


def load_shared(reader: CheckpointReader, spec: MoESpec, layer: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> SharedExpertWeights:
    base = f"model.layers.{layer}.mlp"
    gate_up, down = _mlp_weights(reader, f"{base}.{spec.shared_prefix}", dtype, device)
    shared_gate = reader.get(f"{base}.shared_expert_gate.weight", dtype, device) if spec.has_shared_gate else None
    return SharedExpertWeights(gate_up=gate_up, down=down, shared_gate=shared_gate)


def load_routed_shard(
    reader: CheckpointReader, spec: MoESpec, layer: int, ffn_index: int, num_ffn_ranks: int, dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> RoutedExpertShard:
    per_rank = spec.local_experts(num_ffn_ranks)
    first = ffn_index * per_rank
    gate_ups, downs = [], []
    for expert in range(first, first + per_rank):
        gate_up, down = _mlp_weights(reader, f"model.layers.{layer}.mlp.experts.{expert}", dtype, device)
        gate_ups.append(gate_up)
        downs.append(down)
    return RoutedExpertShard(first_expert=first, gate_up=torch.stack(gate_ups), down=torch.stack(downs))


@dataclass
class AttentionMoEWeights:
    """What an Attention rank holds for one MoE layer: the gate, and the shared expert only
    under placement 'attention'."""

    gate: GateWeights
    shared: SharedExpertWeights | None

    def parameter_bytes(self) -> int:
        shared = (self.shared.gate_up, self.shared.down, self.shared.shared_gate) if self.shared else ()
        return tensor_bytes(self.gate.weight, self.gate.correction_bias, *shared)


@dataclass
class FFNMoEWeights:
    """What an FFN rank holds for one MoE layer: its routed shard, and the shared expert
    only under placement 'ffn'."""

    routed: RoutedExpertShard
    shared: SharedExpertWeights | None

    def parameter_bytes(self) -> int:
        shared = (self.shared.gate_up, self.shared.down, self.shared.shared_gate) if self.shared else ()
        return tensor_bytes(self.routed.gate_up, self.routed.down, *shared)


def require_unquantized(model_dir: str | Path, spec: MoESpec) -> None:
    """These loaders cast stored tensors to the model dtype: quantized weights would be served wrong."""
    if spec.quant_method is not None:
        raise CheckpointError(f"{model_dir}: the checkpoint is quantized (quantization_config.quant_method "
                              f"{spec.quant_method!r}) but the torch expert path reads unquantized weights only; "
                              "use --expert-backend vllm (FFN server)")


def require_even_split(model_dir: str | Path, spec: MoESpec, num_ffn_ranks: int) -> None:
    if spec.num_routed_experts % num_ffn_ranks:
        raise CheckpointError(
            f"{model_dir}: {spec.num_routed_experts} routed experts do not split evenly over {num_ffn_ranks} FFN ranks"
        )


def load_attention_weights(
    model_dir: str | Path, spec: MoESpec, placement: str, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[int, AttentionMoEWeights]:
    require_unquantized(model_dir, spec)
    reader = CheckpointReader(model_dir)
    return {
        layer: AttentionMoEWeights(
            gate=load_gate(reader, spec, layer, dtype, device),
            shared=load_shared(reader, spec, layer, dtype, device) if placement == "attention" else None,
        )
        for layer in spec.moe_layers
    }


def load_ffn_weights(
    model_dir: str | Path, spec: MoESpec, placement: str, ffn_index: int, num_ffn_ranks: int, dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[int, FFNMoEWeights]:
    require_unquantized(model_dir, spec)
    require_even_split(model_dir, spec, num_ffn_ranks)
    reader = CheckpointReader(model_dir)
    return {
        layer: FFNMoEWeights(
            routed=load_routed_shard(reader, spec, layer, ffn_index, num_ffn_ranks, dtype, device),
            shared=load_shared(reader, spec, layer, dtype, device) if placement == "ffn" else None,
        )
        for layer in spec.moe_layers
    }
