"""Self-check: run every MoE layer of a checkpoint through real AFD ranks (one process each).

python -m afd_shared_experts.selfcheck --model DIR --inputs IN.safetensors --out OUT.safetensors
    --attention-ranks A --ffn-ranks F [--placement ffn|attention] [--partition affinity|contiguous]
    [--dtype float32|bfloat16|float16] [--steps K] [--device cpu|cuda[:i]|npu[:i]]
    [--data-plane auto|direct|staged] [--report REPORT.json] [--port P]

OUT holds ``layer.{l}`` [T, H] float32 for each MoE layer l: the layer's MoE output in model
units (under float16 the runtime keeps vLLM's 1/r-scaled residual convention; the tool
multiplies by r when writing so every dtype is comparable with the model's definition).
Every rank loads its weights and inputs onto ``--device`` (all ranks on that one device), so
on an accelerator the connector's data plane is ``staged``. On CUDA each Attention rank runs
its forward under ``torch.cuda.set_sync_debug_mode("error")``: only the connector's calls may
sync (the staged plane's host<->device copies); dispatch and combine themselves never do.
Exit status 0 on success, 1 on any failure (message on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .attention import AttentionMoELayer, RemoteMoE
from .config import DATA_PLANES, AFDConfig, AFDConfigError, SharedExpertsConfig
from .connector import P2PConnector
from .wire import BYTE_KINDS, WireLayout
from .device import resolve_device, select_device, sync_debug_mode
from .errors import DeviceUnavailableError
from .ffn_runtime import FFNRuntime, torch_experts
from .model import DTYPES, load_attention_weights, load_ffn_weights
from .moe_spec import load_spec
from .ports import listen_ports

CHILD_DEADLINE_SECONDS = 600.0
# After a rank fails, how long to wait for its peers' errors: the rank that failed first
# closes its connections before it reports, so a peer's "connection closed" may arrive first.
FAILURE_REPORTS_SECONDS = 2.0
# How long ranks that delivered their results get, together, to exit on their own.
EXIT_GRACE_SECONDS = 10.0
# Steps after it must repeat its outputs bit for bit (run_attention_rank says why not step 0).
REFERENCE_STEP = 1


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
    device: str = "cpu"
    data_plane: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    timeout_seconds: float = 60.0
    max_tokens: int = 0  # tokens of the largest Attention rank's share (set from the inputs)


@dataclass
class AttentionResult:
    rank: int
    outputs: dict[int, torch.Tensor]
    step_seconds: list[float]
    sent_bytes: dict[str, int]
    parameter_bytes: int
    data_plane: str


@dataclass
class FFNResult:
    index: int
    shared_tokens: int
    zero_token_replies: dict[str, int]
    sent_bytes: dict[str, int]
    parameter_bytes: int
    items_served: int
    data_plane: str


@dataclass
class RunResult:
    outputs: dict[int, torch.Tensor]
    report: dict = field(default_factory=dict)


def token_range(rank: int, num_tokens: int, attention_ranks: int) -> tuple[int, int]:
    return rank * num_tokens // attention_ranks, (rank + 1) * num_tokens // attention_ranks


def rank_connector(run: RunSpec, role: str, rank: int, spec, dtype: torch.dtype) -> P2PConnector:
    cfg = AFDConfig(role=role, num_attention_ranks=run.attention_ranks, num_ffn_ranks=run.ffn_ranks, host=run.host,
                    port=run.port, timeout_seconds=run.timeout_seconds, rendezvous_timeout_seconds=run.timeout_seconds)
    layout = WireLayout.for_world(spec, replace(cfg, shared_experts=SharedExpertsConfig(run.placement, run.partition)),
                                  dtype=dtype, token_budget=max(run.max_tokens, 1))
    return P2PConnector.from_config(cfg, role=role, rank=rank, layout=layout, device=run.device,
                                    data_plane=run.data_plane)


class _SyncsAllowed:
    """The connector as an Attention rank's forward calls it: its calls may sync the host
    (on the staged plane: the device<->host copies of payloads and replies) inside a
    forward that runs under sync-debug mode "error"; everything else is the connector's."""

    def __init__(self, connector: P2PConnector):
        self.connector = connector

    def __getattr__(self, name):
        return getattr(self.connector, name)

    def dispatch(self, *args, **kwargs):
        with sync_debug_mode(self.connector.device, 0):
            return self.connector.dispatch(*args, **kwargs)

    def receive_replies(self, *args, **kwargs):
        with sync_debug_mode(self.connector.device, 0):
            return self.connector.receive_replies(*args, **kwargs)


