"""Attention-side work of one MoE layer step: RemoteMoE dispatch + combine, before vs after.

DeepSeek-V3 shapes (hidden 7168, 256 routed experts, top-8 of 8 groups keeping 4, r = 2.5),
bf16, F = 16 FFN ranks, placement 'ffn' with both partitions. The connector is a no-op that
answers every dispatch at once (``NoOpConnector``), so neither transport nor FFN compute is
measured; frames are sized for the step's token count. (Placement 'attention' is left out: its local shared-expert GEMM
is model compute, the same before and after.) BEFORE is another copy of the plugin package,
e.g. the previous commit's (`git archive HEAD plugin | tar -x -C DIR`), loaded beside this
checkout's package under another name; both run in one process, alternating step by step.
``--hidden`` shrinks only the hidden size, leaving mostly the host-side work.

    python benchmarks/remote_moe_overhead.py --baseline DIR/plugin/afd_shared_experts \
        [--tokens 1 256 4096] [--ffn-ranks 16] [--repeats 5] [--hidden 7168]

Columns: median milliseconds per layer step, the after/before ratio, and host reads per
layer step (Tensor.tolist/.item calls, counted in a separate untimed step).

glibc's malloc starts a process with a 128 KiB mmap threshold and trims its heap eagerly, so
a fresh process pays page faults on every step's larger temporaries (2.7x the time at T = 64
and 3.0x at T = 256 with hidden 512, docs/benchmarks.md); a serving process, and this script
(``settle_allocator``), has its thresholds at glibc's long-run maximum, where tcmalloc gives
about the same times.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import statistics
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

from afd_shared_experts.connector import FrameSet
from afd_shared_experts.wire import DispatchTicket

V3_SHAPE = {"hidden_size": 7168, "moe_intermediate_size": 2048, "shared_intermediate_size": 2048,
            "num_routed_experts": 256, "top_k": 8, "num_groups": 8, "topk_groups": 4,
            "routed_scaling_factor": 2.5}
PARTITIONS = ("affinity", "contiguous")


class NoOpConnector:
    """Answers each dispatch at once without transport or FFN compute. Speaks both connector
    interfaces, so a baseline package of either wire format runs against it: per-FFN-rank
    payloads answered with zero rows of the announced shape (a broadcast view of one row), or
    frames whose reply rows stay as they are."""

    rank = 0

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str, layout=None):
        self.zero_row = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.layout, self.device = layout, device
        self.frames = None
        self.pending: dict[int, deque] = {}
        self.seq = 0

    def acquire(self):
        if self.frames is None:
            ranks = self.layout.num_ffn_ranks
            self.frames = FrameSet(work=self.layout.work_frames(ranks, self.device),
                                   reply=self.layout.reply_frames(ranks, self.device).zero_())
        return self.frames

    def release(self, frames):
        pass

    def dispatch(self, layer, stage, payloads_or_frames, *, step=None, tokens=None, stages=1):
        ticket = DispatchTicket(layer=layer, seq=self.seq, stage=stage)
        self.seq += 1
        if isinstance(payloads_or_frames, list):  # the per-rank payloads of wire format 1
            replies = [self.zero_row.expand(p.routed_rows + p.shared_rows, -1) for p in payloads_or_frames]
        else:
            replies = payloads_or_frames
        self.pending.setdefault(stage, deque()).append((ticket, replies))
        return ticket

    def receive_replies(self, stage):
        return self.pending[stage].popleft()


def load_plugin(name: str, package_dir: Path):
    """Import a copy of the plugin package under another top-level name."""
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.attention"), spec_module(name)


def spec_module(package: str):
    """The package's module defining MoESpec: `moe_spec`, or `model` in trees older than it."""
    try:
        return importlib.import_module(f"{package}.moe_spec")
    except ModuleNotFoundError:
        return importlib.import_module(f"{package}.model")


def v3_spec(definitions, hidden_size: int = V3_SHAPE["hidden_size"]):
    return definitions.MoESpec(model_type="deepseek_v3", gate_kind=definitions.GATE_SIGMOID_GROUPED,
                                norm_topk_prob=True, has_shared_gate=False, moe_layers=(0,),
                                **{**V3_SHAPE, "hidden_size": hidden_size})


def v3_inputs(spec, tokens: int, device, dtype=torch.bfloat16):
    """Hidden states and DeepSeek-V3 routing from a random gate (grouped top-k, not uniform ids)."""
    from afd_shared_experts.compute import route
    from afd_shared_experts.model import GateWeights

    gen = torch.Generator().manual_seed(tokens)
    hidden = spec.hidden_size
    x = torch.randn(tokens, hidden, generator=gen)
    gate = GateWeights(weight=torch.randn(spec.num_routed_experts, hidden, generator=gen) * hidden ** -0.5,
                       correction_bias=torch.randn(spec.num_routed_experts, generator=gen) * 0.01)
    ids, weights = route(spec, gate, x)
    return x.to(device=device, dtype=dtype), ids.to(device), weights.to(device)


