"""Transport-only AFD connector: the abstract contract and a torch.distributed p2p one.

Wire protocol (per Attention rank a -> FFN rank f, one AFD world: Attention ranks 0..A-1,
FFN ranks A..A+F-1):
- work: an int64 header (``WorkHeader``), then, when it announces rows, one payload
  [routed + extra shared rows, H] in the model dtype;
- reply (f -> a): an int64 header (``ReplyHeader``), then, when rows > 0, one payload
  [routed rows + shared rows, H].
Every dispatch reaches every FFN rank (a header-only one when it has no rows) and every FFN
rank answers every dispatch, so no side waits for a message that never comes.

Ordering and lifetime rules (docs/plugin-runtime.md):
1. A send is posted only after the payload is complete on the producing stream
   (``record_ready_event``); the sent tensor is referenced by the connector until the send
   handle reports completion: it is never freed, reused or mutated while in flight.
2. A received tensor is handed out only after its handle reports completion.
3. Replies are paired with dispatches per stage, first in first out; the header's layer,
   sequence number, stage and row counts must match, otherwise ``PairingError``.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .device import new_process_group, record_ready_event, resolve_device, wait_event
from .errors import AFDError, ConnectorClosedError, PairingError, PayloadError, PeerLostError
from .metrics import RuntimeMetrics

MAGIC = 0xAFD5
KIND_WORK, KIND_SHUTDOWN, KIND_REPLY = 1, 2, 3
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TAG_WORK_HEADER, TAG_WORK_PAYLOAD = 1, 2
# Reply tags carry the stage so stages can be received in any order on tag-aware backends.
TAG_REPLY_BASE = 16
BYTE_KINDS = ("routed_rows", "shared_rows", "headers", "replies")
REPLY_HEADER_LEN = 8
WAIT_SLICE_SECONDS = 0.05
WATCHER_JOIN_SECONDS = 2.0
PROCESS_GROUP_TIMEOUT = timedelta(days=1)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class FFNPayload:
    """Rows for one FFN rank: grouped by local expert, within each group the rows whose
    shared work this rank does come first (``shared_prefix``), then ``shared_extra`` rows
    sent only for shared work (contiguous partition)."""

    rows: torch.Tensor
    routed_counts: tuple[int, ...]
    shared_prefix: tuple[int, ...]
    shared_extra: int

    @property
    def routed_rows(self) -> int:
        return sum(self.routed_counts)

    @property
    def shared_rows(self) -> int:
        return sum(self.shared_prefix) + self.shared_extra


@dataclass(frozen=True)
class WorkItem:
    source: int  # Attention rank
    layer: int
    seq: int
    stage: int
    payload: FFNPayload


@dataclass(frozen=True)
class DispatchTicket:
    layer: int
    seq: int
    stage: int


def encode_work_header(kind: int, layer: int, seq: int, stage: int, source: int, dtype: torch.dtype,
                       hidden: int, payload: FFNPayload | None, local_experts: int) -> torch.Tensor:
    routed = payload.routed_counts if payload else (0,) * local_experts
    prefix = payload.shared_prefix if payload else (0,) * local_experts
    extra = payload.shared_extra if payload else 0
    return torch.tensor([MAGIC, kind, layer, seq, stage, source, DTYPE_CODES[dtype], hidden, local_experts, extra,
                         *routed, *prefix], dtype=torch.int64)


def work_header_len(local_experts: int) -> int:
    return 10 + 2 * local_experts


def decode_work_header(header: torch.Tensor, *, source: int, dtype: torch.dtype, hidden: int,
                       local_experts: int) -> tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], int]:
    """Returns (kind, layer, seq, stage, routed_counts, shared_prefix, shared_extra)."""
    values = header.tolist()
    expected = {"magic": MAGIC, "source": source, "dtype": DTYPE_CODES[dtype], "hidden": hidden,
                "local_experts": local_experts}
    got = {"magic": values[0], "source": values[5], "dtype": values[6], "hidden": values[7],
           "local_experts": values[8]}
    for name, want in expected.items():
        if got[name] != want:
            raise PayloadError(f"work header from Attention rank {source}: field {name} must be {want} (got {got[name]})")
    kind = values[1]
    if kind not in (KIND_WORK, KIND_SHUTDOWN):
        raise PayloadError(f"work header from Attention rank {source}: field kind must be work or shutdown (got {kind})")
    routed = tuple(values[10:10 + local_experts])
    prefix = tuple(values[10 + local_experts:])
    extra = values[9]
    if any(c < 0 for c in routed) or extra < 0 or any(not 0 <= p <= c for p, c in zip(prefix, routed)):
        raise PayloadError(f"work header from Attention rank {source}: row counts must satisfy "
                           f"0 <= shared_prefix <= routed_counts and shared_extra >= 0 (got {values[9:]})")
    return kind, values[2], values[3], values[4], routed, prefix, extra


# --------------------------------------------------------------------------- transport


class Handle(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


class Transport(Protocol):
    """Non-blocking point-to-point primitive the connector is written against."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...


