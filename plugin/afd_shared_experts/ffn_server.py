"""FFN role server: ``python3 -m afd_shared_experts.ffn_server``.

Started with the same ``--model`` and ``--additional-config`` as the Attention engines plus
its FFN rank range. The process started with ``--ffn-local-ranks N`` supervises N rank
processes, one per device (ffn_supervisor.py: probes, signals, exit status of the pod). Each
rank process loads only its routed-expert shard (and, under placement 'ffn', the shared
experts), joins the AFD world and serves work items with the core runtime. Expert math:
vLLM's MoE layer, kernels and (quantized) weight loaders (``--expert-backend vllm``,
``vllm.ffn``) or plain torch (``torch``, unquantized only); no vLLM engine or scheduler is
needed either way.

Probes (served by the supervisor): /health (200 while it runs), /ready (200 only once every
rank has loaded its weights and initialized its connector), /metrics (Prometheus, all ranks).
SIGTERM/SIGINT: every rank finishes the work item in flight, closes its connector; exit 0.
Exit 1 when a rank fails (e.g. an Attention rank is lost), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Callable

import torch

from .config import AFDConfig, AFDConfigError, parse_afd_config
from .connector import P2PConnector
from .device import resolve_device, select_device
from .errors import AFDError, ConnectorClosedError
from .ffn_runtime import FFNRuntime, LayerExperts, torch_experts
from .ffn_supervisor import READY_LINE, STARTED_LINE, supervise
from .metrics import RuntimeMetrics
from .model import DTYPES, load_ffn_weights
from .moe_spec import CheckpointError, load_spec
from .roles import ffn_world_ranks
from .wire import WireLayout

logger = logging.getLogger("afd_shared_experts.ffn_server")

# A rank retries the rendezvous until the Attention ranks come up (FFN pods start first).
RENDEZVOUS_RETRY_SECONDS = 2.0
STOP_TIMEOUT_SECONDS = 30.0
EXPERT_BACKENDS = ("auto", "vllm", "torch")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m afd_shared_experts.ffn_server",
                                description="AFD FFN role: serves routed (and shared) experts to Attention ranks.")
    p.add_argument("--model", required=True, help="HF checkpoint directory (the same as the Attention engines')")
    p.add_argument("--ffn-rank-start", type=int, required=True, help="first FFN rank held by this server")
    p.add_argument("--ffn-local-ranks", type=int, required=True, help="number of FFN ranks held by this server")
    p.add_argument("--health-port", type=int, required=True, help="port of /health and /ready (0: ephemeral)")
    p.add_argument("--metrics-port", type=int, default=None, help="port of /metrics (default: the health port)")
    p.add_argument("--max-num-batched-tokens", type=int, required=True,
                   help="the Attention engines' value; bounds the rows of one work item")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="model dtype; 'auto' takes config.json's torch_dtype like vLLM")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engines' value (used by the vllm expert backend's model config)")
    p.add_argument("--quantization", default=None,
                   help="vLLM quantization method of the experts (vllm backend only; e.g. fp8, ascend)")
    p.add_argument("--expert-backend", choices=EXPERT_BACKENDS, default="auto",
                   help="expert compute: vllm (vLLM's MoE kernels and loaders), torch (unquantized), "
                        "auto: vllm when vLLM can be imported, else torch")
    p.add_argument("--additional-config", required=True, help="JSON holding the 'afd' block (role 'ffn')")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or npu (rank i of the server on device i); 'auto': npu when VLLM_PLUGINS names "
                        "'ascend', else cuda if available, else cpu")
    p.add_argument("--bind-host", default="0.0.0.0", help="address the probe server listens on")
    # Set by the supervisor on each rank process it starts (one FFN rank, no probe server).
    p.add_argument("--rank-status-fd", type=int, default=None, help=argparse.SUPPRESS)
    return p


class ArgumentError(ValueError):
    """A command-line value is invalid; the message names the flag."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, AFDConfig, list[int]]:
    """Parse the command line and the afd block; returns (args, config, world ranks)."""
    args = build_parser().parse_args(argv)
    try:
        additional = json.loads(args.additional_config)
    except json.JSONDecodeError as exc:
        raise ArgumentError(f"--additional-config: not valid JSON ({exc})") from exc
    cfg = parse_afd_config(additional)
    ranks = ffn_world_ranks(cfg, rank_start=args.ffn_rank_start, local_ranks=args.ffn_local_ranks)
    if args.max_num_batched_tokens < 1:
        raise ArgumentError(f"--max-num-batched-tokens: must be >= 1 (got {args.max_num_batched_tokens})")
    if ":" in args.device and args.ffn_local_ranks > 1:
        raise ArgumentError(f"--device: {args.device!r} names one device, but the server holds "
                            f"{args.ffn_local_ranks} ranks; give the platform (cpu, cuda, npu) and rank i uses device i")
    for flag, port in (("--health-port", args.health_port), ("--metrics-port", args.metrics_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ArgumentError(f"{flag}: must be in [0, 65535] (got {port})")
    return args, cfg, ranks


def resolve_expert_backend(name: str) -> str:
    """'vllm' or 'torch' for --expert-backend (imports vLLM when it may be used)."""
    if name == "torch":
        return "torch"
    from .vllm.compat import VLLMVersionError, require_supported_vllm

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if name == "auto":
            return "torch"
        raise ArgumentError(f"--expert-backend vllm: vLLM cannot be imported ({exc}); install vLLM 0.23.0 "
                            "(vllm-ascend on NPU) or use --expert-backend torch") from exc
    try:
        require_supported_vllm()
    except VLLMVersionError as exc:
        raise ArgumentError(f"--expert-backend {name}: {exc}") from exc
    return "vllm"


def check_supported(args: argparse.Namespace) -> str:
    """The expert backend to use; refuses what it cannot serve before any weight is read."""
    backend = resolve_expert_backend(args.expert_backend)
    if args.quantization is None:
        return backend
    if backend == "torch":
        raise ArgumentError(f"--quantization: {args.quantization!r} is not supported by the torch expert backend "
                            "(unquantized only); use --expert-backend vllm or serve an unquantized checkpoint")
    from .vllm.ffn import quantization_methods

    known = quantization_methods()
    if args.quantization not in known:
        raise ArgumentError(f"--quantization: {args.quantization!r} is not a quantization method vLLM knows here "
                            f"(known: {', '.join(known)})")
    return backend


def resolve_dtype(name: str, model_dir: str) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    with open(os.path.join(model_dir, "config.json")) as handle:
        config = json.load(handle)
    declared = config.get("torch_dtype") or config.get("dtype") or "float32"
    if declared not in DTYPES:
        raise ArgumentError(f"--dtype auto: config.json declares {declared!r}; pass --dtype explicitly")
    return DTYPES[declared]


def resolve_device_name(name: str) -> str:
    if name != "auto":
        return name
    if "ascend" in os.environ.get("VLLM_PLUGINS", "").split(","):
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class FFNServer:
    """One FFN rank (a rank process of the pod's supervisor, ffn_supervisor.py)."""

    def __init__(self, args: argparse.Namespace, cfg: AFDConfig, world_rank: int, expert_backend: str,
                 report_ready: Callable[[], object]):
        self.args, self.cfg, self.world_rank, self.expert_backend = args, cfg, world_rank, expert_backend
        self.report_ready = report_ready
        # Under the supervisor's PROMETHEUS_MULTIPROC_DIR these values go to files it sums.
        self.metrics = RuntimeMetrics("ffn")
        self.runtime: FFNRuntime | None = None
        self.stopping = threading.Event()

    def load_and_connect(self) -> None:
        args, cfg = self.args, self.cfg
        spec = load_spec(args.model)
        cfg.validate_for_model(spec.num_routed_experts)
        dtype = resolve_dtype(args.dtype, args.model)
        device = resolve_device_name(args.device)
        select_device(resolve_device(device))
        ffn_index = args.ffn_rank_start
        started = time.monotonic()
        requested = cfg.shared_experts.placement
        placement = spec.placement(requested)
        self.metrics.shared_experts_placement.labels(requested=requested, effective=placement).set(1)
        if placement != requested:
            logger.info("FFN rank %d: %s has no shared experts: shared_experts.placement %r does not apply "
                        "(routed experts only)", ffn_index, spec.model_type, requested)
        experts = self._load_experts(spec, placement, ffn_index, dtype, device)
        logger.info("FFN rank %d: loaded %d MoE layers in %.1fs (placement %s, %s expert backend, device %s)",
                    ffn_index, len(spec.moe_layers), time.monotonic() - started, placement, self.expert_backend,
                    device)
        layout = WireLayout.for_world(spec, cfg, dtype=dtype, token_budget=args.max_num_batched_tokens)
        connector = self._connect(self.world_rank, layout, device)
        if connector is None:
            return
        self.runtime = FFNRuntime(connector, experts, self.metrics).start()
        logger.info("FFN rank %d (world rank %d) serving", ffn_index, self.world_rank)
        self.report_ready()

    def _load_experts(self, spec, placement: str, ffn_index: int, dtype: torch.dtype,
                      device: str) -> dict[int, LayerExperts]:
        args, cfg = self.args, self.cfg
        if self.expert_backend == "vllm":
            from .vllm.ffn import build_vllm_experts

            return build_vllm_experts(args.model, spec, placement, ffn_index, cfg.num_ffn_ranks, dtype,
                                      args.quantization, args.max_model_len, args.max_num_batched_tokens, device)
        return torch_experts(load_ffn_weights(args.model, spec, placement, ffn_index, cfg.num_ffn_ranks, dtype,
                                              device))

    def _connect(self, world_rank: int, layout: WireLayout, device: str):
        """Rendezvous, retried until the Attention ranks are up or the server is stopped. Each
        attempt is bounded by the liveness timeout, not the rendezvous one, so a server waiting
        for its Attention ranks logs that it is still waiting."""
        cfg = replace(self.cfg, rendezvous_timeout_seconds=self.cfg.timeout_seconds)
        while not self.stopping.is_set():
            connector = P2PConnector.from_config(cfg, role="ffn", rank=world_rank, layout=layout, device=device,
                                                 metrics=self.metrics)
            try:
                connector.init()
                return connector
            except AFDError as exc:
                connector.close()
                logger.info("world rank %d: rendezvous not complete yet (%s); retrying", world_rank, exc)
                self.stopping.wait(RENDEZVOUS_RETRY_SECONDS)
        return None

    def wait(self) -> int:
        """Block until stopped or until the runtime ended; the exit status."""
        while not self.stopping.wait(0.2):
            if self.runtime is not None and not self.runtime.running:
                break
        return self.shutdown()

    def shutdown(self) -> int:
        # stop() lets the item in flight finish and its reply go out before the connector closes.
        if self.runtime is None:
            return 0
        try:
            self.runtime.stop(STOP_TIMEOUT_SECONDS)
        except ConnectorClosedError:
            pass
        except Exception as exc:
            if not self.stopping.is_set():
                logger.error("FFN runtime failed: %s", exc)
                return 1
        return 0


def report(status, line: str) -> bool:
    """Write one line to the supervisor's status pipe; False once the supervisor is gone."""
    try:
        status.write(line + "\n")
        status.flush()
        return True
    except BrokenPipeError:
        return False


def follow_supervisor(status) -> bool:
    """Linux: SIGTERM this rank when its supervisor dies (even by SIGKILL), so no rank is
    orphaned; False if the supervisor is already gone (the pipe's read end closed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor still stops its ranks on every exit path but SIGKILL
    # After prctl: a supervisor that died before it would go unnoticed, the closed pipe shows it.
    return report(status, STARTED_LINE)


def serve_rank(args: argparse.Namespace, cfg: AFDConfig, world_rank: int) -> int:
    """The rank process: load, connect, serve; 'ready' on the status pipe once serving."""
    faulthandler.enable()  # a crash inside the backend still leaves every thread's stack in the log
    status = os.fdopen(args.rank_status_fd, "w")
    if not follow_supervisor(status):
        logger.error("FFN rank %d: the supervisor is gone", args.ffn_rank_start)
        return 1
    try:
        expert_backend = check_supported(args)
    except ArgumentError as exc:
        print(f"ffn_server: {exc}", file=sys.stderr)
        return 2
    server = FFNServer(args, cfg, world_rank, expert_backend, lambda: report(status, READY_LINE))

    def on_signal(signum, _frame):
        logger.info("FFN rank %d: signal %d: draining", args.ffn_rank_start, signum)
        server.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.load_and_connect()
    except (AFDError, AFDConfigError, CheckpointError, ArgumentError, OSError) as exc:
        logger.error("FFN rank %d: %s", args.ffn_rank_start, exc)
        server.stopping.set()
        server.shutdown()
        return 1
    return server.wait()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args, cfg, ranks = parse_args(argv)
        if args.rank_status_fd is None:
            # Refused before any rank starts; the ranks get the resolved backend.
            args.expert_backend = check_supported(args)
            # The checkpoint the Attention engine and afdctl refuse is refused here too, before
            # any rank starts, so the reason is the pod's last log line (its termination message).
            cfg.validate_for_model(load_spec(args.model).num_routed_experts)
            logger.info("expert backend: %s", args.expert_backend)
            device_name = resolve_device_name(args.device)
    except (AFDConfigError, ArgumentError, ValueError) as exc:
        print(f"ffn_server: {exc}", file=sys.stderr)
        return 2
    if args.rank_status_fd is not None:
        end_rank_process(serve_rank(args, cfg, ranks[0]))
    return supervise(args, device_name)


def end_rank_process(code: int) -> None:
    """Exit a rank process without interpreter teardown. A receive a departed peer never
    answers leaves its watcher thread blocked inside the backend; running C++ static
    destructors under it aborted a drained rank ("terminate called without an active
    exception", exit -6) now and then, which the supervisor must read as a failed pod."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
