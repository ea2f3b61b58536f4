"""Runs under the vLLM venv: the plugin's MicroBatchRunner on vLLM 0.23.0's micro-batch contexts,
without an engine (a forward that only records and yields, as each MoE layer does); prints one
JSON object.

python vllm_stage_runner_driver.py
{"schedule": [[micro-batch, layer], ...] in the order the forwards ran them,
 "output": the concatenated outputs, "error": what a failing micro-batch raised through run(),
 "after_error": the output of a step run after it, "forward_context_restored": bool}
"""

import json
import threading

import torch


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import create_forward_context, get_forward_context, override_forward_context
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from afd_shared_experts.vllm.stages import MicroBatchRunner, current_stage, stage_yield

    config = VllmConfig()
    schedule: list[list[int]] = []
    running = threading.Semaphore(1)  # fails if two micro-batches compute at once
    layers = 3

    def forward(input_ids, positions, intermediate_tensors, inputs_embeds, fail_at=None):
        stage = current_stage()
        own = get_forward_context().attn_metadata["stage"]
        for layer in range(layers):
            if not running.acquire(blocking=False):
                raise RuntimeError("two micro-batches computed at once")
            schedule.append([stage, layer, own])
            running.release()
            if fail_at == (stage, layer):
                raise ValueError(f"micro-batch {stage} failed at layer {layer}")
            stage_yield()  # between this layer's dispatch and combine
        return input_ids.float()[:, None] * 10 + stage

    slices = [UBatchSlice(slice(0, 2), slice(0, 3)), UBatchSlice(slice(2, 4), slice(3, 5)),
              UBatchSlice(slice(4, 5), slice(5, 6))]
    with set_current_vllm_config(config):
        step = create_forward_context([{"stage": i} for i in range(3)], config, slot_mapping=[{}, {}, {}])
        runner = MicroBatchRunner(config)
        ids, positions = torch.arange(6), torch.arange(6)
        with override_forward_context(step):
            output = runner.run(forward, step, slices, ids, positions, None)
            result = {"schedule": list(schedule), "output": output.flatten().tolist()}
            try:
                runner.run(forward, step, slices, ids, positions, None, fail_at=(1, 1))
                result["error"] = None
            except ValueError as error:
                result["error"] = str(error)
            result["after_error"] = runner.run(forward, step, slices, ids, positions, None).flatten().tolist()
            result["forward_context_restored"] = get_forward_context() is step
    print(json.dumps(result))


if __name__ == "__main__":
    main()