class ProcessGroupTransport:
    def __init__(self, process_group):
        self.process_group = process_group

    def isend(self, tensor, dst, tag):
        return self.process_group.send([tensor], dst, tag)

    def irecv(self, tensor, src, tag):
        return self.process_group.recv([tensor], src, tag)


class _Tracked:
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

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class _Watcher:
    """Waits on one peer's handles of one direction in post order (the order they complete)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def track(self, handle, peer: int, wakeup: threading.Event) -> _Tracked:
        tracked = _Tracked(handle, peer, wakeup)
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


@dataclass
class _InFlight:
    """Handles with the tensors they use: the references keep buffers alive until done."""

    handles: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def add(self, handle, tensor):
        self.handles.append(handle)
        self.tensors.append(tensor)

    def done(self) -> bool:
        return all(h.is_completed() for h in self.handles)


# --------------------------------------------------------------------------- contract


class AFDConnector(ABC):
    """Transport contract between Attention and FFN ranks (no model knowledge)."""

    @abstractmethod
    def init(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Idempotent; safe after partial init; drops pending work and unblocks receivers."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool: ...

    # Attention side
    @abstractmethod
    def dispatch(self, layer: int, stage: int, payloads: list[FFNPayload]) -> DispatchTicket: ...

    @abstractmethod
    def receive_replies(self, stage: int) -> tuple[DispatchTicket, list[torch.Tensor]]:
        """Replies (one per FFN rank) to the oldest pending dispatch of ``stage``."""

    # FFN side
    @abstractmethod
    def receive_work(self) -> WorkItem | None:
        """Next work item from any Attention rank in arrival order; None once every
        Attention rank has shut down."""

    @abstractmethod
    def send_reply(self, item: WorkItem, rows: torch.Tensor, routed_rows: int, shared_rows: int) -> None: ...


# --------------------------------------------------------------------------- p2p implementation


class P2PConnector(AFDConnector):
    def __init__(
        self,
        *,
        role: str,
        rank: int,
        num_attention_ranks: int,
        num_ffn_ranks: int,
        host: str,
        port: int,
        hidden_size: int,
        local_experts: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        timeout_seconds: float = 60.0,
        metrics: RuntimeMetrics | None = None,
        transport_wrapper: Callable[[Transport], Transport] | None = None,
    ):
        if role not in ("attention", "ffn"):
            raise ValueError(f"role must be attention or ffn (got {role!r})")
        world = num_attention_ranks + num_ffn_ranks
        in_range = 0 <= rank < num_attention_ranks if role == "attention" else num_attention_ranks <= rank < world
        if not in_range:
            raise ValueError(f"rank {rank} is not a {role} rank of a {num_attention_ranks}A{num_ffn_ranks}F world")
        self.role, self.rank = role, rank
        self.num_attention_ranks, self.num_ffn_ranks = num_attention_ranks, num_ffn_ranks
        self.world_size = world
        self.host, self.port = host, port
        self.hidden_size, self.local_experts, self.dtype = hidden_size, local_experts, dtype
        self.device = resolve_device(device)
        self.timeout_seconds = timeout_seconds
        self.metrics = metrics
        self._transport_wrapper = transport_wrapper
        self.sent_bytes = dict.fromkeys(BYTE_KINDS, 0)
        self._store = None
        self._process_group = None
        self._transport: Transport | None = None
        self._closed = threading.Event()
        self._initialized = False
        self._failed = False
        self._heartbeat: _Heartbeat | None = None
        self._seq = 0
        self._pending: dict[int, deque] = {}
        self._sends_in_flight: deque[_InFlight] = deque()
        self._header_recvs: dict[int, tuple[_Tracked, torch.Tensor]] = {}
        self._active_sources: list[int] = []
        self._next_source = 0
        self._watchers: dict[tuple[int, str], _Watcher] = {}
        self._wakeup = threading.Event()

    # ------------------------------------------------------------------ lifetime
    @property
    def is_initialized(self) -> bool:
        return self._initialized and not self._closed.is_set()

    def init(self) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: init() after close()")
        timeout = timedelta(seconds=self.timeout_seconds)
        try:
            # The store bounds the rendezvous; the process group's own timeout would break the
            # pairs of an FFN rank that is merely idle, so liveness is checked by heartbeats instead.
            self._store = dist.TCPStore(self.host, self.port, self.world_size, self.rank == 0, timeout)
            self._process_group = new_process_group(self.device, self._store, self.rank, self.world_size,
                                                    PROCESS_GROUP_TIMEOUT)
        except Exception as exc:
            self._failed = True
            raise PeerLostError(
                f"rank {self.rank} ({self.role}): AFD rendezvous at {self.host}:{self.port} for world size "
                f"{self.world_size} failed within {self.timeout_seconds}s: {exc}"
            ) from exc
        transport: Transport = ProcessGroupTransport(self._process_group)
        self._transport = self._transport_wrapper(transport) if self._transport_wrapper else transport
        self._heartbeat = _Heartbeat(self.host, self.port, self.rank, self.timeout_seconds)
        if self.role == "ffn":
            self._active_sources = list(range(self.num_attention_ranks))
            for source in self._active_sources:
                self._post_header_recv(source)
        self._initialized = True

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self._initialized and not self._failed and self.role == "attention":
            self._send_shutdown()
        self._closed.set()
        self._wakeup.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        # Joined so no watcher is still inside the backend when the process exits.
        deadline = time.monotonic() + WATCHER_JOIN_SECONDS
        for watcher in self._watchers.values():
            watcher.stop(deadline)
        self._watchers = {}
        # Drop pending work and retained tensors (the process group goes with them). Fresh
        # containers, not clear(): a receiver blocked in another thread still iterates the old ones.
        self._pending = {}
        self._sends_in_flight = deque()
        self._header_recvs = {}
        self._transport = None
        self._process_group = None
        self._store = None

    def _send_shutdown(self) -> None:
        flight = _InFlight()
        for f in range(self.num_ffn_ranks):
            header = encode_work_header(KIND_SHUTDOWN, -1, self._seq, -1, self.rank, self.dtype, self.hidden_size,
                                        None, self.local_experts)
            flight.add(self._isend(header, self.num_attention_ranks + f, TAG_WORK_HEADER), header)
        try:
            self._wait([flight], "shutdown notice", peers=[], deadline=time.monotonic() + min(5.0, self.timeout_seconds))
        except AFDError:
            pass  # peers already gone: nothing left to notify

    def _require_open(self, side: str) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: connector is closed")
        if not self._initialized:
            raise AFDError(f"rank {self.rank}: connector used before init()")
        if self.role != side:
            raise AFDError(f"rank {self.rank}: {side}-side operation on a {self.role} connector")

    # ------------------------------------------------------------------ waiting
    def _wait(self, flights: list[_InFlight], what: str, *, peers: list[int], deadline: float | None) -> None:
        """Wait until every handle completes; close() unblocks us and a lost peer surfaces
        as an error within the timeout."""
        for flight in flights:
            for handle in flight.handles:
                while not handle.done.wait(WAIT_SLICE_SECONDS):
                    self._check_progress(what, peers, deadline)
                if self._closed.is_set():
                    raise ConnectorClosedError(f"rank {self.rank}: connector closed while waiting for {what}")
                self._finish(handle, what, peers)

    def _check_progress(self, what: str, peers: list[int], deadline: float | None) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: connector closed while waiting for {what}")
        if peers:
            self._heartbeat.check(peers, self._peer_name)
        if deadline is not None and time.monotonic() > deadline:
            self._failed = True
            names = ", ".join(self._peer_name(p) for p in peers) or "peers"
            raise PeerLostError(f"rank {self.rank}: no {what} from {names} within {self.timeout_seconds}s "
                                "(peer dead or not answering)")

    def _watcher(self, peer: int, direction: str) -> _Watcher:
        watcher = self._watchers.get((peer, direction))
        if watcher is None:
            watcher = self._watchers[(peer, direction)] = _Watcher(f"afd-{self.rank}-{direction}-{peer}")
        return watcher

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Tracked:
        return self._watcher(dst, "send").track(self._post(self._transport.isend, tensor, dst, tag), dst, self._wakeup)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Tracked:
        return self._watcher(src, "recv").track(self._post(self._transport.irecv, tensor, src, tag), src, self._wakeup)

    def _post(self, operation, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return operation(tensor, peer, tag)
        except Exception as exc:  # e.g. the pair was closed by a dead peer
            self._failed = True
            raise PeerLostError(f"rank {self.rank}: connection to {self._peer_name(peer)} failed: {exc}") from exc

    def _finish(self, handle: _Tracked, what: str, peers: list[int] = ()) -> None:
        try:
            handle.wait()
        except Exception as exc:
            self._failed = True
            names = ", ".join(self._peer_name(p) for p in peers) or "a peer"
            raise PeerLostError(f"rank {self.rank}: connection to {names} failed during {what}: {exc}") from exc

    def _peer_name(self, rank: int) -> str:
        if rank < self.num_attention_ranks:
            return f"Attention rank {rank}"
        return f"FFN rank {rank - self.num_attention_ranks} (world rank {rank})"

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sent_bytes[kind] += nbytes
        if self.metrics is not None:
            self.metrics.sent_bytes.labels(kind=kind).inc(nbytes)

    # ------------------------------------------------------------------ Attention side
    def dispatch(self, layer: int, stage: int, payloads: list[FFNPayload]) -> DispatchTicket:
        self._require_open("attention")
        if len(payloads) != self.num_ffn_ranks:
            raise ValueError(f"dispatch needs one payload per FFN rank ({self.num_ffn_ranks}), got {len(payloads)}")
        ticket = DispatchTicket(layer=layer, seq=self._seq, stage=stage)
        self._seq += 1
        wait_event(record_ready_event(self.device))  # payload rows complete before the send reads them
        sends, reply_recvs = _InFlight(), []
        reply_tag = TAG_REPLY_BASE + 2 * stage
        for f, payload in enumerate(payloads):
            if payload.rows.shape != (payload.routed_rows + payload.shared_extra, self.hidden_size):
                raise PayloadError(f"payload for FFN rank {f}: rows shape {tuple(payload.rows.shape)} does not match "
                                   f"its counts ({payload.routed_rows} routed + {payload.shared_extra} extra shared)")
            dst = self.num_attention_ranks + f
            header = encode_work_header(KIND_WORK, layer, ticket.seq, stage, self.rank, self.dtype, self.hidden_size,
                                        payload, self.local_experts)
            # Post the reply receives first so a fast FFN rank never waits on us.
            reply_header = torch.empty(REPLY_HEADER_LEN, dtype=torch.int64)
            reply_rows = payload.routed_rows + payload.shared_rows
            reply = torch.empty(reply_rows, self.hidden_size, dtype=self.dtype, device=self.device)
            recv = _InFlight()
            recv.add(self._irecv(reply_header, dst, reply_tag), reply_header)
            if reply_rows:
                recv.add(self._irecv(reply, dst, reply_tag + 1), reply)
            reply_recvs.append((recv, reply_header, reply, payload))
            sends.add(self._isend(header, dst, TAG_WORK_HEADER), header)
            self._count("headers", header)
            if payload.rows.shape[0]:
                rows = payload.rows.contiguous()
                sends.add(self._isend(rows, dst, TAG_WORK_PAYLOAD), rows)
                self._count("routed_rows", rows[: payload.routed_rows])
                self._count("shared_rows", rows[payload.routed_rows:])
        self._pending.setdefault(stage, deque()).append((ticket, sends, reply_recvs))
        return ticket

    def receive_replies(self, stage: int) -> tuple[DispatchTicket, list[torch.Tensor]]:
        self._require_open("attention")
        queue_ = self._pending.get(stage)
        if not queue_:
            raise PairingError(f"rank {self.rank}: receive_replies(stage={stage}) without a pending dispatch")
        ticket, sends, reply_recvs = queue_[0]
        started = time.monotonic()
        deadline = started + self.timeout_seconds
        replies = []
        for f, (recv, header, reply, payload) in enumerate(reply_recvs):
            peer = self.num_attention_ranks + f
            self._wait([recv], f"reply to layer {ticket.layer} seq {ticket.seq}", peers=[peer], deadline=deadline)
            got = header.tolist()
            expected = [MAGIC, KIND_REPLY, ticket.layer, ticket.seq, ticket.stage, peer, payload.routed_rows,
                        payload.shared_rows]
            if got != expected:
                self._failed = True
                raise PairingError(
                    f"rank {self.rank}: reply from {self._peer_name(peer)} does not match the oldest pending dispatch "
                    f"of stage {stage}: expected [magic, kind, layer, seq, stage, source, routed, shared] = "
                    f"{expected}, got {got}"
                )
            replies.append(reply)
        # Sent buffers are released only once their sends are complete.
        self._wait([sends], f"send completion of seq {ticket.seq}", peers=[], deadline=deadline)
        queue_.popleft()
        if self.metrics is not None:
            self.metrics.attention_reply_wait.observe(time.monotonic() - started)
        return ticket, replies

    def pending_dispatches(self) -> int:
        return sum(len(q) for q in self._pending.values())

    # ------------------------------------------------------------------ FFN side
    def _post_header_recv(self, source: int) -> None:
        header = torch.empty(work_header_len(self.local_experts), dtype=torch.int64)
        self._header_recvs[source] = (self._irecv(header, source, TAG_WORK_HEADER), header)

    def receive_work(self) -> WorkItem | None:
        self._require_open("ffn")
        self._reap_sends()
        started = time.monotonic()
        while True:
            if not self._active_sources:
                return None
            self._wakeup.clear()
            # Serve whichever Attention rank's header arrived, rotating the start for fairness.
            header_recvs = self._header_recvs
            count = len(self._active_sources)
            for offset in range(count):
                source = self._active_sources[(self._next_source + offset) % count]
                handle, header = header_recvs[source]
                if handle.is_completed():
                    self._finish(handle, "work header", [source])
                    self._next_source = (self._next_source + offset + 1) % count
                    item = self._take_work(source, header)
                    if item is not None and self.metrics is not None:
                        self.metrics.ffn_work_wait.observe(time.monotonic() - started)
                    if item is not None:
                        return item
                    break
            else:
                self._check_progress("work", self._active_sources, None)
                self._wakeup.wait(WAIT_SLICE_SECONDS)

    def _take_work(self, source: int, header: torch.Tensor) -> WorkItem | None:
        kind, layer, seq, stage, routed, prefix, extra = decode_work_header(
            header, source=source, dtype=self.dtype, hidden=self.hidden_size, local_experts=self.local_experts)
        if kind == KIND_SHUTDOWN:
            self._active_sources.remove(source)
            del self._header_recvs[source]
            return None
        rows = torch.empty(sum(routed) + extra, self.hidden_size, dtype=self.dtype, device=self.device)
        flight = _InFlight()
        if rows.shape[0]:
            flight.add(self._irecv(rows, source, TAG_WORK_PAYLOAD), rows)
        # Re-post the next header receive only after the payload receive (FIFO on tagless backends).
        self._post_header_recv(source)
        self._wait([flight], f"work payload from Attention rank {source}", peers=[source],
                   deadline=time.monotonic() + self.timeout_seconds)
        return WorkItem(source=source, layer=layer, seq=seq, stage=stage,
                        payload=FFNPayload(rows=rows, routed_counts=routed, shared_prefix=prefix, shared_extra=extra))

    def send_reply(self, item: WorkItem, rows: torch.Tensor, routed_rows: int, shared_rows: int) -> None:
        self._require_open("ffn")
        if rows.shape != (routed_rows + shared_rows, self.hidden_size):
            raise PayloadError(f"reply rows shape {tuple(rows.shape)} must be ({routed_rows + shared_rows}, "
                               f"{self.hidden_size})")
        wait_event(record_ready_event(self.device))
        header = torch.tensor([MAGIC, KIND_REPLY, item.layer, item.seq, item.stage, self.rank, routed_rows,
                               shared_rows], dtype=torch.int64)
        tag = TAG_REPLY_BASE + 2 * item.stage
        flight = _InFlight()
        flight.add(self._isend(header, item.source, tag), header)
        self._count("headers", header)
        if rows.shape[0]:
            rows = rows.contiguous()
            flight.add(self._isend(rows, item.source, tag + 1), rows)
            self._count("replies", rows)
        self._sends_in_flight.append(flight)
        self._reap_sends()

    def _reap_sends(self) -> None:
        while self._sends_in_flight and self._sends_in_flight[0].done():
            for handle in self._sends_in_flight[0].handles:
                self._finish(handle, "reply send", [handle.peer])
            self._sends_in_flight.popleft()

    def sends_in_flight(self) -> int:
        return len(self._sends_in_flight)


class _Heartbeat:
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

    def check(self, peers: list[int], describe: Callable[[int], str]) -> None:
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
