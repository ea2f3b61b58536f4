"""Attention-role model wrappers for vLLM 0.23.0's DeepSeek-V2/V3 (also Kimi-K2 and DeepSeek-V3.2),
GLM-4.5, Qwen2-MoE and Qwen3-MoE classes.

Attention, norms, dense MLPs and the gate stay local; each MoE layer's experts are the
remote experts of ``experts.AFDFusedMoE``, built while the wrapper builds its model. The
wrappers drop what an Attention rank must not hold and skip those checkpoint tensors: routed
experts always, the shared expert (and the Qwen families' shared-expert gate) under placement 'ffn'.
Without an ``afd`` block they are the upstream classes unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from vllm.model_executor.models.glm4_moe import Glm4MoeForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from ..model import tensor_bytes
from .experts import AFDFusedMoE, attention_rank, remote_experts_installed
from .compat import afd_config_of
from .cpu_patches import apply_cpu_patches
from .stages import MicroBatchRunner

logger = logging.getLogger(__name__)

ROUTED_EXPERTS = ".mlp.experts."
# Module names of the shared expert in each supported MoE block (DeepSeek and GLM-4.5, the Qwen families).
SHARED_MODULES = ("shared_experts", "shared_expert", "shared_expert_gate")


class _AFDModelMixin:
    def __init__(self, *, vllm_config, prefix: str = ""):
        cfg = afd_config_of(vllm_config)
        if cfg is not None:
            apply_cpu_patches()  # before the layers exist (docs/compat.md); plain engines keep vLLM's kernels
        with remote_experts_installed() if cfg is not None else nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd_rank = None if cfg is None else attention_rank(vllm_config, cfg)
        self.afd_placement = None if cfg is None else self.afd_rank.placement
        self.afd_micro_batches = MicroBatchRunner(vllm_config) if cfg is not None and cfg.num_stages > 1 else None
        if self.afd_placement == "ffn":
            for layer in self.model.layers:
                mlp = getattr(layer, "mlp", None)
                if isinstance(getattr(mlp, "experts", None), AFDFusedMoE):
                    for name in SHARED_MODULES:
                        if getattr(mlp, name, None) is not None:
                            setattr(mlp, name, None)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        upstream = super().forward
        slices = None
        if self.afd_micro_batches is not None and is_forward_context_available():
            slices = get_forward_context().ubatch_slices
        if self.afd_rank is not None:
            self.afd_rank.step_stages = 1 if slices is None else len(slices)
        if slices is None:
            return upstream(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        return self.afd_micro_batches.run(upstream, get_forward_context(), slices, input_ids, positions,
                                          inputs_embeds, **kwargs)

    def _afd_local_only(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            if self._afd_skipped(name):
                self.remote_tensors_read += 1
            else:
                yield name, tensor

    def _afd_skipped(self, name: str) -> bool:
        if ROUTED_EXPERTS in name:
            return True
        return self.afd_placement == "ffn" and any(f".mlp.{module}." in name for module in SHARED_MODULES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Remote tensors read from disk anyway (vLLM's default loader reads every tensor; the
        # ``afd`` load format skips routed-expert weights before reading them).
        self.remote_tensors_read = 0
        if self.afd_placement is not None:
            # Remote tensors are never copied into this process: the FFN servers load them.
            weights = self._afd_local_only(weights)
        loaded = super().load_weights(weights)
        if self.remote_tensors_read:
            logger.info("afd: dropped %d remote-expert tensors the loader had read from disk (--load-format afd "
                        "skips routed-expert weights before reading them)", self.remote_tensors_read)
        # Measured now: vLLM's CPU backend later repacks linear weights outside nn.Parameters.
        self.loaded_parameter_bytes = tensor_bytes(*self.parameters())
        return loaded


class AFDDeepseekV2ForCausalLM(_AFDModelMixin, DeepseekV2ForCausalLM):
    pass


class AFDDeepseekV3ForCausalLM(_AFDModelMixin, DeepseekV3ForCausalLM):
    pass


class AFDGlm4MoeForCausalLM(_AFDModelMixin, Glm4MoeForCausalLM):
    pass


class AFDQwen2MoeForCausalLM(_AFDModelMixin, Qwen2MoeForCausalLM):
    pass


class AFDQwen3MoeForCausalLM(_AFDModelMixin, Qwen3MoeForCausalLM):
    pass


def model_parameter_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes of the live model as loaded (see ``load_weights``). Module-level so
    ``LLM.apply_model`` can ship it to the workers by reference."""
    return model.loaded_parameter_bytes


def model_remote_tensors_read(model: torch.nn.Module) -> int:
    """Remote-expert tensors the loader read from disk before the wrapper dropped them."""
    return model.remote_tensors_read
