"""Accelerator check of the plugin core (run by scripts/device-check.sh; torch only, no vLLM).

1. Self-check: A Attention ranks and F FFN ranks in one process on one device (several
   ranks on one GPU), payloads and replies crossing through host memory with explicit
   device<->host copies (the host-staged data plane), every MoE layer of a small
   DeepSeek-V3-shaped checkpoint, both placements and partitions, float32/bfloat16/float16,
   compared with a dense torch reference computed on the CPU. On CUDA the Attention side
   runs under ``torch.cuda.set_sync_debug_mode("error")``; only ``host_row_counts`` (the one
   named sync) and the transport stand-in may sync, and ``host_row_counts`` must run exactly
   once per layer per step.
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
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

import afd_shared_experts.attention as attention
from afd_shared_experts.compute import combine, route, swiglu
from afd_shared_experts.connector import DispatchTicket, FFNPayload, WorkItem
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import DTYPES, load_attention_weights, load_ffn_weights, load_spec
from remote_moe_overhead import build_remote, median_step_ms, v3_inputs, v3_spec
from shared_placement import write_model

VARIANTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
# Largest |out - reference| relative to the largest |reference| of a layer.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


class CheckFailed(RuntimeError):
    pass


@contextmanager
def sync_debug_mode(device: torch.device, mode):
    """CUDA's sync-debug mode for the block ("error": any host sync raises; 0: syncs allowed,
    for the one named sync and the transport stand-in); nothing off CUDA."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class HostStagedLoopback:
    """One Attention rank's connector to FFN runtimes of the same process: each payload is
    copied to the host and back onto the device before the FFN rank computes it, and each
    reply likewise, as a host-staged data plane does between processes."""

    def __init__(self, runtimes: list[FFNRuntime], source: int, device: torch.device):
        self.runtimes, self.source, self.device = runtimes, source, device
        self.pending: dict[int, deque] = {}
        self.seq = 0

    def dispatch(self, layer: int, stage: int, payloads: list[FFNPayload]) -> DispatchTicket:
        ticket = DispatchTicket(layer=layer, seq=self.seq, stage=stage)
        self.seq += 1
        with sync_debug_mode(self.device, 0):
            host_replies = []
            for runtime, payload in zip(self.runtimes, payloads):
                rows = payload.rows.cpu().to(self.device)
                item = WorkItem(source=self.source, layer=layer, seq=ticket.seq, stage=stage,
                                payload=FFNPayload(rows=rows, routed_counts=payload.routed_counts,
                                                   shared_prefix=payload.shared_prefix,
                                                   shared_extra=payload.shared_extra))
                host_replies.append(runtime.process(item)[0].cpu())
        self.pending.setdefault(stage, deque()).append((ticket, host_replies))
        return ticket

    def receive_replies(self, stage: int):
        ticket, host_replies = self.pending[stage].popleft()
        with sync_debug_mode(self.device, 0):
            return ticket, [reply.to(self.device) for reply in host_replies]


@contextmanager
def counted_row_count_syncs(device: torch.device):
    """Replaces attention.host_row_counts by a counting wrapper that may sync."""
    original = attention.host_row_counts
    calls = {"n": 0}

    def counted(counts):
        calls["n"] += 1
        with sync_debug_mode(device, 0):
            return original(counts)

    attention.host_row_counts = counted
    try:
        yield calls
    finally:
        attention.host_row_counts = original


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


def run_selfcheck(model_dir: Path, device: torch.device, *, attention_ranks: int, ffn_ranks: int,
                  placement: str, partition: str, dtype_name: str, tokens: int, steps: int) -> float:
    """Worst relative error against the reference over layers; raises CheckFailed."""
    spec = load_spec(model_dir)
    dtype = DTYPES[dtype_name]
    runtimes = [FFNRuntime(None, torch_experts(load_ffn_weights(model_dir, spec, placement, f, ffn_ranks, dtype,
                                                                 device)))
                for f in range(ffn_ranks)]
    weights = load_attention_weights(model_dir, spec, placement, dtype, device)
    x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
    bounds = [(a * tokens // attention_ranks, (a + 1) * tokens // attention_ranks) for a in range(attention_ranks)]
    ranks = []
    for a in range(attention_ranks):
        connector = HostStagedLoopback(runtimes, a, device)
        ranks.append({l: attention.AttentionMoELayer(w.gate, attention.RemoteMoE(
            spec=spec, layer=l, connector=connector, num_ffn_ranks=ffn_ranks, placement=placement,
            partition=partition, dtype=dtype, shared=w.shared)) for l, w in weights.items()})
    outputs: dict[int, list[torch.Tensor]] = {l: [] for l in spec.moe_layers}
    for step in range(steps):
        for a, layers in enumerate(ranks):
            shard = x[slice(*bounds[a])].to(device)
            for layer, moe in layers.items():
                with counted_row_count_syncs(device) as syncs, sync_debug_mode(device, "error"):
                    out = moe.forward(shard)
                if syncs["n"] != 1:
                    raise CheckFailed(f"layer {layer} step {step}: {syncs['n']} row-count syncs (expected exactly 1)")
                if out.device != shard.device:
                    raise CheckFailed(f"layer {layer}: output on {out.device}, input on {shard.device}")
                if step == 0:
                    outputs[layer].append(out.cpu().float())
    scale = spec.routed_scaling_factor if dtype == torch.float16 else 1.0  # fp16: output is model units / r
    expected = reference_outputs(model_dir, x.to(dtype).float(), dtype)
    worst = 0.0
    for layer in spec.moe_layers:
        actual = torch.cat(outputs[layer]) * scale
        error = float((actual - expected[layer]).abs().max() / expected[layer].abs().max())
        if not error <= TOLERANCE[dtype_name]:
            raise CheckFailed(f"layer {layer}, {placement}/{partition}, {dtype_name}: relative error {error:.2e} "
                              f"exceeds {TOLERANCE[dtype_name]:.0e}")
        worst = max(worst, error)
    return worst


def selfcheck_all(device: torch.device, attention_ranks: int, ffn_ranks: int, tokens: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "v3-scaled")
        print(f"self-check on {device}: {attention_ranks} Attention + {ffn_ranks} FFN ranks in one process, "
              f"{tokens} tokens, {steps} steps, host-staged loopback")
        for placement, partition in VARIANTS:
            for dtype_name in TOLERANCE:
                error = run_selfcheck(model_dir, device, attention_ranks=attention_ranks, ffn_ranks=ffn_ranks,
                                      placement=placement, partition=partition, dtype_name=dtype_name,
                                      tokens=tokens, steps=steps)
                print(f"  {placement:>9} {partition:>10} {dtype_name:>8}: ok, max relative error {error:.2e}, "
                      "1 row-count sync per layer step")


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
    parser.add_argument("--ffn-ranks", type=int, default=4, help="FFN ranks of the self-check (must divide 32)")
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
