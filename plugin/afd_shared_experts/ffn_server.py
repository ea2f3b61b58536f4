"""FFN role server: ``python3 -m afd_shared_experts.ffn_server``.

Started with the same ``--model`` and ``--additional-config`` as the Attention engines plus
its FFN rank range. For each local FFN rank it loads only that rank's routed-expert shard
(and, under placement 'ffn', the shared experts), joins the AFD world and serves work items
with the core runtime. Expert math: vLLM's MoE layer, kernels and (quantized) weight loaders
(``--expert-backend vllm``, ``vllm.ffn``) or plain torch (``torch``, unquantized only); no
vLLM engine or scheduler is needed either way.

Probes: /health (200 while the process runs), /ready (200 only once every local rank has
loaded its weights and initialized its connector), /metrics (Prometheus).
SIGTERM/SIGINT: finish the work item in flight, close the connectors, exit 0.
Exit 1 when a runtime fails (e.g. an Attention rank is lost), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

import torch

from .config import AFDConfig, AFDConfigError, parse_afd_config
from .connector import P2PConnector
from .errors import AFDError, ConnectorClosedError
from .ffn_runtime import FFNRuntime, LayerExperts, torch_experts
from .metrics import ProbeServer, RuntimeMetrics
from .model import DTYPES, CheckpointError, load_ffn_weights, load_spec
from .roles import ffn_world_ranks

logger = logging.getLogger("afd_shared_experts.ffn_server")

# A rank retries the rendezvous until the Attention ranks come up (FFN pods start first).
RENDEZVOUS_RETRY_SECONDS = 2.0
STOP_TIMEOUT_SECONDS = 30.0
EXPERT_BACKENDS = ("auto", "vllm", "torch")


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
                   help="cpu, cuda or npu; 'auto': npu when VLLM_PLUGINS names 'ascend', else cuda if available, else cpu")
    p.add_argument("--bind-host", default="0.0.0.0", help="address the probe server listens on")
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
    def __init__(self, args: argparse.Namespace, cfg: AFDConfig, world_ranks: list[int], expert_backend: str):
        self.args, self.cfg, self.world_ranks, self.expert_backend = args, cfg, world_ranks, expert_backend
        self.metrics = RuntimeMetrics("ffn")
        self.runtimes: list[FFNRuntime] = []
        self.stopping = threading.Event()
        self.weights_loaded = False
        self.probes: ProbeServer | None = None

    def ready(self) -> bool:
        return (self.weights_loaded and len(self.runtimes) == len(self.world_ranks)
                and all(r.ready for r in self.runtimes) and not self.stopping.is_set())

    def start_probes(self) -> None:
        args = self.args
        metrics_port = args.health_port if args.metrics_port is None else args.metrics_port
        self.probes = ProbeServer(self.metrics, self.ready, args.bind_host, metrics_port, args.health_port).start()
        logger.info("probes on :%d (/health, /ready), metrics on :%d", self.probes.health_port, self.probes.metrics_port)

    def load_and_connect(self) -> None:
        args, cfg = self.args, self.cfg
        spec = load_spec(args.model)
        cfg.validate_for_model(spec.num_routed_experts)
        dtype = resolve_dtype(args.dtype, args.model)
        device_name = resolve_device_name(args.device)
        local = [args.ffn_rank_start + i for i in range(args.ffn_local_ranks)]
        devices = [device_name if device_name == "cpu" or args.ffn_local_ranks == 1 else f"{device_name}:{i}"
                   for i in range(args.ffn_local_ranks)]
        experts = {}
        for ffn_index, device in zip(local, devices):
            started = time.monotonic()
            experts[ffn_index] = self._load_experts(spec, ffn_index, dtype, device)
            logger.info("FFN rank %d: loaded %d MoE layers in %.1fs (placement %s, %s expert backend)", ffn_index,
                        len(spec.moe_layers), time.monotonic() - started, cfg.shared_experts.placement,
                        self.expert_backend)
        self.weights_loaded = True
        for ffn_index, world_rank, device in zip(local, self.world_ranks, devices):
            connector = self._connect(world_rank, spec.hidden_size, spec.local_experts(cfg.num_ffn_ranks), dtype, device)
            if connector is None:
                return
            self.runtimes.append(FFNRuntime(connector, experts[ffn_index], self.metrics).start())
            logger.info("FFN rank %d (world rank %d) serving", ffn_index, world_rank)

    def _load_experts(self, spec, ffn_index: int, dtype: torch.dtype, device: str) -> dict[int, LayerExperts]:
        args, cfg = self.args, self.cfg
        placement = cfg.shared_experts.placement
        if self.expert_backend == "vllm":
            from .vllm.ffn import build_vllm_experts

            return build_vllm_experts(args.model, spec, placement, ffn_index, cfg.num_ffn_ranks, dtype,
                                      args.quantization, args.max_model_len, args.max_num_batched_tokens, device)
        return torch_experts(load_ffn_weights(args.model, spec, placement, ffn_index, cfg.num_ffn_ranks, dtype))

    def _connect(self, world_rank: int, hidden: int, local_experts: int, dtype: torch.dtype, device: str):
        """Rendezvous, retried until the Attention ranks are up or the server is stopped."""
        cfg = self.cfg
        while not self.stopping.is_set():
            connector = P2PConnector(role="ffn", rank=world_rank, num_attention_ranks=cfg.num_attention_ranks,
                                     num_ffn_ranks=cfg.num_ffn_ranks, host=cfg.host, port=cfg.port,
                                     hidden_size=hidden, local_experts=local_experts, dtype=dtype, device=device,
                                     timeout_seconds=cfg.timeout_seconds, metrics=self.metrics)
            try:
                connector.init()
                return connector
            except AFDError as exc:
                connector.close()
                logger.info("world rank %d: rendezvous not complete yet (%s); retrying", world_rank, exc)
                self.stopping.wait(RENDEZVOUS_RETRY_SECONDS)
        return None

    def wait(self) -> int:
        """Block until stopped or until every runtime ended; the exit status."""
        while not self.stopping.wait(0.2):
            if self.runtimes and len(self.runtimes) == len(self.world_ranks) and \
                    not any(r.running for r in self.runtimes):
                break
        return self.shutdown()

    def shutdown(self) -> int:
        # stop() lets the item in flight finish and its reply go out before the connector closes.
        status = 0
        for runtime in self.runtimes:
            try:
                runtime.stop(STOP_TIMEOUT_SECONDS)
            except ConnectorClosedError:
                pass
            except Exception as exc:
                if not self.stopping.is_set():
                    logger.error("FFN runtime failed: %s", exc)
                    status = 1
        if self.probes is not None:
            self.probes.stop()
        return status


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args, cfg, ranks = parse_args(argv)
        expert_backend = check_supported(args)
    except (AFDConfigError, ArgumentError, ValueError) as exc:
        print(f"ffn_server: {exc}", file=sys.stderr)
        return 2
    logger.info("expert backend: %s (--expert-backend %s)", expert_backend, args.expert_backend)
    server = FFNServer(args, cfg, ranks, expert_backend)

    def on_signal(signum, _frame):
        logger.info("signal %d: draining", signum)
        server.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start_probes()
    try:
        server.load_and_connect()
    except (AFDError, AFDConfigError, CheckpointError, ArgumentError, OSError) as exc:
        logger.error("%s", exc)
        server.stopping.set()
        server.shutdown()
        return 1
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
