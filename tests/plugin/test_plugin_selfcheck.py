"""The selfcheck CLI contract, run as a real command with real rank processes."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_devcluster import free_port
from afd_shared_experts.model import DTYPES
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import token_range
from afd_shared_experts.wire import WireLayout
from plugin_harness import assert_matches_oracle, oracle_outputs


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
                   "--dtype", "bfloat16", "--steps", "2", "--data-plane", "direct"], "direct"),
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
    # Work bytes: whole frames on the direct plane; on staged each frame's header and valid rows:
    # every token's top-k rows, plus one extra row per token under the contiguous partition
    # (affinity sends no extra row for the shared expert).
    attention_ranks = int(args[args.index("--attention-ranks") + 1])
    share = max(hi - lo for lo, hi in (token_range(a, 7, attention_ranks) for a in range(attention_ranks)))
    layout = WireLayout(hidden_size=spec.hidden_size, dtype=DTYPES[dtype], local_experts=spec.local_experts(ffn_ranks),
                        num_ffn_ranks=ffn_ranks, top_k=spec.top_k, max_tokens=share,
                        shared="contiguous" if "contiguous" in args else "affinity" if placement == "ffn" else "none")
    frames = steps * len(spec.moe_layers) * attention_ranks * ffn_ranks
    rows = frames * layout.work_rows if data_plane == "direct" else \
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
