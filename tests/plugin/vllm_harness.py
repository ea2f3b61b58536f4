"""Helpers for the end-to-end tests with real vLLM 0.23.0 on CPU.

The dev venv never imports vllm: vLLM, the FFN servers and the driver run as subprocesses
of ``$AFD_VLLM_PYTHON`` (set by scripts/test.sh from scripts/vllm-env.sh).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from afd_devcluster import free_port
from afd_devcluster.ports import PORT_SPAN, describe_bind_failure, port_span_base
from afd_shared_experts.trace import TRACE_DIR_ENV, read_traces
from afd_shared_experts.vllm.cpu_patches import CPU_PATCHES_ENV

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
TESTBED_PLUGIN = HERE / "vllm_testbed_plugin"
DRIVER = HERE / "vllm_driver.py"
# Fixed prompts (token ids), long enough to exercise prefill and several decode steps.
PROMPTS = [[5, 17, 33, 9, 64, 21], [7, 7, 90, 14], [100, 3, 55, 41, 12, 88, 23, 61], [30]]
MAX_TOKENS = 12
# A plain engine AFD is compared with runs the plugin's CPU kernel fixes too, as AFD engines do
# by default (docs/compat.md): the same corrected kernels on both sides.
PLAIN_REFERENCE_ENV = {CPU_PATCHES_ENV: "all"}


def vllm_python() -> str:
    python = os.environ.get("AFD_VLLM_PYTHON")
    if not python or not os.access(python, os.X_OK):
        raise RuntimeError("AFD_VLLM_PYTHON must name the python of the vLLM 0.23.0 venv: run the suite through "
                           "scripts/test.sh (it prepares the venv with scripts/vllm-env.sh)")
    return python


def vllm_console_script() -> str:
    """The `vllm` CLI of the vLLM venv (the command the operator renders for Attention pods)."""
    return str(Path(vllm_python()).parent / "vllm")


def install_testbed_plugin() -> None:
    """The test-only platform-plugin stand-in, into the vLLM venv (idempotent, no network); one
    pip at a time in the venv (both xdist workers call this)."""
    with open(Path(vllm_python()).parent.parent / "testbed-plugin.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([vllm_python(), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                        str(TESTBED_PLUGIN)], check=True, cwd=REPO_ROOT)


def vllm_port_span() -> int:
    """A span of the port plan for one vLLM process (port_span_base), first rid of the CPU
    shared-memory segments that killed vLLM engines left under its ports: vLLM 0.23 names a
    tensor-parallel group's segment after its process group's port (``VLLM_DIST_IDENT``,
    ``cpu_communicator.py``), the plan hands out the same ports run after run, and a new
    engine on a stale segment's port fails "create shm in SHMManager failed. errno: 17". The
    span's ports are free, so no live engine owns a segment named after one of them."""
    base = port_span_base()
    for port in range(base, base + PORT_SPAN):
        for stale in Path("/dev/shm").glob(f"{port}-*cpushm*"):
            stale.unlink(missing_ok=True)
    return base


def base_env(**extra: str) -> dict[str, str]:
    # In-process engine core: LLM.generate queues every prompt before the first step, so the
    # batches (and CPU kernels' blocking) are the same in every run and greedy ids compare exactly.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_PLUGINS="afd_shared_experts,afd_testbed_platform_moe", VLLM_MLA_DISABLE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               # vLLM 0.23's CPU sampler torch.compiles its random-sampling kernel while the engine
               # warms up: 10-15 s of every engine start here (inductor's ISA probes start a Python
               # per ISA). Every request of the tests is greedy, which never runs that kernel; the
               # models run eager either way (enforce_eager, or the plugin's config hook).
               TORCHDYNAMO_DISABLE="1",
               # Every port vLLM opens for itself (data-parallel master ports, the engine's process
               # group) from a span of the port plan, outside the ephemeral range (afd_devcluster.ports).
               VLLM_PORT=str(vllm_port_span()))
    env.update(extra)
    return env


# The stage tests split every step that has two requests (the plugin's own minimum step sizes
# keep small steps whole: ``min_split=None`` leaves them in force).
SPLIT_EVERY_STEP = {"decode": 1, "prefill": 1}


