"""Runs under the vLLM venv: vLLM 0.23.0's CPU rotary embedding on 3-D query/key, by itself and
through RotaryEmbedding as the plugin patches it; prints one JSON object.

python vllm_rotary_driver.py
{"kernel_3d_error", "kernel_3d_batch_dependence", "kernel_2d_error", "patched_error",
 "patched_batch_dependence", "patched"}: largest absolute differences against an independent
rotation (interleaved pairs, vLLM's non-neox layout) of DeepSeek's 3-D views (q_pe and k_pe are
slices of wider rows), and between rotating 4 tokens alone and within 10.
"""

import json

import torch


def reference(cache, positions, x):
    cos, sin = cache[positions].chunk(2, dim=-1)
    even, odd = x[..., ::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def main() -> None:
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from afd_shared_experts.vllm.cpu_patches import apply_cpu_patches

    torch.manual_seed(0)
    tokens, heads, nope, rope_dim = 10, 2, 32, 32
    positions = torch.arange(tokens) % 6
    # DeepSeek without MLA: q [T, H, nope + rope] and the latent row [T, 1, lora + rope]; rope parts are views.
    q_rows, latent_rows = torch.randn(tokens, heads, nope + rope_dim), torch.randn(tokens, 1, 32 + rope_dim)

    def views(count):
        q, latent = q_rows[:count].clone(), latent_rows[:count].clone()
        return q, latent, q[..., nope:], latent[..., 32:]

    apply_cpu_patches()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rope_dim, max_position=64, is_neox_style=False, dtype=torch.float32)
    cache = rope.cos_sin_cache
    reference_q = reference(cache, positions, q_rows[..., nope:])
    result = {"patched": getattr(RotaryEmbedding.forward_cpu, "afd_patched", False)}

    def kernel(count, flatten):
        _, _, q_pe, k_pe = views(count)
        q, k = (q_pe.contiguous(), k_pe.contiguous()) if flatten else (q_pe, k_pe)
        if flatten:
            q, k = q.view(count, -1), k.view(count, -1)
        ops.rotary_embedding(positions[:count], q, k, rope_dim, cache, False)
        return q.reshape(count, heads, rope_dim)

    def patched(count):
        q, _, q_pe, k_pe = views(count)
        rope.forward_cpu(positions[:count], q_pe, k_pe)
        return q[..., nope:]  # rotated in place, as the model reads it

    for name, run in (("kernel_3d", lambda n: kernel(n, False)), ("kernel_2d", lambda n: kernel(n, True)),
                      ("patched", patched)):
        full = run(tokens)
        result[f"{name}_error"] = (full - reference_q).abs().max().item()
        result[f"{name}_batch_dependence"] = (full[:4] - run(4)).abs().max().item()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
