"""Test-only: on CPUs without AVX512, vLLM 0.23.0's fused-MoE fallback builds SiluAndMul
outside a config context and asserts. vLLM 0.27.1 ships the same one-line fix."""


def register() -> None:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = SiluAndMul.forward_native
