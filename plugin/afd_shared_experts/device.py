"""Device and backend selection; the only place that knows about CUDA/NPU.

Import-safe on CPU: torch_npu is imported only when an NPU is requested.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import DeviceUnavailableError

BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def load_torch_npu() -> None:
    """Import torch_npu, telling a missing torch-npu package from missing CANN libraries."""
    if importlib.util.find_spec("torch_npu") is None:
        raise DeviceUnavailableError(
            "device 'npu' requested but torch_npu/CANN cannot be loaded: the torch-npu package is not installed "
            "in this Python environment; "
            "install the torch-npu build matching torch (vllm-ascend 0.23.0 pairs with torch-npu 2.10.0.post4)"
        )
    try:
        import torch_npu  # noqa: F401  (registers the npu device and HCCL)
    except Exception as exc:  # OSError/ImportError: a CANN shared library (libhccl.so, ...) is missing
        raise DeviceUnavailableError(
            "device 'npu' requested but torch_npu/CANN cannot be loaded: torch-npu is installed but the Ascend "
            f"CANN libraries are missing ({exc}); "
            "install CANN 9.1.0 and source its set_env.sh (LD_LIBRARY_PATH), or use device 'cpu'"
        ) from exc


def resolve_device(device: str | torch.device) -> torch.device:
    # torch.device("npu") itself fails until torch_npu registers the device type.
    if str(device).split(":")[0] == "npu":
        load_torch_npu()
        return torch.device(device)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError("device 'cuda' requested but torch.cuda.is_available() is False")
    elif device.type not in BACKEND_BY_DEVICE:
        raise DeviceUnavailableError(f"device type {device.type!r} is not supported (use cpu, cuda or npu)")
    return device


def new_process_group(device: torch.device, store: dist.Store, rank: int, world_size: int, timeout: timedelta):
    """A process group of the AFD world, separate from the caller's default group."""
    backend = BACKEND_BY_DEVICE[device.type]
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    # Not exercisable on CPU machines: mirrors the NCCL constructor shape that torch_npu exposes.
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, world_size, options)


def record_ready_event(device: torch.device):
    """Event marking that work queued so far on the current stream is done (None on CPU,
    where every op is complete when it returns)."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


def wait_event(event) -> None:
    if event is not None:
        event.synchronize()
