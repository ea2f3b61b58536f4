"""The MoE experts boundary inside vLLM 0.23.0: ``FusedMoE`` replaced by remote experts.

In vLLM 0.23.0 ``DeepseekV2MoE`` and ``Qwen2MoeSparseMoeBlock`` build their gate and
shared-expert MLP and hand the shared MLP to ``FusedMoE``, whose runner returns routed +
shared in one tensor. ``AFDFusedMoE`` keeps that contract on an Attention rank: it routes with
vLLM's own router (identical top-k to plain vLLM) and hands the rows to the core's
``RemoteMoE``; no routed expert weight is created.

It is installed only while an AFD model wrapper builds its model (``remote_experts_installed``),
as the out-of-tree class vLLM's ``PluggableLayer`` resolves ``FusedMoE`` to, and the entry in
force before (vllm-ascend's ``AscendFusedMoE`` on NPU, none on CPU) is restored right after:
nothing is registered at plugin load, so the platform's own registration never collides with
the plugin's and a model without an ``afd`` block is built exactly as upstream builds it.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router

from ..attention import RemoteMoE
from ..config import AFDConfig
from ..connector import P2PConnector
from ..device import current_device
from ..metrics import RuntimeMetrics
from ..model import SharedExpertWeights
from ..moe_spec import MoESpec
from ..ops import RemoteLayer, register, remote_moe, set_stage_source
from ..roles import attention_role_rank
from ..tp import all_gather_and_trim, shard_tokens
from ..wire import WireLayout
from .compat import afd_config_of, model_spec
from .stages import current_stage, stage_yield

logger = logging.getLogger(__name__)

LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AttentionRank:
    """Per-process AFD state of one Attention worker: its role rank and its connector,
    shared by every MoE layer of the model."""

    def __init__(self, vllm_config, cfg: AFDConfig, spec: MoESpec):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.distributed.parallel_state import get_pcp_group, get_tp_group
        from vllm.platforms import current_platform

        parallel = vllm_config.parallel_config
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_group = get_tp_group().device_group
        pcp_size = parallel.prefill_context_parallel_size
        self.rank = attention_role_rank(
            cfg, dp_rank=parallel.data_parallel_rank, dp_size=parallel.data_parallel_size,
            tp_rank=self.tp_rank, tp_size=self.tp_size,
            pcp_rank=get_pcp_group().rank_in_group if pcp_size > 1 else 0, pcp_size=pcp_size)
        cfg.validate_for_model(spec.num_routed_experts)
        self.cfg, self.spec = cfg, spec
        self.metrics = RuntimeMetrics("attention")
        requested = cfg.shared_experts.placement
        self.placement = spec.placement(requested)
        self.metrics.shared_experts_placement.labels(requested=requested, effective=self.placement).set(1)
        if self.placement != requested:
            logger.info("afd: %s has no shared experts: shared_experts.placement %r does not apply (routed experts "
                        "only)", spec.model_type, requested)
        # Frames sized for the engine's token budget (a TP rank dispatches its shard; a micro-batch holds less).
        layout = WireLayout.for_world(spec, cfg, dtype=vllm_config.model_config.dtype,
                                      token_budget=vllm_config.scheduler_config.max_num_batched_tokens)
        # The worker selected its device before building the model: the connector's is that one,
        # with its index (the device links' communicators bind to it).
        device = torch.device(current_platform.device_type)
        device = device if device.type == "cpu" else current_device(device)
        self.connector = P2PConnector.from_config(cfg, role="attention", rank=self.rank, layout=layout,
                                                  device=device, metrics=self.metrics)
        logger.info("AFD Attention rank %d of %d (+%d FFN ranks): rendezvous at %s:%d",
                    self.rank, cfg.num_attention_ranks, cfg.num_ffn_ranks, cfg.host, cfg.port)
        self.connector.init()
        # Micro-batches of the step the model forward is running (set by the model wrapper).
        self.step_stages = 1
        set_stage_source(current_stage)
        # Tells the FFN servers this rank is done, so they end cleanly with the engine. Not
        # atexit: vLLM's workers are forked multiprocessing children, which leave through
        # os._exit after running multiprocessing's own exit finalizers (these), never atexit.
        # They run only if vLLM lets its workers exit: --shutdown-timeout > 0 (the operator sets it).
        multiprocessing.util.Finalize(None, self.connector.close, exitpriority=10)


_attention_rank: AttentionRank | None = None


def attention_rank(vllm_config, cfg: AFDConfig) -> AttentionRank:
    """The process's AttentionRank (the engine's config hook has refused what it cannot serve)."""
    global _attention_rank
    if _attention_rank is None:
        _attention_rank = AttentionRank(vllm_config, cfg, model_spec(vllm_config.model_config))
    return _attention_rank


def platform_expert_selection(top_k: int, num_experts: int, routing: dict):
    """(hidden_states, router_logits) -> (top-k weights, ids), chosen as plain vLLM chooses on
    this platform, without the routed scaling factor (the core's combine applies it once).

    On CPU, vLLM 0.23.0's fused MoE routes inside its kernel with ``cpu_fused_moe.select_experts``
    (the router factory's softmax top-k is a CUDA-only op there); elsewhere FusedMoE routes with
    the router from ``create_fused_moe_router``."""
    from vllm.platforms import current_platform

    common = dict(top_k=top_k, renormalize=routing.get("renormalize", True),
                  use_grouped_topk=routing.get("use_grouped_topk", False),
                  num_expert_group=routing.get("num_expert_group"), topk_group=routing.get("topk_group"),
                  scoring_func=routing.get("scoring_func", "softmax"), routed_scaling_factor=1.0,
                  e_score_correction_bias=routing.get("e_score_correction_bias"),
                  custom_routing_function=routing.get("custom_routing_function"))
    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe

        return lambda hidden_states, router_logits: cpu_fused_moe.select_experts(
            hidden_states=hidden_states, router_logits=router_logits, **common)
    return create_fused_moe_router(global_num_experts=num_experts, num_logical_experts=num_experts,
                                   **common).select_experts


class AFDFusedMoE(FusedMoE):
    """Remote experts of one MoE layer on an Attention rank (built only under an afd block)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *args,
                 prefix: str = "", shared_experts: torch.nn.Module | None = None, **kwargs):
        vllm_config = get_current_vllm_config()
        cfg = afd_config_of(vllm_config)
        if cfg is None:
            raise RuntimeError("afd: AFDFusedMoE is installed only while an AFD model is built")
        if args:
            raise TypeError("afd: FusedMoE must be built with keyword arguments (as vLLM 0.23.0 models do)")
        # nn.Module init only: FusedMoE.__init__ would create the routed expert weights.
        torch.nn.Module.__init__(self)
        match = LAYER_PREFIX.search(prefix + ".")
        if match is None:
            raise ValueError(f"afd: cannot tell the layer index of MoE layer {prefix!r}")
        self.layer_name = prefix  # as upstream FusedMoE names itself
        rank = attention_rank(vllm_config, cfg)
        layer = int(match.group(1))
        if layer not in rank.spec.moe_layers:
            raise ValueError(f"afd: vLLM built a MoE layer at {prefix} but the checkpoint's config.json has none there")
        placement = rank.placement
        shared = None
        if placement == "attention":
            if shared_experts is None:
                raise ValueError(f"afd: {prefix}: placement 'attention' needs the model's shared experts")
            if rank.tp_size > 1:
                raise ValueError("afd.shared_experts.placement: 'attention' supports Attention tensor parallel size 1 "
                                 f"only (got {rank.tp_size}); use placement 'ffn'")
            # Views of vLLM's own (merged gate_up, down, Qwen2-MoE's expert gate) parameters:
            # filled in place by its loader.
            expert_gate = getattr(shared_experts, "expert_gate", None)
            shared = SharedExpertWeights(gate_up=shared_experts.gate_up_proj.weight.data,
                                         down=shared_experts.down_proj.weight.data,
                                         shared_gate=None if expert_gate is None else expert_gate.weight.data)
        elif shared_experts is not None:
            # Built (uninitialized) by the upstream MoE block before this layer: release its
            # storage now, before the next layer is built; the model wrapper drops the module.
            shared_experts.to_empty(device="meta")
        self.expert_selection = platform_expert_selection(top_k, num_experts, kwargs)
        self.rank = rank
        self.remote = RemoteMoE(
            spec=rank.spec, layer=layer, connector=rank.connector, num_ffn_ranks=cfg.num_ffn_ranks,
            placement=placement, partition=cfg.shared_experts.partition, dtype=vllm_config.model_config.dtype,
            shared=shared, metrics=rank.metrics)
        register(prefix, RemoteLayer(dispatch=self.afd_dispatch, combine=self.afd_combine))

    @property
    def is_internal_router(self) -> bool:
        return False

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Two custom ops: a compiled model keeps them as opaque calls, run as Python at run time.
        return remote_moe(hidden_states, [router_logits], self.layer_name)

    def afd_dispatch(self, hidden_states: torch.Tensor, routing: list[torch.Tensor]) -> tuple[object, int]:
        """``afd::dispatch`` of this layer: route as plain vLLM does, send this rank's rows."""
        topk_weights, topk_ids = self.expert_selection(hidden_states, routing[0])
        rank = self.rank
        stage = dict(stage=current_stage(), stages=rank.step_stages)
        if rank.tp_size == 1:
            # Idle DP steps arrive here too (dummy rows): they are dispatched like any other
            # step, and an empty batch still sends header-only frames to every FFN rank.
            return self.remote.dispatch(hidden_states, topk_ids, topk_weights, **stage), hidden_states.shape[0]
        # Every TP rank holds all tokens after the attention all-reduce: each dispatches its
        # ceil(T/TP) shard and all join the gather, also with an all-padding shard.
        x, real = shard_tokens(hidden_states, rank.tp_rank, rank.tp_size)
        ids, _ = shard_tokens(topk_ids, rank.tp_rank, rank.tp_size)
        weights, _ = shard_tokens(topk_weights, rank.tp_rank, rank.tp_size)
        return self.remote.dispatch(x, ids, weights, num_tokens=real, **stage), hidden_states.shape[0]

    def afd_combine(self, dispatched: tuple[object, int]) -> torch.Tensor:
        """``afd::combine`` of this layer: the next micro-batch computes while the FFN side holds
        this one, then this rank's output (gathered over TP)."""
        pending, num_tokens = dispatched
        stage_yield()
        out = self.remote.combine(pending)
        if self.rank.tp_size == 1:
            return out
        return all_gather_and_trim(out, num_tokens, self.rank.tp_group)


@contextmanager
def remote_experts_installed() -> Iterator[None]:
    """While an AFD model is built, ``FusedMoE(...)`` builds ``AFDFusedMoE``; the out-of-tree
    entry in force before (if any) is back afterwards."""
    previous = op_registry_oot.get("FusedMoE")
    op_registry_oot["FusedMoE"] = AFDFusedMoE
    try:
        yield
    finally:
        if previous is None:
            del op_registry_oot["FusedMoE"]
        else:
            op_registry_oot["FusedMoE"] = previous
