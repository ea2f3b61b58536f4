"""Attention-role model wrappers for DeepSeek-V2/V3 in vLLM 0.23.0.

Attention, norms, dense MLPs and the gate stay local; each MoE layer's experts are the
remote experts of ``vllm_experts.AFDFusedMoE``. The wrappers drop what an Attention rank
must not hold and skip those checkpoint tensors: routed experts always, the shared expert
under placement 'ffn'. Without an ``afd`` block they are the upstream classes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2MoE,
    DeepseekV3ForCausalLM,
)

from .model import tensor_bytes
from .vllm_plugin import afd_config_of

ROUTED_EXPERTS = ".mlp.experts."
SHARED_EXPERTS = ".mlp.shared_experts."


class _AFDDeepseekMixin:
    def _afd_setup(self, vllm_config) -> None:
        cfg = afd_config_of(vllm_config)
        self.afd_placement = None if cfg is None else cfg.shared_experts.placement
        if self.afd_placement == "ffn":
            for layer in self.model.layers:
                mlp = getattr(layer, "mlp", None)
                if isinstance(mlp, DeepseekV2MoE):
                    mlp.shared_experts = None

    def _afd_skipped(self, name: str) -> bool:
        if ROUTED_EXPERTS in name:
            return True
        return self.afd_placement == "ffn" and SHARED_EXPERTS in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.afd_placement is not None:
            # Remote tensors are never copied into this process: the FFN servers load them.
            weights = ((name, w) for name, w in weights if not self._afd_skipped(name))
        loaded = super().load_weights(weights)
        # Measured now: vLLM's CPU backend later repacks linear weights outside nn.Parameters.
        self.loaded_parameter_bytes = tensor_bytes(*self.parameters())
        return loaded


class AFDDeepseekV2ForCausalLM(_AFDDeepseekMixin, DeepseekV2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._afd_setup(vllm_config)


class AFDDeepseekV3ForCausalLM(_AFDDeepseekMixin, DeepseekV3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._afd_setup(vllm_config)


def model_parameter_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes of the live model as loaded (see ``load_weights``). Module-level so
    ``LLM.apply_model`` can ship it to the workers by reference."""
    return model.loaded_parameter_bytes
