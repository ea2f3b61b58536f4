"""The ``direct`` data plane's links on an accelerator: one vLLM ``PyNcclCommunicator`` per
(Attention rank, FFN rank) pair and link (work, reply), created at the rendezvous from the AFD
world's own store (``links.link_transports``), before vLLM's memory profile (the connector is
made while the model is built).

Untested on a device: no GPU or NPU has run this module. What is tested on the CPU is the
transport it feeds (``links.GroupedTransport``) over a communicator double that enforces
NCCL's rules (tests/plugin/strict_communicator.py).

Why a communicator of our own rather than torch's ``ProcessGroupNCCL``: torch picks a batched
point-to-point op's NCCL communicator like a collective's and a single op's as a two-rank pair
communicator, so a side that posts one operation and a peer that posts several would wait in
two different communicators; grouping every post needs torch's private coalescing API.
``PyNcclCommunicator`` is one communicator with explicit ``group_start``/``group_end``.

NPU: vllm-ascend's ``PyHcclCommunicator`` (as read at vllm-ascend commit 1e263ae) offers
``all_reduce`` and ``broadcast`` only, no ``send``/``recv``, so an NPU world runs the
``staged`` plane (``transport.choose_data_plane``) and a request for ``direct`` on an NPU is
refused here with that reason.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup

from ..device import DeviceStreams, current_device
from ..errors import DeviceUnavailableError
from ..links import GroupedTransport


def link_transport(name: str, store: dist.Store, rank: int, world_size: int, device: torch.device) -> GroupedTransport:
    """One pair's communicator of a link (both ranks of the pair call this at the same time)."""
    if device.type != "cuda":
        raise DeviceUnavailableError(
            f"data plane direct on {device.type}: its links need a point-to-point communicator, and "
            "vllm-ascend's PyHcclCommunicator has no send/recv; use data_plane staged (auto picks it on NPUs)")
    group = StatelessProcessGroup(rank=rank, world_size=world_size, store=dist.PrefixStore("pynccl", store))
    communicator = PyNcclCommunicator(group, device=device)
    if communicator.disabled:  # vLLM disables it silently (NCCL library missing, VLLM_DISABLE_PYNCCL)
        raise DeviceUnavailableError(f"data plane direct on {device}: vLLM's PyNcclCommunicator is disabled "
                                     "(NCCL library not found, or VLLM_DISABLE_PYNCCL set); use data_plane staged")
    return GroupedTransport(name, communicator, DeviceStreams(device), device, current_device)
