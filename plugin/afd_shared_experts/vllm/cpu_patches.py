"""Compat patches, vLLM 0.23.0 on CPU: two kernels that give wrong answers or none (docs/compat.md).

- **Fused-MoE SiLU.** On CPUs without AVX512 (AVX2 only), the CPU fused-MoE fallback
  (``cpu_fused_moe``) looks up its SiLU-and-multiply in a table filled with ``SiluAndMul``
  CustomOp objects built at import, outside any VllmConfig context; calling one asserts, so no
  MoE model (plain or AFD) runs there. The fix points the table's SILU entry at
  ``SiluAndMul.forward_native`` (the same math, no CustomOp dispatch), the line vLLM 0.27.1
  ships.
- **Rotary embedding of 3-D query/key.** ``RotaryEmbedding.forward_cpu`` calls the CPU
  ``rotary_embedding`` kernel, which rotates ``[tokens, heads * head_size]`` correctly but not
  ``[tokens, heads, head_size]`` with more than one head: heads after the first come out wrong,
  and differently depending on the other requests in the batch (measured with the kernel alone:
  tests/plugin/test_vllm_cpu_patches.py). DeepSeek-V2/V3 with MLA disabled (required on CPU)
  pass 3-D views whenever their config has no ``rope_scaling``. The fix hands the kernel the
  2-D layout it handles (a copy when the view cannot be flattened) and writes the result back.

Applied only for the vLLM versions listed here, on the CPU platform, and by default only to AFD
engines: by a model wrapper when its engine has an afd block, and by the FFN server. A plain
engine's process keeps vLLM's kernels unless ``AFD_CPU_PATCHES=all`` asks for them there too (a
plain reference that AFD's answers are compared with). Remove each when the pin moves past it: the
SiLU patch at vLLM 0.27.1; the rotary patch when the pinned release's CPU kernel rotates 3-D input
like 2-D (the test that shows the kernel's error then fails and says so).
"""

from __future__ import annotations

import os

from .compat import installed_vllm_version

# Where the patches apply: "afd" (default) AFD engines only; "all" every vLLM process the plugin
# is loaded into, plain engines included.
CPU_PATCHES_ENV = "AFD_CPU_PATCHES"
CPU_PATCH_SCOPES = ("afd", "all")

# vLLM releases with these kernels (this plugin supports exactly one, compat.SUPPORTED_VLLM_VERSION).
PATCHED_VLLM_VERSIONS = ("0.23.0",)
SILU_FIXED_IN_VLLM = "0.27.1"


def rotary_in_2d(upstream):
    """``RotaryEmbedding.forward_cpu`` that runs ``upstream`` on 2-D query/key and returns the
    caller's own tensors, rotated in place, as upstream does."""

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return upstream(self, positions, query, key)
        # A contiguous tensor flattens to a view the kernel rotates in place; a strided view
        # (DeepSeek's q_pe/k_pe are slices of wider rows) goes through a copy.
        flat_query, flat_key = (None if t is None else t.contiguous().view(t.shape[0], -1) for t in (query, key))
        upstream(self, positions, flat_query, flat_key)
        for original, flat in ((query, flat_query), (key, flat_key)):
            if original is not None and not original.is_contiguous():
                original.copy_(flat.view(original.shape))
        return query, key

    forward_cpu.afd_patched = True
    return forward_cpu


def cpu_patch_scope() -> str:
    """The scope ``AFD_CPU_PATCHES`` asks for ("afd" when unset); anything else is refused."""
    scope = os.environ.get(CPU_PATCHES_ENV, "").strip() or "afd"
    if scope not in CPU_PATCH_SCOPES:
        raise ValueError(f"{CPU_PATCHES_ENV}={scope!r}: must be one of {', '.join(CPU_PATCH_SCOPES)} "
                         "(afd: AFD engines only, the default; all: plain engines too)")
    return scope


def apply_cpu_patches() -> bool:
    """Patch what this vLLM needs when it runs on CPU; True when it patched."""
    if installed_vllm_version().split("+")[0] not in PATCHED_VLLM_VERSIONS:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = SiluAndMul.forward_native
    if not getattr(RotaryEmbedding.forward_cpu, "afd_patched", False):
        RotaryEmbedding.forward_cpu = rotary_in_2d(RotaryEmbedding.forward_cpu)
    return True