def afd_block(role: str, *, port: int, attention_ranks: int = 1, ffn_ranks: int = 2, placement: str = "ffn",
              partition: str = "affinity", tp: int = 1, stages: int = 1,
              min_split: dict | None = SPLIT_EVERY_STEP) -> dict:
    """The afd block as the operator renders it (afd_operator.planner.afd_config)."""
    block = {"role": role, "connector": "p2p", "async": True, "host": "127.0.0.1", "port": port,
             "num_attention_ranks": attention_ranks, "num_ffn_ranks": ffn_ranks, "num_stages": stages,
             "compute_gate_on_attention": True, "connector_extra_config": {"attn_ranks_per_dp": tp},
             "shared_experts": {"placement": placement, "partition": partition}, "timeout_seconds": 120}
    if min_split is not None:
        block["min_split_tokens"] = min_split
    return {"afd": block}


def pinned_to(cpus: set[int] | None):
    """A subprocess preexec_fn that pins the child (and what it starts) to `cpus`; None: unpinned."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class Proc:
    """A subprocess with its log file; stopped by pid (never by name)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], cpus: set[int] | None = None):
        self.log_path = log
        self._log = open(log, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                      start_new_session=True, preexec_fn=pinned_to(cpus))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def failure_excerpt(self) -> str:
        """The first error line with what follows it, then the log's end: vLLM reports the root
        cause of a failed start long before the traceback it ends with."""
        text = self.log()
        first = min((i for i in (text.find("Traceback"), text.find(" ERROR ")) if i >= 0), default=-1)
        head = f"{text[first:first + 3000]}\n[...]\n" if 0 <= first < len(text) - 3000 else ""
        owners = describe_bind_failure(text)
        return head + text[-3000:] + (f"\n[bind failures: {owners}]" if owners else "")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the process group (vLLM's engine children included), SIGKILL after timeout."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()


# Engine arguments of every vLLM start (the offline driver passes the same to vllm.LLM).
# The engines' --max-num-batched-tokens in these tests (the FFN servers must be given the same).
SERVER_TOKEN_BUDGET = 512
SERVE_ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-batched-tokens",
                     str(SERVER_TOKEN_BUDGET), "--max-num-seqs", "8", "--seed", "0"]


def start_vllm_serve(model: Path, api_port: int, logdir: Path, name: str, *, block: dict | None = None,
                     data_parallel: int = 1, tensor_parallel: int = 1, extra_args: tuple[str, ...] = (),
                     trace_dir: Path | None = None, env: dict[str, str] | None = None,
                     engine_args: list[str] = SERVE_ENGINE_ARGS, cpus: set[int] | None = None) -> Proc:
    """`vllm serve` (the real console script) on 127.0.0.1:api_port, parallel flags and the
    head's metrics directory as the operator renders them (plus `extra_args`); `block` is the
    afd config (None: plain vLLM); `trace_dir`: where the Attention ranks write their stage
    traces (trace.py); `env`: laid over base_env; `engine_args`: the engine's own flags (the
    tests': eager, small limits); `cpus`: the cores it runs on (default any)."""
    argv = [vllm_console_script(), "serve", str(model), "--host", "127.0.0.1", "--port", str(api_port),
            *engine_args, "--tensor-parallel-size", str(tensor_parallel), "--data-parallel-size", str(data_parallel),
            "--data-parallel-size-local", str(data_parallel), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(free_port())]
    if block is not None:
        argv += ["--load-format", "afd", "--additional-config", json.dumps(block)]
    argv += list(extra_args)
    metrics_dir = logdir / f"{name}-prometheus"
    metrics_dir.mkdir()
    reference = PLAIN_REFERENCE_ENV if block is None else {}
    return Proc(argv, logdir / f"{name}.log", base_env(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
                                                       **{**reference, **trace_env(trace_dir), **(env or {})}), cpus)


def trace_env(trace_dir: Path | None) -> dict[str, str]:
    return {} if trace_dir is None else {TRACE_DIR_ENV: str(trace_dir)}


