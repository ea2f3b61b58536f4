"""Test-only stand-in for a platform plugin that replaces FusedMoE, as vllm-ascend does
(``CustomOp.register_oot(AscendFusedMoE, name="FusedMoE")`` in its worker): registered at
plugin load, it must coexist with afd_shared_experts, be what a model without an afd block
builds, and be restored after an AFD model is built. Same math as upstream FusedMoE."""


def register() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    if "FusedMoE" in op_registry_oot:
        return

    class PlatformFusedMoE(FusedMoE):
        pass

    FusedMoE.register_oot(PlatformFusedMoE, name="FusedMoE")
