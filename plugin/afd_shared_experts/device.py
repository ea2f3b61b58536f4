"""Device and backend selection; the only place that knows about CUDA/NPU.

Import-safe on CPU: torch_npu is imported only when an NPU is requested.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
from contextlib import contextmanager
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


_selected = threading.local()


def select_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device. The current accelerator device is
    per host thread (CUDA and the NPU runtime alike) and index 0 until a thread selects its own:
    every thread that launches device work (an FFN rank's runtime thread does) must call this
    (micro-batch stage threads do not yet: stages run on vLLM's CPU platform only), or an FFN rank with local index 1 launches on device 0 with pointers of device 1.
    torch_npu registers the NPU as torch's accelerator, so one call serves cuda and npu. The
    choice is also kept per thread, for ``current_device`` on the CPU."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)
    _selected.device = device


def current_device(device: torch.device) -> torch.device | None:
    """The calling thread's current device of ``device``'s type: the accelerator's current
    index on cuda and npu; on the CPU the device the thread selected with ``select_device``
    (None: none yet)."""
    if device.type == "cpu":
        return getattr(_selected, "device", None)
    return torch.device(device.type, torch.accelerator.current_device_index())


def gloo_process_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo process group of the AFD world (host tensors), separate from the caller's default group."""
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class DeviceStreams:
    """Streams and events of an accelerator through torch's device module (cuda; npu once
    torch_npu is loaded): what ``links.GroupedTransport`` needs. Untested on a device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.module = torch.get_device_module(device)

    def new_stream(self):
        return self.module.Stream(device=self.device)

    def current_stream(self):
        return self.module.current_stream(self.device)

    def new_event(self):
        return self.module.Event()


def device_identity(device: torch.device) -> str:
    """Names the physical device across processes of one machine, so ranks can tell that
    two of them share one accelerator (NCCL refuses two ranks of a communicator on one GPU)."""
    if device.type == "cpu":
        return "cpu"
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{host}/cuda/{torch.cuda.get_device_properties(index).uuid}"
    index = device.index if device.index is not None else torch.npu.current_device()
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",")
    physical = visible[index] if index < len(visible) and visible[index].strip() else str(index)
    return f"{host}/npu/{physical.strip()}"


@contextmanager
def sync_debug_mode(device: torch.device, mode: int | str):
    """CUDA's sync-debug mode for the block (``"error"``: a host sync raises; ``0``: syncs
    allowed again, for a named sync inside an ``"error"`` block); nothing off CUDA. The mode is
    process-wide: one rank per process while it is set."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# --------------------------------------------------------------------------- host staging


def to_host(tensors: list[torch.Tensor], out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Contiguous host copies of device tensors for a gloo send (the tensors themselves on CPU),
    into ``out`` when given (pinned buffers of the same shapes).

    The copies go to pinned memory without blocking, then one event waits for all of them:
    one host wait per batch of payloads, not one per tensor."""
    if not tensors or tensors[0].device.type == "cpu":
        return [t.contiguous() for t in tensors]
    copies = out if out is not None else [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for copy, tensor in zip(copies, tensors):
        copy.copy_(tensor, non_blocking=True)
    event = torch.Event(device=tensors[0].device)
    event.record()
    event.synchronize()  # gloo reads the host buffers from another thread, outside stream order
    return copies


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer for a host-staged payload bound for ``device`` (pinned on accelerators,
    so the copy up can be asynchronous)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type != "cpu")


def to_device(host: torch.Tensor, device: torch.device, *, out: torch.Tensor | None = None,
              reuse_host: bool = False) -> torch.Tensor:
    """A received host buffer on ``device`` (into ``out`` when given): an asynchronous copy
    ordered on the current stream. ``reuse_host``: the caller writes the host buffer again soon
    (a gloo receive from another thread, outside stream order), so the copy is waited for."""
    if device.type == "cpu":
        return host if out is None else out.copy_(host)
    copy = host.to(device, non_blocking=True) if out is None else out.copy_(host, non_blocking=True)
    if reuse_host:
        event = torch.Event(device=device)
        event.record()
        event.synchronize()
    return copy
