"""The links of an AFD world: gloo process groups (``transport.ProcessGroupTransport``: the
staged plane, and the CPU), or on an accelerator's ``direct`` plane one communicator per
(Attention rank, FFN rank) pair and link, each posting in groups on a stream of its own.

Untested on a device: the device path has run on the CPU only, over a communicator double that
enforces NCCL's rules (tests/plugin/strict_communicator.py); docs/plugin-runtime.md lists its
known gaps.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .device import gloo_process_group
from .errors import DeviceUnavailableError
from .transport import LINKS, PROCESS_GROUP_TIMEOUT, SEND, P2POperation, ProcessGroupTransport, Transport


class Communicator(Protocol):
    """A device link's communicator, as vLLM's ``PyNcclCommunicator`` and vllm-ascend's
    ``PyHcclCommunicator`` offer it: sends and receives launched on a stream, grouped between
    ``group_start`` and ``group_end`` (one fused launch), completing in stream order."""

    def group_start(self) -> None: ...

    def group_end(self) -> None: ...

    def send(self, tensor: torch.Tensor, dst: int, stream=None) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, stream=None) -> None: ...


class Streams(Protocol):
    """The stream and event operations a grouped link needs (``device.DeviceStreams`` on an
    accelerator)."""

    def new_stream(self): ...

    def current_stream(self): ...

    def new_event(self): ...


class EventHandle:
    """Completion of one grouped post: an event recorded on the link's stream after the group."""

    __slots__ = ("event", "streams")

    def __init__(self, event, streams: Streams):
        self.event, self.streams = event, streams

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        """The caller's current stream waits for the group (the host does not)."""
        self.streams.current_stream().wait_event(self.event)


class GroupedTransport:
    """Untested on a device: run on the CPU only over the strict communicator double
    (tests/plugin/strict_communicator.py); docs/plugin-runtime.md lists its known gaps.

    A device link (the ``direct`` plane on an accelerator) over one communicator: every post
    of either side, one operation or many, is one group on the link's own stream, so both ends
    of every pair post the same way on the same communicator, and each link's operations
    block only that link's stream (a receive waiting for the next work frame never holds up a
    reply on the other link, nor the compute stream). The link stream first waits for the
    caller's stream: the frames it sends were written there. No private torch API.

    ``posting_device(device)`` is the calling thread's current device (``device.current_device``):
    a thread that did not select the rank's device would launch on another device's stream."""

    on_stream = True

    def __init__(self, name: str, communicator: Communicator, streams: Streams, device: torch.device,
                 posting_device: Callable[[torch.device], torch.device | None]):
        self.name, self.communicator, self.streams, self.device = name, communicator, streams, device
        self._posting_device = posting_device
        self.stream = streams.new_stream()

    def batch(self, ops: list[P2POperation]) -> list[EventHandle]:
        selected = self._posting_device(self.device)
        if selected is None or selected.type != self.device.type or \
                (self.device.index is not None and selected.index != self.device.index):
            raise RuntimeError(f"thread {threading.current_thread().name!r} posts on the {self.name} link of "
                               f"{self.device} but selected {selected or 'no device'} (device.select_device)")
        self.stream.wait_stream(self.streams.current_stream())
        communicator = self.communicator
        communicator.group_start()
        try:
            for op in ops:
                post = communicator.send if op.kind == SEND else communicator.recv
                post(op.tensor, op.peer, stream=self.stream)
        finally:
            communicator.group_end()
        event = self.streams.new_event()
        event.record(self.stream)
        handle = EventHandle(event, self.streams)
        return [handle] * len(ops)

    def abort(self) -> None:
        """Fail what the link's stream waits on (a lost peer): the communicator's abort."""
        destroy = getattr(self.communicator, "destroy", None)
        if destroy is not None:
            destroy()


class PairedTransport:
    """A device link as one communicator per (Attention rank, FFN rank) pair, each with its own
    stream (``GroupedTransport``): a post is one group per peer, on that pair's communicator.
    With one communicator for the whole link an FFN rank's receives from every Attention rank
    would run in one stream's order, so a receive waiting for one Attention rank would hold up
    what another one already sent (a hang once receives are posted in answer to headers). Pairs
    are separate so that one could later be formed again without the others (not built yet).
    Untested on a device, like ``GroupedTransport``."""

    on_stream = True

    def __init__(self, rank: int, pairs: dict[int, GroupedTransport]):
        self.rank, self.pairs = rank, pairs

    def batch(self, ops: list[P2POperation]) -> list[EventHandle]:
        """A handle per operation, in order; in a pair the lower world rank (the Attention one) is rank 0."""
        handles: list = [None] * len(ops)
        by_peer: dict[int, list[int]] = {}
        for index, op in enumerate(ops):
            by_peer.setdefault(op.peer, []).append(index)
        for peer, indices in by_peer.items():
            in_pair = int(peer > self.rank)
            posted = self.pairs[peer].batch([P2POperation(ops[i].kind, ops[i].tensor, in_pair, ops[i].tag)
                                             for i in indices])
            for index, handle in zip(indices, posted):
                handles[index] = handle
        return handles

    def abort(self) -> None:
        for transport in self.pairs.values():
            transport.abort()


# Makes one device link's transport for one pair: (link name, the pair's store, rank in the pair,
# 2, device).
LinkTransportFactory = Callable[[str, dist.Store, int, int, torch.device], "Transport"]


def accelerator_link_transport(name: str, store: dist.Store, rank: int, world_size: int,
                               device: torch.device) -> GroupedTransport:
    """One link of the ``direct`` plane on an accelerator: vLLM's communicator
    (vllm/communicators.py), imported only here, when such a link is made."""
    try:
        from .vllm.communicators import link_transport
    except ImportError as exc:
        raise DeviceUnavailableError(
            f"data plane direct on {device}: its links are vLLM's PyNcclCommunicator, and vLLM cannot be "
            f"imported here ({exc}); use data_plane staged") from exc
    return link_transport(name, store, rank, world_size, device)


def link_transports(store: dist.Store, rank: int, world_size: int, attention_ranks: int, device: torch.device, *,
                    gloo: bool, factory: LinkTransportFactory | None) -> list:
    """The world's two links (LINKS), each on a store prefix of its own: gloo groups (``gloo``:
    the staged plane, and the CPU; gloo runs each operation on its own, so one group per link
    couples no pairs), else per link one communicator per (Attention rank, FFN rank) pair from
    ``factory`` (default: vLLM's, ``accelerator_link_transport``), ``PairedTransport``. Every
    rank makes its pairs in one global order (link, Attention rank, FFN rank): the first pair
    not yet made always has both of its ranks waiting for it, so the creation cannot deadlock."""
    stores = [dist.PrefixStore(f"afd/{name}", store) for name in LINKS]
    if gloo:
        return [ProcessGroupTransport(gloo_process_group(link_store, rank, world_size, PROCESS_GROUP_TIMEOUT))
                for link_store in stores]
    make = factory or accelerator_link_transport
    links = []
    for name, link_store in zip(LINKS, stores):
        pairs = {}
        for a in range(attention_ranks):
            for f in range(attention_ranks, world_size):
                if rank in (a, f):
                    pairs[f if rank == a else a] = make(f"{name} ({a}, {f})", dist.PrefixStore(f"{a}-{f}", link_store),
                                                        int(rank == f), 2, device)
        links.append(PairedTransport(rank, pairs))
    return links
