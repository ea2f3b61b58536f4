"""FFN-side shared experts for asynchronous Attention-FFN disaggregation (AFD).

Plain torch runtime (no vLLM import): configuration, a transport-only connector, the
Attention-side remote MoE with local gate and the FFN runtime loop. See
docs/plugin-runtime.md for the ordering, lifetime and configuration contract.
"""

from .config import AFDConfig, AFDConfigError, SharedExpertsConfig, parse_afd_config

__all__ = ["AFDConfig", "AFDConfigError", "SharedExpertsConfig", "parse_afd_config"]
