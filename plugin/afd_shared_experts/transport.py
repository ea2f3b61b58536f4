"""Transport of the AFD connector: the gloo link, batched posting, completion tracking,
rendezvous and liveness (the links themselves, device ones included, are made in ``links.py``).
No message format (``wire.py``) and no pairing (``connector.py``) here.

Two links, one per direction, each a process group of its own (docs/plugin-runtime.md,
"Connector"): ``work`` (Attention -> FFN) and ``reply`` (FFN -> Attention). On the ``direct``
data plane they are groups of the device's backend (nccl/hccl; gloo on CPU) carrying device
tensors; on ``staged`` they are gloo groups carrying host copies (CPU, or several ranks on one
device). On a link one side of each pair only sends and the other only receives, in the same
order, so execution in post order per pair (HCCL/NCCL, tags ignored) cannot deadlock, and a
receive waiting on one direction never holds up the other.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .errors import ConnectorClosedError, PeerLostError

WAIT_SLICE_SECONDS = 0.05
# How often a device work's completion is polled (nccl/hccl works report it through an event).
DEVICE_POLL_SECONDS = 0.0002
WATCHER_JOIN_SECONDS = 2.0
PROCESS_GROUP_TIMEOUT = timedelta(days=1)
# How often a rank polls for rank 0's store to listen before joining it (see wait_for_listener).
LISTENER_POLL_SECONDS = 0.2
SEND, RECV = "isend", "irecv"
LINKS = ("work", "reply")

class Handle(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


class Transport(Protocol):
    """Non-blocking point-to-point primitive the connector is written against (one per link:
    ``transport_wrapper`` sees each of them). A transport may instead offer
    ``batch(ops) -> list[Handle]``, posting a link's operations as one call (``GroupedTransport``);
    ``on_stream`` says whether its handles complete on a device stream."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...


@dataclass(frozen=True)
class P2POperation:
    kind: str  # SEND or RECV
    tensor: torch.Tensor
    peer: int
    tag: int


class ProcessGroupTransport:
    """A gloo link: host tensors, each operation a work of its own (gloo has no grouping, so
    the operations of a post go out back to back)."""

    on_stream = False

    def __init__(self, process_group):
        self.process_group = process_group

    def isend(self, tensor, dst, tag):
        return self.process_group.send([tensor], dst, tag)

    def irecv(self, tensor, src, tag):
        return self.process_group.recv([tensor], src, tag)


class Tracked:
    """A transport handle whose completion is observed by a watcher thread.

    gloo's send/recv works only report completion from a blocking ``wait()``, which close()
    could not interrupt; the watcher blocks instead and the connector waits on an Event.
    """

    __slots__ = ("handle", "peer", "done", "error", "wakeup")

    def __init__(self, handle, peer: int, wakeup: threading.Event):
        self.handle, self.peer, self.wakeup = handle, peer, wakeup
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def ready(self, timeout: float) -> bool:
        return self.done.wait(timeout)

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class StreamOrdered:
    """A nccl/hccl work: ``result()`` makes the caller's current stream wait for it (no host
    wait); ``is_completed()`` polls its device event, for releasing sent buffers, and
    ``ready()`` polls it for a host that must read the data."""

    __slots__ = ("handle", "peer")

    def __init__(self, handle, peer: int):
        self.handle, self.peer = handle, peer

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def ready(self, timeout: float) -> bool:
        """Host-side completion, for a host that must read what arrived (the FFN side)."""
        deadline = time.monotonic() + timeout
        while not self.handle.is_completed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(DEVICE_POLL_SECONDS)
        return True

    def result(self) -> None:
        self.handle.wait()


class Answered:
    """A gloo send that the peer answers only after receiving all of it (an Attention rank's
    work frame: the FFN rank's reply). The answer's arrival completes it (``answer()``), so no
    watcher thread waits on it: on a rank pinned to one core each hand-off to a watcher costs a
    thread switch and a GIL hand-over. The handle is kept until then so the send lives on."""

    __slots__ = ("handle", "peer", "answered")

    def __init__(self, handle, peer: int):
        self.handle, self.peer, self.answered = handle, peer, False

    def is_completed(self) -> bool:
        return self.answered

    def answer(self) -> None:
        self.answered = True


