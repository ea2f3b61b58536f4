"""One MoE layer's round trip through the connector on real rank processes, before vs after.

Two 1A1F worlds on loopback gloo (the staged plane) share one pair of rank processes: the
Attention process pinned to core 0, the FFN process to core 1, one torch thread each, as
``e2e_cpu.py --suite serve`` runs them. One world runs BEFORE, another copy of the plugin
package loaded under another name (e.g. the previous commit's: ``git archive HEAD plugin |
tar -x -C DIR``), the other this checkout; the Attention process alternates steps between them
(which goes first alternates too), so this machine's drift reaches both alike. The MoE shape is
that suite's model (hidden 512, 8 routed experts of intermediate 256, top-2, one shared expert,
placement 'ffn'), 3 MoE layers per step, T tokens per step, the FFN computing with plain torch.

    PYTHONPATH=devcluster python benchmarks/connector_round_trip.py --baseline DIR/plugin/afd_shared_experts \
        [--tokens 8 64] [--steps 400]

Columns (medians over the steps after the first 20): the step's wall time on the Attention
process, and per MoE layer from the stage traces (``AFD_TRACE_DIR``; each interval belongs to
the step it starts in) the Attention rank's dispatch, its wait for the reply and its combine,
and the FFN rank's expert pass; microseconds, and after / before.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from remote_moe_overhead import load_plugin

SHAPE = dict(hidden=512, inter=256, experts=8, top_k=2, layers=3, n_shared_experts=1, n_group=1, topk_group=1)
WARMUP_STEPS = 20
SPANS = (("attention", "dispatch"), ("attention", "combine_wait"), ("attention", "combine"), ("ffn", "expert_pass"))
PACKAGES = ("afd_before", "afd_shared_experts")  # BEFORE's name here, this checkout's
RESULT_SECONDS = 900


def _modules(baseline: Path):
    """Both packages' modules by name; BEFORE imported under its own top-level name."""
    load_plugin(PACKAGES[0], baseline)
    return {name: importlib.import_module(name) for name in PACKAGES}


def _pin(role: str) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0] if role == "attention" else cores[-1]})
    torch.set_num_threads(1)


def _run_spec(package: str, model_dir: str, port: int, tokens: int):
    selfcheck = importlib.import_module(f"{package}.selfcheck")
    return selfcheck, selfcheck.RunSpec(model_dir=model_dir, attention_ranks=1, ffn_ranks=1, placement="ffn",
                                        port=port, max_tokens=tokens)


def attention_process(baseline: Path, model_dir: str, ports: list[int], tokens: int, steps: int, results) -> None:
    """Joins both worlds, then alternates steps between them; each step's (world, start, end)."""
    _pin("attention")
    _modules(baseline)
    x = torch.randn(tokens, SHAPE["hidden"], generator=torch.Generator().manual_seed(1))
    worlds, connectors = [], []
    for package, port in zip(PACKAGES, ports):
        selfcheck, run = _run_spec(package, model_dir, port, tokens)
        attention = importlib.import_module(f"{package}.attention")
        spec = importlib.import_module(f"{package}.moe_spec").load_spec(model_dir)
        weights = importlib.import_module(f"{package}.model").load_attention_weights(model_dir, spec, "ffn",
                                                                                     torch.float32)
        connector = selfcheck.rank_connector(run, "attention", 0, spec, torch.float32)
        connector.init()
        connectors.append(connector)
        worlds.append([attention.AttentionMoELayer(w.gate, attention.RemoteMoE(
            spec=spec, layer=layer, connector=connector, num_ffn_ranks=1, placement="ffn", partition="affinity",
            dtype=torch.float32, shared=w.shared)) for layer, w in weights.items()])
    windows = []
    for step in range(steps):
        for world in (0, 1) if step % 2 == 0 else (1, 0):
            started = time.monotonic_ns()
            for layer in worlds[world]:
                layer.forward(x)
            windows.append((world, step, started, time.monotonic_ns()))
    for connector in connectors:
        connector.close()
    results.put(windows)


