"""The micro-batch stage glue in the vLLM venv, without serving: engine configs with stages
(afd.num_stages), built by vLLM 0.23.0 itself (EngineArgs.create_engine_config, no engine): an
Attention engine with stages gets the plugin's worker, and what stages cannot run with is
refused before any process starts, naming the field and the reason; the MicroBatchRunner on
vLLM's micro-batch contexts with a forward that only records and yields."""

import json
import subprocess

import pytest

from afd_devcluster.checkpoints import write_vllm_checkpoint
from vllm_harness import (HERE, REPO_ROOT, afd_block, base_env, free_port, install_testbed_plugin, run_driver,
                          vllm_python)

STAGED_WORKER = "afd_shared_experts.vllm.worker.AFDCPUWorker"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    install_testbed_plugin()
    root = tmp_path_factory.mktemp("stage-config")
    return root, write_vllm_checkpoint(root / "model", "deepseek_v3")


def engine_config(model, name: str, stages: int, **request) -> dict:
    root, checkpoint = model
    block = afd_block("attention", port=free_port(), stages=stages)
    return run_driver({"model": str(checkpoint), "additional_config": block, "config_only": True, **request},
                      root, name)


def test_stages_install_the_plugins_worker_and_one_stage_keeps_vllms(model):
    assert engine_config(model, "stages-2", 2)["worker_cls"] == STAGED_WORKER
    assert engine_config(model, "stages-1", 1)["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker"


def test_stages_with_another_worker_class_are_refused(model):
    with pytest.raises(AssertionError, match=r"afd\.num_stages: micro-batch stages need the plugin.s worker.*--worker-cls "
                                             r"my\.Worker was given; set num_stages 1 \(got 2\)"):
        engine_config(model, "other-worker", 2, worker_cls="my.Worker")


def test_micro_batches_take_turns_per_layer_and_a_failing_one_ends_the_step():
    # The plugin's MicroBatchRunner on vLLM's own micro-batch contexts, no engine: three
    # micro-batches, each "layer" yielding as AFDFusedMoE does between dispatch and combine.
    run = subprocess.run([vllm_python(), str(HERE / "vllm_stage_runner_driver.py")], capture_output=True, text=True,
                         env=base_env(), cwd=REPO_ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # Round robin, layer by layer; each micro-batch sees its own forward context.
    assert result["schedule"] == [[stage, layer, stage] for layer in range(3) for stage in range(3)]
    assert result["output"] == [0, 10, 20, 31, 41, 52]  # each micro-batch's rows, in slice order
    # A micro-batch that fails mid-step: its error comes out of run(), the others stop at their
    # next hand-off instead of waiting forever, and the next step runs normally.
    assert result["error"] == "micro-batch 1 failed at layer 1"
    assert result["after_error"] == result["output"]
    assert result["forward_context_restored"]
