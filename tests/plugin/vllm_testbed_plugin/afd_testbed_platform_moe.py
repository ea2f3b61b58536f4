"""Test-only stand-in for a platform plugin that replaces FusedMoE, as vllm-ascend does
(``CustomOp.register_oot(AscendFusedMoE, name="FusedMoE")`` in its worker): registered at
plugin load, it must coexist with afd_shared_experts, be what a model without an afd block
builds, and be restored after an AFD model is built. Same math as upstream FusedMoE.

It also applies the plugin's CPU kernel patches in every process, plain engines included: the
plugin applies them to AFD engines only (docs/compat.md), and the plain references the tests
compare AFD with must run the same corrected kernels."""


def register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    from afd_shared_experts.vllm.cpu_patches import apply_cpu_patches

    apply_cpu_patches()

    if "FusedMoE" in op_registry_oot:
        return

    class PlatformFusedMoE(FusedMoE):
        pass

    FusedMoE.register_oot(PlatformFusedMoE, name="FusedMoE")
