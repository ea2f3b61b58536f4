"""Runs under the vLLM venv for tests/plugin/test_vllm_ascend_context.py (one process).

argv: request.json result.json. vLLM's platform here is the CPU; the FFN vLLM backend's Ascend
branch is selected (``vllm.ffn.on_ascend``) and:
1. with no vllm_ascend importable, ``build_vllm_experts`` fails: its message is recorded;
2. with the stand-in vllm_ascend tree (vllm_ascend_standin/) on sys.path it builds one FFN rank's
   experts and computes routed() and shared() once each: the stand-in's recorded calls, and
   whether the outputs equal the same computation in plain vLLM's forward context.
"""

import enum
import importlib
import json
import sys
from pathlib import Path

import torch

from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.vllm import ffn

STANDIN = Path(__file__).resolve().parent / "vllm_ascend_standin"
THE_CONFIG = "<the rank's VllmConfig>"


def describe(value, vllm_config):
    if value is vllm_config:
        return THE_CONFIG
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.device):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    model = request["model"]
    spec = load_spec(model)
    args = (model, spec, "ffn", 0, request["num_ffn_ranks"], torch.float32, None, None, 64, "cpu")
    ffn.on_ascend = lambda: True
    try:
        ffn.build_vllm_experts(*args)
        missing_error = None
    except RuntimeError as exc:
        missing_error = str(exc)

    sys.path.insert(0, str(STANDIN))
    importlib.invalidate_caches()
    import vllm_ascend

    experts = ffn.build_vllm_experts(*args)
    layer = experts[min(experts)]
    gen = torch.Generator().manual_seed(0)
    counts = request["counts"]
    routed_rows = torch.randn(sum(counts), spec.hidden_size, generator=gen)
    shared_rows = torch.randn(request["shared_rows"], spec.hidden_size, generator=gen)
    on_ascend = (layer.routed(routed_rows, counts), layer.shared(shared_rows))
    calls = [[name, {key: describe(value, layer.vllm_config) for key, value in kwargs.items()}]
             for name, kwargs in vllm_ascend.CALLS]
    ffn.on_ascend = lambda: False
    plain = (layer.routed(routed_rows, counts), layer.shared(shared_rows))
    result = {"missing_error": missing_error, "calls": calls,
              "max_num_seqs": layer.vllm_config.scheduler_config.max_num_seqs,
              "outputs_equal_plain_context": [torch.equal(a, b) for a, b in zip(on_ascend, plain)]}
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
