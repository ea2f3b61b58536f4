"""FFN server and NPU fail-fast behaviour that needs no vLLM (dev venv)."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from afd_devcluster import free_port
from afd_shared_experts import device, ffn_server
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
])
def test_bad_arguments_name_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        ffn_server.parse_args(argv(FFN_BLOCK, **overrides))
    assert message in str(err.value)


def test_quantized_checkpoints_are_refused_with_the_flag_named():
    args, _, _ = ffn_server.parse_args(argv(FFN_BLOCK, **{"--quantization": "ascend"}))
    with pytest.raises(ffn_server.ArgumentError, match="--quantization: 'ascend' is not supported"):
        ffn_server.check_supported(args)


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


def test_server_is_healthy_not_ready_until_connected_and_exits_0_on_sigterm(checkpoints):
    """Weights load, but no Attention rank ever comes: /health 200, /ready 503; SIGTERM -> 0."""
    block = {"afd": {**FFN_BLOCK["afd"], "port": free_port()}}
    health_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "afd_shared_experts.ffn_server",
                             *argv(block, **{"--model": str(checkpoints["deepseek_v2"]),
                                             "--health-port": str(health_port)})],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        time.sleep(2)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{health_port}/ready", timeout=2)
        assert err.value.code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "rendezvous not complete yet" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
