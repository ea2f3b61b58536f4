"""FFN pods with several ranks as the operator renders them, real processes (dev venv, torch
expert backend, no vLLM): `python -m afd_shared_experts.ffn_server --ffn-local-ranks N` is one
supervisor with N rank processes. The Attention side is the plugin's selfcheck Attention ranks
(threads of this test process, real gloo connectors) plus one Attention rank that joins the
world and idles, so the pods keep serving after the selfcheck ranks finished.

Shapes (Attention ranks, FFN ranks per pod): deepseek-v3-ascend (16, one pod of 16), small-ascend
(4 = DP2 x TP2, two pods of 2) and an uneven split (2, pods of 2 + 1). The model's 48 routed
experts divide by 16, 4 and 3 FFN ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from afd_devcluster.checkpoints import write_moe_checkpoint
from afd_shared_experts.connector import P2PConnector
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.selfcheck import RunSpec, run_attention_rank, token_range
from plugin_harness import (assert_matches_oracle, child_pids, make_connector, oracle_outputs, process_alive,
                            run_threads)
from vllm_harness import SERVER_TOKEN_BUDGET, afd_block, free_port, http_status, start_ffn_servers, wait_until

SHAPES = {"deepseek-v3-ascend": (16, (16,)), "small-ascend": (4, (2, 2)), "uneven": (2, (2, 1))}
EXPERTS = 48
TOKENS = 40
STEPS = 3  # steps 2.. must repeat step 1's outputs bit for bit (selfcheck.run_attention_rank)
START_TIMEOUT = 240


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("ffn-pods") / "deepseek_v3", "deepseek_v3", seed=3,
                                experts=EXPERTS)


def http_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


class PodWorld:
    """The FFN pods of one shape, started; `serve()` runs the Attention side against them."""

    def __init__(self, model, shape: str, logdir):
        self.model, self.spec = model, load_spec(model)
        self.attention_ranks, self.split = SHAPES[shape]
        self.ffn_ranks = sum(self.split)
        self.port = free_port()
        self.block = afd_block("attention", port=self.port, attention_ranks=self.attention_ranks,
                               ffn_ranks=self.ffn_ranks)
        self.block["afd"]["timeout_seconds"] = 60
        self.pods = start_ffn_servers(model, self.block, logdir, tag=shape, split=self.split, python=sys.executable,
                                      extra_args=("--expert-backend", "torch"))
        self.idle: P2PConnector | None = None

    @property
    def procs(self):
        return [proc for proc, _ in self.pods]

    def wait_loaded(self) -> None:
        def loaded() -> bool:
            return all(http_status(port, "/health") == 200 and proc.log().count(": loaded ") == ranks
                       for (proc, port), ranks in zip(self.pods, self.split))

        wait_until(loaded, START_TIMEOUT, "every FFN rank loaded its weights", self.procs)

    def ready(self) -> list[int | None]:
        return [http_status(port, "/ready") for _, port in self.pods]

    def serve(self, hidden_states: torch.Tensor) -> dict[int, torch.Tensor]:
        """Attention ranks 0..A-2 run the selfcheck layers on their token share; rank A-1 joins and idles."""
        working = self.attention_ranks - 1
        # The FFN pods were started with the engines' token budget: every rank sizes its frames by it.
        run = RunSpec(model_dir=str(self.model), attention_ranks=self.attention_ranks, ffn_ranks=self.ffn_ranks,
                      steps=STEPS, port=self.port, timeout_seconds=60, max_tokens=SERVER_TOKEN_BUDGET)
        self.idle = make_connector(self.spec, "attention", working, self.attention_ranks, self.ffn_ranks, self.port,
                                   timeout=60, max_tokens=SERVER_TOKEN_BUDGET)
        shares = [hidden_states[slice(*token_range(a, len(hidden_states), working))] for a in range(working)]
        step_barrier = threading.Barrier(working)
        results = run_threads([lambda a=a: run_attention_rank(run, a, shares[a], step_barrier) for a in range(working)]
                              + [self.idle.init], timeout=START_TIMEOUT)
        return {layer: torch.cat([r.outputs[layer] for r in results[:working]]) for layer in self.spec.moe_layers}

    def close(self) -> None:
        if self.idle is not None:
            self.idle.close()  # its shutdown notice may find a pod a test already ended: not an error
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def worlds(model, tmp_path_factory):
    """Every shape's pods started together (their ranks load concurrently), each world served in turn."""
    hidden_states = torch.randn(TOKENS, load_spec(model).hidden_size, generator=torch.Generator().manual_seed(5))
    started = {shape: PodWorld(model, shape, tmp_path_factory.mktemp(shape)) for shape in SHAPES}
    try:
        results = {}
        for shape, world in started.items():
            world.wait_loaded()
            result = {"ready_before_attention": world.ready(), "rank_pids": [child_pids(proc.popen.pid)
                                                                             for proc in world.procs]}
            result["outputs"] = world.serve(hidden_states)
            wait_until(lambda: all(status == 200 for status in world.ready()), 30, "pods ready", world.procs)
            result["ready_after_attention"] = world.ready()
            result["metrics"] = [http_text(port, "/metrics") for _, port in world.pods]
            results[shape] = result
        yield {"worlds": started, "results": results, "hidden_states": hidden_states}
    finally:
        for world in started.values():
            world.close()