def check_repeat(rank: int, step: int, outputs: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> None:
    """A step's outputs must equal the reference step's bit for bit (on the CPU, float32)."""
    for l, out in outputs.items():
        if not torch.equal(out, reference[l]):
            raise SelfCheckError(f"Attention rank {rank}: layer {l} output of step {step} differs from step "
                                 f"{REFERENCE_STEP} (every step after the first must repeat it bit for bit)")


def run_attention_rank(run: RunSpec, rank: int, hidden_states: torch.Tensor,
                       step_barrier: threading.Barrier | None = None) -> AttentionResult:
    """One Attention rank's layers on ``run.device``; each forward under sync-debug mode
    "error" on CUDA (process-wide: one such rank per process there). Outputs (step 0's) come
    back on the CPU, in float32.

    ``step_barrier`` (one party per working Attention rank) starts every step on all of them
    together, as vLLM's data-parallel engines start each forward together. The outputs of
    steps 2.. are checked against step 1's, not step 0's: an FFN rank computes the first
    (step, layer, stage) without a rank that sends it past its gather window, and a GEMM's
    rounding depends on its row count (CPU BLAS: 1, 2-3 and 4+ rows differ in the last bits).
    From step 1 every rank has sent work, so the FFN awaits all of them and the grouping,
    and with it every bit, repeats."""
    torch.set_num_threads(1)
    spec = load_spec(run.model_dir)
    dtype = DTYPES[run.dtype]
    device = resolve_device(run.device)
    select_device(device)
    weights = load_attention_weights(run.model_dir, spec, run.placement, dtype, device)
    hidden_states = hidden_states.to(device)
    connector = rank_connector(run, "attention", rank, spec, dtype)
    try:
        connector.init()
        layers = {
            l: AttentionMoELayer(w.gate, RemoteMoE(spec=spec, layer=l, connector=_SyncsAllowed(connector),
                                                   num_ffn_ranks=run.ffn_ranks, placement=run.placement,
                                                   partition=run.partition, dtype=dtype, shared=w.shared))
            for l, w in weights.items()
        }
        first: dict[int, torch.Tensor] = {}
        reference: dict[int, torch.Tensor] = {}
        step_seconds = []
        for step in range(run.steps):
            if step_barrier is not None:
                try:
                    step_barrier.wait(run.timeout_seconds)
                except threading.BrokenBarrierError:
                    raise SelfCheckError(f"Attention rank {rank}: the other Attention ranks did not start step {step} "
                                         f"within {run.timeout_seconds}s") from None
            started = time.perf_counter()
            outputs = {}
            for l, layer in layers.items():
                with sync_debug_mode(device, "error"):
                    outputs[l] = layer.forward(hidden_states)
            torch.get_device_module(device).synchronize(device)  # the step's device work is in its time
            step_seconds.append(time.perf_counter() - started)
            for l, out in outputs.items():
                if out.device != hidden_states.device:  # hidden_states.device names the index ("cuda:0")
                    raise SelfCheckError(f"Attention rank {rank}: layer {l} output on {out.device}, "
                                         f"input on {hidden_states.device}")
            outputs = {l: out.float().cpu() for l, out in outputs.items()}  # lossless from bf16/fp16
            if step == 0:
                first = outputs
            elif step == REFERENCE_STEP:
                reference = outputs
            else:
                check_repeat(rank, step, outputs, reference)
        return AttentionResult(rank=rank, outputs=first, step_seconds=step_seconds, sent_bytes=dict(connector.sent_bytes),
                               parameter_bytes=sum(w.parameter_bytes() for w in weights.values()),
                               data_plane=connector.data_plane)
    finally:
        connector.close()


def run_ffn_rank(run: RunSpec, index: int) -> FFNResult:
    torch.set_num_threads(1)
    spec = load_spec(run.model_dir)
    dtype = DTYPES[run.dtype]
    device = resolve_device(run.device)
    select_device(device)
    weights = load_ffn_weights(run.model_dir, spec, run.placement, index, run.ffn_ranks, dtype, device)
    connector = rank_connector(run, "ffn", run.attention_ranks + index, spec, dtype)
    try:
        connector.init()
        runtime = FFNRuntime(connector, torch_experts(weights))
        runtime.serve()
        return FFNResult(index=index, shared_tokens=runtime.shared_tokens,
                         zero_token_replies={k: runtime.zero_token_replies[k] for k in ("routed", "shared")},
                         sent_bytes=dict(connector.sent_bytes),
                         parameter_bytes=sum(w.parameter_bytes() for w in weights.values()),
                         items_served=runtime.items_served, data_plane=connector.data_plane)
    finally:
        connector.close()


def validate_run(run: RunSpec, hidden_states: torch.Tensor):
    spec = load_spec(run.model_dir)
    for name, value in (("--attention-ranks", run.attention_ranks), ("--ffn-ranks", run.ffn_ranks), ("--steps", run.steps)):
        if value < 1:
            raise SelfCheckError(f"{name} must be >= 1 (got {value})")
    if not 0 <= run.port <= 65535:
        raise SelfCheckError(f"--port must be 0 (pick a free one) or 1-65535 (got {run.port})")
    validate_device(run)
    AFDConfig(role="attention", num_attention_ranks=run.attention_ranks,
              num_ffn_ranks=run.ffn_ranks).validate_for_model(spec.num_routed_experts, field_path="--ffn-ranks")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != spec.hidden_size:
        raise SelfCheckError(f"inputs: hidden_states must be [T, {spec.hidden_size}] (got {list(hidden_states.shape)})")
    if hidden_states.dtype != torch.float32:
        raise SelfCheckError(f"inputs: hidden_states must be float32 (got {hidden_states.dtype})")
    return spec


def validate_device(run: RunSpec) -> None:
    """Fails fast, before any rank starts, on a device this machine cannot use or a data
    plane the ranks cannot share it with."""
    if run.data_plane not in DATA_PLANES:
        raise SelfCheckError(f"--data-plane must be one of {', '.join(DATA_PLANES)} (got {run.data_plane!r})")
    try:
        device = resolve_device(run.device)
    except (DeviceUnavailableError, RuntimeError) as exc:  # RuntimeError: torch cannot parse the name
        raise SelfCheckError(f"--device {run.device!r}: {exc}") from None
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SelfCheckError(f"--device {run.device!r}: no such CUDA device ({torch.cuda.device_count()} visible)")
    if device.type != "cpu" and run.data_plane == "direct":
        raise SelfCheckError(f"--data-plane direct needs one device per rank, but every rank runs on {run.device!r}: "
                             "use staged or auto")


def _child_main(role: str, index: int, runs: list[RunSpec], hidden_states, results, step_barrier) -> None:
    """One rank of every run in turn (a new AFD world per run)."""
    for number, run in enumerate(runs):
        try:
            if role == "attention":
                result = run_attention_rank(run, index, hidden_states, step_barrier)
                # numpy pickles by value: the parent must not depend on this process's shared memory.
                result.outputs = {l: t.numpy() for l, t in result.outputs.items()}
            else:
                result = run_ffn_rank(run, index)
            results.put(("ok", number, role, index, result))
        except BaseException:
            results.put(("error", number, role, index, traceback.format_exc()))
            return


def run_topology(run: RunSpec, hidden_states: torch.Tensor) -> RunResult:
    """Run A Attention + F FFN ranks, one process each."""
    return run_topologies([run], hidden_states)[0]


def run_topologies(runs: list[RunSpec], hidden_states: torch.Tensor) -> list[RunResult]:
    """Several runs of one topology (same A and F) in one set of rank processes, one after
    another, each its own AFD world on its own port: the processes start once."""
    if not runs:
        raise SelfCheckError("no run given")
    if len({(run.attention_ranks, run.ffn_ranks) for run in runs}) != 1:
        raise SelfCheckError("runs of one launch must have the same --attention-ranks and --ffn-ranks")
    specs = [validate_run(run, hidden_states) for run in runs]
    explicit = [run.port for run in runs if run.port]
    if len(set(explicit)) != len(explicit):
        raise SelfCheckError(f"runs of one launch need distinct ports (got {explicit})")
    picked = iter(listen_ports(len(runs) - len(explicit), runs[0].host))
    runs = [replace(run, port=run.port or next(picked)) for run in runs]
    attention_ranks, ffn_ranks = runs[0].attention_ranks, runs[0].ffn_ranks
    num_tokens = hidden_states.shape[0]
    share = max(hi - lo for lo, hi in (token_range(a, num_tokens, attention_ranks) for a in range(attention_ranks)))
    runs = [replace(run, max_tokens=run.max_tokens or share) for run in runs]
    jobs = [("attention", a, hidden_states[slice(*token_range(a, num_tokens, attention_ranks))].clone())
            for a in range(attention_ranks)]
    jobs += [("ffn", f, None) for f in range(ffn_ranks)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    step_barrier = context.Barrier(attention_ranks)
    workers = [context.Process(target=_child_main, args=(role, i, runs, x, results, step_barrier), daemon=True)
               for role, i, x in jobs]
    for worker in workers:
        worker.start()
    collected: dict[tuple[int, str, int], object] = {}
    finished = False
    try:
        deadline = time.monotonic() + CHILD_DEADLINE_SECONDS
        while len(collected) < len(jobs) * len(runs):
            try:
                status, number, role, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise SelfCheckError(f"a rank process exited with status {dead[0].exitcode} without a result")
                if time.monotonic() > deadline:
                    raise SelfCheckError(f"ranks made no progress within {CHILD_DEADLINE_SECONDS}s")
                continue
            if status == "error":
                prefix = f"run {number + 1} of {len(runs)}: " if len(runs) > 1 else ""
                failures = [f"{role} rank {index} failed:\n{payload}"] + _more_failures(results)
                raise SelfCheckError(prefix + "\n".join(failures))
            collected[(number, role, index)] = payload
            deadline = time.monotonic() + CHILD_DEADLINE_SECONDS
        finished = True
    finally:
        # After a failure the other ranks wait on the one that failed: no use waiting for them.
        _reap(workers, EXIT_GRACE_SECONDS if finished else 0.0)
    return [_run_result(run, spec, num_tokens,
                        [collected[(number, "attention", a)] for a in range(attention_ranks)],
                        [collected[(number, "ffn", f)] for f in range(ffn_ranks)])
            for number, (run, spec) in enumerate(zip(runs, specs))]


def _more_failures(results) -> list[str]:
    failures, until = [], time.monotonic() + FAILURE_REPORTS_SECONDS
    while time.monotonic() < until:
        try:
            status, _, role, index, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            failures.append(f"{role} rank {index} failed:\n{payload}")
    return failures


def _run_result(run: RunSpec, spec, num_tokens: int, attention: list[AttentionResult],
                ffn: list[FFNResult]) -> RunResult:
    planes = {r.data_plane for r in attention + ffn}
    if len(planes) != 1:
        raise SelfCheckError(f"the ranks ran different data planes: {sorted(planes)}")
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
        "data_plane": planes.pop(),
        "bytes_by_kind": bytes_by_kind,
        "shared_tokens_per_ffn_rank": [r.shared_tokens for r in ffn],
        "zero_token_replies": {k: sum(r.zero_token_replies[k] for r in ffn) for k in ("routed", "shared")},
        "wall_time_per_step_seconds": [max(r.step_seconds[s] for r in attention) for s in range(run.steps)],
        "attention_parameter_bytes": [r.parameter_bytes for r in attention],
        "ffn_parameter_bytes": [r.parameter_bytes for r in ffn],
        "items_served_per_ffn_rank": [r.items_served for r in ffn],
    }
    return RunResult(outputs=outputs, report=report)


def _reap(workers, grace_seconds: float) -> None:
    """No rank outlives the tool: all of them get `grace_seconds` together to exit, then the
    rest are terminated, then killed."""
    deadline = time.monotonic() + grace_seconds
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
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
    parser.add_argument("--device", default="cpu",
                        help="device of every rank (cpu, cuda, cuda:i, npu, npu:i; all ranks on this one device)")
    parser.add_argument("--data-plane", choices=DATA_PLANES, default="auto",
                        help="the connector's data plane (auto: staged here, as all ranks share one device)")
    parser.add_argument("--report", help="JSON report path")
    parser.add_argument("--port", type=int, default=0,
                        help="loopback rendezvous port (default 0: a free one, picked when the run starts)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = RunSpec(model_dir=args.model, attention_ranks=args.attention_ranks, ffn_ranks=args.ffn_ranks,
                  placement=args.placement, partition=args.partition, dtype=args.dtype, steps=args.steps,
                  device=args.device, data_plane=args.data_plane, port=args.port)
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
          f"dtype {run.dtype}, {run.steps} step(s), device {run.device}, {result.report['data_plane']} data plane")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
