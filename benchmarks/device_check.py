"""Accelerator check of the plugin core (run by scripts/device-check.sh; torch only, no vLLM).

1. Self-check: the plugin's selfcheck (afd_shared_experts.selfcheck) with two rank processes
   on the device, one Attention and one FFN rank, the real P2PConnector between them, whose
   data plane must resolve to ``staged`` there (NCCL refuses two ranks on one GPU). Every MoE
   layer of a small DeepSeek-V3-shaped checkpoint, both placements and partitions,
   float32/bfloat16/float16 (nine runs in one launch of the rank processes), compared with a
   dense torch reference computed on the CPU. On CUDA the Attention rank runs its forward
   under ``torch.cuda.set_sync_debug_mode("error")``; only the connector's staged copies may
   sync.
2. Graph capture: one RemoteMoE layer at DeepSeek-V3 shapes (hidden 7168, 256 routed experts,
   top-8 of 8 groups keeping 4, bf16, F = 16), called through the custom ops ``afd::dispatch``
   and ``afd::combine``, against a device-side loopback FFN (each reply is a device copy of
   its work frame's rows, as many bytes as a direct-plane send of the whole frame moves; no
   transport, no host work), captured in a CUDA graph under sync-debug mode "error" and
   replayed on new inputs; the replay must equal the eager layer bit for bit. Frames are sized
   for the largest token count of step 3.
3. Timings: that layer's dispatch + combine per step for 1, 64 and 512 tokens, eager and
   replayed from its graph.

Exit 0 when every comparison holds, 1 with a message otherwise (also when no CUDA device is
present), 2 on bad arguments. ``--device cpu`` runs steps 1 and 3 (eager only) on the CPU,
which is how the check itself is tested.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from afd_shared_experts import ops
from afd_shared_experts.attention import RemoteMoE
from afd_shared_experts.compute import combine, route, swiglu
from afd_shared_experts.connector import FrameSet
from afd_shared_experts.device import sync_debug_mode
from afd_shared_experts.model import DTYPES, GateWeights, load_attention_weights, load_ffn_weights
from afd_shared_experts.moe_spec import GATE_SIGMOID_GROUPED, MoESpec, load_spec
from afd_shared_experts.selfcheck import RunSpec, run_topologies
from afd_shared_experts.wire import DispatchTicket, WireLayout
from shared_placement import write_model

VARIANTS = [("ffn", "affinity"), ("ffn", "contiguous"), ("attention", "affinity")]
# Largest |out - reference| relative to the largest |reference| of a layer.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
V3 = dict(hidden_size=7168, moe_intermediate_size=2048, shared_intermediate_size=2048, num_routed_experts=256,
          top_k=8, num_groups=8, topk_groups=4, routed_scaling_factor=2.5)


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


def selfcheck_all(device: torch.device, attention_ranks: int, ffn_ranks: int, tokens: int, steps: int,
                  port: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "v3-scaled")
        spec = load_spec(model_dir)
        print(f"self-check on {device}: {attention_ranks} Attention + {ffn_ranks} FFN rank processes on one device, "
              f"real P2PConnector, {tokens} tokens, {steps} steps")
        x = torch.randn(tokens, spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
        runs = [RunSpec(model_dir=str(model_dir), attention_ranks=attention_ranks, ffn_ranks=ffn_ranks,
                        placement=placement, partition=partition, dtype=dtype_name, steps=steps, device=str(device),
                        port=port + number if port else 0)
                for number, (placement, partition, dtype_name) in enumerate(
                    (placement, partition, dtype_name) for placement, partition in VARIANTS for dtype_name in TOLERANCE)]
        for run, result in zip(runs, run_topologies(runs, x)):
            report = result.report
            # auto must pick the staged plane for several ranks on one device
            if report["data_plane"] != "staged":
                raise CheckFailed(f"{run.placement}/{run.partition}, {run.dtype}: data plane {report['data_plane']} "
                                  "(expected staged: every rank is on one device)")
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
                  f"{report['data_plane']} data plane")


class LoopbackFFN:
    """The connector as the layer sees it, with the FFN side done on the device: each reply is
    its work frame's rows (identity experts), by device copies only, on one static frame set."""

    rank = 0

    def __init__(self, layout: WireLayout, device: torch.device):
        self.layout = layout
        self.frames = FrameSet(work=layout.work_frames(layout.num_ffn_ranks, device),
                               reply=layout.reply_frames(layout.num_ffn_ranks, device).zero_())
        self._pending: list[DispatchTicket] = []

    def acquire(self) -> FrameSet:
        return self.frames

    def dispatch(self, layer, stage, frames, *, tokens, stages=1):
        rows = min(self.layout.rows_message_rows(tokens), self.layout.reply_message_rows(tokens))
        frames.reply[:, :rows].copy_(frames.work[:, self.layout.header_rows:self.layout.header_rows + rows])
        self._pending.append(DispatchTicket(layer=layer, seq=len(self._pending), stage=stage))
        return self._pending[-1]

    def receive_replies(self, stage):
        return self._pending.pop(0), self.frames

    def release(self, frames):
        pass


