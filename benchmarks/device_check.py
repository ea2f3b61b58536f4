"""Accelerator check of the plugin core (run by scripts/device-check.sh; torch only, no vLLM).

1. Self-check: the plugin's selfcheck (afd_shared_experts.selfcheck) with every rank on the
   device: A Attention and F FFN rank processes on one GPU, the real P2PConnector between
   them, whose data plane must resolve to ``staged`` there (payloads and replies over gloo
   with explicit device<->host copies; NCCL refuses two ranks on one GPU). Every MoE layer of
   a small DeepSeek-V3-shaped checkpoint, both placements and partitions,
   float32/bfloat16/float16 (all nine runs in one launch of the rank processes), compared
   with a dense torch reference computed on the CPU. On CUDA each Attention rank runs its
   forward under ``torch.cuda.set_sync_debug_mode("error")``; only ``host_row_counts`` (the
   one named sync) and the connector's calls (its staged copies) may sync, and
   ``host_row_counts`` must run exactly once per layer per step.
2. Timings: RemoteMoE dispatch + combine per layer step for DeepSeek-V3 shapes, F = 16,
   T = 1..4096, with the no-op connector of benchmarks/remote_moe_overhead.py.

Exit 0 when every comparison holds, 1 with a message otherwise (also when no CUDA device is
present), 2 on bad arguments. ``--device cpu`` runs the same check on the CPU (no
sync-debug mode there), which is how the check itself is tested.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import afd_shared_experts.attention as attention
from afd_shared_experts.compute import combine, route, swiglu
from afd_shared_experts.model import DTYPES, load_attention_weights, load_ffn_weights, load_spec
from afd_shared_experts.selfcheck import RunSpec, run_topologies
from remote_moe_overhead import build_remote, median_step_ms, v3_inputs, v3_spec
from shared_placement import write_model

VARIANTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
# Largest |out - reference| relative to the largest |reference| of a layer.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


class CheckFailed(RuntimeError):
    pass


def reference_outputs(model_dir: Path, x: torch.Tensor, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Dense MoE of every layer on the CPU in float32 arithmetic over the weights as stored in
    ``dtype``, in model units: r * sum_k w_k E_k(x) + S(x)."""
    spec = load_spec(model_dir)
    gates = load_attention_weights(model_dir, spec, "attention", dtype)
    experts = load_ffn_weights(model_dir, spec, "ffn", 0, 1, dtype)
    outputs = {}
    for layer in spec.moe_layers:
        ids, weights = route(spec, gates[layer].gate, x)
        routed, shared = experts[layer].routed, experts[layer].shared
        routed_sum = torch.zeros_like(x)
        for slot in range(ids.shape[1]):
            for expert in ids[:, slot].unique().tolist():
                rows = ids[:, slot] == expert
                out = swiglu(x[rows], routed.gate_up[expert].float(), routed.down[expert].float())
                routed_sum[rows] += weights[rows, slot, None] * out
        shared_out = swiglu(x, shared.gate_up.float(), shared.down.float())
        outputs[layer] = combine(routed_sum, shared_out, spec.routed_scaling_factor, torch.float32)
    return outputs


def selfcheck_all(device: torch.device, attention_ranks: int, ffn_ranks: int, tokens: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "v3-scaled")
        spec = load_spec(model_dir)
        print(f"self-check on {device}: {attention_ranks} Attention + {ffn_ranks} FFN rank processes on one device, "
              f"real P2PConnector, {tokens} tokens, {steps} steps")
        x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
        runs = [RunSpec(model_dir=str(model_dir), attention_ranks=attention_ranks, ffn_ranks=ffn_ranks,
                        placement=placement, partition=partition, dtype=dtype_name, steps=steps, device=str(device))
                for placement, partition in VARIANTS for dtype_name in TOLERANCE]
        for run, result in zip(runs, run_topologies(runs, x)):
            report = result.report
            # auto must pick the staged plane for several ranks on one device
            if report["data_plane"] != "staged":
                raise CheckFailed(f"{run.placement}/{run.partition}, {run.dtype}: data plane {report['data_plane']} "
                                  "(expected staged: every rank is on one device)")
            if report["row_count_syncs_per_layer_step"] != [1]:
                raise CheckFailed(f"{run.placement}/{run.partition}, {run.dtype}: row-count syncs per layer step "
                                  f"{report['row_count_syncs_per_layer_step']} (expected exactly 1)")
            dtype = DTYPES[run.dtype]
            expected = reference_outputs(model_dir, x.to(dtype).float(), dtype)
            worst = 0.0
            for layer in spec.moe_layers:
                actual = result.outputs[layer]
                error = float((actual - expected[layer]).abs().max() / expected[layer].abs().max())
                if not error <= TOLERANCE[run.dtype]:
                    raise CheckFailed(f"layer {layer}, {run.placement}/{run.partition}, {run.dtype}: relative error "
                                      f"{error:.2e} exceeds {TOLERANCE[run.dtype]:.0e}")
                worst = max(worst, error)
            print(f"  {run.placement:>9} {run.partition:>10} {run.dtype:>8}: ok, max relative error {worst:.2e}, "
                  f"{report['data_plane']} data plane, 1 row-count sync per layer step")


def timings(device: torch.device, token_counts: list[int], ffn_ranks: int, repeats: int) -> None:
    import afd_shared_experts.model as model

    spec = v3_spec(model)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"timings on {device}: RemoteMoE dispatch + combine per layer step, DeepSeek-V3 shapes, bf16, "
          f"F = {ffn_ranks}, no-op connector, median of {repeats}")
    print(f"{'T':>5} {'affinity ms':>12} {'contiguous ms':>14}")
    for tokens in token_counts:
        inputs = v3_inputs(spec, tokens, device)
        cells = [median_step_ms(build_remote(attention, spec, partition, ffn_ranks, device), inputs, repeats,
                                synchronize) for partition in ("affinity", "contiguous")]
        print(f"{tokens:>5} {cells[0]:>12.3f} {cells[1]:>14.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/device-check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu runs the same check without sync-debug mode, to test the check")
    parser.add_argument("--attention-ranks", type=int, default=2)
    parser.add_argument("--ffn-ranks", type=int, default=2, help="FFN ranks of the self-check (must divide 32)")
    parser.add_argument("--tokens", type=int, default=67, help="tokens of the self-check")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timing-tokens", type=int, nargs="*", default=[1, 16, 64, 256, 1024, 4096],
                        help="token counts of the timing table (none: skip the timings)")
    parser.add_argument("--timing-ffn-ranks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("attention_ranks", "ffn_ranks", "tokens", "steps", "timing_ffn_ranks", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if 32 % args.ffn_ranks or 256 % args.timing_ffn_ranks:
        parser.error("--ffn-ranks must divide 32 and --timing-ffn-ranks must divide 256 "
                     f"(got {args.ffn_ranks}, {args.timing_ffn_ranks})")
    if any(t < 1 for t in args.timing_tokens):
        parser.error(f"--timing-tokens must all be >= 1 (got {args.timing_tokens})")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device-check failed: no CUDA device (torch.cuda.is_available() is False); run it on a machine "
              "with an NVIDIA GPU, or pass --device cpu to test the check itself", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        selfcheck_all(device, args.attention_ranks, args.ffn_ranks, args.tokens, args.steps)
        if args.timing_tokens:
            timings(device, args.timing_tokens, args.timing_ffn_ranks, args.repeats)
    except RuntimeError as exc:  # CheckFailed, or a forbidden sync under sync-debug mode
        print(f"device-check failed: {exc}", file=sys.stderr)
        return 1
    print("device-check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
