"""Compat patch, vLLM 0.23.0 on CPU: the fused-MoE fallback's SiLU activation.

On CPUs without AVX512 (AVX2 only), vLLM 0.23.0's CPU fused-MoE fallback
(``cpu_fused_moe``) looks up its SiLU-and-multiply in a table filled with ``SiluAndMul``
CustomOp objects built at import, outside any VllmConfig context; calling one asserts, so no
MoE model (plain or AFD) runs there. The fix points the table's SILU entry at
``SiluAndMul.forward_native`` (the same math, no CustomOp dispatch) — the line vLLM 0.27.1
ships. Applied only for the vLLM versions listed here, on the CPU platform; remove this module
when the pin moves to 0.27.1 or later (docs/compat.md).
"""

from __future__ import annotations

from .compat import installed_vllm_version

# vLLM releases with the broken table (this plugin supports exactly one, compat.SUPPORTED_VLLM_VERSION).
PATCHED_VLLM_VERSIONS = ("0.23.0",)
FIXED_IN_VLLM = "0.27.1"


def apply_cpu_silu_patch() -> bool:
    """Patch the table when this vLLM needs it and runs on CPU; True when it patched."""
    if installed_vllm_version().split("+")[0] not in PATCHED_VLLM_VERSIONS:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = SiluAndMul.forward_native
    return True
