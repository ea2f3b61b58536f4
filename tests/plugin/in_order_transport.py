"""HCCL/NCCL point-to-point semantics on CPU, for proving the connector cannot deadlock.

On those backends every send and receive between one pair of ranks on one communicator runs
in order on one stream, and tags are ignored: a receive at the head of a pair's queue holds
up every later operation with that peer, including sends. ``InOrderTransport`` imposes
exactly that on a tag-aware transport (gloo): per peer, one operation at a time, strictly in
post order, all with tag 0. A transport that shares its ``Lanes`` with another one behaves as
one communicator carrying both (e.g. both directions of a pair).
"""

from __future__ import annotations

import threading
from collections import deque


class _Operation:
    """A handle completing when the lane has executed the operation."""

    def __init__(self, start):
        self.start = start
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class Lanes:
    """One in-order queue per peer; a worker thread runs while a queue is non-empty."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict[int, deque[_Operation]] = {}
        self._running: set[int] = set()
        self.executed = 0

    def post(self, peer: int, operation: _Operation) -> None:
        with self._lock:
            self._queues.setdefault(peer, deque()).append(operation)
            if peer in self._running:
                return
            self._running.add(peer)
        threading.Thread(target=self._drain, args=(peer,), name=f"in-order-lane-{peer}", daemon=True).start()

    def _drain(self, peer: int) -> None:
        while True:
            with self._lock:
                if not self._queues[peer]:
                    self._running.discard(peer)
                    return
                operation = self._queues[peer].popleft()
            try:
                operation.start().wait()  # the next operation with this peer starts only after this one
            except BaseException as exc:
                operation.error = exc
            with self._lock:
                self.executed += 1
            operation.done.set()


class InOrderTransport:
    def __init__(self, inner, lanes: Lanes | None = None):
        self.inner = inner
        self.lanes = lanes or Lanes()

    def isend(self, tensor, dst, tag):
        return self._post(dst, lambda: self.inner.isend(tensor, dst, 0))

    def irecv(self, tensor, src, tag):
        return self._post(src, lambda: self.inner.irecv(tensor, src, 0))

    def _post(self, peer, start) -> _Operation:
        operation = _Operation(start)
        self.lanes.post(peer, operation)
        return operation


def one_communicator_per_rank():
    """A ``transport_wrapper`` under which all of a rank's process groups share one lane per
    peer: both directions of a pair on one in-order communicator."""
    lanes_by_rank: dict[int, Lanes] = {}
    lock = threading.Lock()

    def wrap(inner):
        with lock:
            lanes = lanes_by_rank.setdefault(inner.process_group.rank(), Lanes())
        return InOrderTransport(inner, lanes)

    return wrap
