"""Engine configs with micro-batch stages (afd.num_stages), built by vLLM 0.23.0 itself
(EngineArgs.create_engine_config, no engine): an Attention engine with stages gets the
plugin's worker; what stages cannot run with is refused before any process starts, naming
the field and the reason."""

import pytest

from vllm_harness import afd_block, free_port, install_testbed_plugin, run_driver, write_vllm_checkpoint

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
