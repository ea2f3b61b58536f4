"""NCCL's point-to-point rules on the CPU: a double of vLLM's ``PyNcclCommunicator`` that
fails, with a description, where NCCL would hang or corrupt, driving the real
``links.GroupedTransport`` (the direct plane's code path on a GPU) over gloo.

What it enforces, per link and rank:
1. every send and receive is posted between ``group_start`` and ``group_end``, by the thread
   that opened the group, and a group holds operations of one stream (one fused launch);
2. the posting thread's current device is the rank's (``device.current_device``: on the CPU,
   what the thread selected with ``device.select_device``);
3. a message's element count and dtype agree on both ends, and each pair's messages match in
   post order (NCCL matches a pair's operations in order, tags ignored);
4. blocking semantics: a stream runs its groups one after another, a group ends only when all of
   its operations matched (a receive at the head of a stream holds up everything behind it on
   that stream, sends included); a group that does not finish within ``stall_seconds`` is a
   violation naming the link, the rank and the operations still waiting (NCCL would hang);
5. completion is known only through events recorded on the stream (``query``, or a stream's
   ``wait_event``; the host stream's wait blocks, as a synchronize would).

Not enforced here: host reads of device tensors (the CPU has no device memory to tell apart);
the link stream's wait for the caller's stream (``wait_stream`` is a no-op: CPU compute is done
when it returns); a tensor written after its send was posted; an FFN rank blocked behind an idle
Attention rank (the 2A x 3F test runs both Attention ranks in lockstep).
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from afd_shared_experts.device import current_device
from afd_shared_experts.links import GroupedTransport

DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.int8))}
META_FIELDS = 3  # sequence number of the pair's message, element count, dtype code


class ContractViolation(AssertionError):
    pass


class StrictEvent:
    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def record(self, stream: "StrictStream") -> None:
        stream.record(self)

    def query(self) -> bool:
        return self._done.is_set()

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class StrictStream:
    """A stream: groups and recorded events run in enqueue order on one executor thread."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._failed: BaseException | None = None

    def enqueue(self, work) -> None:
        self._queue.put(work)

    def record(self, event: StrictEvent) -> None:
        self._queue.put(event)

    def wait_stream(self, other) -> None:
        """Work enqueued on the host stream is done when it is enqueued (CPU compute is eager)."""

    def wait_event(self, event: StrictEvent) -> None:
        event.synchronize()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if isinstance(work, StrictEvent):
                work.finish(self._failed)
                continue
            if self._failed is None:
                try:
                    work()
                except BaseException as exc:  # every later event of this stream reports it
                    self._failed = exc


