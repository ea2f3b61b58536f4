"""Self-check: run every MoE layer of a checkpoint through real AFD ranks over gloo.

python -m afd_shared_experts.selfcheck --model DIR --inputs IN.safetensors --out OUT.safetensors
    --attention-ranks A --ffn-ranks F [--placement ffn|attention] [--partition affinity|contiguous]
    [--dtype float32|bfloat16|float16] [--steps K] [--report REPORT.json] [--port P]

OUT holds ``layer.{l}`` [T, H] float32 for each MoE layer l: the layer's MoE output in model
units (under float16 the runtime keeps vLLM's 1/r-scaled residual convention; the tool
multiplies by r when writing so every dtype is comparable with the model's definition).
Exit status 0 on success, 1 on any failure (message on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .attention import AttentionMoELayer, RemoteMoE
from .config import AFDConfigError, AFDConfig
from .connector import BYTE_KINDS, P2PConnector
from .ffn_runtime import FFNRuntime, torch_experts
from .model import DTYPES, load_attention_weights, load_ffn_weights, load_spec

CHILD_DEADLINE_SECONDS = 600.0


class SelfCheckError(RuntimeError):
    pass


@dataclass
class RunSpec:
    model_dir: str
    attention_ranks: int
    ffn_ranks: int
    placement: str = "ffn"
    partition: str = "affinity"
    dtype: str = "float32"
    steps: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    timeout_seconds: float = 60.0


@dataclass
class AttentionResult:
    rank: int
    outputs: dict[int, torch.Tensor]
    step_seconds: list[float]
    sent_bytes: dict[str, int]
    parameter_bytes: int


@dataclass
class FFNResult:
    index: int
    shared_tokens: int
    zero_token_replies: dict[str, int]
    sent_bytes: dict[str, int]
    parameter_bytes: int
    items_served: int


@dataclass
class RunResult:
    outputs: dict[int, torch.Tensor]
    report: dict = field(default_factory=dict)


def token_range(rank: int, num_tokens: int, attention_ranks: int) -> tuple[int, int]:
    return rank * num_tokens // attention_ranks, (rank + 1) * num_tokens // attention_ranks


def rank_connector(run: RunSpec, role: str, rank: int, spec, dtype: torch.dtype) -> P2PConnector:
    cfg = AFDConfig(role=role, num_attention_ranks=run.attention_ranks, num_ffn_ranks=run.ffn_ranks, host=run.host,
                    port=run.port, timeout_seconds=run.timeout_seconds)
    return P2PConnector.from_config(cfg, role=role, rank=rank, hidden_size=spec.hidden_size,
                                    local_experts=spec.local_experts(run.ffn_ranks), dtype=dtype)


def run_attention_rank(run: RunSpec, rank: int, hidden_states: torch.Tensor) -> AttentionResult:
    torch.set_num_threads(1)
    spec = load_spec(run.model_dir)
    dtype = DTYPES[run.dtype]
    weights = load_attention_weights(run.model_dir, spec, run.placement, dtype)
    connector = rank_connector(run, "attention", rank, spec, dtype)
    try:
        connector.init()
        layers = {
            l: AttentionMoELayer(w.gate, RemoteMoE(spec=spec, layer=l, connector=connector, num_ffn_ranks=run.ffn_ranks,
                                                   placement=run.placement, partition=run.partition, dtype=dtype,
                                                   shared=w.shared))
            for l, w in weights.items()
        }
        first: dict[int, torch.Tensor] = {}
        step_seconds = []
        for step in range(run.steps):
            started = time.perf_counter()
            outputs = {l: layer.forward(hidden_states) for l, layer in layers.items()}
            step_seconds.append(time.perf_counter() - started)
            if step == 0:
                first = {l: out.float() for l, out in outputs.items()}  # lossless from bf16/fp16
            for l, out in outputs.items():
                if not torch.equal(out.float(), first[l]):
                    raise SelfCheckError(f"Attention rank {rank}: layer {l} output of step {step} differs from step 0")
        return AttentionResult(rank=rank, outputs=first, step_seconds=step_seconds, sent_bytes=dict(connector.sent_bytes),
                               parameter_bytes=sum(w.parameter_bytes() for w in weights.values()))
    finally:
        connector.close()


def run_ffn_rank(run: RunSpec, index: int) -> FFNResult:
    torch.set_num_threads(1)
    spec = load_spec(run.model_dir)
    dtype = DTYPES[run.dtype]
    weights = load_ffn_weights(run.model_dir, spec, run.placement, index, run.ffn_ranks, dtype)
    connector = rank_connector(run, "ffn", run.attention_ranks + index, spec, dtype)
    try:
        connector.init()
        runtime = FFNRuntime(connector, torch_experts(weights))
        runtime.serve()
        return FFNResult(index=index, shared_tokens=runtime.shared_tokens,
                         zero_token_replies={k: runtime.zero_token_replies[k] for k in ("routed", "shared")},
                         sent_bytes=dict(connector.sent_bytes),
                         parameter_bytes=sum(w.parameter_bytes() for w in weights.values()),
                         items_served=runtime.items_served)
    finally:
        connector.close()


def validate_run(run: RunSpec, hidden_states: torch.Tensor):
    spec = load_spec(run.model_dir)
    for name, value in (("--attention-ranks", run.attention_ranks), ("--ffn-ranks", run.ffn_ranks), ("--steps", run.steps)):
        if value < 1:
            raise SelfCheckError(f"{name} must be >= 1 (got {value})")
    if not 0 <= run.port <= 65535:
        raise SelfCheckError(f"--port must be 0 (pick a free one) or 1-65535 (got {run.port})")
    AFDConfig(role="attention", num_attention_ranks=run.attention_ranks,
              num_ffn_ranks=run.ffn_ranks).validate_for_model(spec.num_routed_experts, field_path="--ffn-ranks")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != spec.hidden_size:
        raise SelfCheckError(f"inputs: hidden_states must be [T, {spec.hidden_size}] (got {list(hidden_states.shape)})")
    if hidden_states.dtype != torch.float32:
        raise SelfCheckError(f"inputs: hidden_states must be float32 (got {hidden_states.dtype})")
    return spec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _child_main(role: str, index: int, run: RunSpec, hidden_states, results) -> None:
    try:
        if role == "attention":
            result = run_attention_rank(run, index, hidden_states)
            # numpy pickles by value: the parent must not depend on this process's shared memory.
            result.outputs = {l: t.numpy() for l, t in result.outputs.items()}
            results.put(("ok", role, index, result))
        else:
            results.put(("ok", role, index, run_ffn_rank(run, index)))
    except BaseException:
        results.put(("error", role, index, traceback.format_exc()))


def run_topology(run: RunSpec, hidden_states: torch.Tensor) -> RunResult:
    """Run A Attention + F FFN ranks, one process each."""
    spec = validate_run(run, hidden_states)
    if run.port == 0:
        run.port = free_port(run.host)
    num_tokens = hidden_states.shape[0]
    jobs = [("attention", a, hidden_states[slice(*token_range(a, num_tokens, run.attention_ranks))].clone())
            for a in range(run.attention_ranks)]
    jobs += [("ffn", f, None) for f in range(run.ffn_ranks)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_child_main, args=(role, i, run, x, results), daemon=True)
               for role, i, x in jobs]
    for worker in workers:
        worker.start()
    collected: dict[tuple[str, int], object] = {}
    try:
        deadline = time.monotonic() + CHILD_DEADLINE_SECONDS
        while len(collected) < len(jobs):
            try:
                status, role, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise SelfCheckError(f"a rank process exited with status {dead[0].exitcode} without a result")
                if time.monotonic() > deadline:
                    raise SelfCheckError(f"ranks did not finish within {CHILD_DEADLINE_SECONDS}s")
                continue
            if status == "error":
                raise SelfCheckError(f"{role} rank {index} failed:\n{payload}")
            collected[(role, index)] = payload
    finally:
        _reap(workers)

    attention = [collected[("attention", a)] for a in range(run.attention_ranks)]
    ffn = [collected[("ffn", f)] for f in range(run.ffn_ranks)]
    scale = spec.routed_scaling_factor if run.dtype == "float16" else 1.0
    outputs = {}
    for layer in spec.moe_layers:
        parts = [torch.as_tensor(r.outputs[layer]) for r in attention]
        outputs[layer] = torch.cat(parts) * scale if parts else torch.zeros(0, spec.hidden_size)
    bytes_by_kind = {k: sum(r.sent_bytes[k] for r in attention + ffn) for k in BYTE_KINDS}
    report = {
        "model_type": spec.model_type,
        "moe_layers": list(spec.moe_layers),
        "tokens": num_tokens,
        "run": {k: v for k, v in asdict(run).items() if k not in ("host", "port")},
        "bytes_by_kind": bytes_by_kind,
        "shared_tokens_per_ffn_rank": [r.shared_tokens for r in ffn],
        "zero_token_replies": {k: sum(r.zero_token_replies[k] for r in ffn) for k in ("routed", "shared")},
        "wall_time_per_step_seconds": [max(r.step_seconds[s] for r in attention) for s in range(run.steps)],
        "attention_parameter_bytes": [r.parameter_bytes for r in attention],
        "ffn_parameter_bytes": [r.parameter_bytes for r in ffn],
        "items_served_per_ffn_rank": [r.items_served for r in ffn],
    }
    return RunResult(outputs=outputs, report=report)


def _reap(workers) -> None:
    """No rank outlives the tool: join briefly, then terminate, then kill."""
    for worker in workers:
        worker.join(timeout=10)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def _read_inputs(path: str) -> torch.Tensor:
    if not Path(path).is_file():
        raise SelfCheckError(f"inputs: no such file {path}")
    with safe_open(path, framework="pt") as handle:
        if "hidden_states" not in handle.keys():
            raise SelfCheckError(f"inputs: {path} has no tensor 'hidden_states' (has {sorted(handle.keys())})")
        return handle.get_tensor("hidden_states")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m afd_shared_experts.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF-format checkpoint directory (config.json + safetensors)")
    parser.add_argument("--inputs", required=True, help="safetensors file holding hidden_states [T, H] float32")
    parser.add_argument("--out", required=True, help="safetensors file to write layer.{l} [T, H] float32 to")
    parser.add_argument("--attention-ranks", type=int, required=True)
    parser.add_argument("--ffn-ranks", type=int, required=True)
    parser.add_argument("--placement", choices=("ffn", "attention"), default="ffn")
    parser.add_argument("--partition", choices=("affinity", "contiguous"), default="affinity")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--report", help="JSON report path")
    parser.add_argument("--port", type=int, default=0,
                        help="loopback rendezvous port (default 0: a free one, picked when the run starts)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = RunSpec(model_dir=args.model, attention_ranks=args.attention_ranks, ffn_ranks=args.ffn_ranks,
                  placement=args.placement, partition=args.partition, dtype=args.dtype, steps=args.steps, port=args.port)
    try:
        hidden_states = _read_inputs(args.inputs)
        result = run_topology(run, hidden_states)
        save_file({f"layer.{l}": t.contiguous() for l, t in result.outputs.items()}, args.out)
        if args.report:
            Path(args.report).write_text(json.dumps(result.report, indent=2) + "\n")
    except (SelfCheckError, AFDConfigError, ValueError, OSError) as exc:
        print(f"selfcheck failed: {exc}", file=sys.stderr)
        return 1
    print(f"selfcheck ok: {len(result.outputs)} MoE layer(s), {hidden_states.shape[0]} tokens, "
          f"{run.attention_ranks}A{run.ffn_ranks}F, placement {run.placement}, partition {run.partition}, "
          f"dtype {run.dtype}, {run.steps} step(s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
