"""Shared-expert placement benchmark (CPU, real gloo rank processes).

A DeepSeek-V3-shaped MoE layer scaled down to fit a small CPU machine, run through the
selfcheck machinery for placement attention vs ffn (affinity, contiguous) at A:F = 1:1,
2:1, 4:1. Prints Attention-side weight bytes, wire bytes by kind, per-layer step latency and
tokens/s side by side, with ratios against placement 'attention'. Work bytes are frame headers
and valid rows (the staged plane every rank here runs).

    python benchmarks/shared_placement.py [--tokens-per-attention-rank 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from afd_shared_experts.selfcheck import RunSpec, run_topology

# DeepSeek-V3 proportions (7168 hidden, 2048 expert intermediate, 256 routed, top-8 in
# 8 groups of which 4 are kept, 1 shared expert, r = 2.5) scaled down.
SHAPE = {"hidden_size": 256, "moe_intermediate_size": 96, "n_routed_experts": 32, "num_experts_per_tok": 8,
         "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
RATIOS = [(1, 1), (2, 1), (4, 1)]
VARIANTS = [("attention", "affinity"), ("ffn", "affinity"), ("ffn", "contiguous")]


def write_model(directory: Path) -> Path:
    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu",
           "num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1, "norm_topk_prob": True,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", **SHAPE}
    gen = torch.Generator().manual_seed(0)
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["n_routed_experts"]
    s = i * SHAPE["n_shared_experts"]
    base = "model.layers.0.mlp"
    tensors = {f"{base}.gate.weight": torch.randn(e, h, generator=gen) * h ** -0.5,
               f"{base}.gate.e_score_correction_bias": torch.randn(e, generator=gen) * 0.01}
    for name, inter in [(f"experts.{x}", i) for x in range(e)] + [("shared_experts", s)]:
        tensors[f"{base}.{name}.gate_proj.weight"] = torch.randn(inter, h, generator=gen) * h ** -0.5
        tensors[f"{base}.{name}.up_proj.weight"] = torch.randn(inter, h, generator=gen) * h ** -0.5
        tensors[f"{base}.{name}.down_proj.weight"] = torch.randn(h, inter, generator=gen) * inter ** -0.5
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(__import__("json").dumps(cfg))
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-attention-rank", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "v3-scaled")
        print(f"DeepSeek-V3-shaped layer {SHAPE}, dtype {args.dtype}, {args.tokens_per_attention_rank} tokens per "
              f"Attention rank, {args.steps} steps (first dropped), median per-layer step latency")
        header = (f"{'A:F':>4} {'placement':>9} {'partition':>10} {'attn weight B':>13} {'work B':>10} "
                  f"{'reply B':>10} {'latency ms':>10} {'tok/s':>9} {'lat ratio':>9} {'attnW ratio':>11}")
        print(header)
        for a, f in RATIOS:
            tokens = a * args.tokens_per_attention_rank
            x = torch.randn(tokens, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
            baseline = None
            for placement, partition in VARIANTS:
                run = RunSpec(model_dir=str(model), attention_ranks=a, ffn_ranks=f, placement=placement,
                              partition=partition, dtype=args.dtype, steps=args.steps + 1)
                report = run_topology(run, x).report
                latency = statistics.median(report["wall_time_per_step_seconds"][1:])
                weight = report["attention_parameter_bytes"][0]
                per_step = {k: v // (args.steps + 1) for k, v in report["bytes_by_kind"].items()}
                if baseline is None:
                    baseline = (latency, weight)
                print(f"{a}:{f:<2} {placement:>9} {partition if placement == 'ffn' else '-':>10} {weight:>13} "
                      f"{per_step['work']:>10} {per_step['replies']:>10} {latency * 1e3:>10.2f} {tokens / latency:>9.0f} "
                      f"{latency / baseline[0]:>9.2f} {weight / baseline[1]:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
