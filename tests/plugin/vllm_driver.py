"""Runs under the vLLM venv: greedy generation with offline vllm.LLM.

python vllm_driver.py REQUEST.json RESULT.json
REQUEST: {"model", "prompts" (token ids), "max_tokens", "additional_config" (optional),
          "tensor_parallel_size" (optional, default 1), "load_format" (optional, default "auto"),
          "enforce_eager" (optional, default true; false: vLLM's default compilation settings),
          "config_only" (optional: build the engine config only, no engine, no generation),
          "worker_cls" (optional: vLLM's --worker-cls),
          "max_num_seqs", "max_num_batched_tokens" (optional, default 8 and 512: the scheduler's limits per step),
          "logprobs" (optional k: also return the top-k logprobs of every generated position)}
RESULT: {"graph_mode": {"enforce_eager", "compilation_mode", "cudagraph_mode"} of the engine config,
         "worker_cls": the engine config's worker class,
         "token_ids": [[...] per prompt], "generate_seconds", "generate_window_ns" ([start, end] on the host's
         monotonic clock, as stage traces record), "parameter_bytes": [per worker],
         "experts_classes": [per worker: class names of the MoE layers' experts],
         "fused_moe_registered": [per worker: the out-of-tree FusedMoE class in force after the build],
         "cpu_patched": [per worker: whether the plugin's CPU rotary patch is in force],
         "remote_tensors_read": [per worker: remote-expert tensors read from disk, AFD runs only],
         "logprobs" (when asked): [per prompt: [per position: {token id (str): logprob}, the chosen token
         and the top k]]}
"""

import json
import sys
import time


def experts_classes(model) -> list[str]:
    return sorted({type(module.mlp.experts).__name__ for module in model.model.layers
                   if hasattr(getattr(module, "mlp", None), "experts")})


def fused_moe_registered(model) -> str | None:
    from vllm.model_executor.custom_op import op_registry_oot

    registered = op_registry_oot.get("FusedMoE")
    return None if registered is None else registered.__name__


def cpu_patched(model) -> bool:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return getattr(RotaryEmbedding.forward_cpu, "afd_patched", False)


def graph_mode(vllm_config) -> dict:
    compilation = vllm_config.compilation_config
    return {"enforce_eager": vllm_config.model_config.enforce_eager, "compilation_mode": compilation.mode.name,
            "cudagraph_mode": compilation.cudagraph_mode.name}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    from afd_shared_experts.vllm.models import model_parameter_bytes, model_remote_tensors_read

    request = json.loads(open(sys.argv[1]).read())
    kwargs = {"additional_config": request["additional_config"]} if request.get("additional_config") else {}
    if request.get("enforce_eager", True):
        kwargs["enforce_eager"] = True
    if request.get("worker_cls"):
        kwargs["worker_cls"] = request["worker_cls"]
    engine_args = dict(model=request["model"], dtype="float32", max_model_len=512,
                       max_num_batched_tokens=request.get("max_num_batched_tokens", 512),
                       max_num_seqs=request.get("max_num_seqs", 8), seed=0,
                       tensor_parallel_size=request.get("tensor_parallel_size", 1),
                       pipeline_parallel_size=request.get("pipeline_parallel_size", 1),
                       load_format=request.get("load_format", "auto"), **kwargs)
    if request.get("config_only"):
        config = EngineArgs(**engine_args).create_engine_config()
        result = {"graph_mode": graph_mode(config), "worker_cls": config.parallel_config.worker_cls}
        with open(sys.argv[2], "w") as handle:
            json.dump(result, handle)
        return
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                            logprobs=request.get("logprobs"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    started, window_start = time.perf_counter(), time.monotonic_ns()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    window = [window_start, time.monotonic_ns()]
    result = {"graph_mode": graph_mode(llm.llm_engine.vllm_config),
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "generate_seconds": time.perf_counter() - started,
              "generate_window_ns": window,
              "parameter_bytes": llm.apply_model(model_parameter_bytes),
              "experts_classes": llm.apply_model(experts_classes),
              "fused_moe_registered": llm.apply_model(fused_moe_registered),
              "cpu_patched": llm.apply_model(cpu_patched)}
    if request.get("logprobs"):
        result["logprobs"] = [[{str(token): entry.logprob for token, entry in position.items()}
                               for position in o.outputs[0].logprobs] for o in outputs]
    if "additional_config" in kwargs:
        result["remote_tensors_read"] = llm.apply_model(model_remote_tensors_read)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