def v3_layer(device: torch.device, partition: str, ffn_ranks: int, max_tokens: int):
    spec = MoESpec(model_type="deepseek_v3", gate_kind=GATE_SIGMOID_GROUPED, norm_topk_prob=True, has_shared_gate=False,
                   moe_layers=(0,), **V3)
    gen = torch.Generator().manual_seed(0)
    gate = GateWeights(weight=(torch.randn(spec.num_routed_experts, spec.hidden_size, generator=gen)
                               * spec.hidden_size ** -0.5).to(device),
                       correction_bias=(torch.randn(spec.num_routed_experts, generator=gen) * 0.01).to(device))
    layout = WireLayout(hidden_size=spec.hidden_size, dtype=torch.bfloat16, local_experts=spec.local_experts(ffn_ranks),
                        num_ffn_ranks=ffn_ranks, top_k=spec.top_k, max_tokens=max_tokens, shared=partition)
    remote = RemoteMoE(spec=spec, layer=0, connector=LoopbackFFN(layout, device), num_ffn_ranks=ffn_ranks,
                       placement="ffn", partition=partition, dtype=torch.bfloat16)
    name = f"device-check.{partition}"
    ops.register_remote_moe(name, remote)

    def forward(x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(spec, gate, x)
        return ops.remote_moe(x, [ids, weights], name)

    return spec, forward


def graph_and_timings(device: torch.device, token_counts: list[int], ffn_ranks: int, repeats: int) -> None:
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"remote MoE layer on {device}: DeepSeek-V3 shapes, bf16, F = {ffn_ranks}, placement ffn, loopback FFN on "
          f"the device, {'eager vs CUDA graph replay' if cuda else 'eager'}, median of {repeats} (ms per layer step)")
    print(f"{'T':>5} {'partition':>10} {'eager ms':>9} {'graph ms':>9} {'replay == eager':>15}")
    for tokens in token_counts:
        for partition in ("affinity", "contiguous"):
            spec, forward = v3_layer(device, partition, ffn_ranks, max(token_counts))
            gen = torch.Generator().manual_seed(tokens)
            static_x = torch.randn(tokens, spec.hidden_size, generator=gen).to(device, torch.bfloat16)
            eager_times = []
            for _ in range(repeats + 1):  # the first warms up
                synchronize()
                started = time.perf_counter()
                eager = forward(static_x)
                synchronize()
                eager_times.append((time.perf_counter() - started) * 1e3)
            graph_ms, same = "-", "-"
            if cuda:
                graph = torch.cuda.CUDAGraph()
                with sync_debug_mode(device, "error"), torch.cuda.graph(graph):
                    static_out = forward(static_x)
                other = torch.randn(tokens, spec.hidden_size, generator=gen).to(device, torch.bfloat16)
                static_x.copy_(other)
                with sync_debug_mode(device, "error"):
                    graph.replay()
                eager_other = forward(other)
                synchronize()
                if not torch.equal(static_out, eager_other):
                    raise CheckFailed(f"T={tokens} {partition}: the replayed graph differs from the eager layer "
                                      f"(max |diff| {float((static_out.float() - eager_other.float()).abs().max()):.3e})")
                replays = []
                for _ in range(repeats):
                    synchronize()
                    started = time.perf_counter()
                    graph.replay()
                    synchronize()
                    replays.append((time.perf_counter() - started) * 1e3)
                graph_ms, same = f"{statistics.median(replays):.3f}", "yes"
            elif eager.shape != static_x.shape:
                raise CheckFailed(f"T={tokens} {partition}: output shape {tuple(eager.shape)}")
            print(f"{tokens:>5} {partition:>10} {statistics.median(eager_times[1:]):>9.3f} {graph_ms:>9} {same:>15}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/device-check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu runs the same check without sync-debug mode or graphs, to test it")
    parser.add_argument("--attention-ranks", type=int, default=1)
    parser.add_argument("--ffn-ranks", type=int, default=1, help="FFN ranks of the self-check (must divide 32)")
    parser.add_argument("--tokens", type=int, default=67, help="tokens of the self-check")
    parser.add_argument("--steps", type=int, default=3,
                        help="self-check steps (steps 2.. must repeat step 1's outputs bit for bit)")
    parser.add_argument("--timing-tokens", type=int, nargs="*", default=[1, 64, 512],
                        help="token counts of the graph check and timing table (none: skip them)")
    parser.add_argument("--timing-ffn-ranks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--port", type=int, default=0,
                        help=f"the self-check's rendezvous ports are PORT, PORT+1, .. (one per run, "
                             f"{len(VARIANTS) * len(TOLERANCE)}); default: free ports outside the ephemeral range")
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
    if not 0 <= args.port <= 65535 - len(VARIANTS) * len(TOLERANCE):
        parser.error(f"--port must leave room for {len(VARIANTS) * len(TOLERANCE)} ports below 65536 (got {args.port})")
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
        selfcheck_all(device, args.attention_ranks, args.ffn_ranks, args.tokens, args.steps, args.port)
        if args.timing_tokens:
            graph_and_timings(device, args.timing_tokens, args.timing_ffn_ranks, args.repeats)
    except RuntimeError as exc:  # CheckFailed, or a forbidden sync under sync-debug mode
        print(f"device-check failed: {exc}", file=sys.stderr)
        return 1
    print("device-check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