class Watcher:
    """Waits on one peer's handles of one link in post order (the order they complete)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def track(self, handle, peer: int, wakeup: threading.Event) -> Tracked:
        tracked = Tracked(handle, peer, wakeup)
        self._queue.put(tracked)
        return tracked

    def _run(self) -> None:
        while True:
            tracked = self._queue.get()
            if tracked is None:
                return
            try:
                tracked.handle.wait()
            except BaseException as exc:  # handed to the connector thread that waits on it
                tracked.error = exc
            tracked.done.set()
            tracked.wakeup.set()

    def stop(self, deadline: float) -> None:
        """Let queued handles finish, bounded by ``deadline``; a watcher still blocked on a
        receive that will never complete is left behind as a daemon thread."""
        self._queue.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))


class Link:
    """One direction of one plane, on a process group of its own. On a link one side of each
    pair only sends and the other only receives, in the same order: in-order execution per
    pair cannot deadlock it, and a receive waiting on it never holds up the other direction."""

    def __init__(self, name: str, transport: Transport, *, rank: int, wakeup: threading.Event):
        self.name, self.transport, self.on_stream = name, transport, getattr(transport, "on_stream", False)
        self._rank, self._wakeup = rank, wakeup
        self._watchers: dict[int, Watcher] = {}

    def post(self, ops: list[P2POperation], *, answered: bool = False) -> list[Tracked | StreamOrdered | Answered]:
        """Post ``ops`` as one batch (``Transport.batch`` where the transport has it); a handle
        per operation, in order. ``answered``: sends each completed by the peer's answer, which
        the caller reports (``Answered.answer``); off the stream no watcher waits on them."""
        batch = getattr(self.transport, "batch", None)
        if batch is not None:
            handles = batch(ops)
        else:
            handles = [getattr(self.transport, op.kind)(op.tensor, op.peer, op.tag) for op in ops]
        if answered and not self.on_stream:
            return [Answered(handle, op.peer) for handle, op in zip(handles, ops)]
        return [self.track(handle, op.peer) for handle, op in zip(handles, ops)]

    def track(self, handle, peer: int) -> Tracked | StreamOrdered:
        if self.on_stream:
            return StreamOrdered(handle, peer)
        watcher = self._watchers.get(peer)
        if watcher is None:
            watcher = self._watchers[peer] = Watcher(f"afd-{self._rank}-{self.name}-{peer}")
        return watcher.track(handle, peer, self._wakeup)

    def stop(self, deadline: float) -> None:
        for watcher in self._watchers.values():
            watcher.stop(deadline)
        self._watchers = {}


@dataclass
class InFlight:
    """Handles with the tensors they use: the references keep buffers alive until done."""

    handles: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def add(self, handle, tensor):
        self.handles.append(handle)
        self.tensors.append(tensor)

    def done(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def answer(self) -> None:
        """The peers answered: their ``Answered`` sends are complete."""
        for handle in self.handles:
            if isinstance(handle, Answered):
                handle.answer()



def wait_for_listener(host: str, port: int, deadline: float, cancelled: threading.Event) -> None:
    """Return once host:port accepts a TCP connection. A TCPStore client that finds nobody
    listening sleeps a random delay of about its own timeout before it tries again, so rank 0 could
    give up waiting for it although it started in time; probing with a plain socket first lets
    every rank join within a poll of rank 0 coming up. Probes do not count as joined ranks."""
    while True:
        remaining = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(remaining, 1.0))).close()
            return
        except OSError as exc:
            if remaining <= LISTENER_POLL_SECONDS:
                raise TimeoutError(f"nothing listening at {host}:{port}: {exc}") from exc
            if cancelled.wait(LISTENER_POLL_SECONDS):
                raise ConnectorClosedError(f"closed while waiting for {host}:{port}") from exc


def choose_data_plane(requests: list[tuple[str, str]]) -> str:
    """The data plane of a world from every rank's (requested plane, device identity): one
    request for all; ``auto`` is ``direct`` when every rank owns a GPU of its own, else
    ``staged`` (CPU ranks; NCCL refuses two ranks of one communicator on one GPU; NPUs have no
    point-to-point communicator in vllm-ascend: vllm/communicators.py)."""
    requested = sorted({plane for plane, _ in requests})
    if len(requested) != 1:
        raise ValueError(f"data_plane: every rank of the AFD world must request the same data plane "
                         f"(got {', '.join(requested)})")
    if requested[0] != "auto":
        return requested[0]
    identities = [identity for _, identity in requests]
    if any("/cuda/" not in identity for identity in identities) or len(set(identities)) < len(identities):
        return "staged"
    return "direct"


class Heartbeat:
    """Liveness over the rendezvous store: each rank bumps a counter; a peer whose counter
    stops moving for ``timeout`` seconds is reported lost (gloo alone cannot tell a dead
    peer from a slow one on a pending receive)."""

    def __init__(self, host: str, port: int, rank: int, timeout: float):
        self.timeout = timeout
        self.interval = min(1.0, timeout / 5)
        self._lock = threading.Lock()
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        self._key = f"afd/heartbeat/{rank}"
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_check = 0.0
        self._stop = threading.Event()
        self.store_lost = False
        self._check_lock = threading.Lock()
        self._monitored: tuple[list[int], Callable[[int], str], Callable[[PeerLostError], None]] | None = None
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"afd-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with self._lock:
            self._store.add(self._key, 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:
                return  # store gone: peers notice through their own checks
            monitored = self._monitored
            if monitored is not None:
                peers, describe, on_lost = monitored
                try:
                    self.check(peers, describe)
                except PeerLostError as exc:
                    self._monitored = None
                    on_lost(exc)

    def monitor(self, peers: list[int], describe: Callable[[int], str], on_lost: Callable[[PeerLostError], None]) -> None:
        """Check ``peers`` from the heartbeat thread too, for a rank whose waits are on a device
        stream (no host thread waits, so none would notice a lost peer): ``on_lost`` once."""
        self._monitored = (list(peers), describe, on_lost)

    def check(self, peers: list[int], describe: Callable[[int], str]) -> None:
        with self._check_lock:
            self._check(peers, describe)

    def _check(self, peers: list[int], describe: Callable[[int], str]) -> None:
        now = time.monotonic()
        if self.store_lost or now - self._last_check < self.interval:
            return
        self._last_check = now
        for peer in peers:
            try:
                with self._lock:
                    value = self._store.add(f"afd/heartbeat/{peer}", 0)
            except Exception:
                # The store lives in Attention rank 0, which may finish before its peers. A peer
                # that dies still fails its pending receives (connection closed by peer); a
                # reply that never comes still hits the reply deadline.
                self.store_lost = True
                return
            previous = self._seen.get(peer)
            if previous is None or previous[0] != value:
                self._seen[peer] = (value, now)
            elif now - previous[1] > self.timeout:
                raise PeerLostError(f"{describe(peer)} lost: no heartbeat for more than {self.timeout}s")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)
