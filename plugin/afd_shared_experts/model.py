"""Checkpoint loading by role, from a checkpoint's safetensors files.

Checkpoint names follow the classic per-expert HF layout of every supported family (and
vLLM's loader): ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias`` (sigmoid-gated families),
``mlp.shared_experts.*`` (DeepSeek, GLM-4.5), ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate.weight`` (Qwen2-MoE, Qwen3-MoE when it has one). What a checkpoint is
(``MoESpec``, ``load_spec``) comes from ``moe_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .moe_spec import GATE_SIGMOID_GROUPED, CheckpointError, MoESpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    placement = spec.placement(placement)
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
    placement = spec.placement(placement)
    return {
        layer: FFNMoEWeights(
            routed=load_routed_shard(reader, spec, layer, ffn_index, num_ffn_ranks, dtype, device),
            shared=load_shared(reader, spec, layer, dtype, device) if placement == "ffn" else None,
        )
        for layer in spec.moe_layers
    }
