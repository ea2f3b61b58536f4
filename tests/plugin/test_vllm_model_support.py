"""Which checkpoints an AFD Attention engine accepts, decided by vLLM 0.23.0's own engine
config (EngineArgs.create_engine_config, no engine) with the plugin loaded: every new family
builds an AFD engine config (DeepSeek-V3.2 too, which is not started here); a checkpoint the plugin cannot serve is refused before any
process starts with one line naming the checkpoint's key, the same line the FFN server and
`afdctl validate` give (``moe_spec.spec_from_config``); without an afd block nothing changes. And
`vllm serve --load-format afd` on such a checkpoint exits with that line, never healthy, and the
operator's event for such a pod quotes it."""

import json
import re
import subprocess

import pytest

from afd_devcluster.checkpoints import model_config, write_config_checkpoint
from afd_operator.observe import summarize_pod
from afd_shared_experts.moe_spec import CheckpointError, load_spec
from vllm_harness import afd_block, base_env, free_port, install_testbed_plugin, run_driver, vllm_console_script

STAGED_WORKER = "afd_shared_experts.vllm.worker.AFDCPUWorker"
TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
            vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="float32")
# Checkpoints the plugin cannot serve, with the rule each one's refusal states.
REFUSED = {
    # Routed experts the wrappers do not know: served whole by plain vLLM, never with an afd block.
    "mixtral": ({**TINY, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                 "num_experts_per_tok": 2}, r"model_type must be one of .* \(got 'mixtral'\)"),
    # The router weight scales the expert's input.
    "llama4": ({**TINY, "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "num_local_experts": 8,
                "num_experts_per_tok": 1, "intermediate_size_mlp": 128, "head_dim": 32, "interleave_moe_layer_step": 1},
               r"model_type 'llama4_text': its router weight scales each expert's input"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    install_testbed_plugin()
    return tmp_path_factory.mktemp("model-support")


def engine_config(root, model, name: str, block: dict | None) -> dict:
    request = {"model": str(model), "config_only": True}
    if block is not None:
        request["additional_config"] = block
    return run_driver(request, root, name)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "kimi_k2", "deepseek_v32"])
def test_new_families_build_an_afd_engine_config(root, model_type):
    model = write_config_checkpoint(root / model_type, model_config(model_type, hidden=64, inter=64, layers=2,
                                                                    vocab_size=128))
    config = engine_config(root, model, f"{model_type}-afd", afd_block("attention", port=free_port(), stages=2))
    assert config["worker_cls"] == STAGED_WORKER


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_checkpoint_the_plugin_cannot_serve_is_refused_with_its_key_named(root, case):
    config, rule = REFUSED[case]
    model = write_config_checkpoint(root / case, config)
    with pytest.raises(CheckpointError, match=rule):  # the FFN server's and afdctl's answer
        load_spec(model)
    with pytest.raises(AssertionError, match=rule):
        engine_config(root, model, f"{case}-afd", afd_block("attention", port=free_port()))
    # Plain vLLM (no afd block) builds it as before.
    assert engine_config(root, model, f"{case}-plain", None)["worker_cls"] != STAGED_WORKER


def test_experts_that_do_not_split_over_the_ffn_ranks_are_refused(root):
    model = write_config_checkpoint(root / "v3-uneven", model_config("deepseek_v3", hidden=64, inter=64, experts=8))
    with pytest.raises(AssertionError, match=r"afd.num_ffn_ranks.*must divide the model.s 8 routed experts evenly"):
        engine_config(root, model, "uneven", afd_block("attention", port=free_port(), ffn_ranks=3))


def test_pipeline_parallel_is_refused_in_one_line(root):
    model = write_config_checkpoint(root / "v3-pp", model_config("deepseek_v3", hidden=64, inter=64, experts=8))
    request = {"model": str(model), "config_only": True, "pipeline_parallel_size": 2,
               "additional_config": afd_block("attention", port=free_port())}
    with pytest.raises(AssertionError, match=r"afd: pipeline parallel is not supported \(--pipeline-parallel-size 2\): "
                                             r"the AFD world's ranks are data x tensor parallel Attention ranks"):
        run_driver(request, root, "pp")


def test_vllm_serve_on_an_unservable_checkpoint_exits_with_the_reason(root):
    model = write_config_checkpoint(root / "mixtral-serve", REFUSED["mixtral"][0])
    block = afd_block("attention", port=free_port())
    # One stream, as a container's log is.
    run = subprocess.run([vllm_console_script(), "serve", str(model), "--port", str(free_port()), "--load-format",
                          "afd", "--additional-config", json.dumps(block), "--dtype", "float32",
                          "--max-model-len", "512"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=base_env(), timeout=300)
    assert run.returncode != 0
    # The reason as one line of its own (besides vLLM's traceback of the failed config), and the
    # same line again as the last one of the log, after the traceback.
    lines = [line for line in run.stdout.splitlines() if "afd: refused: " in line]
    assert len(lines) == 2, lines
    assert all(re.search(r"model_type must be one of .* \(got 'mixtral'\)$", line) for line in lines), lines
    assert run.stdout.rstrip().splitlines()[-1] == lines[1]
    # The operator's event: the termination message is the log's tail (FallbackToLogsOnError:
    # at most 2048 bytes); the event quotes the refusal.
    pod = {"metadata": {"name": "m-abc-0-attn-0", "labels": {
               "afd.inference.dev/instance": "m-abc-0", "afd.inference.dev/revision": "abc",
               "afd.inference.dev/role": "attention", "afd.inference.dev/pod-ordinal": "0"}},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "attention", "state": {"terminated": {
               "exitCode": run.returncode, "reason": "Error", "message": run.stdout[-2048:]}}}]}}
    assert re.search(r": afd: refused: .*model_type must be one of", summarize_pod(pod).termination)