def build_remote(attention_module, spec, partition: str, ffn_ranks: int, device, dtype=torch.bfloat16,
                 max_tokens: int = 1):
    # The measured package's own wire layout: frame shapes differ between wire formats.
    package = attention_module.__name__.rsplit(".", 1)[0]
    layout = importlib.import_module(f"{package}.wire").WireLayout(
        hidden_size=spec.hidden_size, dtype=dtype, local_experts=spec.local_experts(ffn_ranks),
        num_ffn_ranks=ffn_ranks, top_k=spec.top_k, max_tokens=max_tokens, shared=partition)
    connector = NoOpConnector(spec.hidden_size, dtype, device, layout)
    return attention_module.RemoteMoE(spec=spec, layer=0, connector=connector, num_ffn_ranks=ffn_ranks,
                                      placement="ffn", partition=partition, dtype=dtype)


def step_ms(remote, inputs, synchronize=lambda: None) -> float:
    synchronize()
    started = time.perf_counter()
    remote.forward(*inputs)
    synchronize()
    return (time.perf_counter() - started) * 1e3


def median_step_ms(remote, inputs, repeats: int, synchronize=lambda: None) -> float:
    remote.forward(*inputs)  # warm-up
    return statistics.median(step_ms(remote, inputs, synchronize) for _ in range(repeats))


@contextmanager
def counting_host_reads():
    """Counts Tensor.tolist() and Tensor.item() calls made inside the block."""
    counts = {"reads": 0}
    names = ("tolist", "item")
    overridden = {name: torch.Tensor.__dict__[name] for name in names if name in torch.Tensor.__dict__}
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counted(original):
        def call(self, *args, **kwargs):
            counts["reads"] += 1
            return original(self, *args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counts
    finally:
        for name in names:
            if name in overridden:
                setattr(torch.Tensor, name, overridden[name])
            else:
                delattr(torch.Tensor, name)


def host_reads_per_step(remote, inputs) -> int:
    with counting_host_reads() as counts:
        remote.forward(*inputs)
    return counts["reads"]


def settle_allocator() -> None:
    """glibc malloc's thresholds as a long-running process reaches them by itself (freeing large
    blocks raises the mmap threshold up to 32 MiB, the trim threshold to twice that): step
    temporaries then reuse heap pages instead of faulting fresh ones in. A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mmap_threshold, trim_threshold = -3, -1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD (malloc.h)
    mallopt(mmap_threshold, 32 << 20)
    mallopt(trim_threshold, 64 << 20)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path,
                        help="directory of the BEFORE copy of the afd_shared_experts package")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 4096])
    parser.add_argument("--ffn-ranks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=V3_SHAPE["hidden_size"],
                        help="hidden size (a small one leaves mostly the host-side work: Python, op launches)")
    args = parser.parse_args(argv)
    if not (args.baseline / "attention.py").is_file():
        parser.error(f"--baseline: {args.baseline} holds no attention.py (expected the afd_shared_experts package)")
    # One thread: on a shared machine, multi-threaded ops measure the neighbours' load.
    torch.set_num_threads(1)
    settle_allocator()
    before = load_plugin("afd_shared_experts_before", args.baseline)
    after = (importlib.import_module("afd_shared_experts.attention"), spec_module("afd_shared_experts"))
    print(f"RemoteMoE dispatch + combine per layer step, CPU (1 thread), bf16, DeepSeek-V3 shapes with hidden "
          f"{args.hidden}, F = {args.ffn_ranks}, no-op connector, median of {args.repeats}")
    print(f"{'T':>5} {'partition':>10} {'before ms':>10} {'after ms':>9} {'after/before':>12} "
          f"{'host reads before':>17} {'after':>5}")
    for tokens in args.tokens:
        inputs = v3_inputs(v3_spec(after[1], args.hidden), tokens, "cpu")
        for partition in PARTITIONS:
            remotes = [build_remote(attention_module, v3_spec(module_of_spec, args.hidden), partition, args.ffn_ranks,
                                    "cpu", max_tokens=tokens)
                       for attention_module, module_of_spec in (before, after)]
            # Alternating before/after step by step, so a change in the machine's load hits both.
            times = [[], []]
            for _ in range(args.repeats + 1):  # the first round warms up
                for remote, series in zip(remotes, times):
                    series.append(step_ms(remote, inputs))
            before_ms, after_ms = (statistics.median(series[1:]) for series in times)
            before_reads, after_reads = (host_reads_per_step(remote, inputs) for remote in remotes)
            print(f"{tokens:>5} {partition:>10} {before_ms:>10.2f} {after_ms:>9.2f} {after_ms / before_ms:>12.2f} "
                  f"{before_reads:>17} {after_reads:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
