"""The selfcheck CLI contract, run as a real command with real rank processes."""

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_devcluster import free_port
from afd_shared_experts.ffn_runtime import FFNRuntime, torch_experts
from afd_shared_experts.model import DTYPES, load_ffn_weights
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import RunSpec, SelfCheckError, check_repeat, run_attention_rank, token_range
from afd_shared_experts.wire import WireLayout
from plugin_harness import assert_matches_oracle, make_connector, oracle_outputs, run_threads


def processes_with_tag(tag: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_selfcheck(tmp_path, model_dir, tokens, *args, env_extra=None):
    inputs, out, report = tmp_path / "in.safetensors", tmp_path / "out.safetensors", tmp_path / "report.json"
    x = torch.randn(tokens, load_spec(model_dir).hidden_size, generator=torch.Generator().manual_seed(tokens))
    save_file({"hidden_states": x}, str(inputs))
    tag = f"AFD_SELFCHECK_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, tag: "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "afd_shared_experts.selfcheck", "--model", str(model_dir),
                           "--inputs", str(inputs), "--out", str(out), "--report", str(report),
                           "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert processes_with_tag(tag) == [], "selfcheck left a rank process behind"
    return proc, x, out, report


# Every case runs on --device cpu (the default where not named); the data plane is forced
# staged, forced direct, or left to auto, which picks staged for ranks sharing a device (CPU).
@pytest.mark.parametrize("model,args,data_plane", [
    ("deepseek_v3", ["--attention-ranks", "3", "--ffn-ranks", "2", "--placement", "ffn", "--partition", "affinity",
                     "--steps", "3", "--device", "cpu", "--data-plane", "staged"], "staged"),
    ("qwen2_moe", ["--attention-ranks", "2", "--ffn-ranks", "4", "--placement", "ffn", "--partition", "contiguous",
                   "--dtype", "bfloat16", "--steps", "3", "--data-plane", "direct"], "direct"),
    ("deepseek_v2_group_limited", ["--attention-ranks", "4", "--ffn-ranks", "1", "--placement", "attention",
                                   "--dtype", "float16"], "staged"),
    ("glm4_moe", ["--attention-ranks", "2", "--ffn-ranks", "2", "--placement", "ffn", "--partition", "affinity"],
     "staged"),
    # No shared expert: the placement asked for does not apply.
    ("qwen3_moe", ["--attention-ranks", "2", "--ffn-ranks", "2", "--placement", "ffn", "--dtype", "bfloat16"],
     "staged"),
], ids=["staged-forced", "direct-forced", "auto", "glm4-moe", "qwen3-moe"])
def test_selfcheck_matches_oracle(tmp_path, checkpoints, model, args, data_plane):
    model_dir = checkpoints[model]
    proc, x, out, report_path = run_selfcheck(tmp_path, model_dir, 7, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"device cpu, {data_plane} data plane" in proc.stdout
    spec = load_spec(model_dir)
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "float32"
    with safe_open(str(out), framework="pt") as f:
        actual = {int(k.split(".")[1]): f.get_tensor(k) for k in f.keys()}
    assert all(t.dtype == torch.float32 and t.shape == x.shape for t in actual.values())
    assert_matches_oracle(actual, oracle_outputs(model_dir, x, dtype, spec.moe_layers), dtype)

    report = json.loads(report_path.read_text())
    assert report["data_plane"] == data_plane  # the plane the ranks agreed on and ran
    assert report["run"]["device"] == "cpu"
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 1
    ffn_ranks = int(args[args.index("--ffn-ranks") + 1])
    assert len(report["wall_time_per_step_seconds"]) == steps
    assert set(report["bytes_by_kind"]) == {"work", "replies"}
    placement = spec.placement(args[args.index("--placement") + 1])  # 'none' without shared experts
    shared_total = sum(report["shared_tokens_per_ffn_rank"])
    assert shared_total == (7 * steps * len(spec.moe_layers) if placement == "ffn" else 0)
    # Work bytes: on the direct plane each frame's header and the rows message sized for the
    # Attention rank's token count; on staged each frame's header and valid rows: every token's
    # top-k rows, plus one extra row per token under the contiguous partition (affinity sends no
    # extra row for the shared expert).
    attention_ranks = int(args[args.index("--attention-ranks") + 1])
    shares = [hi - lo for lo, hi in (token_range(a, 7, attention_ranks) for a in range(attention_ranks))]
    layout = WireLayout(hidden_size=spec.hidden_size, dtype=DTYPES[dtype], local_experts=spec.local_experts(ffn_ranks),
                        num_ffn_ranks=ffn_ranks, top_k=spec.top_k, max_tokens=max(shares),
                        shared="contiguous" if "contiguous" in args else "affinity" if placement == "ffn" else "none")
    dispatches = steps * len(spec.moe_layers) * ffn_ranks
    frames = dispatches * attention_ranks
    rows = sum(dispatches * (layout.header_rows + layout.rows_message_rows(t)) for t in shares) \
        if data_plane == "direct" else \
        frames * layout.header_rows + steps * len(spec.moe_layers) * 7 * (spec.top_k + ("contiguous" in args))
    assert report["bytes_by_kind"]["work"] == rows * spec.hidden_size * layout.row_bytes_per_element
    assert len(report["ffn_parameter_bytes"]) == ffn_ranks


def test_selfcheck_fails_cleanly_on_bad_topology(tmp_path, checkpoints):
    proc, *_ = run_selfcheck(tmp_path, checkpoints["deepseek_v2"], 5, "--attention-ranks", "1", "--ffn-ranks", "3")
    assert proc.returncode == 1
    assert "--ffn-ranks: must divide the model's 8 routed experts evenly" in proc.stderr


def test_selfcheck_names_a_bad_port(tmp_path, checkpoints):
    proc, *_ = run_selfcheck(tmp_path, checkpoints["deepseek_v2"], 5, "--attention-ranks", "1", "--ffn-ranks", "2",
                             "--port", "70000")
    assert proc.returncode == 1
    assert "--port must be 0 (pick a free one) or 1-65535 (got 70000)" in proc.stderr


@pytest.mark.parametrize("device,message", [
    ("npu", "--device 'npu': device 'npu' requested but torch_npu/CANN cannot be loaded: the torch-npu package is "
            "not installed"),
    ("cuda", "--device 'cuda': device 'cuda' requested but torch.cuda.is_available() is False"),
    ("cuda:1", "--device 'cuda:1': device 'cuda' requested but torch.cuda.is_available() is False"),
    ("tpu", "--device 'tpu': "),
])
def test_selfcheck_names_an_unusable_device_before_any_rank_starts(tmp_path, checkpoints, device, message):
    """No CUDA (hidden) and no torch-npu in the dev venv: exit 1 naming the flag, no output
    written, no rank process started or left."""
    proc, _, out, report = run_selfcheck(tmp_path, checkpoints["deepseek_v2"], 5, "--attention-ranks", "1",
                                         "--ffn-ranks", "2", "--device", device,
                                         env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert f"selfcheck failed: {message}" in proc.stderr
    assert "rank" not in proc.stderr and not out.exists() and not report.exists()


def test_selfcheck_fails_cleanly_when_a_rank_fails(tmp_path, checkpoints):
    """An FFN rank cannot load its experts: non-zero exit, the cause named, no process left."""
    broken = tmp_path / "broken"
    broken.mkdir()
    source = checkpoints["deepseek_v2"]
    (broken / "config.json").write_text((source / "config.json").read_text())
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.experts.6.up_proj.weight"}
    save_file(tensors, str(broken / "model.safetensors"))
    proc, *_ = run_selfcheck(tmp_path, broken, 5, "--attention-ranks", "2", "--ffn-ranks", "2")
    assert proc.returncode == 1
    assert "ffn rank 1 failed" in proc.stderr
    assert "lacks tensor 'model.layers.1.mlp.experts.6.up_proj.weight'" in proc.stderr


def test_steps_repeat_after_a_first_group_that_went_without_ranks(checkpoints):
    """An FFN rank with no gather window computes the first item it receives alone, and each
    other Attention rank's first item alone as it comes: step 0 puts 3 rows through each GEMM
    that later steps fill with 12, and CPU BLAS rounds 2-3 rows and 4+ rows differently. The
    ranks' outputs still repeat from step 1 on (they start each step together, so every
    later group holds all four), and step 0's match the model."""
    model_dir = checkpoints["deepseek_v3"]
    spec = load_spec(model_dir)
    attention_ranks, share = 4, 3
    port = free_port()
    run = RunSpec(model_dir=str(model_dir), attention_ranks=attention_ranks, ffn_ranks=1, steps=4, port=port,
                  max_tokens=share)
    ffn = make_connector(spec, "ffn", attention_ranks, attention_ranks, 1, port, timeout=60, max_tokens=share)
    runtime = FFNRuntime(ffn, torch_experts(load_ffn_weights(model_dir, spec, "ffn", 0, 1, torch.float32)),
                         gather_window=0.0)
    x = torch.randn(attention_ranks * share, spec.hidden_size, generator=torch.Generator().manual_seed(7))
    step_barrier = threading.Barrier(attention_ranks)

    def serve_ffn():
        ffn.init()
        runtime.serve()

    try:
        results = run_threads([lambda a=a: run_attention_rank(run, a, x[a * share:(a + 1) * share], step_barrier)
                               for a in range(attention_ranks)] + [serve_ffn])
    finally:
        ffn.close()
    assert runtime.partial_groups >= 1
    assert runtime.pass_peers[attention_ranks] >= 3 * len(spec.moe_layers)  # steps 1-3: one pass over all ranks
    outputs = {layer: torch.cat([r.outputs[layer] for r in results[:attention_ranks]]) for layer in spec.moe_layers}
    assert_matches_oracle(outputs, oracle_outputs(model_dir, x, "float32", spec.moe_layers), "float32")


def test_a_step_that_differs_from_step_1_in_one_bit_fails_the_selfcheck():
    reference = {3: torch.ones(2, 4)}
    check_repeat(0, 2, {3: torch.ones(2, 4)}, reference)
    one_ulp_off = torch.ones(2, 4)
    one_ulp_off[1, 2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(SelfCheckError, match="Attention rank 0: layer 3 output of step 2 differs from step 1"):
        check_repeat(0, 2, {3: one_ulp_off}, reference)
