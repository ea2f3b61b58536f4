"""Runs under the vLLM venv: greedy generation with offline vllm.LLM.

python vllm_driver.py REQUEST.json RESULT.json
REQUEST: {"model", "prompts" (token ids), "max_tokens", "additional_config" (optional),
          "tensor_parallel_size" (optional, default 1), "load_format" (optional, default "auto")}
RESULT: {"token_ids": [[...] per prompt], "generate_seconds", "parameter_bytes": [per worker],
         "experts_classes": [per worker: class names of the MoE layers' experts],
         "fused_moe_registered": [per worker: the out-of-tree FusedMoE class in force after the build],
         "remote_tensors_read": [per worker: remote-expert tensors read from disk, AFD runs only]}
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


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from afd_shared_experts.vllm.models import model_parameter_bytes, model_remote_tensors_read

    request = json.loads(open(sys.argv[1]).read())
    kwargs = {"additional_config": request["additional_config"]} if request.get("additional_config") else {}
    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=512, max_num_seqs=8, seed=0,
              tensor_parallel_size=request.get("tensor_parallel_size", 1),
              load_format=request.get("load_format", "auto"), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              "generate_seconds": time.perf_counter() - started,
              "parameter_bytes": llm.apply_model(model_parameter_bytes),
              "experts_classes": llm.apply_model(experts_classes),
              "fused_moe_registered": llm.apply_model(fused_moe_registered)}
    if kwargs:
        result["remote_tensors_read"] = llm.apply_model(model_remote_tensors_read)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
