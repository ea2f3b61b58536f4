"""FFN server and NPU fail-fast behaviour that needs no vLLM (dev venv)."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from afd_devcluster import free_port
from afd_shared_experts import device, ffn_server, ffn_supervisor
from afd_shared_experts.errors import DeviceUnavailableError


def argv(block, **overrides):
    base = {"--model": "/models/m", "--ffn-rank-start": "0", "--ffn-local-ranks": "1", "--health-port": "0",
            "--max-num-batched-tokens": "64", "--dtype": "float32", "--additional-config": json.dumps(block)}
    base.update(overrides)
    return [x for k, v in base.items() for x in (k, v)]


FFN_BLOCK = {"afd": {"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 2, "host": "127.0.0.1",
                     "port": 1, "shared_experts": {"placement": "ffn"}, "timeout_seconds": 1}}


@pytest.mark.parametrize("overrides,message", [
    ({"--additional-config": "{not json"}, "--additional-config: not valid JSON"),
    ({"--additional-config": json.dumps({"afd": {**FFN_BLOCK["afd"], "role": "attention"}})}, "afd.role"),
    ({"--ffn-rank-start": "2"}, "afd.num_ffn_ranks: must cover"),
    ({"--health-port": "70000"}, "--health-port: must be in [0, 65535]"),
    ({"--ffn-local-ranks": "2", "--device": "npu:1"}, "--device: 'npu:1' names one device"),
])
def test_bad_arguments_name_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        ffn_server.parse_args(argv(FFN_BLOCK, **overrides))
    assert message in str(err.value)


def test_quantized_checkpoints_are_refused_with_the_flag_named():
    args, _, _ = ffn_server.parse_args(argv(FFN_BLOCK, **{"--quantization": "ascend"}))
    with pytest.raises(ffn_server.ArgumentError, match="--quantization: 'ascend' is not supported"):
        ffn_server.check_supported(args)


def test_rank_processes_get_the_pods_flags_with_their_own_rank_and_device():
    args, _, _ = ffn_server.parse_args(argv(FFN_BLOCK, **{"--ffn-local-ranks": "2", "--max-model-len": "512",
                                                          "--expert-backend": "torch", "--device": "npu"}))
    command = ffn_supervisor.rank_argv(args, 1, ffn_supervisor.rank_device("npu", 1), 7)
    assert command[1:3] == ["-m", "afd_shared_experts.ffn_server"]
    rank_args, _, world_ranks = ffn_server.parse_args(command[3:])
    assert (rank_args.ffn_rank_start, rank_args.ffn_local_ranks, rank_args.device, rank_args.rank_status_fd) == \
        (1, 1, "npu:1", 7)
    assert world_ranks == [2]  # after the one Attention rank
    for name in ("model", "max_model_len", "max_num_batched_tokens", "dtype", "expert_backend", "additional_config",
                 "quantization"):
        assert getattr(rank_args, name) == getattr(args, name), name
    assert ffn_supervisor.rank_device("cpu", 1) == "cpu"
    assert ffn_supervisor.rank_device("cuda:3", 0) == "cuda:3"  # a single-rank pod's explicit device


def test_bad_arguments_are_refused_before_any_rank_starts():
    block = {"afd": {**FFN_BLOCK["afd"], "port": free_port()}}
    result = subprocess.run([sys.executable, "-m", "afd_shared_experts.ffn_server",
                             *argv(block, **{"--ffn-local-ranks": "2", "--quantization": "ascend",
                                             "--expert-backend": "torch", "--health-port": str(free_port())})],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "ffn_server: --quantization: 'ascend' is not supported" in result.stderr
    assert "FFN rank 0: process" not in result.stderr


def test_a_checkpoint_the_plugin_cannot_serve_ends_the_server_with_its_reason(tmp_path):
    """The FFN server's answer is the Attention engine's and afdctl's (moe_spec): one line."""
    from afd_devcluster.checkpoints import model_config, write_config_checkpoint

    model = write_config_checkpoint(tmp_path / "mixtral", {**model_config("qwen2_moe"), "model_type": "mixtral"})
    block = {"afd": {**FFN_BLOCK["afd"], "port": free_port()}}
    result = subprocess.run([sys.executable, "-m", "afd_shared_experts.ffn_server",
                             *argv(block, **{"--model": str(model), "--expert-backend": "torch",
                                             "--health-port": str(free_port())})],
                            capture_output=True, text=True, timeout=120)
    # Refused before any rank starts, as its last line: what the operator reads from a failed
    # container's termination message into its events.
    assert result.returncode == 2
    assert "FFN rank 0: process" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ffn_server: ") and "model_type must be one of" in last and last.endswith("(got 'mixtral')")


def test_npu_without_torch_npu_package(monkeypatch):
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DeviceUnavailableError, match="torch-npu package is not installed"):
        device.resolve_device("npu")


def test_npu_with_torch_npu_but_no_cann(monkeypatch, tmp_path):
    # A torch_npu that fails like the real one does without CANN (libhccl.so missing).
    (tmp_path / "torch_npu.py").write_text("raise OSError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(DeviceUnavailableError, match=r"CANN libraries are missing \(libhccl.so"):
        device.resolve_device("npu")


def test_server_is_healthy_not_ready_until_connected_and_exits_0_on_sigterm(checkpoints, tmp_path):
    """Weights load, but no Attention rank ever comes: /health 200, /ready 503 while the rank
    retries the rendezvous; SIGTERM to the supervisor drains the rank -> 0."""
    block = {"afd": {**FFN_BLOCK["afd"], "port": free_port()}}
    health_port = free_port()
    log = tmp_path / "ffn.log"
    with open(log, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "afd_shared_experts.ffn_server",
                                 *argv(block, **{"--model": str(checkpoints["deepseek_v2"]),
                                                 "--health-port": str(health_port)})],
                                stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "rendezvous not complete yet" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/health", timeout=2) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{health_port}/ready", timeout=2)
        assert err.value.code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "FFN rank 0: signal 15: draining" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