def samples(exposition: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(exposition) for s in family.samples}


@pytest.mark.parametrize("shape", SHAPES)
def test_one_process_per_rank_and_not_ready_before_the_world_is_complete(worlds, shape):
    result = worlds["results"][shape]
    assert [len(pids) for pids in result["rank_pids"]] == list(SHAPES[shape][1])
    assert result["ready_before_attention"] == [503] * len(SHAPES[shape][1])
    assert result["ready_after_attention"] == [200] * len(SHAPES[shape][1])


@pytest.mark.parametrize("shape", SHAPES)
def test_multi_rank_pods_serve_the_reference_moe_outputs(worlds, model, shape):
    spec = load_spec(model)
    expected = oracle_outputs(model, worlds["hidden_states"], "float32", spec.moe_layers)
    assert_matches_oracle(worlds["results"][shape]["outputs"], expected, "float32")


def test_pod_metrics_sum_every_rank_and_pass_promtool(worlds, model, tmp_path):
    spec = load_spec(model)
    exposition = worlds["results"]["deepseek-v3-ascend"]["metrics"][0]
    values = samples(exposition)
    assert [values[("afd_ffn_rank_ready", (("ffn_rank", str(r)),))] for r in range(16)] == [1.0] * 16
    # The placement asked for and the one in effect (the same: DeepSeek-V3 has shared experts).
    assert values[("afd_shared_experts_placement_info", (("effective", "ffn"), ("requested", "ffn")))] == 1.0
    for layer in spec.moe_layers:
        # Every token's top-k routed rows and (placement 'ffn') its shared row, in each step,
        # were received by some rank of the pod: only the sum over all 16 ranks adds up.
        routed = values[("afd_tokens_received_total", (("kind", "routed"), ("layer", str(layer))))]
        shared = values[("afd_tokens_received_total", (("kind", "shared"), ("layer", str(layer))))]
        assert (routed, shared) == (STEPS * TOKENS * spec.top_k, STEPS * TOKENS)
    path = tmp_path / "metrics.txt"
    path.write_text(exposition)
    lint = subprocess.run(["promtool", "check", "metrics"], stdin=path.open(), capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_a_killed_rank_ends_the_pod_non_zero_without_orphans(worlds):
    world = worlds["worlds"]["deepseek-v3-ascend"]
    proc = world.procs[0]
    ranks = child_pids(proc.popen.pid)
    assert len(ranks) == 16
    os.kill(ranks[5], signal.SIGKILL)
    assert proc.wait(90) == 1
    assert [pid for pid in ranks if process_alive(pid)] == []
    assert "exited with -9: stopping the pod" in proc.log()


def test_sigterm_drains_every_rank_and_exits_0(worlds):
    world = worlds["worlds"]["small-ascend"]
    proc = world.procs[0]
    ranks = child_pids(proc.popen.pid)
    assert len(ranks) == 2
    proc.signal(signal.SIGTERM)
    assert proc.wait(90) == 0
    assert [pid for pid in ranks if process_alive(pid)] == []
    assert proc.log().count("draining") == 2


def test_pods_exit_0_once_every_attention_rank_shut_down(worlds):
    world = worlds["worlds"]["uneven"]
    world.idle.close()
    assert [proc.wait(90) for proc in world.procs] == [0, 0]