class HostStream:
    """The caller's (compute) stream: on the CPU the host itself."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event: StrictEvent) -> None:
        event.synchronize()


class StrictStreams:
    def __init__(self, name: str):
        self.name = name
        self._host = HostStream()
        self._count = 0

    def new_stream(self) -> StrictStream:
        self._count += 1
        return StrictStream(f"strict-{self.name}-stream-{self._count}")

    def current_stream(self) -> HostStream:
        return self._host

    def new_event(self) -> StrictEvent:
        return StrictEvent()


class StrictCommunicator:
    """``PyNcclCommunicator``'s point-to-point surface over a gloo group of its own."""

    def __init__(self, link: str, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 stall_seconds: float):
        self.link, self.rank, self.device, self.stall_seconds = link, rank, device, stall_seconds
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("strict", store), rank, world_size, timedelta(days=1))
        self._open: list | None = None
        self._opener: threading.Thread | None = None
        self._sequence: dict[tuple[str, int], int] = {}
        self.groups_posted = 0

    def _fail(self, rule: str) -> ContractViolation:
        return ContractViolation(f"rank {self.rank}, {self.link} link: {rule}")

    def _check_thread(self, what: str) -> None:
        selected = current_device(self.device)
        if selected != self.device:
            raise self._fail(f"thread {threading.current_thread().name!r} {what} with current device "
                             f"{selected or 'none selected'}, the rank's is {self.device}")

    def group_start(self) -> None:
        if self._open is not None:
            raise self._fail("group_start inside an open group")
        self._check_thread("opened a group")
        self._open, self._opener = [], threading.current_thread()

    def group_end(self) -> None:
        if self._open is None:
            raise self._fail("group_end without group_start")
        ops, self._open = self._open, None
        streams = {id(op[3]) for op in ops}
        if len(streams) > 1:
            raise self._fail("one group posted operations on two streams")
        if ops:
            self.groups_posted += 1
            ops[0][3].enqueue(lambda: self._execute(ops))

    def send(self, tensor: torch.Tensor, dst: int, stream=None) -> None:
        self._add("send", tensor, dst, stream)

    def recv(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        self._add("recv", tensor, src, stream)

    def _add(self, kind: str, tensor: torch.Tensor, peer: int, stream) -> None:
        if self._open is None:
            raise self._fail(f"{kind} with rank {peer} outside a group (every post must be one group)")
        if threading.current_thread() is not self._opener:
            raise self._fail(f"{kind} from thread {threading.current_thread().name!r}, the group was opened by "
                             f"{self._opener.name!r}")
        if stream is None:
            raise self._fail(f"{kind} with rank {peer} on the caller's stream (a link posts on its own stream)")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise self._fail(f"{kind} of a tensor on {tensor.device} (contiguous: {tensor.is_contiguous()})")
        key = (kind, peer)
        sequence = self._sequence.get(key, 0)
        self._sequence[key] = sequence + 1
        self._open.append((kind, tensor, peer, stream, sequence))

    def _execute(self, ops: list) -> None:
        """One group on its stream: every operation progresses at once; the group ends when all
        matched, or is reported stalled."""
        deadline = time.monotonic() + self.stall_seconds
        works, headers = [], []
        for kind, tensor, peer, _, sequence in ops:
            meta = torch.tensor([sequence, tensor.numel(), DTYPE_CODES[tensor.dtype]], dtype=torch.int64)
            if kind == "send":
                works += [(self._group.send([meta], peer, 0), "send", peer),
                          (self._group.send([tensor], peer, 0), "send", peer)]
            else:
                header = torch.empty(META_FIELDS, dtype=torch.int64)
                headers.append((self._group.recv([header], peer, 0), header, tensor, peer, sequence))
        for work, header, tensor, peer, sequence in headers:
            self._wait([(work, "recv (header)", peer)], deadline, ops)
            expected = [sequence, tensor.numel(), DTYPE_CODES[tensor.dtype]]
            if header.tolist() != expected:
                raise self._fail(f"message {sequence} from rank {peer}: sender's (sequence, elements, dtype) "
                                 f"{header.tolist()}, receiver's {expected} (both ends must agree on the size "
                                 "before posting)")
            works.append((self._group.recv([tensor], peer, 0), "recv", peer))
        self._wait(works, deadline, ops)

    def _wait(self, works: list, deadline: float, ops: list) -> None:
        """gloo's timed wait closes the pair when it expires: a stall fails both ends, as it must."""
        for index, (work, _, _) in enumerate(works):
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as exc:
                if "Timed out" not in str(exc):
                    raise
                waiting = ", ".join(f"{kind} rank {peer}" for _, kind, peer in works[index:])
                raise self._fail(f"a group of {len(ops)} operation(s) stalled for {self.stall_seconds}s, "
                                 f"waiting on: {waiting} (NCCL would hang here)") from None

    def destroy(self) -> None:
        abort = getattr(self._group, "abort", None)
        if abort is not None:
            abort()


def strict_link_transport(stall_seconds: float = 30.0, communicators: list | None = None):
    """A ``link_transport`` factory for P2PConnector: each link a ``GroupedTransport`` over a
    ``StrictCommunicator`` (appended to ``communicators`` when given)."""

    def make(name: str, store: dist.Store, rank: int, world_size: int, device: torch.device) -> GroupedTransport:
        communicator = StrictCommunicator(name, store, rank, world_size, device, stall_seconds)
        if communicators is not None:
            communicators.append(communicator)
        return GroupedTransport(name, communicator, StrictStreams(f"{rank}-{name}"), device, current_device)

    return make