def ffn_process(baseline: Path, model_dir: str, ports: list[int], tokens: int) -> None:
    """Serves both worlds, one FFN runtime thread each, until their Attention rank shuts down."""
    _pin("ffn")
    _modules(baseline)
    runtimes = []
    for package, port in zip(PACKAGES, ports):
        selfcheck, run = _run_spec(package, model_dir, port, tokens)
        ffn_runtime = importlib.import_module(f"{package}.ffn_runtime")
        spec = importlib.import_module(f"{package}.moe_spec").load_spec(model_dir)
        weights = importlib.import_module(f"{package}.model").load_ffn_weights(model_dir, spec, "ffn", 0, 1,
                                                                               torch.float32)
        connector = selfcheck.rank_connector(run, "ffn", 1, spec, torch.float32)
        connector.init()
        runtimes.append(ffn_runtime.FFNRuntime(connector, ffn_runtime.torch_experts(weights)).start())
    for runtime in runtimes:
        runtime.join(RESULT_SECONDS)


def measure(baseline: Path, model_dir: str, tokens: int, steps: int) -> dict[int, dict[str, float]]:
    """Per world (0 BEFORE, 1 this checkout): median step and per-layer span times, in us."""
    from afd_devcluster.ports import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as trace_dir:
        os.environ["AFD_TRACE_DIR"] = trace_dir  # inherited by the rank processes
        ports = [free_port(), free_port()]
        ranks = [context.Process(target=attention_process, args=(baseline, model_dir, ports, tokens, steps, results)),
                 context.Process(target=ffn_process, args=(baseline, model_dir, ports, tokens))]
        for rank in ranks:
            rank.start()
        windows = results.get(timeout=RESULT_SECONDS)
        for rank in ranks:
            rank.join(60)
        del os.environ["AFD_TRACE_DIR"]
        intervals = [json.loads(line) for path in Path(trace_dir).glob("*.jsonl")
                     for line in path.read_text().splitlines()]
    windows = [w for w in windows if w[1] >= WARMUP_STEPS]
    starts = sorted((start, end, world) for world, _, start, end in windows)
    spans: dict[int, dict[str, list[float]]] = {world: defaultdict(list) for world in (0, 1)}
    for interval in intervals:
        owner = next((world for start, end, world in starts if start <= interval["start_ns"] < end), None)
        if owner is not None:
            spans[owner][f"{interval['role']} {interval['kind']}"].append((interval["end_ns"] - interval["start_ns"]) / 1e3)
    medians = {}
    for world in (0, 1):
        medians[world] = {kind: statistics.median(spans[world][f"{role} {kind}"]) for role, kind in SPANS}
        medians[world]["step"] = statistics.median((end - start) / 1e3 for w, _, start, end in windows if w == world)
    return medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="the BEFORE afd_shared_experts package folder")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=400, help="steps per world (the first 20 left out)")
    args = parser.parse_args(argv)
    if not (args.baseline / "__init__.py").is_file():
        parser.error(f"--baseline: {args.baseline} is not a package folder (no __init__.py)")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than {WARMUP_STEPS} (the steps left out as warm-up)")
    from afd_devcluster.checkpoints import write_moe_checkpoint

    columns = ("step",) + tuple(kind for _, kind in SPANS)
    print(f"1A1F connector round trip, hidden {SHAPE['hidden']}, {SHAPE['experts']} experts of {SHAPE['inter']} "
          f"top-{SHAPE['top_k']} + 1 shared (placement ffn), {SHAPE['layers']} MoE layers per step, float32, Attention "
          f"on one core and FFN on another, BEFORE and AFTER alternating step by step; median over "
          f"{args.steps - WARMUP_STEPS} steps each, us")
    print(f"{'T':>4} {'':>7} " + " ".join(f"{c:>12}" for c in columns))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_moe_checkpoint(Path(tmp) / "serve-shape", "deepseek_v3", **SHAPE))
        for tokens in args.tokens:
            medians = measure(args.baseline, model_dir, tokens, args.steps)
            for world, label in ((0, "before"), (1, "after")):
                print(f"{tokens:>4} {label:>7} " + " ".join(f"{medians[world][c]:>12.0f}" for c in columns))
            print(f"{tokens:>4} {'ratio':>7} " + " ".join(f"{medians[1][c] / medians[0][c]:>12.2f}" for c in columns),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
