"""vLLM general plugin entry point (group ``vllm.general_plugins``, name ``afd_shared_experts``).

vLLM calls ``register()`` in every process (argument parsing, engine core, each worker)
*before* any ``--additional-config`` is known, so registration cannot look at the ``afd``
block. What it registers is inert without one: the model wrappers (``ModelRegistry``) check
``vllm_config.additional_config`` when they are built and are the upstream classes without an
``afd`` block; the load format ``afd`` (``vllm.loader``) is only used when asked for with
``--load-format afd``. The experts layer is not registered here: a wrapper installs it only while it
builds an AFD model (``vllm.experts.remote_experts_installed``), so the platform plugin's own
``FusedMoE`` registration (vllm-ascend's) never collides with this plugin. Nor are the CPU kernel
patches (``vllm.cpu_patches``) applied here unless ``AFD_CPU_PATCHES=all`` asks for plain engines
too: an AFD model applies them when it is built, the FFN server when it sets up vLLM, so a plain
engine's process is left as vLLM made it. See docs/compat.md.
"""

from __future__ import annotations

# Architectures whose MoE layers hand gate, shared experts and routed experts to FusedMoE
# in the layout the wrappers know; anything else with an afd block is refused
# (``compat.AFDConfigHook``). vLLM 0.23.0 builds DeepSeek-V3.2 with its DeepseekV3ForCausalLM.
MODEL_WRAPPERS = {
    "DeepseekV2ForCausalLM": "afd_shared_experts.vllm.models:AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "afd_shared_experts.vllm.models:AFDDeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "afd_shared_experts.vllm.models:AFDDeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM": "afd_shared_experts.vllm.models:AFDGlm4MoeForCausalLM",
    "Qwen2MoeForCausalLM": "afd_shared_experts.vllm.models:AFDQwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "afd_shared_experts.vllm.models:AFDQwen3MoeForCausalLM",
}


_registered = False


def register() -> None:
    """Idempotent: registers the AFD model wrappers, the ``afd`` load format and the engine
    config hook once per process."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import register_model_loader

    from .compat import install_config_hooks
    from .cpu_patches import apply_cpu_patches, cpu_patch_scope
    from .loader import LOAD_FORMAT, AFDAttentionModelLoader

    for arch, target in MODEL_WRAPPERS.items():
        ModelRegistry.register_model(arch, target)
    register_model_loader(LOAD_FORMAT)(AFDAttentionModelLoader)
    # Before any VllmConfig exists: what engines with an afd block refuse, their graph mode and
    # worker (docs/compat.md).
    install_config_hooks(MODEL_WRAPPERS)
    # vLLM 0.23.0's CPU fused MoE cannot run SiLU without AVX512, and its CPU rotary kernel
    # mis-rotates 3-D query/key (docs/compat.md): plain engines get the fixes only when asked.
    if cpu_patch_scope() == "all":
        apply_cpu_patches()
    _registered = True
