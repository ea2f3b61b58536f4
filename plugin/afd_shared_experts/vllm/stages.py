"""Micro-batch stages in vLLM 0.23.0's Attention forward (``afd.num_stages > 1``).

Three pieces, each documented with its removal plan in docs/compat.md ("Micro-batch stages"):

- ``StagedRunnerMixin`` (model-runner hook): vLLM's own ``execute_model`` builds, per
  micro-batch, the attention metadata (``split_attn_metadata`` through
  ``_build_attention_metadata(ubatch_slices=...)``) and the slot mappings, from request-aligned
  ``UBatchSlice``s the plugin plans (``stages.stage_plan``), and hands the slices to the model in
  the step's ``ForwardContext.ubatch_slices``. vLLM's own micro-batching (DBO) cannot be used:
  ``VllmConfig`` accepts it only with a DeepEP all2all backend, it slices only under data
  parallel and by token count (mid-request), and its driver is CUDA-only.
- ``MicroBatchRunner`` (model forward): runs the upstream forward once per micro-batch, on
  persistent threads handed off round-robin by vLLM's ``UBatchContext``s: exactly one thread
  computes at a time, and a thread yields between the dispatch and the combine of each MoE layer
  (``stage_yield``), so micro-batch s+1 computes attention while the FFN side holds s.
- ``current_stage``/``stage_yield``: the MoE layer's view (stage 0 and a no-op outside).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch
from vllm.forward_context import ForwardContext, create_forward_context, get_forward_context, override_forward_context
from vllm.utils import torch_utils
from vllm.v1.worker.ubatch_utils import UBatchSlice
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_enabled, dbo_yield, make_ubatch_contexts

from ..config import MinSplitTokens
from ..stages import stage_plan, step_stages


class StagesAborted(RuntimeError):
    """Another micro-batch of this step failed; this one stops at its next hand-off."""


_abort = threading.Event()  # set while a failed step unwinds its micro-batch threads


def current_stage() -> int:
    """The micro-batch the calling thread computes (0 outside a staged step)."""
    return dbo_current_ubatch_id()


def stage_yield() -> None:
    """Hand the Attention side to the next micro-batch; returns when this one's turn comes back
    (at once outside a staged step)."""
    if not dbo_enabled():
        return
    dbo_yield()
    if _abort.is_set():
        raise StagesAborted("afd: another micro-batch of this step failed")


class StagedRunnerMixin:
    """Hooks of a vLLM 0.23.0 ``GPUModelRunner`` subclass (the CPU runner derives from it) that
    split each real step into request-aligned micro-batches once it holds enough tokens
    (``stages.step_stages``). Dummy and profiling runs (``_dummy_run``) are never split; nor are
    padded batches (CUDA-graph sizes)."""

    afd_num_stages = 1
    afd_min_split = MinSplitTokens()
    afd_stage_slices: list[UBatchSlice] | None = None
    _afd_in_step = False

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._afd_in_step = True
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._afd_in_step, self.afd_stage_slices = False, None

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np, *args, **kwargs):
        result = super()._determine_batch_execution_and_padding(num_tokens, num_reqs, num_scheduled_tokens_np,
                                                                *args, **kwargs)
        batch_descriptor = result[1]
        if self._afd_in_step and self.afd_num_stages > 1 and batch_descriptor.num_tokens == num_tokens:
            tokens = num_scheduled_tokens_np[:num_reqs].tolist()
            plan = stage_plan(tokens, step_stages(tokens, self.afd_num_stages, self.afd_min_split))
            self.afd_stage_slices = [UBatchSlice(slice(s.req_start, s.req_stop), slice(s.tok_start, s.tok_stop))
                                     for s in plan] if len(plan) > 1 else None
        return result

    def _get_slot_mappings(self, *args, ubatch_slices=None, **kwargs):
        return super()._get_slot_mappings(*args, ubatch_slices=ubatch_slices or self.afd_stage_slices, **kwargs)

    def _build_attention_metadata(self, *args, ubatch_slices=None, **kwargs):
        return super()._build_attention_metadata(*args, ubatch_slices=ubatch_slices or self.afd_stage_slices,
                                                 **kwargs)

    def _model_forward(self, *args, **kwargs):
        if self.afd_stage_slices is not None:
            get_forward_context().ubatch_slices = self.afd_stage_slices
        return super()._model_forward(*args, **kwargs)

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes):
        # One attention-metadata builder per micro-batch: a split step asks builder i for
        # micro-batch i, and vLLM makes more than one only under its own DBO flags.
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        for group_id, groups in enumerate(self.attn_groups):
            for group in groups:
                if len(group.metadata_builders) < self.afd_num_stages:
                    group.create_metadata_builders(
                        self.vllm_config, self.device,
                        kernel_block_sizes[group_id] if group_id < len(kernel_block_sizes) else None,
                        num_metadata_builders=self.afd_num_stages)


class MicroBatchRunner:
    """Runs one step's micro-batches of the upstream model forward, ping-pong, on persistent
    threads (an OpenMP team is made once per thread, not once per step)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self._contexts: list = []
        self._inboxes: list[queue.SimpleQueue] = []

    def _ensure_threads(self, count: int) -> None:
        while len(self._inboxes) < count:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=f"afd-stage-{len(self._inboxes)}",
                             daemon=True).start()
            self._inboxes.append(inbox)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        with torch.inference_mode():
            while True:
                index, context, forward, results, stream = inbox.get()
                # vLLM's CPU "stream" is a per-thread placeholder: a UBatchContext compares the
                # thread's with the step's and calls torch.cuda.set_stream on a mismatch.
                torch_utils._current_stream_tls.value = stream
                try:
                    with context:
                        if _abort.is_set():
                            raise StagesAborted("afd: another micro-batch of this step failed")
                        results.put((index, forward(), None))
                except BaseException as error:  # noqa: BLE001 - handed to the step's thread
                    if not isinstance(error, StagesAborted):
                        _abort.set()
                        for ubatch in self._contexts:
                            ubatch.cpu_wait_event.set()
                    results.put((index, None, error))

    def run(self, forward: Callable[..., torch.Tensor], step_context: ForwardContext, slices: list[UBatchSlice],
            input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None,
            **kwargs) -> torch.Tensor:
        count = len(slices)
        self._ensure_threads(count)
        contexts = [create_forward_context(
            step_context.attn_metadata[i], self.vllm_config, dp_metadata=step_context.dp_metadata,
            batch_descriptor=step_context.batch_descriptor, slot_mapping=step_context.slot_mapping[i],
            additional_kwargs=step_context.additional_kwargs, skip_compiled=step_context.skip_compiled)
            for i in range(count)]
        barrier = threading.Barrier(count + 1)
        stream = torch_utils.current_stream()
        self._contexts = make_ubatch_contexts(count, stream, stream, contexts, barrier)
        results: queue.SimpleQueue = queue.SimpleQueue()
        _abort.clear()
        for i, (ubatch, piece) in enumerate(zip(self._contexts, slices)):
            tokens = piece.token_slice
            self._inboxes[i].put((i, ubatch, lambda tokens=tokens: forward(
                None if input_ids is None else input_ids[tokens], positions[..., tokens], None,
                None if inputs_embeds is None else inputs_embeds[tokens], **kwargs), results, stream))
        with override_forward_context(None):
            barrier.wait()
            self._contexts[0].cpu_wait_event.set()
            outputs: list[torch.Tensor | None] = [None] * count
            errors = []
            for _ in range(count):
                index, output, error = results.get()
                outputs[index] = output
                if error is not None:
                    errors.append(error)
        if errors:
            raise next((e for e in errors if not isinstance(e, StagesAborted)), errors[0])
        return torch.cat(outputs)