def start_ffn_servers(model: Path, block: dict, logdir: Path, count: int = 2, tag: str = "ffn",
                      extra_args: tuple[str, ...] = (), split: tuple[int, ...] | None = None,
                      python: str | None = None, trace_dir: Path | None = None,
                      cpus: set[int] | None = None, env: dict[str, str] | None = None,
                      token_budget: int = SERVER_TOKEN_BUDGET) -> list[tuple[Proc, int]]:
    """FFN servers (pods) with consecutive FFN ranks, command lines as the operator renders them
    (plus `extra_args`): `split` gives each server's rank count (default `count` servers of one
    rank); `python` the interpreter (default the vLLM venv's); `trace_dir` and `env` as for
    start_vllm_serve; `cpus`: the cores they run on (default any); `token_budget`: the
    engines' --max-num-batched-tokens, which every rank's frames are sized by."""
    servers = []
    ffn_block = {"afd": {**block["afd"], "role": "ffn"}}
    rank_start = 0
    for index, local_ranks in enumerate(split or (1,) * count):
        health = free_port()
        argv = [python or vllm_python(), "-m", "afd_shared_experts.ffn_server", "--model", str(model),
                "--ffn-rank-start", str(rank_start), "--ffn-local-ranks", str(local_ranks),
                "--health-port", str(health),
                "--max-num-batched-tokens", str(token_budget), "--dtype", "float32", "--max-model-len", "512",
                "--additional-config", json.dumps(ffn_block), "--bind-host", "127.0.0.1", *extra_args]
        servers.append((Proc(argv, logdir / f"{tag}-{index}.log", base_env(**trace_env(trace_dir), **(env or {})),
                             cpus), health))
        rank_start += local_ranks
    return servers


def http_status(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def wait_until(predicate, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{what}: {proc.log_path.name} exited with {proc.popen.returncode}:\n"
                                     f"{proc.failure_excerpt()}")
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s")


def run_driver(request: dict, logdir: Path, name: str, timeout: float = 400, trace_dir: Path | None = None,
               cpus: set[int] | None = None, env: dict[str, str] | None = None) -> dict:
    """Run vllm_driver.py (offline vllm.LLM) under the vLLM venv, on `cpus` (default any), with
    `env` over the base environment (and a plain reference's, without an afd block); returns its
    JSON result."""
    reference = {} if "additional_config" in request else PLAIN_REFERENCE_ENV
    req_path, out_path = logdir / f"{name}.request.json", logdir / f"{name}.result.json"
    req_path.write_text(json.dumps(request))
    log = logdir / f"{name}.log"
    with open(log, "wb") as handle:
        proc = subprocess.run([vllm_python(), str(DRIVER), str(req_path), str(out_path)], stdout=handle,
                              stderr=subprocess.STDOUT,
                              env=base_env(**{**reference, **trace_env(trace_dir), **(env or {})}),
                              cwd=REPO_ROOT, timeout=timeout, preexec_fn=pinned_to(cpus))
    if proc.returncode != 0:
        raise AssertionError(f"driver {name} failed ({proc.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
    return json.loads(out_path.read_text())


def afd_run(model: Path, request: dict, block: dict, root: Path, tag: str, env: dict | None = None,
            split: tuple[int, ...] | None = None) -> dict:
    """The offline driver as an AFD Attention side with FFN server processes (two of one rank, or
    ``split`` ranks each; stopped after); both sides write stage traces (result["traces"]); the
    engine's log in result["log"], the servers' in result["ffn_logs"]."""
    traces = root / f"traces-{tag}"
    servers = start_ffn_servers(model, block, root, tag=f"ffn-{tag}", split=split, trace_dir=traces)
    try:
        result = run_driver({**request, "additional_config": block}, root, f"afd-{tag}", trace_dir=traces, env=env)
        result["log"] = (root / f"afd-{tag}.log").read_text(errors="replace")
    finally:
        for proc, _ in servers:
            proc.stop()
    result["ffn_logs"] = [proc.log() for proc, _ in servers]
    result["traces"] = read_traces(traces)
    return result


def post_json(port: int, path: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def complete(port: int, name: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    """A greedy completion's choice, with its token ids."""
    return post_json(port, "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True,
                                                "return_token_ids": True})["choices"][0]


def greedy_completions(port: int, at_once: bool = False) -> list[tuple[str, list[int]]]:
    """(text, token ids) of a greedy completion of each of PROMPTS, sent one at a time, or all at
    once (`at_once`: steps then hold several requests, which micro-batch stages split)."""
    name = served_model(port)
    if at_once:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            choices = list(pool.map(lambda prompt: complete(port, name, prompt), PROMPTS))
    else:
        choices = [complete(port, name, prompt) for prompt in PROMPTS]
    return [(choice["text"], choice["token_ids"]) for choice in choices]
